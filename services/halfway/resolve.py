"""Operator resolution: a person settles a step, or a saga's undo, the harness could not.

Also `halfway abort TASK --reason …`: a caller or operator calls a task off.

`halfway resolve STEP done --evidence charge_id=ch_…` or
`halfway resolve STEP not_done --reason "the bank confirmed no payment"` journals
`step.settled` with source `operator`; the decider then moves the task on. An undo is named by
its key, `STEP:undo` (or `:undo2`, `:undo3`, the keys it was intended under again), and is
settled the same way with `compensation.settled`; the saga's undoing goes on from that verdict.
It refuses to settle an effect that is not in the journal, or one already settled (a second
verdict is kept as a contradiction: say `--force` to record one deliberately; the record says
so in `contradiction`).

Log order is the arbiter, not what this process read. Two operators may read an effect open at
once and both append a verdict, so after appending the verdict this reads the task's journal
back up to that record and answers from it: accepted only if the fold took this verdict as the
effect's settlement; otherwise refused, naming the settlement that came first (the fold keeps
the late record in `not_accepted`, never as a contradiction). The same holds for a call-off:
the first `task.aborted` in the log is the one that counts.

Who acted is journaled, never left blank: the command line records the OS user it runs as
(`os:alice`), after the name `--by` gives when one is given (`the CFO (os:alice)`); the HTTP API
records the name of the token (`api:ops`). The same functions serve both, and the API passes
its one journal writer.
"""

from __future__ import annotations

import contextlib
import getpass
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeVar

from aiokafka.structs import RecordMetadata
from pydantic import ValidationError

from halfway import tracing
from halfway.contract import (
    CompensationSettled,
    Outcome,
    SettlementSource,
    StepSettled,
    TaskAborted,
    encode_event,
    parse_step_id,
)
from halfway.contract.ids import UNDO_KEYS_MAX, is_task_id, mint_undo_key, parse_undo_key
from halfway.contract.topics import JOURNAL, TASKS
from halfway.core.fold import EffectState, Settlement, TaskState, apply
from halfway.journal import JournalWriter
from halfway.journal.records import describe, stamp
from halfway.journal.replay import read_topic, task_state
from halfway.settings import KafkaSettings

BY_CHARS_MAX = 200
REASON_CHARS_MAX = 2000  # an operator's reason, here and in the API (halfway.api.bodies)
SAID_CHARS_MAX = 300  # of the first verdict, quoted in a refusal
E = TypeVar("E", StepSettled, CompensationSettled, TaskAborted)


class ResolveRefused(Exception):
    """Why the resolution was not journaled, in words for the operator."""


class NotInJournal(ResolveRefused):
    """The step or task it names is not in the journal."""


class AlreadyDecided(ResolveRefused):
    """The step is settled, or the task is over or called off, already."""


def os_user() -> str:
    """The user this process runs as (a uid when the system has no name for it)."""
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no LOGNAME/USER and no passwd entry (a bare container)
        return f"uid{os.getuid()}"


def operator_identity(by: str | None, user: str | None = None) -> str:
    """Who acted, as the command line journals it: always the OS user, after the name `--by`
    gives (free text, so it is never all the journal knows)."""
    user = user or os_user()
    if by is None:
        return f"os:{user}"
    by = " ".join(by.split())
    if not by:
        raise ResolveRefused("--by must name who acts (it is empty); leave it out to record "
                             f"the OS user, os:{user}")
    return by if by == f"os:{user}" else f"{by} (os:{user})"


def _checked_by(by: str) -> str:
    if not by or not by.strip():
        raise ResolveRefused("who acts must be named (`by` is empty)")
    if len(by) > BY_CHARS_MAX:
        raise ResolveRefused(f"`by` is {len(by)} characters; at most {BY_CHARS_MAX}")
    return by


def _checked_reason(reason: str) -> str:
    if not reason.strip():
        raise ResolveRefused("the reason must say why (it is empty)")
    if len(reason) > REASON_CHARS_MAX:
        raise ResolveRefused(f"the reason is {len(reason)} characters; at most "
                             f"{REASON_CHARS_MAX}")
    return reason


def _journalable(kind: type[E], **fields: Any) -> E:
    """The event, or ResolveRefused saying why the journal cannot keep it: text from a command
    line may hold bytes that are not UTF-8 (lone surrogates), which the contract refuses and no
    JSON encoder writes."""
    try:
        event = kind(**fields)
        encode_event(event)
    except ValidationError as exc:
        raise ResolveRefused(describe(exc, "it cannot be journaled: ")) from None
    except ValueError as exc:  # not valid text, found only when encoded
        raise ResolveRefused(f"it cannot be journaled: {exc}") from None
    return event


