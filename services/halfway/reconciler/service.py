"""The reconciler service: an unknown step must become known.

It follows the journal and the webhooks topic together (both keyed by task id, so one instance
sees a task's steps and the webhooks about them), and for each changed task:

- weighs verified webhooks (`reconcile.weigh_webhook`) once the journal has been read past the
  point where each arrived: one about an effect attempted before it arrived, whose object
  matches the step, settles an unknown effect (`done`; a `failed` is corroborated by a lookup
  first), or is journaled as a contradiction when it disagrees with what is known; one about a
  key that was not attempted before it arrived is an orphan, quarantined on the dead-letter
  topic with the reason and never applied. A restart re-reads both topics and weighs again:
  what is on record adds nothing, an orphan stays an orphan;
- performs the lookups `next_action` asks for, on the check schedule: a found effect is
  settled (source `lookup`); nothing found is journaled as `step.checked` with the time of the
  next check (`on_nothing_found`), or as proof of `not_done` when the tool declares that its
  provider finishes every request within a bound (an effect that must happen, an undo or a
  saga's step past its pivot, is instead checked "now", which sends it again while a retry
  with its key is safe);
- escalates: when no lookup is left and no retry is safe, a `step.checked` with no next check
  says the step needs an operator (`halfway resolve`).

Undos are effects too (`effects_to_work`): they are looked up, checked and escalated the same
way, with `compensation.*` events. Calls (first attempts and retries with the same key) are the
executor's; this service never sends one.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from aiokafka.structs import ConsumerRecord

from halfway import log, tracing
from halfway import settings as env
from halfway.contract import Event, Outcome, SettlementSource, parse_step_id
from halfway.contract.ids import parse_undo_key
from halfway.contract.topics import WEBHOOKS
from halfway.core.args import parse_args
from halfway.core.effects import Effect, effects_to_work
from halfway.core.fold import TaskState
from halfway.core.next_action import (
    Escalate,
    Lookup,
    SettleNotDone,
    Wait,
    governing,
    next_action,
    on_lookup_failed,
    on_nothing_found,
)
from halfway.core.reconcile import (
    Corroborate,
    Ignore,
    Quarantine,
    Settle,
    WebhookMove,
    declared_report,
    weigh_webhook,
)
from halfway.journal import JournalWriter
from halfway.journal.deadletters import send_dead_letter
from halfway.journal.follower import HeldWebhook, JournalFollower
from halfway.journal.records import stamp
from halfway.journal.steps import MoveFailed, StepWorker
from halfway.settings import KafkaSettings
from halfway.tools.registry import Registry, Tool
from halfway.tools.spec import CallContext, Found, LookupFailed

UNSERVED_SAID_MAX = 1_000  # distinct missing tools named in the log, then no more
LOOKUPS_IN_FLIGHT_MAX = 200
# The reconciler is off the step's critical path (an unknown step is looked up seconds later, a
# webhook waits for the journal anyway): the broker may hold its fetches this long to gather
# records, one fetch per window instead of one per record (its CPU, and the broker's).
GATHER_MS = 100


class Reconciler(StepWorker):
    def __init__(self, settings: KafkaSettings, registry: Registry, writer: JournalWriter, *,
                 lookups: bool = True, group: str | None = None,
                 app_label: str | None = None) -> None:
        super().__init__()
        self.registry = registry
        self.writer = writer
        self.lookups = lookups  # off: only webhooks (and operators) settle unknown steps
        group = group or f"{settings.topic_prefix}reconciler"  # one group per deployment
        self.follower = JournalFollower(settings, group=group, writer=writer,
                                        on_change=self._on_change, side=WEBHOOKS,
                                        app_label=app_label,
                                        seal_after_s=env.seal_after_s(), snapshots=True,
                                        gather_ms=GATHER_MS)
        self._slots = asyncio.Semaphore(LOOKUPS_IN_FLIGHT_MAX)
        self._log = log.get("halfway.reconciler")
        self._app_label = app_label
        self._unserved_said: set[str] = set()  # tools said to be missing: UNSERVED_SAID_MAX

    async def _on_change(self, task_ids: set[str]) -> None:
        now = datetime.now(UTC)
        await self.follower.for_each(task_ids, lambda task_id: self._advance(task_id, now))

    async def _advance(self, task_id: str, now: datetime) -> None:
        state = self.follower.states.get(task_id)
        with log.bound(task_id=task_id):
            if await self._weigh_webhooks(task_id, state):
                return  # a write: the fold must see it before anything else is weighed
        if state is None:
            return
        for effect in effects_to_work(state, now):
            if not self.busy(effect):
                with log.bound(task_id=task_id, step_id=effect.step_id, undo=effect.undo):
                    self._consider(effect, now)

    async def _weigh_webhooks(self, task_id: str, state: TaskState | None) -> bool:
        """Weigh the task's webhooks whose order against the journal is known, one at a time;
        True once one was journaled (the rest wait for the fold to see it)."""
        held = self.follower.take_webhooks(task_id)
        for i, item in enumerate(held):
            effect = _effect_named(state, item.hook.key)
            if await self._act_on_webhook(item, effect, self._weigh(item, effect)):
                self.follower.put_back_webhooks(task_id, held[i + 1:])
                return True
        return False

    def _weigh(self, item: HeldWebhook, effect: Effect | None) -> WebhookMove:
        hook = item.hook
        if item.past_end is not None:
            return Quarantine(f"the webhook for {hook.key} names journal offset "
                              f"{hook.journal_offset} of journal partition "
                              f"{hook.journal_partition}, past its end {item.past_end} when "
                              "the broker was asked after the webhook arrived: no gateway "
                              "stamped it so")
        if item.unordered:
            return Quarantine(f"held the webhook for {hook.key} too long: its journal offset "
                              f"{hook.journal_offset} was never reached")
        tool = self.registry.get(effect.tool) if effect is not None else None
        report = None
        if effect is not None and tool is not None:
            read = getattr(tool.adapter, "read_webhook", None)
            if read is not None:
                report = read(parse_args(tool.spec.args_model, dict(effect.args)), hook)
            else:  # the provider's declared mapping speaks for a tool that reads no webhooks
                report = declared_report(hook, tool.spec.evidence_id)
        elif effect is not None:
            return Ignore(f"no tool {effect.tool} here to read it")
        # A tool with a lookup never takes a negative report's word, even with lookups off
        # (then nothing corroborates it, and an operator is asked): not done must be proven.
        return weigh_webhook(effect.state if effect is not None else None, report, hook,
                             first_attempt_offset=self.follower.first_attempt.get(hook.key or ""),
                             has_lookup=tool is not None and tool.spec.has_lookup)

    async def _act_on_webhook(self, item: HeldWebhook, effect: Effect | None,
                              move: WebhookMove) -> bool:
        hook = item.hook
        fields = {"provider_event_id": hook.provider_event_id, "key": hook.key}
        match move:
            case Quarantine(reason=reason):
                self._log.warning("webhook quarantined", reason=reason, **fields)
                if item.fresh:  # a replay finds what an earlier instance already recorded
                    await self._quarantine(item, reason)
                return False
            case Ignore(why=why):
                self._log.debug("webhook adds nothing", why=why, **fields)
                return False
            case Corroborate(told=told):
                assert effect is not None
                tool = self.registry.get(effect.tool)
                if not self.lookups:
                    if item.fresh and not effect.state.needs_attention:
                        await self._escalate(effect, f"{told}; lookups are off, so nothing "
                                                     "corroborates it: an operator must "
                                                     "resolve it")
                    return False
                if tool is not None and not self.busy(effect):
                    self._log.info("a negative webhook; looking it up before believing it",
                                   **fields)
                    self.start_move(effect, self._lookup(effect, tool))
                return False
            case Settle():
                assert effect is not None
                with tracing.span("halfway.settlement", effect.task_id, effect.step_id,
                                  source="webhook", undo=effect.undo, tool=effect.tool):
                    await self._write(effect.settled(
                        stamp(effect.task_id), outcome=move.outcome, evidence=move.evidence,
                        reason=move.reason, effect_id=move.effect_id,
                        contradiction=move.contradiction, source=SettlementSource.WEBHOOK))
                self._log.info("webhook journaled", outcome=move.outcome,
                               contradiction=move.contradiction, **fields)
                return True
        return False

    async def _quarantine(self, item: HeldWebhook, reason: str) -> None:
        """The webhook's dead letter: where it is, and why it is never applied (whether or
        not the letter can be written, it is never applied)."""
        value = item.hook.model_dump_json().encode()
        record = ConsumerRecord(
            topic=self.writer.topic(WEBHOOKS), partition=item.partition, offset=item.offset,
            timestamp=0, timestamp_type=0, key=item.hook.record_key(), value=value,
            checksum=None, serialized_key_size=-1, serialized_value_size=len(value),
            headers=())
        await send_dead_letter(self.writer, record, reason, group=self.follower.group,
                               logger=self._log)

    def _consider(self, effect: Effect, now: datetime) -> None:
        tool = self.registry.get(effect.tool)
        if tool is None:
            self._unserved(effect)
            return
        if effect.called_off is not None:
            return
        action = next_action(effect.state, governing(tool.spec.policy(), effect.effect_class),
                             now)
        match action:
            case Lookup() if self.lookups:
                self.start_move(effect, self._lookup(effect, tool))
            case Escalate(reason=reason):
                self.start_move(effect, self._escalate(effect, reason))
            case Wait(until=until):
                self.wake_at(effect, until, now)
            case _:
                pass  # settled, or the executor's move (a call), or lookups are off

    def _unserved(self, effect: Effect) -> None:
        """A step of a tool this reconciler's app lacks: never looked up here. Said once per
        tool, as an error an operator sees, not silently: its status says it is checked."""
        if effect.tool in self._unserved_said or len(self._unserved_said) >= UNSERVED_SAID_MAX:
            return
        self._unserved_said.add(effect.tool)
        self._log.error("no tool of this name in this reconciler's app: its unknown steps are "
                        "not looked up here; run the reconciler with "
                        "the app the executors run", tool=effect.tool[:200], app=self._app_label,
                        step_id=effect.step_id)

    async def _lookup(self, effect: Effect, tool: Tool) -> None:
        spec = tool.spec
        with log.bound(task_id=effect.task_id, step_id=effect.step_id, undo=effect.undo), \
                tracing.span("halfway.settlement", effect.task_id, effect.step_id,
                             source="lookup", undo=effect.undo, tool=effect.tool):
            try:
                async with self._slots:
                    args = parse_args(spec.args_model, dict(effect.args))
                    ctx = CallContext(effect.step_id, effect.key, len(effect.state.attempts),
                                      spec.timeout_s)
                    found = await tool.adapter.lookup(args, ctx)
                    await self._record_lookup(effect, tool, found)
            except Exception:
                self._log.exception("lookup failed; it is tried again after a rest")
                raise MoveFailed from None

    async def _record_lookup(self, effect: Effect, tool: Tool, found: object) -> None:
        task_id = effect.task_id
        if isinstance(found, Found) and found.succeeded:
            await self._write(effect.settled(stamp(task_id), outcome=Outcome.DONE,
                                             evidence=found.evidence,
                                             effect_id=tool.spec.effect_id(found.evidence),
                                             source=SettlementSource.LOOKUP))
            for other in found.others:
                # More than one effect under our key: the provider did it again (a key reused
                # after it forgot it). Kept as a contradiction: an operator must look.
                await self._write(effect.settled(
                    stamp(task_id), outcome=Outcome.DONE, evidence=found.evidence,
                    effect_id=other, source=SettlementSource.LOOKUP,
                    contradiction=f"the lookup found another effect, {other}, under the same "
                                  f"key: it may have happened twice"))
            return
        if isinstance(found, Found):
            await self._write(effect.settled(
                stamp(task_id), outcome=Outcome.NOT_DONE, source=SettlementSource.LOOKUP,
                effect_id=tool.spec.effect_id(found.evidence),
                reason=f"the provider's record shows it failed: {found.reason}"))
            return
        now = datetime.now(UTC)
        detail = getattr(found, "detail", "nothing found")
        # Only a lookup that answered "nothing" may prove not_done (`completes_within_s`);
        # one that failed saw nothing at all (the chaos suite's refused connections).
        policy = governing(tool.spec.policy(), effect.effect_class)
        after = (on_lookup_failed(effect.state, policy, now)
                 if isinstance(found, LookupFailed)
                 else on_nothing_found(effect.state, policy, now,
                                       must_happen=effect.must_happen))
        if isinstance(after, SettleNotDone):
            # It covers the attempts this fold has: one journaled meanwhile (an executor's
            # retry) voids it in the log (halfway.core.fold, rule 3).
            last = max((a.attempt for a in effect.state.attempts), default=None)
            await self._write(effect.settled(stamp(task_id, now), outcome=Outcome.NOT_DONE,
                                             source=SettlementSource.LOOKUP, attempt=last,
                                             reason=after.reason))
            return
        if after is None:
            detail += "; lookups are over and no retry is safe: an operator must resolve it"
        await self._write(effect.checked(stamp(task_id, now), detail, after))
        self._log.info("checked: nothing yet", next_check_at=after)

    async def _escalate(self, effect: Effect, reason: str) -> None:
        await self._write(effect.checked(stamp(effect.task_id), reason, None))
        self._log.warning("needs an operator", reason=reason)

    async def _write(self, event: Event) -> None:
        meta = await self.writer.append(event)
        self.follower.note_write(event.task_id, meta.partition, meta.offset)
        tracing.record(event)  # on the settlement's span, when traced


def _effect_named(state: TaskState | None, key: str | None) -> Effect | None:
    """The effect (a step, or a step's undo under one of its keys) our key names in the task,
    if it is in the log."""
    if state is None or key is None:
        return None
    undo = parse_undo_key(key)
    try:
        task_id, n = parse_step_id(key if undo is None else undo[0])
    except ValueError:
        return None
    if task_id != state.task_id:
        return None  # another task's key (weigh_webhook quarantines the record)
    step = state.steps.get(n)
    if step is None:
        return None
    intent = step.intent
    if undo is None:
        return Effect(False, intent.task_id, step.step_id, intent.tool, intent.args,
                      intent.key, step.effect)
    # The latest undo, or one under an earlier key: news of that one is weighed against
    # its proof of absence (a `done` contradicts it: the undo may have happened twice).
    for undo_ in step.undos:
        plan = undo_.plan
        if plan.key == key:
            return Effect(True, intent.task_id, step.step_id, plan.tool, plan.args, plan.key,
                          undo_.state, generation=plan.generation)
    return None
