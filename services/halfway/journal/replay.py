"""Replay: read a topic from offset zero to its current end, and fold it.

This is how callers rebuild state without any read model: `await replay(settings)` returns
every task's state as the fold of its events, exactly as the live services see it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition

from halfway.contract.topics import JOURNAL, TopicSpec
from halfway.core.fold import TaskState, apply
from halfway.journal.admin import topic_partitions
from halfway.journal.limits import fetch_limits
from halfway.journal.records import Delivery, InvalidRecord, decode, partition_of
from halfway.settings import KafkaSettings

FETCH_TIMEOUT_MS = 1000
IDLE_TIMEOUT_S = 30.0  # no progress for this long while behind the end: the broker is gone


@dataclass
class ReplayResult:
    states: dict[str, TaskState] = field(default_factory=dict)
    events: int = 0
    invalid: list[tuple[int, int, str]] = field(default_factory=list)  # partition, offset, why


async def read_topic(settings: KafkaSettings, spec: TopicSpec = JOURNAL,
                     invalid: list[tuple[int, int, str]] | None = None,
                     only_key: bytes | None = None) -> AsyncIterator[Delivery]:
    """Every valid event of a topic, from the beginning to the end it had when we started.

    Invalid records are skipped (the live consumers dead-letter them) and listed in `invalid`.
    With `only_key`, only the partition that key maps to is read.
    """
    topic = spec.name(settings.topic_prefix)
    partitions = await topic_partitions(settings, topic)
    count = len(partitions)
    if only_key is not None:
        partitions = {partition_of(only_key, count)}
    consumer = AIOKafkaConsumer(**settings.client(), group_id=None,
                                enable_auto_commit=False, isolation_level="read_committed",
                                **fetch_limits())
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
        behind = {tp for tp in tps if await consumer.position(tp) < end[tp]}
        progress_at = time.monotonic()
        while behind:
            batches = await consumer.getmany(*behind, timeout_ms=FETCH_TIMEOUT_MS)
            for tp, records in batches.items():
                for record in records:
                    if record.offset >= end[tp]:
                        break  # written after we started: not part of this replay
                    try:
                        yield Delivery(decode(record, count), record.topic,
                                       record.partition, record.offset)
                    except InvalidRecord as exc:
                        if invalid is not None:
                            invalid.append((record.partition, record.offset, exc.reason))
            if batches:
                progress_at = time.monotonic()
            elif time.monotonic() - progress_at > IDLE_TIMEOUT_S:
                raise TimeoutError(f"replay of {topic} made no progress for {IDLE_TIMEOUT_S} s")
            # Positions, not record offsets: transaction markers take offsets too.
            behind = {tp for tp in behind if await consumer.position(tp) < end[tp]}
    finally:
        await consumer.stop()


async def task_state(settings: KafkaSettings, task_id: str) -> TaskState:
    """One task's state, folded from its journal partition alone."""
    state = TaskState(task_id=task_id)
    async for delivery in read_topic(settings, JOURNAL, only_key=task_id.encode()):
        if delivery.event.task_id == task_id:
            state = apply(state, delivery.event)
    return state


async def replay(settings: KafkaSettings, spec: TopicSpec = JOURNAL) -> ReplayResult:
    """Fold a whole topic into per-task states."""
    result = ReplayResult()
    async for delivery in read_topic(settings, spec, result.invalid):
        event = delivery.event
        state = result.states.get(event.task_id) or TaskState(task_id=event.task_id)
        result.states[event.task_id] = apply(state, event)
        result.events += 1
    return result