@contextlib.asynccontextmanager
async def _writer(settings: KafkaSettings, given: JournalWriter | None,
                  ) -> AsyncIterator[JournalWriter]:
    if given is not None:
        yield given
        return
    async with JournalWriter(settings) as writer:
        yield writer


@dataclass(frozen=True, slots=True)
class Effect:
    """What a resolution names: a step (`generation` None) or its undo under one key."""

    task_id: str
    step_id: str
    n: int
    generation: int | None = None

    @property
    def name(self) -> str:
        if self.generation is None:
            return f"step {self.step_id}"
        return f"the undo {mint_undo_key(self.step_id, self.generation)}"

    def state_in(self, state: TaskState) -> EffectState | None:
        """Its state in the task's fold; None if the journal does not hold it."""
        step = state.step(self.n)
        if step is None or self.generation is None:
            return None if step is None else step.effect
        return next((u.state for u in step.undos if u.plan.generation == self.generation),
                    None)


def parse_effect(name: str) -> Effect:
    """A step id (`TASK:N`) or an undo key (`TASK:N:undo`, `:undo2`, …); ResolveRefused if
    it is neither."""
    undo = parse_undo_key(name)
    step = undo[0] if undo is not None else name
    try:
        task_id, n = parse_step_id(step)
    except ValueError:
        raise ResolveRefused(f"invalid step id {name[:80]!r}: must be a step's "
                             "'{task_id}:{n}' or its undo's '{task_id}:{n}:undo' (':undo2', "
                             f"… ':undo{UNDO_KEYS_MAX}' once intended again)") from None
    return Effect(task_id, step, n, None if undo is None else undo[1])


def _checked_verdict(outcome: Outcome, evidence: dict[str, Any] | None,
                     reason: str | None) -> str | None:
    """The reason, checked; ResolveRefused unless the verdict is substantiated."""
    if outcome is Outcome.UNKNOWN:
        raise ResolveRefused("an operator settles a step done or not_done; it is unknown already")
    if outcome is Outcome.DONE and not evidence:
        raise ResolveRefused("done needs evidence: --evidence charge_id=ch_…")
    if outcome is Outcome.NOT_DONE and reason is None:
        raise ResolveRefused("not_done needs a reason: --reason \"…\"")
    return None if reason is None else _checked_reason(reason)


def _open_effect(state: TaskState, effect: Effect, force: bool) -> Outcome | None:
    """The outcome the effect has (a definitive one only with `force`); refused if the journal
    does not hold it, or it is settled and this is not forced."""
    step = state.step(effect.n)
    if step is None:
        raise NotInJournal(f"step {effect.step_id} is not in the journal")
    outcome = step.outcome
    if effect.generation is not None:
        undo = effect.state_in(state)
        if undo is None:
            raise NotInJournal(f"{effect.name} is not in the journal (no undo of step "
                               f"{effect.step_id} was intended under that key)")
        outcome = undo.outcome
    if outcome in (Outcome.DONE, Outcome.NOT_DONE) and not force:
        raise AlreadyDecided(f"{effect.name} is already {outcome}; a second verdict would be "
                             "kept as a contradiction (use --force to record one)")
    return outcome


def _verdict(effect: Effect, outcome: Outcome, seen: Outcome | None, *,
             evidence: dict[str, Any] | None, reason: str | None, by: str) -> Settlement:
    """The operator's settlement. One given knowing the effect was settled (`seen`, forced)
    and disagreeing says so in `contradiction`: only then does the fold keep it as one."""
    overrules = seen in (Outcome.DONE, Outcome.NOT_DONE) and seen is not outcome
    fields: dict[str, Any] = {
        **stamp(effect.task_id), "step_id": effect.step_id, "outcome": outcome,
        "source": SettlementSource.OPERATOR,
        "evidence": {**evidence, "resolved_by": by} if evidence else None,
        "reason": f"{reason} (resolved by {by})" if reason else None,
        "contradiction": (f"{by} says {outcome}, knowing it was settled {seen} (a second "
                          "verdict, forced)") if overrules else None}
    if effect.generation is None:
        return _journalable(StepSettled, **fields)
    return _journalable(CompensationSettled, generation=effect.generation, **fields)


