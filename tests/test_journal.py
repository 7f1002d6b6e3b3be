"""The journal against the real broker: round trips, dead letters, replay equals live fold."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable

import jsonschema
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from halfway.contract import Event, Outcome, SettlementSource
from halfway.contract.events import DeadLetter
from halfway.contract.topics import ALL_TOPICS, DEAD_LETTERS, JOURNAL, TASKS, TopicSpec
from halfway.core import TaskState, apply
from halfway.journal import Delivery, EventConsumer, JournalWriter, ensure_topics, replay
from halfway.settings import KafkaSettings
from tests.factories import Stamper, one_of_each
from tests.test_contract import schema_for

pytestmark = pytest.mark.broker
WAIT_S = 60.0  # upper bound for any await on the broker: a hang fails, it never blocks CI


async def take(deliveries: AsyncIterator[Delivery], count: int) -> list[Delivery]:
    out: list[Delivery] = []

    async def pull() -> None:
        async for d in deliveries:
            out.append(d)
            if len(out) == count:
                return

    await asyncio.wait_for(pull(), WAIT_S)
    return out


async def raw_records(settings: KafkaSettings, spec: TopicSpec, count: int,
                      keep: Callable[[object], bool] = lambda r: True) -> list:
    consumer = AIOKafkaConsumer(spec.name(settings.topic_prefix),
                                bootstrap_servers=settings.bootstrap,
                                auto_offset_reset="earliest", group_id=None)
    await consumer.start()
    out = []
    try:
        async def pull() -> None:
            async for record in consumer:
                if keep(record):
                    out.append(record)
                if len(out) == count:
                    return
        await asyncio.wait_for(pull(), WAIT_S)
    finally:
        await consumer.stop()
    return out


def group() -> str:
    return f"test-{uuid.uuid4().hex[:8]}"


async def test_topics_are_created_with_their_configs_once(topics: KafkaSettings) -> None:
    assert await ensure_topics(topics, ALL_TOPICS) == []  # a second call creates nothing
    admin = AIOKafkaAdminClient(bootstrap_servers=topics.bootstrap)
    await admin.start()
    try:
        responses = await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, JOURNAL.name(topics.topic_prefix))])
        configs = {name: value for name, value, *_ in responses[0].resources[0][4]}
        described = await admin.describe_topics([JOURNAL.name(topics.topic_prefix)])
    finally:
        await admin.close()
    assert configs["cleanup.policy"] == "delete"
    assert configs["retention.ms"] == "-1"
    assert configs["retention.bytes"] == "-1"
    assert len(described[0]["partitions"]) == JOURNAL.partitions


async def test_every_event_type_round_trips_through_the_broker(
    topics: KafkaSettings, writer: JournalWriter,
) -> None:
    task = f"roundtrip-{uuid.uuid4().hex[:8]}"
    events = one_of_each(task)
    for event in events:
        await writer.append(event)
    records = await raw_records(topics, JOURNAL, len(events),
                                keep=lambda r: r.key == task.encode())
    assert [r.value for r in records] == [e.model_dump_json().encode() for e in events]
    for record, event in zip(records, events, strict=True):
        doc = json.loads(record.value)
        jsonschema.validate(doc, schema_for(event.type))  # what other languages will check
        assert dict(record.headers)["type"] == event.type.encode()
    async with EventConsumer(topics, topics=(JOURNAL,), group=group(), writer=writer) as consumer:
        got = await take(_only(consumer.deliveries(), task), len(events))
    assert [d.event for d in got] == events
    assert len({d.partition for d in got}) == 1  # one task, one partition, total order


async def _only(deliveries: AsyncIterator[Delivery], task: str) -> AsyncIterator[Delivery]:
    async for d in deliveries:
        if d.event.task_id == task:
            yield d


async def test_malformed_records_go_to_the_dead_letter_topic_and_the_consumer_goes_on(
    topics: KafkaSettings, writer: JournalWriter,
) -> None:
    task = f"poison-{uuid.uuid4().hex[:8]}"
    s = Stamper(task)
    before, after = s.requested(), s.requested()
    valid_settled = json.loads(s.settled(1, Outcome.DONE).model_dump_json())
    key = task.encode()
    poison: list[tuple[bytes | None, str]] = [
        (b'{"type": "task.requested", "task_id": ', "invalid event: (record): Invalid JSON"),
        (json.dumps(valid_settled | {"evidence": None}).encode(), "must carry evidence"),
        (json.dumps({"type": "step.teleported", "task_id": task}).encode(), "type"),
        (b"\xff\xfe not utf-8", "invalid event"),
        (None, "tombstone"),
    ]
    # All on the tasks topic, one partition (same key), between two valid events.
    await writer.append(before, TASKS)
    for value, _ in poison:
        await writer.append_raw(TASKS, value, key=key)
    other = Stamper(f"{task}-other")
    wrong_key = s.requested()  # valid, but keyed as another task: it would break the order
    await writer.append_raw(TASKS, wrong_key.model_dump_json().encode(), key=other.task_id.encode())
    sentinel = other.requested()  # behind the misrouted record, in its partition
    await writer.append(sentinel, TASKS)
    await writer.append(after, TASKS)

    got: list[Delivery] = []
    async with EventConsumer(topics, topics=(TASKS,), group=group(), writer=writer) as consumer:
        # The misrouted record may sit on another partition: read up to the sentinel behind it.
        async with asyncio.timeout(WAIT_S):
            async for d in consumer.deliveries():
                got.append(d)
                if all(any(x.event == e for x in got) for e in (before, after, sentinel)):
                    break
        assert consumer.dead_lettered == len(poison) + 1
    assert [d.event for d in got if d.event.task_id == task] == [before, after]

    letters = [DeadLetter.model_validate_json(r.value) for r in await raw_records(
        topics, DEAD_LETTERS, len(poison),
        keep=lambda r: DeadLetter.model_validate_json(r.value).key == task)]
    for letter, (value, why) in zip(letters, poison, strict=True):
        assert why in letter.reason
        assert letter.source_topic == TASKS.name(topics.topic_prefix)
        if value is not None and letter.value_b64 is None:
            assert letter.value.encode() == value  # kept whole
    assert letters[3].value_b64 is not None  # the bytes that were not UTF-8, intact
    (misrouted,) = await raw_records(
        topics, DEAD_LETTERS, 1,
        keep=lambda r: wrong_key.event_id in DeadLetter.model_validate_json(r.value).value)
    assert "is not the event's task id" in DeadLetter.model_validate_json(misrouted.value).reason


async def test_a_consumer_resumes_after_what_it_committed(
    topics: KafkaSettings, writer: JournalWriter,
) -> None:
    task, name = f"resume-{uuid.uuid4().hex[:8]}", group()
    s = Stamper(task)
    first, second = s.requested(), s.requested()
    await writer.append(first, TASKS)
    await writer.append(second, TASKS)
    async with EventConsumer(topics, topics=(TASKS,), group=name, writer=writer) as consumer:
        (delivery,) = await take(_only(consumer.deliveries(), task), 1)
        await consumer.commit(delivery)
    async with EventConsumer(topics, topics=(TASKS,), group=name, writer=writer) as consumer:
        (again,) = await take(_only(consumer.deliveries(), task), 1)
    assert (delivery.event, again.event) == (first, second)


async def test_replaying_the_journal_from_zero_equals_the_live_fold(
    topics: KafkaSettings, writer: JournalWriter,
) -> None:
    # Several tasks, interleaved, with a redelivery and a zombie's duplicate decision in the log.
    stampers = [Stamper(f"replay-{uuid.uuid4().hex[:6]}-{i}") for i in range(5)]
    log: list[Event] = []
    for s in stampers:
        log += [s.started(), s.intended(1), s.attempted(1, 1)]
    for i, s in enumerate(stampers):
        log.append(s.settled(1, Outcome.UNKNOWN, attempt=1))
        log.append(s.checked(1))
        if i % 2:
            log.append(s.settled(1, Outcome.DONE, source=SettlementSource.WEBHOOK))
        log.append(log[3 * i + 1])  # a redelivered decision
        log.append(s.intended(1, args={"amount": "49.00"}))  # a zombie's second decision
    for event in log:
        await writer.append(event)

    mine = {s.task_id for s in stampers}
    live: dict[str, TaskState] = {}
    async with EventConsumer(topics, topics=(JOURNAL,), group=group(), writer=writer) as consumer:
        async for delivery in _only_tasks(consumer.deliveries(), mine, len(log)):
            e = delivery.event
            live[e.task_id] = apply(live.get(e.task_id) or TaskState(task_id=e.task_id), e)

    rebuilt = await asyncio.wait_for(replay(topics), WAIT_S)
    assert {t: rebuilt.states[t] for t in mine} == live
    assert sum(1 for t in mine if live[t].step(1).outcome is Outcome.DONE) == 2
    assert all(live[t].step(1).intent.args != {"amount": "49.00"} for t in mine)


async def _only_tasks(deliveries: AsyncIterator[Delivery], tasks: set[str],
                      count: int) -> AsyncIterator[Delivery]:
    seen = 0
    async with asyncio.timeout(WAIT_S):
        async for d in deliveries:
            if d.event.task_id in tasks:
                yield d
                seen += 1
                if seen == count:
                    return
