"""`halfway demo journal`: the journal on the real broker, end to end, in one minute.

A caller publishes `task.requested`; it is read back through the typed consumer; the essay's
timeline (a $49 charge that times out at 5 s and lands at 6.2 s) is journaled as the services
will journal it; then the journal is replayed from offset zero and the rebuilt state is
compared with the live fold. The services that write these events for real (decider, executor,
reconciler) come next; the events and the fold are the ones they will use.
"""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from halfway.contract import (
    DecidedBy,
    EffectClass,
    Event,
    FinalState,
    Outcome,
    SettlementSource,
    StepAttempted,
    StepChecked,
    StepIntended,
    StepSettled,
    TaskFinished,
    TaskRequested,
    TaskStarted,
    mint_key,
    step_id,
)
from halfway.contract.topics import TASKS
from halfway.core import TaskState, apply
from halfway.journal import EventConsumer, JournalWriter, ensure_topics, records, replay
from halfway.render import step_line, task_summary
from halfway.settings import KafkaSettings

READ_BACK_TIMEOUT_S = 60.0


@dataclass
class TourResult:
    task_id: str
    lines: list[str] = field(default_factory=list)
    live: TaskState | None = None
    replay_equal: bool = False
    journal_offsets: list[int] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        assert self.live is not None
        return {"task": task_summary(self.live), "replay_equals_live": self.replay_equal,
                "journal_offsets": self.journal_offsets}


def _essay(task_id: str, now: datetime) -> list[Event]:
    sid = step_id(task_id, 1)
    t = iter(now + timedelta(milliseconds=ms) for ms in range(0, 100_000, 100))

    def stamp(at: datetime | None = None) -> dict[str, Any]:
        return records.stamp(task_id, at or next(t))

    sent = next(t)
    return [
        TaskStarted(**stamp(), input={"invoice": "INV-2291", "amount_cents": 4900},
                    allowed_tools=["charge_customer"]),
        StepIntended(**stamp(), step_id=sid, n=1, tool="charge_customer",
                     args={"invoice": "INV-2291", "amount_cents": 4900, "currency": "usd"},
                     key=mint_key(sid), subject="invoice:INV-2291",
                     effect_class=EffectClass.KEYED, decided_by=DecidedBy(model="scripted")),
        StepAttempted(**stamp(sent), step_id=sid, attempt=1, key=mint_key(sid), started_at=sent),
        StepSettled(**stamp(sent + timedelta(seconds=5)), step_id=sid, outcome=Outcome.UNKNOWN,
                    attempt=1, source=SettlementSource.CALL,
                    reason="no reply within 5 s; the provider may have processed it"),
        StepChecked(**stamp(sent + timedelta(seconds=5.1)), step_id=sid,
                    found="no charge with this key yet",
                    next_check_at=sent + timedelta(seconds=7.1)),
        StepSettled(**stamp(sent + timedelta(seconds=7.1)), step_id=sid, outcome=Outcome.DONE,
                    source=SettlementSource.LOOKUP,
                    evidence={"charge_id": "ch_demo_" + task_id[-6:], "amount_cents": 4900}),
        TaskFinished(**stamp(sent + timedelta(seconds=7.2)), state=FinalState.SUCCEEDED,
                     summary="charged $49.00 for invoice INV-2291, once"),
    ]


async def run(settings: KafkaSettings) -> TourResult:
    await ensure_topics(settings)
    task_id = f"renewal-{uuid.uuid4().hex[:6]}"
    result = TourResult(task_id)
    now = datetime.now(UTC)
    request = TaskRequested(event_id=uuid.uuid4().hex, task_id=task_id, at=now,
                            input={"invoice": "INV-2291", "amount_cents": 4900},
                            allowed_tools=["charge_customer"])
    async with JournalWriter(settings) as writer:
        meta = await writer.append(request, TASKS)
        result.lines.append(f"published task.requested {task_id} "
                            f"(tasks partition {meta.partition}, offset {meta.offset})")
        consumer = EventConsumer(settings, topics=(TASKS,), group=f"demo-{task_id}",
                                 writer=writer)
        async with consumer, asyncio.timeout(READ_BACK_TIMEOUT_S):
            async for delivery in consumer.deliveries():
                if delivery.event == request:
                    result.lines.append("read it back through the typed consumer: valid, equal")
                    break
        state = apply(TaskState(task_id=task_id), request)
        for event in _essay(task_id, now):
            meta = await writer.append(event)
            result.journal_offsets.append(meta.offset)
            state = apply(state, event)
            step = state.step(1)
            shown = step_line(step) if step and event.type.startswith("step") else ""
            result.lines.append(f"  {event.type:<15} {shown}".rstrip())
    result.live = state
    rebuilt = await replay(settings)
    # The live state also saw task.requested (tasks topic); the journal starts at task.started.
    result.replay_equal = rebuilt.states[task_id] == _without_request(state)
    result.lines.append(f"replayed the journal from offset zero ({rebuilt.events} events): "
                        + ("rebuilt state equals the live fold" if result.replay_equal
                           else "MISMATCH with the live fold"))
    return result


def _without_request(state: TaskState) -> TaskState:
    from dataclasses import replace

    return replace(state, request=None)