async def resolve(settings: KafkaSettings, step_id: str, outcome: Outcome, *,
                  evidence: dict[str, Any] | None, reason: str | None, by: str,
                  force: bool = False, writer: JournalWriter | None = None) -> Settlement:
    """Settle the step or undo `step_id` names as the operator `by` says, and answer from the
    log: AlreadyDecided if another settlement reached it first."""
    by = _checked_by(by)
    effect = parse_effect(step_id)
    reason = _checked_verdict(outcome, evidence, reason)
    with tracing.span("halfway.settlement", effect.task_id, effect.step_id,
                      source="operator", by=by):
        seen = _open_effect(await task_state(settings, effect.task_id), effect, force)
        event = _verdict(effect, outcome, seen, evidence=evidence, reason=reason, by=by)
        async with _writer(settings, writer) as journal:
            meta = await journal.append(event)
        tracing.record(event)
        if seen not in (Outcome.DONE, Outcome.NOT_DONE):  # forced: kept as asked, whatever came
            _first_verdict(effect, event, await state_through(settings, effect.task_id, meta))
    return event


def _first_verdict(effect: Effect, event: Settlement, state: TaskState) -> None:
    """AlreadyDecided unless `event` is the effect's settlement in the log read back."""
    known = effect.state_in(state)
    first = None if known is None else known.settlement
    if first is None or first.event_id == event.event_id:
        return
    agrees = "agrees with it" if first.outcome is event.outcome else "is kept as not accepted"
    raise AlreadyDecided(f"{effect.name} was settled {_described(first)} before this verdict "
                         f"reached the journal; yours {agrees}, and the first one stands (use "
                         "--force to record a second verdict)")


def _described(settlement: Settlement) -> str:
    """A settlement in a few words: its outcome, source and what it rests on."""
    said = settlement.reason or ", ".join(f"{k}={v}" for k, v in
                                          (settlement.evidence or {}).items())
    return f"{settlement.outcome} ({settlement.source}: {said[:SAID_CHARS_MAX]})"


async def state_through(settings: KafkaSettings, task_id: str, appended: RecordMetadata,
                        ) -> TaskState:
    """The task's fold of its journal partition up to and including the record `appended`:
    what the log holds before it, and it, never what came after."""
    state = TaskState(task_id=task_id)
    async with contextlib.aclosing(read_topic(settings, JOURNAL,
                                              only_key=task_id.encode())) as deliveries:
        async for delivery in deliveries:
            if delivery.offset > appended.offset:
                break
            if delivery.event.task_id == task_id:
                state = apply(state, delivery.event)
            if delivery.offset == appended.offset:
                return state
    # acks=all: the record is below the end the read started from, so this is a broker that
    # went away mid-read; whether the act counts is unknown, as for a write that timed out.
    raise TimeoutError(f"the journal could not be read back to offset {appended.offset}")


async def abort_task(settings: KafkaSettings, task_id: str, *, reason: str, by: str,
                     writer: JournalWriter | None = None) -> TaskAborted:
    """Journal `task.aborted`: no new step is decided; a saga undoes what is proven done. The
    first call-off in the log counts: one that lost a race is refused, naming the winner."""
    by = _checked_by(by)
    reason = _checked_reason(reason)
    if not is_task_id(task_id):
        raise ResolveRefused(f"{task_id[:60]!r} is not a task id")
    state = await task_state(settings, task_id)
    if state.started is None and state.rejected is None and \
            not await requested(settings, task_id):
        raise NotInJournal(f"task {task_id} was never requested (nothing in the journal or on "
                           "the tasks topic)")
    _not_over(state)
    event = _journalable(TaskAborted, **stamp(task_id), reason=reason, by=by)
    async with _writer(settings, writer) as journal:
        meta = await journal.append(event)
    after = await state_through(settings, task_id, meta)
    if after.aborted is None or after.aborted.event_id != event.event_id:
        _not_over(after)
    return event


async def requested(settings: KafkaSettings, task_id: str) -> bool:
    """A request for `task_id` is on the tasks topic: a task not started yet (its decider is
    down, or behind) may be called off too, and is then rejected, never started."""
    async with contextlib.aclosing(read_topic(settings, TASKS,
                                              only_key=task_id.encode())) as deliveries:
        async for delivery in deliveries:
            if delivery.event.task_id == task_id:
                return True
    return False


def _not_over(state: TaskState) -> None:
    """AlreadyDecided if the task is finished, rejected or called off."""
    if state.rejected is not None:
        raise AlreadyDecided(f"task {state.task_id} was rejected: {state.rejected.reason}")
    if state.finished is not None:
        raise AlreadyDecided(f"task {state.task_id} already finished {state.finished.state}")
    if state.aborted is not None:
        raise AlreadyDecided(f"task {state.task_id} was already called off by "
                             f"{state.aborted.by}: {state.aborted.reason}")
