"""The journal: round trips, dead letters (bounded, whatever the record), replay equals live fold.

Tests marked `broker` use the real broker; the rest are pure."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import json
import uuid
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

import jsonschema
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import KafkaConnectionError
from aiokafka.structs import ConsumerRecord, RecordMetadata
from hypothesis import given
from hypothesis import strategies as st

from halfway.contract import Event, Outcome, SettlementSource
from halfway.contract.events import DeadLetter
from halfway.contract.topics import ALL_TOPICS, DEAD_LETTERS, JOURNAL, TASKS, TopicSpec
from halfway.core import TaskState, apply
from halfway.journal import Delivery, EventConsumer, JournalWriter, ensure_topics, replay
from halfway.journal.admin import delete_topics
from halfway.journal.deadletters import (
    DEAD_LETTER_ATTEMPTS,
    DeadLetters,
    send_dead_letter,
)
from halfway.journal.reader import Wake, known_end
from halfway.journal.records import (
    EXCERPT_BYTES_MAX,
    LETTER_HEADER_CHARS_MAX,
    LETTER_HEADERS_MAX,
    LETTER_KEY_CHARS_MAX,
    REASON_LENGTH_MAX,
    REASON_MSG_CHARS_MAX,
    InvalidRecord,
    dead_letter,
    decode,
    decode_guard,
    decode_webhook,
)
from halfway.settings import KafkaSettings
from tests.factories import Stamper, one_of_each
from tests.test_contract import schema_for

broker = pytest.mark.broker
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
                                **settings.client(),
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


@broker
async def test_topics_are_created_with_their_configs_once(topics: KafkaSettings) -> None:
    assert await ensure_topics(topics, ALL_TOPICS) == []  # a second call creates nothing
    admin = AIOKafkaAdminClient(**topics.client())
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


@broker
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


@broker
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
            assert letter.value.encode() == value  # a small value: the excerpt is all of it
    assert letters[3].value_b64 is not None  # the bytes that were not UTF-8, intact
    (misrouted,) = await raw_records(
        topics, DEAD_LETTERS, 1,
        keep=lambda r: wrong_key.event_id in DeadLetter.model_validate_json(r.value).value)
    assert "is not the event's task id" in DeadLetter.model_validate_json(misrouted.value).reason


@broker
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


@broker
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


# --- dead letters: bounded, whatever the record (pure) -------------------------------------------

MEGABYTE = 1_000_000
LETTER_BYTES_MAX = 16 * 1024  # what a letter may weigh, whatever the record it describes


def consumer_record(value: bytes | None, *, key: bytes | None = b"renewal-1",
                    headers: list[tuple[str, Any]] | None = None, topic: str = "x.tasks",
                    partition: int = 3, offset: int = 41) -> ConsumerRecord:
    return ConsumerRecord(topic=topic, partition=partition, offset=offset, timestamp=0,
                          timestamp_type=0, key=key, value=value, checksum=None,
                          serialized_key_size=-1 if key is None else len(key),
                          serialized_value_size=-1 if value is None else len(value),
                          headers=headers or [])


def letter_of(record: ConsumerRecord, reason: str = "why") -> DeadLetter:
    letter = dead_letter(record, reason, group="g", at=datetime.now(UTC))
    assert len(letter.model_dump_json().encode()) <= LETTER_BYTES_MAX
    return DeadLetter.model_validate_json(letter.model_dump_json())  # and it round-trips


def test_a_megabyte_that_is_not_utf8_becomes_a_small_letter_with_its_digest() -> None:
    value = bytes(range(128, 256)) * (MEGABYTE // 128)

    letter = letter_of(consumer_record(value))

    assert (letter.source_topic, letter.source_partition, letter.source_offset) == (
        "x.tasks", 3, 41)
    assert letter.value_bytes == len(value)
    assert letter.value_sha256 == hashlib.sha256(value).hexdigest()
    assert letter.truncated
    assert letter.value_b64 is not None
    assert base64.b64decode(letter.value_b64) == value[:EXCERPT_BYTES_MAX]
    assert letter.value == value[:EXCERPT_BYTES_MAX].decode("utf-8", errors="replace")


def test_a_character_cut_at_the_excerpt_boundary_is_not_called_invalid() -> None:
    value = ("a" * (EXCERPT_BYTES_MAX - 1) + "é" * 1000).encode()  # é's 2 bytes straddle it

    letter = letter_of(consumer_record(value))

    assert letter.value_b64 is None
    assert letter.value == "a" * (EXCERPT_BYTES_MAX - 1)
    assert (letter.truncated, letter.value_bytes) == (True, len(value))


def test_a_cut_character_at_the_very_end_of_a_whole_value_is_invalid() -> None:
    letter = letter_of(consumer_record(b'{"id": "caf\xc3'))

    assert letter.value_b64 == base64.b64encode(b'{"id": "caf\xc3').decode()
    assert letter.value == '{"id": "caf\ufffd'
    assert not letter.truncated


def test_a_tombstone_is_a_letter_too() -> None:
    letter = letter_of(consumer_record(None), "the record has no value (a tombstone)")

    assert (letter.value, letter.value_b64, letter.value_bytes, letter.value_sha256,
            letter.truncated) == ("", None, 0, None, False)
    assert "tombstone" in letter.reason


def test_the_key_the_headers_and_the_reason_are_cut() -> None:
    headers = [(f"h{i}", b"v" * 1000) for i in range(100)] + [("empty", None)]

    letter = letter_of(consumer_record(b"{}", key=b"k" * MEGABYTE, headers=headers),
                       reason="r" * 10_000)

    assert letter.key == "k" * LETTER_KEY_CHARS_MAX
    assert list(letter.headers) == [f"h{i}" for i in range(LETTER_HEADERS_MAX)]
    assert all(v == "v" * LETTER_HEADER_CHARS_MAX for v in letter.headers.values())
    assert len(letter.reason) == REASON_LENGTH_MAX


def test_a_header_without_a_value_does_not_break_a_letter() -> None:
    letter = letter_of(consumer_record(b"{}", headers=[("type", None)]))

    assert letter.headers == {"type": ""}


@given(value=st.binary(max_size=3 * EXCERPT_BYTES_MAX) | st.text(max_size=1500).map(str.encode))
def test_the_excerpt_is_the_values_start_and_b64_only_for_what_is_not_utf8(value: bytes) -> None:
    letter = dead_letter(consumer_record(value), "why", group=None, at=datetime.now(UTC))

    head = value[:EXCERPT_BYTES_MAX]
    assert letter.truncated == (len(value) > EXCERPT_BYTES_MAX)
    if letter.value_b64 is None:  # the excerpt is text the value starts with, at most one
        excerpt = letter.value.encode()  # character short of the cut
        assert head.startswith(excerpt)
        assert len(head) - len(excerpt) < (4 if letter.truncated else 1)
    else:
        assert base64.b64decode(letter.value_b64) == head
        with pytest.raises(UnicodeDecodeError):
            value.decode("utf-8")
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        pass
    else:
        assert letter.value_b64 is None


def _requested_doc(**extra: Any) -> dict[str, Any]:
    return {"type": "task.requested", "event_id": uuid.uuid4().hex, "task_id": "renewal-1",
            "at": "2026-12-02T09:00:00Z", **extra}


@pytest.mark.parametrize(("value", "key", "words"), [
    pytest.param(json.dumps({"type": "x" * MEGABYTE}).encode(), None, "does not match",
                 id="a-megabyte-tag"),
    pytest.param(json.dumps(_requested_doc(**{"y" * MEGABYTE: 1})).encode(), None,
                 "Extra inputs are not permitted", id="a-megabyte-field-name"),
    pytest.param(json.dumps(_requested_doc(typo="z" * MEGABYTE)).encode(), None,
                 "task.requested.typo: Extra inputs are not permitted", id="one-unknown-field"),
    pytest.param(json.dumps(_requested_doc(allowed_tools=[1] * 200_000)).encode(), None,
                 "200000 errors", id="200000-errors"),
    pytest.param(json.dumps(_requested_doc()).encode(), b"k" * MEGABYTE,
                 "is not the event's task id", id="a-megabyte-key"),
    pytest.param(b"[" * 250 + b"]" * 250, None, "recursion limit", id="nested-250-deep"),
    pytest.param(b"\xff" * MEGABYTE, None, "Invalid JSON", id="not-utf8"),
])
def test_the_reason_for_a_huge_invalid_record_is_bounded(value: bytes, key: bytes | None,
                                                           words: str) -> None:
    for decoder in (decode, decode_webhook, decode_guard):
        with pytest.raises(InvalidRecord) as refused:
            decoder(consumer_record(value, key=key))
        assert len(refused.value.reason) <= REASON_LENGTH_MAX
        longer = REASON_MSG_CHARS_MAX + 1  # the input is quoted, if at all, cut to less
        assert "x" * longer not in refused.value.reason
        assert "y" * longer not in refused.value.reason
        assert "k" * longer not in refused.value.reason
        if decoder is decode:
            assert words in refused.value.reason


# --- writing dead letters: retried, then skipped, never fatal ------------------------------------


class Recorder:
    """A logger that keeps what it was told (structlog's capture misses cached loggers)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict[str, Any]]] = []

    def _keep(self, level: str) -> Callable[..., None]:
        return lambda event, **kw: self.lines.append((level, event, kw))

    def __getattr__(self, level: str) -> Callable[..., None]:
        return self._keep(level)

    def at(self, level: str) -> list[tuple[str, dict[str, Any]]]:
        return [(event, kw) for lvl, event, kw in self.lines if lvl == level]


class FlakyWriter:
    """Fails the first `failures` dead letters (or all with None); other writes go through."""

    def __init__(self, inner: Any = None, failures: int | None = None,
                 error: BaseException | None = None) -> None:
        self.inner = inner
        self.failures = failures
        self.error = error or KafkaConnectionError("the broker is gone")
        self.letters: list[tuple[bytes | None, bytes | None]] = []
        self.calls = 0

    async def append_raw(self, spec: TopicSpec, value: bytes | None, *, key: bytes | None = None,
                         headers: list[tuple[str, bytes]] | None = None) -> RecordMetadata:
        if spec is DEAD_LETTERS:
            self.calls += 1
            if self.failures is None or self.calls <= self.failures:
                raise self.error
            self.letters.append((key, value))
            tp = TopicPartition(DEAD_LETTERS.name(), 0)
            return RecordMetadata(tp.topic, tp.partition, tp, len(self.letters) - 1, None, 0,
                                  None)
        return await self.inner.append_raw(spec, value, key=key, headers=headers)


async def test_a_letter_that_cannot_be_written_is_retried_then_skipped_with_an_error() -> None:
    writer, logger = FlakyWriter(), Recorder()
    value = b"\xff" * MEGABYTE

    ok = await send_dead_letter(writer, consumer_record(value), "invalid event: bytes",
                                group="g", logger=logger, backoff_s=0)  # type: ignore[arg-type]

    assert ok is False
    assert writer.calls == DEAD_LETTER_ATTEMPTS
    assert len(logger.at("warning")) == DEAD_LETTER_ATTEMPTS  # each failed attempt
    [(event, fields)] = logger.at("error")
    assert event == "dead letter lost: record skipped"
    assert (fields["topic"], fields["partition"], fields["offset"], fields["size_bytes"]) == (
        "x.tasks", 3, 41, MEGABYTE)
    assert fields["sha256"] == hashlib.sha256(value).hexdigest()
    assert "KafkaConnectionError" in fields["error"]


async def test_a_letter_is_written_on_a_later_attempt_keyed_by_where_the_record_is() -> None:
    writer, logger = FlakyWriter(failures=1), Recorder()
    letters = DeadLetters(writer, group="g", logger=logger, backoff_s=0)  # type: ignore[arg-type]

    assert await letters.send(consumer_record(b"nope"), "invalid event: nope")

    assert (letters.written, letters.failed, writer.calls) == (1, 0, 2)
    [(key, value)] = writer.letters
    assert key == b"x.tasks/3/41"
    assert value is not None
    assert DeadLetter.model_validate_json(value).reason == "invalid event: nope"


async def test_a_letter_attempt_that_hangs_is_given_up_on() -> None:
    class Hanging:
        async def append_raw(self, *args: Any, **kwargs: Any) -> RecordMetadata:
            await asyncio.Event().wait()
            raise AssertionError("unreachable")

    logger = Recorder()
    ok = await asyncio.wait_for(send_dead_letter(
        Hanging(), consumer_record(b"x"), "why", group=None, logger=logger,  # type: ignore[arg-type]
        backoff_s=0, attempt_timeout_s=0.01), WAIT_S)

    assert ok is False
    assert [event for event, _ in logger.at("error")] == ["dead letter lost: record skipped"]


async def test_cancelling_a_letter_is_not_swallowed() -> None:
    writer = FlakyWriter(error=asyncio.CancelledError())
    with pytest.raises(asyncio.CancelledError):
        await send_dead_letter(writer, consumer_record(b"x"), "why", group=None,
                               logger=Recorder(), backoff_s=0)  # type: ignore[arg-type]
    assert writer.calls == 1


@pytest.fixture
async def own_topics(kafka_settings: KafkaSettings) -> AsyncIterator[KafkaSettings]:
    """A tasks topic (and dead letters) of this test's own: nothing else in them."""
    settings = kafka_settings.with_prefix(f"own-{uuid.uuid4().hex[:8]}.")
    await ensure_topics(settings, (TASKS, DEAD_LETTERS))
    yield settings
    await delete_topics(settings, (TASKS, DEAD_LETTERS))


@broker
async def test_a_consumer_whose_dead_letters_fail_skips_the_record_and_goes_on(
    own_topics: KafkaSettings,
) -> None:
    task = f"unlettered-{uuid.uuid4().hex[:8]}"
    after = Stamper(task).requested()
    logger = Recorder()
    async with JournalWriter(own_topics) as writer:
        bad = await writer.append_raw(TASKS, b"\xff not an event", key=task.encode())
        await writer.append(after, TASKS)
        failing = FlakyWriter(writer)
        async with EventConsumer(own_topics, topics=(TASKS,), group=group(),
                                 writer=failing) as consumer:  # type: ignore[arg-type]
            consumer.dead_letters = DeadLetters(
                failing, group=consumer.group, logger=logger,  # type: ignore[arg-type]
                backoff_s=0.01)
            (delivery,) = await take(consumer.deliveries(), 1)

    assert delivery.event == after
    assert (consumer.dead_letters.written, consumer.dead_letters.failed) == (0, 1)
    assert consumer.dead_lettered == 1
    assert failing.calls == DEAD_LETTER_ATTEMPTS
    [(event, fields)] = logger.at("error")
    assert event == "dead letter lost: record skipped"
    assert (fields["topic"], fields["partition"], fields["offset"]) == (
        TASKS.name(own_topics.topic_prefix), bad.partition, bad.offset)


@broker
@pytest.mark.parametrize("make_wake", [asyncio.Event, Wake])
async def test_a_wake_ends_a_quiet_fetch_and_loses_no_record(
        topics: KafkaSettings, writer: JournalWriter,
        make_wake: Callable[[], asyncio.Event | Wake]) -> None:
    """A service with work besides records (a timer fired) sets the wake: the fetch that was
    waiting for records ends with nothing, and the record that comes next is still delivered.
    (A follower's `Wake` does what an asyncio.Event does here, without a task per batch.)"""
    task = f"wake-{uuid.uuid4().hex[:8]}"
    async with EventConsumer(topics, topics=(TASKS,), group=group(), writer=writer) as consumer:
        async with asyncio.timeout(WAIT_S):  # joined, and past what earlier tests wrote
            while await consumer.batch(500) or not consumer.kafka.assignment():
                pass
        wake = make_wake()
        asyncio.get_running_loop().call_later(0.05, wake.set)
        # Without the wake this fetch would wait ten minutes for a record that never comes.
        async with asyncio.timeout(WAIT_S):
            got = await consumer.batch(600_000, wake=wake)  # nothing new: ends by the wake
        assert not wake.is_set()  # taken: the next quiet fetch waits again
        assert consumer.woken
        request = Stamper(task).requested()
        await writer.append(request, TASKS)
        async with asyncio.timeout(WAIT_S):
            while not any(d.event == request for d in got):
                got += await consumer.batch(1000, wake=make_wake())


@broker
async def test_a_wake_ends_a_quiet_fetch_in_a_loop_left_with_a_cancellation_count(
        topics: KafkaSettings, writer: JournalWriter) -> None:
    """On Python 3.11 and 3.12 a TaskGroup whose children fail while it waits for them leaves
    its task's `cancelling()` at 1 (cpython#116720). A follower's loop caught such an error
    from a service and went on; the next fetch ended by a wake then took the fetch it cancelled
    for its own cancellation and ended the loop: the service ran on, reading nothing."""
    async def fail() -> None:
        await asyncio.sleep(0)
        raise ValueError("a send refused")

    async def loop(consumer: EventConsumer) -> list[Delivery]:
        try:
            async with asyncio.TaskGroup() as group:  # what the outcomes publisher did
                group.create_task(fail())
                group.create_task(fail())
        except ExceptionGroup:
            pass  # logged, and the loop goes on
        this = asyncio.current_task()
        assert this is not None
        if not this.cancelling():  # a Python without the bug: the same state, made by hand
            this.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0)
        assert this.cancelling() == 1
        wake = Wake()
        asyncio.get_running_loop().call_later(0.05, wake.set)
        return await consumer.batch(600_000, wake=wake)

    async with EventConsumer(topics, topics=(TASKS,), group=group(), writer=writer) as consumer:
        async with asyncio.timeout(WAIT_S):  # joined, and past what earlier tests wrote
            while await consumer.batch(500) or not consumer.kafka.assignment():
                pass
        async with asyncio.timeout(WAIT_S):
            got = await asyncio.create_task(loop(consumer))
        assert got == []
        assert consumer.woken


