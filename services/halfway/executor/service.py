"""The executor service: a thin loop around `halfway.core.next_action`.

For every effect of the tasks it follows (a step, or the undo of a step whose turn has come:
`effects_to_work`), and that it has no move in flight for, it asks `next_action` and performs
the calls: journal `step.attempted`, then send the request with
the step's key (never the other way round); journal the outcome `classify` gives; retry with
the same key when a lookup found nothing and the key is alive. Lookups and escalations are the
reconciler's (halfway.reconciler). Moves run as their own tasks (at most CALLS_IN_FLIGHT_MAX at
once), so a slow provider never blocks other tasks on the same partition. After a restart the
follower replays the journal, and every "attempted, no outcome" step is settled unknown, so
the reconciler looks it up before anything else is sent. A step never sent whose task was
aborted, or whose saga is being undone, is settled `not_done` instead of sent.

Fencing: the executor runs only what the fold accepted (a late `step.intended` of a paused
decider never becomes a step). A paused executor is fenced too: an attempt is sent only once
its own fold has read it back and found the effect still open for it there (its
`step.attempted` first in the log for that attempt, no `done` or `not_done` before it, the
task not aborted or over: `_why_not_send`), and only within `send_window_s` of its journaled start
(checked just before sending).

In a worker, the decider hands each decision here before journaling it (`place`): when this
executor would attempt the step at once, the decision and its first attempt are journaled in
one append, and the call is sent only once this executor's fold has read both back and took
them (the decision accepted, the attempt first in the log for it), so a paused worker's late
pair is fenced exactly as a late decision is. A settlement is offered to that decider first
too (`_settle`, `Decider.follow`): with a model that answers without I/O, it goes in the same
append as the task's next move.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Protocol

from aiokafka.structs import RecordMetadata
from pydantic import ValidationError

from halfway import log, metrics, tracing
from halfway import settings as env
from halfway.contract import (
    EffectClass,
    Event,
    Outcome,
    SettlementSource,
    StepIntended,
    StepUnserved,
    parse_step_id,
)
from halfway.core.args import parse_args
from halfway.core.classify import NotSent, Replied, TimedOut, classify
from halfway.core.effects import Effect, effects_to_work, why_not_send
from halfway.core.fold import Attempt, Settlement, TaskState
from halfway.core.next_action import (
    Action,
    Call,
    Escalate,
    Lookup,
    Nothing,
    SettleNotDone,
    SettleUnknown,
    Wait,
    governing,
    next_action,
)
from halfway.failpoints import failpoint
from halfway.journal import JournalWriter
from halfway.journal.follower import JournalFollower
from halfway.journal.records import stamp
from halfway.journal.shared_fold import shared_folds
from halfway.journal.steps import MoveFailed, StepWorker
from halfway.settings import KafkaSettings
from halfway.tools.registry import Registry, Tool
from halfway.tools.spec import CallContext, Succeeded

CALLS_IN_FLIGHT_MAX = 1000
# A guard beyond the adapter's own timeout: an adapter that hangs is a timeout too.
TIMEOUT_GRACE_S = 2.0
PROBLEMS_CHARS_MAX = 500  # of arguments' validation errors, in a settlement's reason
# How long an attempt waits for its own record to be read back, at most (then it is not sent);
# never past its send window, after which it would not be sent anyway.
CONFIRM_TIMEOUT_S = 10.0
# Moves this executor has said it does not serve, remembered (oldest forgotten first) so that
# saying it is never news to itself: the journal keeps only a step's latest `step.unserved`,
# and two sayers (a step and its undo, or executors of two apps) would otherwise answer each
# other's records forever.
UNSERVED_SAID_MAX = 10_000


@dataclass(frozen=True, slots=True)
class Placing:
    """A decision handed over by this process's decider (`Executor.place`), journaled with
    the step's first attempt; `journaled` gets the decision's record, or why it is not."""

    intent: StepIntended
    journaled: asyncio.Future[RecordMetadata]
    before: tuple[Event, ...] = ()  # journaled just before the decision, in the same append

    def tell(self, outcome: RecordMetadata | BaseException) -> None:
        if self.journaled.done():
            return  # the decider stopped waiting
        if isinstance(outcome, BaseException):
            self.journaled.set_exception(outcome)
        else:
            self.journaled.set_result(outcome)


class Partner(Protocol):
    """A worker's decider: journals a settlement together with the task's next move when it
    makes that move at once (the record of that append's last event), or leaves the
    settlement to the executor (None)."""

    async def follow(self, settled: Event) -> RecordMetadata | None: ...


class NotPlaced(Exception):
    """The executor stopped before a handed-over decision was journaled."""


class Executor(StepWorker):
    def __init__(self, settings: KafkaSettings, registry: Registry, writer: JournalWriter, *,
                 group: str | None = None, app_label: str = "unnamed",
                 gather_ms: int = 0) -> None:
        """`gather_ms`: how long the broker may hold a fetch to gather records (a worker's
        executor: what it needs fast is folded from its own process)."""
        super().__init__()
        self.registry = registry
        self.writer = writer
        self.app_label = app_label  # which app this executor serves: `name@fingerprint`
        group = group or f"{settings.topic_prefix}executor"  # one group per deployment
        self.follower = JournalFollower(settings, group=group, writer=writer,
                                        on_change=self._on_change, app_label=app_label,
                                        seal_after_s=env.seal_after_s(), snapshots=True,
                                        gather_ms=gather_ms)
        self._slots = asyncio.Semaphore(CALLS_IN_FLIGHT_MAX)
        self.partner: Partner | None = None  # a worker's decider (`_settle`)
        self._unserved_said: OrderedDict[str, None] = OrderedDict()
        self._log = log.get("halfway.executor")

    async def _on_change(self, task_ids: set[str]) -> None:
        now = datetime.now(UTC)
        await self.follower.for_each(task_ids, lambda task_id: self._advance(task_id, now))

    async def _advance(self, task_id: str, now: datetime) -> None:
        state = self.follower.states.get(task_id)
        if state is None:
            return
        for effect in effects_to_work(state, now):
            if not self.busy(effect):
                self._consider(effect, now)

    def _consider(self, effect: Effect, now: datetime) -> None:
        if effect.called_off is not None:
            self.start_move(effect, self._move(effect, None, SettleNotDone(effect.called_off)))
            return
        tool = self.registry.get(effect.tool)
        if tool is None:
            self._unserved(effect)
            return
        action = next_action(effect.state, governing(tool.spec.policy(), effect.effect_class),
                             now)
        match action:
            case Nothing() | Lookup() | Escalate():
                return  # settled, or the reconciler's move: it looks up and escalates
            case Wait(until=until):
                self.wake_at(effect, until, now)
            case _:
                self.start_move(effect, self._move(effect, tool, action))

    async def place(self, intent: StepIntended,
                    before: tuple[Event, ...] = ()) -> RecordMetadata | None:
        """A worker's decider hands its decision here before journaling it. When this
        executor would attempt the step at once (its tool served here, its task's partition
        ours, nothing calling it off), the events `before` it (a settlement, a start), the
        decision and the first attempt are journaled together, one round trip instead of
        several in series, and the call follows as for any attempt: returns the decision's
        record. None: the decider journals it alone."""
        task_id = intent.task_id
        tool = self.registry.get(intent.tool)
        if tool is None or not self.follower.holds(task_id):
            return None
        # A task with no event yet is placed only with its start (`before`): the fold says so.
        state = self.follower.states.get(task_id) or TaskState(task_id=task_id)
        for event in (*before, intent):
            # Shared: the decider folded `before` onto this very state, and this process's
            # followers fold the same events onto it once they are journaled.
            state = shared_folds.apply(state, event)
        now = datetime.now(UTC)
        effect = next((e for e in effects_to_work(state, now)
                       if e.step_id == intent.step_id and not e.undo), None)
        if effect is None or effect.called_off is not None or self.busy(effect) or \
                next_action(effect.state, governing(tool.spec.policy(), effect.effect_class),
                            now) != Call(1):
            return None
        placing = Placing(intent, asyncio.get_running_loop().create_future(), before)
        self.start_move(effect, self._move(effect, tool, Call(1), placing))
        # However the move ends (cancelled even before it began), the decider hears of it.
        self._moves[effect.move_id].add_done_callback(
            lambda _: placing.tell(NotPlaced("the executor stopped before journaling it")))
        return await placing.journaled

    def _unserved(self, effect: Effect) -> None:
        """A step for a tool this executor's app does not have: say so in the task's journal
        (once per app), so its status shows what it waits for, instead of a silent stall."""
        state = self.follower.states.get(effect.task_id)
        step = None if state is None else state.step(parse_step_id(effect.step_id)[1])
        if step is not None and step.unserved is not None and \
                step.unserved.app == self.app_label and step.unserved.undo == effect.undo:
            return  # already said, before a restart too
        if effect.move_id in self._unserved_said:
            return  # said by this process; the journal's latest word may be another's
        self._log.error("no executor here serves this tool; the effect waits",
                        move=effect.move_id, tool=effect.tool, app=self.app_label)
        self.start_move(effect, self._write_unserved(effect))

    async def _write_unserved(self, effect: Effect) -> None:
        await self._write(StepUnserved(**stamp(effect.task_id), step_id=effect.step_id,
                                       tool=effect.tool[:200], app=self.app_label[:200],
                                       undo=effect.undo))
        self._unserved_said[effect.move_id] = None  # before the move ends: still busy here
        if len(self._unserved_said) > UNSERVED_SAID_MAX:
            self._unserved_said.popitem(last=False)

    async def _move(self, effect: Effect, tool: Tool | None, action: Action,
                    placing: Placing | None = None) -> None:
        with log.bound(task_id=effect.task_id, step_id=effect.step_id, undo=effect.undo), \
                tracing.span("halfway.attempt" if isinstance(action, Call)
                             else "halfway.settlement", effect.task_id, effect.step_id,
                             undo=effect.undo, tool=effect.tool, action=type(action).__name__):
            try:
                async with self._slots:
                    settled = await self._perform(effect, tool, action, placing)
                if settled is not None:  # outside the slot: it may start the next step's move
                    await self._settle(settled)
            except Exception as exc:
                if placing is not None:
                    placing.tell(exc)  # the decider tries again, as after its own failed write
                # The journal is unchanged by a move that failed before its write; the effect
                # is considered again after a rest and the move is retried.
                self._log.exception("move failed", action=type(action).__name__)
                raise MoveFailed from None

    async def _perform(self, effect: Effect, tool: Tool | None, action: Action,
                       placing: Placing | None = None) -> Settlement | None:
        """Make the move; the settlement it ends with is returned, to be journaled."""
        task_id = effect.task_id
        match action:
            case Call(attempt=n):
                assert tool is not None
                spec = tool.spec
                policy = governing(spec.policy(), effect.effect_class)
                try:
                    args = parse_args(spec.args_model, dict(effect.args))
                except ValidationError as exc:
                    if placing is not None:
                        placing.tell(NotPlaced("its arguments do not fit the tool"))
                    return await self._unfit(effect, n, exc)
                failpoint("executor.attempting", task_id)  # tests: paused, fold going stale
                attempted = effect.attempted(stamp(task_id), n, datetime.now(UTC))
                if placing is None:
                    meta = await self._write(attempted)
                else:
                    failpoint("executor.placing", task_id)  # tests: a worker paused here
                    *_, decided, meta = await self._write_all(*placing.before, placing.intent,
                                                              attempted)
                    placing.tell(decided)
                # Write before acting: from here on, a crash leaves "attempted, no outcome".
                refusal = await self._why_not_send(
                    effect, attempted, meta, placing,
                    min(CONFIRM_TIMEOUT_S, policy.send_window_s))
                if refusal is not None:
                    why, ours_alone = refusal
                    self._log.warning(f"not sent: {why}", attempt=n)
                    if not ours_alone:
                        return None  # someone else's attempt, or the log's word, stands
                    # Called off by the log, not by the network: never tried again.
                    verdict = classify(NotSent(f"not sent: {why}"), attempt=n)
                    return effect.settled(stamp(task_id), outcome=verdict.outcome, attempt=n,
                                          source=SettlementSource.CALL, reason=verdict.reason)
                late_s = (datetime.now(UTC) - attempted.started_at).total_seconds()
                if late_s > policy.send_window_s:
                    # Paused between the journal and the wire: the world may have moved on
                    # (lookups, a not_done proof, another task's claim). Never send it now.
                    self._log.warning("not sent: paused past the send window", attempt=n,
                                      late_s=round(late_s, 3))
                    if policy.effect_class is EffectClass.UNKEYED:
                        # Confirmed ours alone: nothing else sends this attempt.
                        verdict = classify(NotSent(f"not sent: the executor was paused "
                                                   f"{late_s:.1f} s after journaling it"),
                                           attempt=n)
                        return effect.settled(
                            stamp(task_id), outcome=verdict.outcome, attempt=n,
                            source=SettlementSource.CALL, reason=verdict.reason)
                    return None
                ctx = CallContext(effect.step_id, effect.key, n, spec.timeout_s)
                started = time.perf_counter()
                if getattr(tool.adapter, "waits_for_its_code", False):
                    # An app's function: its own timeout, then it waits for the code to end
                    # (`halfway.app.runaway`): a deadline here would settle it while it may
                    # still send.
                    result = await tool.adapter.call(args, ctx)
                else:
                    guard = asyncio.timeout(spec.timeout_s + TIMEOUT_GRACE_S)
                    try:
                        async with guard:
                            result = await tool.adapter.call(args, ctx)
                    except TimeoutError:
                        result = TimedOut(spec.timeout_s)
                    if guard.expired():  # it swallowed our cancellation: no proof
                        result = TimedOut(spec.timeout_s)
                metrics.TOOL_CALLS.labels(tool=spec.name, result=type(result).__name__).observe(
                    time.perf_counter() - started)
                self._log.info("attempt answered", attempt=n, result=type(result).__name__)
                if isinstance(result, Succeeded):
                    # The provider's own "replayed" field, if its answer has one, is its word:
                    # ours is on the settlement (and in the evidence where the field is free).
                    evidence = (result.evidence if "replayed" in result.evidence
                                else {**result.evidence, "replayed": result.replayed})
                    return effect.settled(
                        stamp(task_id), outcome=Outcome.DONE, attempt=n,
                        source=SettlementSource.CALL, effect_id=spec.effect_id(result.evidence),
                        evidence=evidence, replayed=result.replayed)
                if policy.effect_class is EffectClass.READ:
                    return None  # reads are never unknown: next_action reads again, in bounds
                verdict = classify(result, attempt=n, must_happen=effect.must_happen)
                return effect.settled(
                    stamp(task_id), outcome=verdict.outcome, attempt=n,
                    source=SettlementSource.CALL, reason=verdict.reason,
                    replayed=isinstance(result, Replied) and result.replayed)
            case SettleUnknown(attempt=n, reason=reason):
                return effect.settled(stamp(task_id), outcome=Outcome.UNKNOWN, attempt=n,
                                      source=SettlementSource.CALL, reason=reason)
            case SettleNotDone(reason=reason):
                return effect.settled(stamp(task_id), outcome=Outcome.NOT_DONE,
                                      source=SettlementSource.CALL, reason=reason)
            case _:
                raise AssertionError(f"unexpected action {action!r}")

    async def _unfit(self, effect: Effect, n: int, exc: ValidationError) -> Settlement | None:
        """Arguments the tool does not take (an undo's, filled from the step's result; a
        step decided before the app changed): nothing is sent. A first attempt is proof of
        not done; after an earlier attempt, which may have happened, an operator must say."""
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                             for e in exc.errors(include_url=False))[:PROBLEMS_CHARS_MAX]
        why = f"its arguments do not fit {effect.tool} ({problems})"
        self._log.error("not sent: the arguments do not fit the tool", attempt=n,
                        problems=problems)
        if n == 1:
            return effect.settled(stamp(effect.task_id), outcome=Outcome.NOT_DONE,
                                  source=SettlementSource.CALL, reason=f"not sent: {why}")
        await self._write(effect.checked(
            stamp(effect.task_id), found=f"attempt {n} not sent: {why}; an earlier attempt "
            "may have happened: an operator must resolve it", next_check_at=None))
        return None

    async def _settle(self, settled: Settlement) -> None:
        """Journal a settlement: with the decider's next move for the task, in one append,
        when this worker's decider makes it at once (`Decider.follow`); alone otherwise."""
        if self.partner is not None:
            try:
                meta = await self.partner.follow(settled)
            except Exception:  # the settlement must not wait on the decider's trouble
                self._log.exception("the decider's next move failed; the settlement goes alone")
            else:
                if meta is not None:
                    # Written by the decider's writer: the task is held here until this fold
                    # has it too, or it would look attempted and not settled.
                    self.follower.note_write(settled.task_id, meta.partition, meta.offset)
                    tracing.record(settled)
                    return
        await self._write(settled)

    async def _why_not_send(self, effect: Effect, attempted: Attempt, meta: RecordMetadata,
                            placing: Placing | None, wait_s: float) -> tuple[str, bool] | None:
        """`effects.why_not_send` (the rule, and why every attempt needs it), asked once this
        executor's fold has read the attempt back. Usually free: an executor that has folded
        everything before its own append folds that at once (`local_appends`); one that is
        behind waits for its fetch."""
        if not await self.follower.applied(meta.partition, meta.offset, wait_s):
            return "the partition moved before the attempt was read back here", False
        return why_not_send(self.follower.states.get(effect.task_id), effect, attempted,
                            None if placing is None else placing.intent.event_id)

    async def _write(self, event: Event) -> RecordMetadata:
        return (await self._write_all(event))[0]

    async def _write_all(self, *events: Event) -> list[RecordMetadata]:
        """Journal events of one task, in one append; hold the task until they are folded."""
        metas = await self.writer.append_all(events)
        last = metas[-1]
        self.follower.note_write(events[-1].task_id, last.partition, last.offset)
        for event in events:
            tracing.record(event)  # on the attempt's span, when traced
        return metas
