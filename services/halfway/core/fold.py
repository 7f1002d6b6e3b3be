"""The fold: a task's state is only ever the fold of its journal. Pure: no I/O, no clock.

Theory of operation
-------------------
A task is a sequence of events in one Kafka partition (keyed by task id), so the log gives them
a total order, and the fold reads them in that order. Services process at-least-once, producers
retry, and a zombie instance may write after a rebalance, so the log holds redeliveries (same
`event_id`) and duplicates (a second writer's version of the same fact). The fold makes both
harmless with three rules:

1. A redelivered record (an `event_id` already applied) changes nothing.
2. First in log wins for any (step, kind, attempt): the first `step.intended` of a step is the
   decision (a later one, even with other args, is ignored: a decision written twice is decided
   once); the first `step.attempted` of an attempt number is that attempt (one that names
   another decision than the step's, `intent_id`, is not the step's at all); the same for the
   task events and for compensations.
3. Settlements: a step's outcome is its first definitive settlement (`done` or `not_done`).
   A `not_done` that names the last attempt it covers proves nothing when a later attempt
   is before it in the log (its writer had not read that one): it is not applied.
   An `unknown` is only ever replaced by a definitive one, and a definitive one is never
   replaced. A later definitive settlement that contradicts it is kept in `contradictions` and
   surfaced; it is never silently dropped. A later one that agrees is redundant, unless it
   names another effect (a `done` with another `effect_id`: a second charge under one key),
   which is a contradiction too. A report that says it cannot settle the effect
   (`contradiction` set: another object, other amounts) goes to `contradictions` directly.
   An effect with a contradiction needs an operator until one settles it in agreement.
   An operator's verdict is a contradiction only when it says it knew of the outcome it
   overrules (`contradiction` set: `halfway resolve --force`). One that does not was given
   while the effect looked open and raced the settlement before it in the log: the first
   verdict stands, and the late one is kept in `not_accepted`.

Fencing: a decision the log cannot accept is never a step. A paused decider wakes up and writes
what it decided before the pause; the log orders that write against what happened meanwhile,
and the fold refuses a `step.intended` that comes after the task finished (or was rejected),
and one placed on a subject claim that the task's owner withdrew
earlier in the log (`claim.withdrawn`: journaled before the claim is released on the guards
topic, so no other task can hold the subject while that step could still be accepted). The
same for a `compensation.intended` after the task finished or for a step that is not done.
Refused decisions are kept in `not_accepted`, with why, and never executed.

Undo keys: the first `compensation.intended` of a step is its undo (rule 2), with one
exception. An undo whose key a lookup proved did nothing (`not_done`, source `lookup`, no
effect named) is intended again under the step's next undo key (`halfway.contract.ids`, at
most UNDO_KEYS_MAX): a provider that saved a 5xx under a key answers every retry with it the
same way, and an undo must happen. `successor_due` says when; the fold accepts a successor of
exactly the next generation then, and keeps the earlier undos in `past_undos`. Events about an
earlier key apply to that undo: a late report that it did happen after all is a contradiction
there (the undo may have happened twice), and the task needs an operator.

What no honest writer journals is not applied either (a forgery from inside the journal's trust
boundary, halfway.journal.acls, or a bug): a `step.intended` of a task that never started (the
decider journals `task.started` before any decision), and a settlement of a step not decided
yet (write-before-acting: an effect is attempted, and so settled, only after its decision).
Both go to `not_accepted` with the reason, so a forged "done" planted before its task existed
can never settle the real step later: that step is attempted and settled as if it were absent.

The fold never raises on a strange sequence (an attempt of a step never intended, a settlement
of nothing): it cannot refuse what is already in the log. It records such events in `anomalies`
so they are visible, and otherwise applies them as well as it can. It does raise on an event of
another task: that is a bug in the caller, not a fact about this task.

What a step "is" for users comes from `StepState.status`: `intended` (decided, not yet
attempted), `in_flight` (an attempt has no settlement yet: after a crash this is exactly the
unknown case, and the executor must look it up before anything else), `done`, `not_done`,
`unknown`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from types import MappingProxyType
from typing import Any, TypeVar, assert_never

from halfway.contract.events import (
    ClaimWithdrawn,
    CompensationAttempted,
    CompensationChecked,
    CompensationIntended,
    CompensationSettled,
    Event,
    FinalState,
    ModelFailed,
    Outcome,
    SettlementSource,
    StepAttempted,
    StepChecked,
    StepIntended,
    StepRefused,
    StepSettled,
    StepUnserved,
    TaskAborted,
    TaskFinished,
    TaskRejected,
    TaskRequested,
    TaskStarted,
)
from halfway.contract.ids import UNDO_KEYS_MAX, parse_step_id

_T = TypeVar("_T")
_FIELDS: dict[type, tuple[str, ...]] = {}
_new = object.__new__
_set = object.__setattr__


def replace(obj: _T, **changes: Any) -> _T:
    """`dataclasses.replace` for the fold's frozen, slotted states, without the generic
    machinery (it is most of a replay's time after decoding): no state here has an
    `__post_init__` or an `InitVar`, so copying the fields is the whole of it."""
    kind = type(obj)
    names = _FIELDS.get(kind)
    if names is None:
        names = _FIELDS[kind] = tuple(f.name for f in fields(obj))  # type: ignore[arg-type]
    out = _new(kind)
    for name in names:
        _set(out, name, changes[name] if name in changes else getattr(obj, name))
    return out


Settlement = StepSettled | CompensationSettled
Attempt = StepAttempted | CompensationAttempted
Check = StepChecked | CompensationChecked


class TaskStatus(StrEnum):
    REQUESTED = "requested"  # asked for, not yet accepted by the decider
    RUNNING = "running"
    REJECTED = "rejected"
    FINISHED = "finished"


class StepStatus(StrEnum):
    INTENDED = "intended"
    IN_FLIGHT = "in_flight"
    DONE = "done"
    NOT_DONE = "not_done"
    UNKNOWN = "unknown"


@dataclass(frozen=True, slots=True)
class EffectState:
    """What is known of one effect (a step, or the compensation of a step): attempts and
    settlements. Shared by steps and compensations because the rules are the same."""

    attempts: tuple[Attempt, ...] = ()
    settlement: Settlement | None = None  # the one that counts (rule 3)
    unknowns: tuple[Settlement, ...] = ()  # every unknown seen, in log order
    contradictions: tuple[Settlement, ...] = ()
    # Contradictions an operator has seen and settled in agreement with the outcome.
    acknowledged: int = 0
    last_check: Check | None = None
    checks: int = 0  # lookups that found nothing, for the backoff schedule

    @property
    def outcome(self) -> Outcome | None:
        return None if self.settlement is None else self.settlement.outcome

    @property
    def attempts_settled(self) -> frozenset[int]:
        settled = {s.attempt for s in self.unknowns if s.attempt is not None}
        if self.settlement is not None and self.settlement.attempt is not None:
            settled.add(self.settlement.attempt)
        return frozenset(settled)

    @property
    def status(self) -> StepStatus:
        outcome = self.outcome
        if outcome is Outcome.DONE:
            return StepStatus.DONE
        if outcome is Outcome.NOT_DONE:
            return StepStatus.NOT_DONE
        if not self.attempts:
            # Unknown without an attempt can only come from a lookup or an operator saying so.
            return StepStatus.UNKNOWN if outcome is Outcome.UNKNOWN else StepStatus.INTENDED
        if self.attempts[-1].attempt not in self.attempts_settled:
            return StepStatus.IN_FLIGHT
        return StepStatus.UNKNOWN

    def with_attempt(self, event: Attempt) -> EffectState:
        if any(a.attempt == event.attempt for a in self.attempts):
            return self  # rule 2: a second writer's copy of an attempt is ignored
        attempts = tuple(sorted((*self.attempts, event), key=lambda a: a.attempt))
        return replace(self, attempts=attempts)

    def with_settlement(self, event: Settlement) -> EffectState:
        after = self._settled_by(event)
        if (event.source is SettlementSource.OPERATOR and event.contradiction is None
                and after.outcome is event.outcome):
            # A person looked and agrees with (or just gave) the outcome: what contradicted it
            # so far is acknowledged, and the effect no longer needs them.
            after = replace(after, acknowledged=len(after.contradictions))
        return after

    def _settled_by(self, event: Settlement) -> EffectState:
        current = self.settlement
        if event.contradiction is not None:
            return self._contradicted_by(event)  # a report that cannot settle the effect
        if event.outcome is Outcome.NOT_DONE and event.attempt is not None and \
                self.attempts and self.attempts[-1].attempt > event.attempt:
            # A proof about the attempts up to `attempt` (its request never left, a lookup
            # found nothing after it), written before its writer read a later attempt that
            # is before it in the log: it says nothing of that one, which may go out.
            return self
        if event.outcome is Outcome.UNKNOWN:
            if current is not None and current.outcome is not Outcome.UNKNOWN:
                return self  # an unknown never replaces a definitive outcome
            if any(u.attempt == event.attempt for u in self.unknowns):
                return self  # rule 2: the first unknown of an attempt is that attempt's
            return replace(self, settlement=event, unknowns=(*self.unknowns, event))
        if current is None or current.outcome is Outcome.UNKNOWN:
            return replace(self, settlement=event)
        if current.outcome is event.outcome and not _other_effect(current, event):
            return self  # agrees with the outcome already known
        return self._contradicted_by(event)

    def _contradicted_by(self, event: Settlement) -> EffectState:
        if any(_same_fact(c, event) for c in self.contradictions):
            return self  # the same contradiction, written twice
        return replace(self, contradictions=(*self.contradictions, event))

    def with_check(self, event: Check) -> EffectState:
        # A check is news only if it is newer than the last one; a zombie's late copy of an
        # older check must not move "next check at" backwards.
        if self.last_check is not None and event.at <= self.last_check.at:
            return self
        return replace(self, last_check=event, checks=self.checks + 1)

    @property
    def escalated(self) -> bool:
        """Unknown, and the harness has said it will not check again."""
        check = self.last_check
        return (self.status in (StepStatus.UNKNOWN, StepStatus.IN_FLIGHT)
                and check is not None and check.next_check_at is None
                and (self.settlement is None or check.at >= self.settlement.at))

    @property
    def contradicted(self) -> bool:
        """Reports about the effect disagree, and no operator has settled it since."""
        return len(self.contradictions) > self.acknowledged

    @property
    def needs_attention(self) -> bool:
        """A person must decide: escalated, or contradicted."""
        return self.escalated or self.contradicted

    @property
    def attention_why(self) -> str:
        """Why a person must decide, in words (empty when nobody needs to)."""
        if self.contradicted:
            latest = self.contradictions[-1]
            said = latest.contradiction or (
                f"a later report ({latest.source}) says {latest.outcome}"
                + (f" ({latest.effect_id})" if latest.effect_id else "")
                + (f": {latest.reason}" if latest.reason else ""))
            return f"reports about it contradict each other: {said}"
        if self.escalated:
            return "it is unknown and no further check is planned"
        return ""


@dataclass(frozen=True, slots=True)
class KeyedUndo:
    """A step's undo under one of its keys: what was intended, and what is known of it."""

    plan: CompensationIntended
    state: EffectState


@dataclass(frozen=True, slots=True)
class StepState:
    intent: StepIntended
    effect: EffectState = EffectState()
    compensation: CompensationIntended | None = None  # the undo, under its latest key
    undo: EffectState = EffectState()
    # The last executor that met this step (or its undo) without its tool: shown while the
    # effect waits for one that serves it.
    unserved: StepUnserved | None = None
    # Under earlier keys, each proven not done before the next was intended; oldest first.
    past_undos: tuple[KeyedUndo, ...] = ()

    @property
    def undos(self) -> tuple[KeyedUndo, ...]:
        """The undo under every key it was intended under, oldest first, the latest last."""
        if self.compensation is None:
            return self.past_undos
        return (*self.past_undos, KeyedUndo(self.compensation, self.undo))

    @property
    def undo_keys(self) -> tuple[str, ...]:
        """Every key the step's undo was intended under, oldest first."""
        return tuple(u.plan.key for u in self.undos)

    @property
    def undo_generation(self) -> int:
        """Which undo key is the step's latest (0: no undo intended)."""
        return 0 if self.compensation is None else self.compensation.generation

    @property
    def undo_needs_attention(self) -> bool:
        """The undo needs a person: under its latest key, or a report contradicts the proof
        that an earlier key did nothing (then the undo may have happened twice)."""
        return any(u.state.needs_attention for u in self.undos)

    @property
    def step_id(self) -> str:
        return self.intent.step_id

    @property
    def n(self) -> int:
        return self.intent.n

    @property
    def status(self) -> StepStatus:
        return self.effect.status

    @property
    def outcome(self) -> Outcome | None:
        return self.effect.outcome


@dataclass(frozen=True, slots=True)
class ModelUse:
    """What the task's model questions cost: every decision, refusal, finish and failure."""

    questions: int = 0
    input_tokens: int = 0
    output_tokens: int = 0

    def plus(self, event: Event) -> ModelUse:
        decided_by = getattr(event, "decided_by", None)
        if isinstance(event, ModelFailed):
            return replace(self, questions=self.questions + 1)
        if decided_by is None:
            return self
        usage = decided_by.usage
        return ModelUse(self.questions + 1,
                        self.input_tokens + (usage.input_tokens if usage else 0),
                        self.output_tokens + (usage.output_tokens if usage else 0))


@dataclass(frozen=True, slots=True)
class NotAccepted:
    """A decision in the log that the fold refused, and why (in words for people)."""

    event: StepIntended | CompensationIntended | StepSettled | CompensationSettled
    reason: str


@dataclass(frozen=True, slots=True)
class TaskState:
    task_id: str
    status: TaskStatus | None = None  # None: nothing known of this task yet
    request: TaskRequested | None = None
    started: TaskStarted | None = None
    rejected: TaskRejected | None = None
    aborted: TaskAborted | None = None  # called off: no new step; a saga undoes what is done
    finished: TaskFinished | None = None
    steps: Mapping[int, StepState] = field(default_factory=lambda: MappingProxyType({}))
    refusals: tuple[StepRefused, ...] = ()  # proposals the decider refused, in log order
    # Events about effects whose step is not (yet) in the log; kept, never dropped.
    orphans: tuple[Event, ...] = ()
    anomalies: tuple[str, ...] = ()
    # Subject claims the task's owner withdrew (claim.withdrawn): no step placed on one of
    # them later in the log is accepted.
    withdrawn_claims: frozenset[str] = frozenset()
    # Decisions the log cannot accept (a paused decider's late write): never executed.
    not_accepted: tuple[NotAccepted, ...] = ()
    # Failed model questions per step: (how many, the last one).
    model_failures: Mapping[int, tuple[int, ModelFailed]] = field(
        default_factory=lambda: MappingProxyType({}))
    # What the model questions behind the task's record cost: its decisions, refusals,
    # failures and finish as the fold took them (a stale decider's copy of one is not counted).
    usage: ModelUse = field(default_factory=lambda: ModelUse())
    # Event ids already applied (rule 1): bookkeeping, not part of what the task *is*.
    applied: frozenset[str] = field(default=frozenset(), compare=False)

    @property
    def final_state(self) -> FinalState | None:
        return None if self.finished is None else self.finished.state

    def step(self, n: int) -> StepState | None:
        return self.steps.get(n)

    def refused(self, n: int) -> tuple[StepRefused, ...]:
        """The refused proposals for step `n` (none once step `n` is decided)."""
        return tuple(r for r in self.refusals if r.n == n)

    @property
    def needs_attention(self) -> bool:
        return any(step.effect.needs_attention or step.undo_needs_attention
                   for step in self.steps.values())

    @property
    def next_step_n(self) -> int:
        return max(self.steps, default=0) + 1


def fold(events: Iterable[Event], task_id: str | None = None) -> TaskState:
    """Fold one task's events, in log order, into its state."""
    state: TaskState | None = None if task_id is None else TaskState(task_id=task_id)
    for event in events:
        if state is None:
            state = TaskState(task_id=event.task_id)
        state = apply(state, event)
    if state is None:
        raise ValueError("fold of no events needs the task_id")
    return state


def fold_all(events: Iterable[Event]) -> dict[str, TaskState]:
    """Fold interleaved events of many tasks (a whole topic, in log order) per task."""
    states: dict[str, TaskState] = {}
    for event in events:
        current = states.get(event.task_id) or TaskState(task_id=event.task_id)
        states[event.task_id] = apply(current, event)
    return states


def apply(state: TaskState, event: Event) -> TaskState:
    """One event onto a task's state. Redeliveries and duplicates change nothing."""
    if event.task_id != state.task_id:
        raise ValueError(f"{event.type} {event.event_id} of task {event.task_id} "
                         f"folded into task {state.task_id}")
    if event.event_id in state.applied:
        return state
    applied = state.applied | {event.event_id}
    after = _take(state, event)
    if after is state:
        return replace(state, applied=applied)
    # Any other state `_take` returns was made by it, for this event: nobody holds it yet, so
    # it takes the bookkeeping in place (one copy of the state per event, not two).
    _set(after, "applied", applied)
    return after


def _take(state: TaskState, event: Event) -> TaskState:
    """What `event` changes in the task (`state` itself: nothing), its id not yet applied."""
    match event:
        case TaskRequested():
            if state.request is not None:
                return state
            status = state.status or TaskStatus.REQUESTED
            return replace(state, request=event, status=status)
        case TaskStarted():
            if state.rejected is not None:
                return _note(state, event, "task was already rejected")
            if state.started is not None:
                return state
            status = TaskStatus.FINISHED if state.finished is not None else TaskStatus.RUNNING
            return replace(state, started=event, status=status)
        case TaskRejected():
            if state.started is not None:
                return _note(state, event, "task was already started")
            if state.rejected is not None:
                return state
            return replace(state, rejected=event, status=TaskStatus.REJECTED)
        case TaskAborted():
            if state.aborted is not None or state.finished is not None:
                return state  # the first call-off counts; a finished task has nothing to stop
            return replace(state, aborted=event)
        case TaskFinished():
            if state.finished is not None:
                return state
            return replace(state, finished=event, status=TaskStatus.FINISHED,
                           usage=state.usage.plus(event))
        case StepIntended():
            if event.n in state.steps:
                return state  # rule 2: the first decision is the decision
            why = _why_not_accepted(state, event)
            if why is not None:
                return _not_accepted(state, event, why)
            steps = dict(state.steps)
            steps[event.n] = StepState(intent=event)
            state = replace(state, steps=MappingProxyType(steps), usage=state.usage.plus(event))
            return _adopt_orphans(state, event.n)
        case StepRefused():
            if event.n in state.steps:
                return state  # too late to matter
            # Every refusal counts, even one that repeats an earlier one word for word: a
            # model that keeps proposing the same thing must run into REFUSALS_MAX.
            return replace(state, refusals=(*state.refusals, event),
                           usage=state.usage.plus(event))
        case ModelFailed():
            if event.n in state.steps or state.finished is not None:
                return state  # too late to matter
            count, _ = state.model_failures.get(event.n, (0, event))
            failures = dict(state.model_failures)
            failures[event.n] = (count + 1, event)
            return replace(state, model_failures=MappingProxyType(failures),
                           usage=state.usage.plus(event))
        case StepUnserved():
            _, n = parse_step_id(event.step_id)
            step = state.steps.get(n)
            if step is None:
                return _note(state, event, f"step {event.step_id} was never intended")
            steps = dict(state.steps)
            steps[n] = replace(step, unserved=event)
            return replace(state, steps=MappingProxyType(steps))
        case ClaimWithdrawn():
            _, n = parse_step_id(event.step_id)
            step = state.steps.get(n)
            if step is not None and step.intent.claim_id in event.claim_ids:
                return _note(state, event, f"void: step {event.step_id} was already placed on "
                             f"claim {step.intent.claim_id}, which it holds until it settles")
            return replace(state, withdrawn_claims=state.withdrawn_claims | set(event.claim_ids))
        case CompensationIntended():
            _, n = parse_step_id(event.step_id)
            step = state.steps.get(n)
            generation = 0 if step is None else step.undo_generation
            if step is not None and step.compensation is not None and (
                    event.generation <= generation):
                return state  # rule 2: the first undo under each key is the undo
            if event.generation != generation + 1:
                return _not_accepted(state, event, f"undo key {event.generation} of step "
                                     f"{event.step_id} skips key {generation + 1}")
            if step is not None and generation and not successor_due(step):
                return _not_accepted(state, event, f"the undo of step {event.step_id} under "
                                     f"{step.compensation.key} was not proven to have done "
                                     f"nothing ({step.undo.status}), so no other key may "
                                     f"undo it")
            if state.finished is not None:
                return _not_accepted(state, event, f"written after the task finished "
                                     f"({state.finished.state}) by a stale decider")
            if step is not None and step.outcome is not Outcome.DONE:
                return _not_accepted(state, event, f"step {event.step_id} is not done "
                                     f"({step.status}), so there is nothing to undo")
            return _apply_to_step(state, event)
        case StepAttempted() | StepSettled() | StepChecked() | \
                CompensationAttempted() | CompensationSettled() | CompensationChecked():
            return _apply_to_step(state, event)
        case _:
            assert_never(event)


CompensationEvent = CompensationAttempted | CompensationSettled | CompensationChecked
StepEvent = (
    StepAttempted
    | StepSettled
    | StepChecked
    | CompensationIntended
    | CompensationAttempted
    | CompensationSettled
    | CompensationChecked
)


def _apply_to_step(state: TaskState, event: StepEvent) -> TaskState:
    _, n = parse_step_id(event.step_id)
    step = state.steps.get(n)
    if isinstance(event, StepAttempted) and _of_a_decision_not_taken(state, step, event):
        # Journaled with a decision the log did not take (a paused worker's pair): it was
        # never the step's attempt, and its executor, which reads the log first, never sent it.
        return _note(state, event, f"an attempt of decision {event.intent_id}, which the log "
                     f"did not take for step {event.step_id}; never counted")
    if step is not None and isinstance(event, CompensationEvent) and \
            event.generation > max(step.undo_generation, 1):
        # No honest writer journals it: an undo key is used only once its intent is in the log.
        return _note(state, event, f"about undo key {event.generation} of step "
                     f"{event.step_id}, which was never intended; never applied")
    if step is None:
        if isinstance(event, StepSettled | CompensationSettled):
            # Never adopted: a verdict older than its decision is not about that decision.
            return _not_accepted(state, event, f"a settlement of step {event.step_id} written "
                                 f"before the step was decided; never applied")
        # Write-before-acting makes this impossible in one partition, unless a writer is buggy.
        # Keep the event: if the decision appears later, it is applied then.
        state = _note(state, event, f"step {event.step_id} was never intended")
        return replace(state, orphans=(*state.orphans, event))
    if isinstance(event, StepSettled | CompensationSettled):
        late = _late_verdict(step, event)
        if late is not None:
            return _not_accepted(state, event, late)
    steps = dict(state.steps)
    steps[n] = _step_with(step, event)
    return replace(state, steps=MappingProxyType(steps))


def _late_verdict(step: StepState, event: Settlement) -> str | None:
    """Why an operator's verdict is not taken (None: it is). One that does not say it knew
    of a settlement (`contradiction` unset: no `--force`) was given on a log where the effect
    was still open; if a definitive settlement that disagrees came first in the log, the two
    operators (or the operator and a lookup) raced, and the first one in the log decided.
    Only a verdict given knowing the effect was settled (`--force`, which sets
    `contradiction`) is kept as a contradiction."""
    if event.source is not SettlementSource.OPERATOR or event.contradiction is not None:
        return None
    undo = isinstance(event, CompensationSettled)
    first = (_undo_at(step, event.generation) if undo else step.effect).settlement
    if first is None or first.outcome in (Outcome.UNKNOWN, event.outcome):
        return None
    what = f"the undo of step {event.step_id}" if undo else f"step {event.step_id}"
    return (f"an operator's verdict ({event.outcome}) on {what}, settled {first.outcome} "
            f"({first.source}) earlier in the log: the first verdict stands; never applied")


def _of_a_decision_not_taken(state: TaskState, step: StepState | None,
                             event: StepAttempted) -> bool:
    """The attempt names a decision (`intent_id`) that is not its step's: another decision of
    the step came first, or the log refused that decision. One that names nothing, or a
    decision not in the log yet, is judged as before (an orphan waits for its decision)."""
    if event.intent_id is None:
        return False
    if step is not None:
        return event.intent_id != step.intent.event_id
    return any(refused.event.event_id == event.intent_id for refused in state.not_accepted)


def _step_with(step: StepState, event: StepEvent) -> StepState:
    match event:
        case StepAttempted():
            return replace(step, effect=step.effect.with_attempt(event))
        case StepSettled():
            return replace(step, effect=step.effect.with_settlement(event))
        case StepChecked():
            return replace(step, effect=step.effect.with_check(event))
        case CompensationIntended():
            if step.compensation is None:
                return replace(step, compensation=event)
            if event.generation != step.compensation.generation + 1:
                return step
            return replace(step, compensation=event, undo=EffectState(),
                           past_undos=step.undos)
        case CompensationAttempted():
            return _with_undo(step, event.generation, lambda u: u.with_attempt(event))
        case CompensationSettled():
            return _with_undo(step, event.generation, lambda u: u.with_settlement(event))
        case CompensationChecked():
            return _with_undo(step, event.generation, lambda u: u.with_check(event))
        case _:
            assert_never(event)


def _undo_at(step: StepState, generation: int) -> EffectState:
    """The step's undo under key `generation`: an earlier one, or else its latest."""
    past = next((p for p in step.past_undos if p.plan.generation == generation), None)
    return step.undo if past is None else past.state


def _with_undo(step: StepState, generation: int,
               change: Callable[[EffectState], EffectState]) -> StepState:
    """`change` the step's undo under key `generation`: an earlier one, or else its latest
    (`_apply_to_step` keeps events about a key never intended away)."""
    for i, past in enumerate(step.past_undos):
        if past.plan.generation == generation:
            undos = list(step.past_undos)
            undos[i] = replace(past, state=change(past.state))
            return replace(step, past_undos=tuple(undos))
    return replace(step, undo=change(step.undo))


def successor_due(step: StepState) -> bool:
    """Whether the step's undo is to be intended again under its next key: a lookup proved
    that nothing happened under the latest one (`not_done` from a lookup, about the attempts
    up to the one it names, naming no effect: not the provider's refusal, not its record of a
    failed undo, not a person's word), no report contradicts that, and a key is left. The
    proof rests on the tool's `completes_within_s`: every request under the key has
    finished, so the old key can never take effect later."""
    plan, settled = step.compensation, step.undo.settlement
    return (plan is not None and plan.generation < UNDO_KEYS_MAX and settled is not None
            and settled.outcome is Outcome.NOT_DONE and settled.source is SettlementSource.LOOKUP
            and settled.attempt is not None and settled.effect_id is None
            and not step.undo_needs_attention)


def _adopt_orphans(state: TaskState, n: int) -> TaskState:
    mine = [o for o in state.orphans if parse_step_id(o.step_id)[1] == n]  # type: ignore[union-attr]
    if not mine:
        return state
    state = replace(state, orphans=tuple(o for o in state.orphans if o not in mine))
    for orphan in mine:
        state = _apply_to_step(state, orphan)  # type: ignore[arg-type]
    return state


def _why_not_accepted(state: TaskState, intent: StepIntended) -> str | None:
    """Why the log cannot accept this decision (None: it can)."""
    if state.finished is not None:
        return (f"written after the task finished ({state.finished.state}) by a stale "
                f"decider; never executed")
    if state.rejected is not None:
        return "written after the task was rejected; never executed"
    if state.started is None:
        return ("the task was never started (no task.started before it in the log), so no "
                "decider placed it; never executed")
    if intent.claim_id is not None and intent.claim_id in state.withdrawn_claims:
        return (f"its subject claim {intent.claim_id} on {intent.subject} was withdrawn "
                f"earlier in the log (the decider that wrote it had lost the task); never "
                f"executed")
    return None


def _not_accepted(state: TaskState,
                  event: StepIntended | CompensationIntended | StepSettled | CompensationSettled,
                  why: str) -> TaskState:
    if any(_same_fact(n.event, event) for n in state.not_accepted):
        return state  # a second writer's copy of a decision already refused
    state = _note(state, event, f"not accepted: {why}")
    return replace(state, not_accepted=(*state.not_accepted, NotAccepted(event, why)))


def _other_effect(known: Settlement, event: Settlement) -> bool:
    """Two `done` reports that name different effects: the provider did it twice."""
    return (known.outcome is Outcome.DONE and known.effect_id is not None
            and event.effect_id is not None and known.effect_id != event.effect_id)


def _same_fact(a: Event, b: Event) -> bool:
    """Two records state the same fact if they differ only in who stamped them when."""
    ignore = {"event_id", "at"}
    return a.model_dump(exclude=ignore) == b.model_dump(exclude=ignore)


def _note(state: TaskState, event: Event, why: str) -> TaskState:
    return replace(state, anomalies=(*state.anomalies, f"{event.type} {event.event_id}: {why}"))