async def test_the_end_of_a_partition_no_longer_assigned_is_unknown_not_an_error() -> None:
    """A metrics scrape runs while partitions move: aiokafka asserts a partition it asks the
    end of is assigned, so a scrape between a revocation and the follower's own bookkeeping
    failed the whole /metrics answer."""
    consumer = AIOKafkaConsumer(bootstrap_servers="127.0.0.1:1")  # never started
    assert known_end(consumer, TopicPartition("halfway.journal", 0)) is None


async def test_a_wake_set_before_its_future_is_asked_for_is_not_missed() -> None:
    wake = Wake()
    wake.set()
    assert wake.future().done()  # a batch starting now does not wait
    wake.clear()
    waiting = wake.future()
    assert not waiting.done()
    assert wake.future() is waiting  # the next batch waits on the same one
    wake.set()
    assert waiting.done()
    assert wake.is_set()


@pytest.fixture
async def tasks_and_journal(kafka_settings: KafkaSettings) -> AsyncIterator[KafkaSettings]:
    """A tasks topic and a journal of this test's own."""
    settings = kafka_settings.with_prefix(f"prompt-{uuid.uuid4().hex[:8]}.")
    await ensure_topics(settings, (TASKS, JOURNAL, DEAD_LETTERS))
    yield settings
    await delete_topics(settings, (TASKS, JOURNAL, DEAD_LETTERS))


