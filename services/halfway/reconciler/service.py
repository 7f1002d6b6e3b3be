"""The reconciler service: an unknown step must become known.

It follows the journal and the webhooks topic together (both keyed by task id, so one instance
sees a task's steps and the webhooks about them), and for each changed task:

- matches verified webhooks to steps by our key (`reconcile.webhook_verdict`) and journals the
  settlement with source `webhook`. A webhook whose step is not in the journal yet stays in the
  follower's view, and is matched when the step appears; a restart re-reads both topics, so
  neither an unknown step nor an unmatched webhook is ever lost;
- performs the lookups `next_action` asks for, on the check schedule: a found effect is
  settled (source `lookup`); nothing found is journaled as `step.checked` with the time of the
  next check (`on_nothing_found`), or as proof of `not_done` when the tool declares that its
  provider finishes every request within a bound;
- escalates: when no lookup is left and no retry is safe, a `step.checked` with no next check
  says the step needs an operator (`halfway resolve`).

Undos are effects too (`effects_to_work`): they are looked up, checked and escalated the same
way, with `compensation.*` events. Calls (first attempts and retries with the same key) are the
executor's; this service never sends one.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

from halfway import log
from halfway.contract import Event, Outcome, SettlementSource
from halfway.contract.topics import WEBHOOKS
from halfway.core.effects import Effect, effects_to_work
from halfway.core.next_action import (
    Escalate,
    Lookup,
    SettleNotDone,
    Wait,
    next_action,
    on_nothing_found,
)
from halfway.core.reconcile import webhook_verdict
from halfway.journal import JournalWriter
from halfway.journal.follower import JournalFollower
from halfway.journal.records import stamp
from halfway.journal.steps import StepWorker
from halfway.settings import KafkaSettings
from halfway.tools.registry import Registry, Tool
from halfway.tools.spec import CallContext, Found

LOOKUPS_IN_FLIGHT_MAX = 200


class Reconciler(StepWorker):
    def __init__(self, settings: KafkaSettings, registry: Registry, writer: JournalWriter, *,
                 lookups: bool = True, group: str | None = None) -> None:
        super().__init__()
        self.registry = registry
        self.writer = writer
        self.lookups = lookups  # off: only webhooks (and operators) settle unknown steps
        group = group or f"{settings.topic_prefix}reconciler"  # one group per deployment
        self.follower = JournalFollower(settings, group=group, writer=writer,
                                        on_change=self._on_change, side=WEBHOOKS)
        self._slots = asyncio.Semaphore(LOOKUPS_IN_FLIGHT_MAX)
        self._log = log.get("halfway.reconciler")

    async def _on_change(self, task_ids: set[str]) -> None:
        now = datetime.now(UTC)
        for task_id in task_ids:
            state = self.follower.states.get(task_id)
            if state is None:
                continue  # webhooks for a task not in the journal yet: kept, matched later
            for effect in effects_to_work(state, now):
                if self.busy(effect):
                    continue
                with log.bound(task_id=task_id, step_id=effect.step_id, undo=effect.undo):
                    if not await self._match_webhooks(effect):
                        self._consider(effect, now)

    async def _match_webhooks(self, effect: Effect) -> bool:
        """Journal what the first webhook with news says; True if one was written."""
        for hook in self.follower.webhooks.get(effect.key, ()):
            verdict = webhook_verdict(effect.state, hook)
            if verdict is None:
                continue
            await self._write(effect.settled(
                stamp(effect.task_id), outcome=verdict.outcome, evidence=verdict.evidence,
                reason=verdict.reason, source=SettlementSource.WEBHOOK))
            self._log.info("settled by webhook", outcome=verdict.outcome,
                           provider_event_id=hook.provider_event_id)
            return True  # the fold must see it before the next webhook is weighed
        return False

    def _consider(self, effect: Effect, now: datetime) -> None:
        tool = self.registry.get(effect.tool)
        if tool is None or effect.called_off is not None:
            return
        action = next_action(effect.state, tool.spec.policy(), now)
        match action:
            case Lookup() if self.lookups:
                self.start_move(effect, self._lookup(effect, tool))
            case Escalate(reason=reason):
                self.start_move(effect, self._escalate(effect, reason))
            case Wait(until=until):
                self.wake_at(effect, until, now)
            case _:
                pass  # settled, or the executor's move (a call), or lookups are off

    async def _lookup(self, effect: Effect, tool: Tool) -> None:
        spec = tool.spec
        with log.bound(task_id=effect.task_id, step_id=effect.step_id, undo=effect.undo):
            try:
                async with self._slots:
                    args = spec.args_model.model_validate(dict(effect.args))
                    ctx = CallContext(effect.step_id, effect.key, len(effect.state.attempts),
                                      spec.timeout_s)
                    found = await tool.adapter.lookup(args, ctx)
                    await self._record_lookup(effect, tool, found)
            except Exception:
                self._log.exception("lookup failed; it is tried again at the next change")

    async def _record_lookup(self, effect: Effect, tool: Tool, found: object) -> None:
        task_id = effect.task_id
        if isinstance(found, Found) and found.succeeded:
            await self._write(effect.settled(stamp(task_id), outcome=Outcome.DONE,
                                             evidence=found.evidence,
                                             source=SettlementSource.LOOKUP))
            return
        if isinstance(found, Found):
            await self._write(effect.settled(
                stamp(task_id), outcome=Outcome.NOT_DONE, source=SettlementSource.LOOKUP,
                reason=f"the provider's record shows it failed: {found.reason}"))
            return
        now = datetime.now(UTC)
        detail = getattr(found, "detail", "nothing found")
        after = on_nothing_found(effect.state, tool.spec.policy(), now)
        if isinstance(after, SettleNotDone):
            await self._write(effect.settled(stamp(task_id, now), outcome=Outcome.NOT_DONE,
                                             source=SettlementSource.LOOKUP,
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