async def delivered(consumers: list[EventConsumer], wanted: set[str],
                    ) -> dict[str, list[tuple[int, Delivery]]]:
    """Batches of every consumer until each of `wanted` (event ids) is delivered: event id ->
    (which consumer, delivery) for each delivery of it."""
    got: dict[str, list[tuple[int, Delivery]]] = {}
    async with asyncio.timeout(WAIT_S):
        while not wanted <= got.keys():
            for i, consumer in enumerate(consumers):
                for d in await consumer.batch(50, wake=asyncio.Event()):
                    if d.event.event_id in wanted:
                        got.setdefault(d.event.event_id, []).append((i, d))
    return got


def owned(consumer: EventConsumer, topic: str) -> set[TopicPartition]:
    return {tp for tp in consumer.kafka.assignment() if tp.topic == topic}


@broker
async def test_a_gathering_consumer_reads_its_prompt_topic_with_a_consumer_of_its_own(
        tasks_and_journal: KafkaSettings) -> None:
    """A worker's decider lets the broker gather its journal fetches but must hear requests at
    once: the group assigns it both topics' partitions, its group consumer leaves the tasks
    topic's paused to a second consumer, and one batch hands out what either fetched. After a
    rebalance each member reads the prompt partitions it owns, and only those."""
    settings = tasks_and_journal
    tasks, journal = TASKS.name(settings.topic_prefix), JOURNAL.name(settings.topic_prefix)
    name = group()

    def member(writer: JournalWriter) -> EventConsumer:
        return EventConsumer(settings, topics=(JOURNAL, TASKS), group=name, writer=writer,
                             gather_ms=20, prompt=(TASKS,))

    async def joined(*consumers: EventConsumer) -> None:
        """Until the group has handed every partition of both topics out, once."""
        async with asyncio.timeout(WAIT_S):
            while True:
                for consumer in consumers:
                    await consumer.batch(50, wake=asyncio.Event())
                mine = [consumer.kafka.assignment() for consumer in consumers]
                handed = [tp for tps in mine for tp in tps]
                if all(mine) and len(handed) == len(set(handed)) == 2 * settings.partitions:
                    return

    def requests_and_starts(tag: str) -> tuple[list[Event], list[Event]]:
        ids = [f"{tag}-{uuid.uuid4().hex[:6]}-{i}" for i in range(12)]
        return [Stamper(t).requested() for t in ids], [Stamper(t).started() for t in ids]

    async with JournalWriter(settings) as writer:
        first = member(writer)
        async with first:
            await joined(first)
            assert len(owned(first, tasks)) == len(owned(first, journal)) == settings.partitions
            assert first.kafka.paused() == owned(first, tasks)  # left to the prompt consumer
            requests, starts = requests_and_starts("alone")
            for request, start in zip(requests, starts, strict=True):
                await writer.append(request, TASKS)
                await writer.append(start)
            got = await delivered([first], {e.event_id for e in [*requests, *starts]})
            # Each once: the group's consumer never fetched a tasks partition too.
            assert all(len(copies) == 1 for copies in got.values()), got
            assert {got[r.event_id][0][1].topic for r in requests} == {tasks}

            second = member(writer)
            async with second:
                await joined(first, second)
                for consumer in (first, second):
                    assert consumer.kafka.paused() == owned(consumer, tasks)
                requests, starts = requests_and_starts("shared")
                for request, start in zip(requests, starts, strict=True):
                    await writer.append(request, TASKS)
                    await writer.append(start)
                got = await delivered([first, second],
                                      {e.event_id for e in [*requests, *starts]})
                for copies in got.values():
                    # Delivered by the member that owns its partition, and by no other.
                    [(who, d)] = copies
                    assert TopicPartition(d.topic, d.partition) in owned(
                        [first, second][who], d.topic)
