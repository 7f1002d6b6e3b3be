"""Poison records: no record of any size the broker accepts, valid or not, stops a service.

Every input topic the services read (tasks, journal, webhooks, guards) gets records of every
bad kind, each as large as the broker accepts (its `message.max.bytes`, for a batch of one),
all keyed so they sit in the partitions the next valid task needs: the renewal's partition of
the tasks, journal and webhooks topics, its invoice's partition of the guards topic. They are
published before the services start, so every service meets them while replaying its topics
from the start, as after any restart. Then the services (decider, executor, reconciler,
outcomes, projector, as real processes) must all be alive, every bad record must be described
on the dead-letter topic by every consumer that read it (reason, position, size, digest, a
small letter), and the valid renewal published after them must finish `succeeded`, visible on
the outcomes topic and in the read model.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import asyncpg
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import MessageSizeTooLargeError
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.record.util import size_of_varint

from halfway import settings as env
from halfway.contract import (
    FinalState,
    Outcome,
    SettlementSource,
    StepSettled,
    TaskRejected,
    TaskRequested,
    TaskStarted,
)
from halfway.contract.events import DeadLetter
from halfway.contract.guards import SubjectClaimed
from halfway.contract.topics import DEAD_LETTERS, GUARDS, JOURNAL, TASKS, WEBHOOKS, TopicSpec
from halfway.contract.webhooks import WebhookReceived
from halfway.journal.limits import BROKER_BATCH_BYTES_MAX, fetch_limits
from halfway.journal.records import EXCERPT_BYTES_MAX, partition_of
from halfway.outcomes.service import read_outcomes
from halfway.projector import store
from halfway.projector.service import journal_end_offsets
from halfway.settings import KafkaSettings

pytest.register_assert_rewrite("tests.processes")

from tests.processes import (  # noqa: E402
    POLL_S,
    Cluster,
    Proc,
    renewal_request,
)
from tests.test_projector import spawn_projector  # noqa: E402

pytest_plugins = ["tests.processes"]
pytestmark = pytest.mark.broker
T = TypeVar("T")

WAIT_S = 90.0  # any wait on the services: bounded, roomy for a busy 2-core CI machine
# Kafka's record batch header (v2), before the records: what the broker's limit also counts.
BATCH_HEADER_BYTES = 61
# Our producer must be able to send what the broker may refuse (aiokafka's default, 1 MiB,
# is below the broker's limit for a batch).
TEST_PRODUCER_REQUEST_BYTES = 2 * BROKER_BATCH_BYTES_MAX
LETTER_BYTES_MAX = 16 * 1024  # what a letter may weigh, whatever the record it describes
NESTING = 250  # deeper than pydantic's JSON parser goes (200)
PAD = "@@PAD@@"


# --- the bad records -----------------------------------------------------------------------------


def batch_bytes(key: bytes | None, value_bytes: int) -> int:
    """The size of a batch holding one record (no headers), as the broker counts it."""
    body = 3 + DefaultRecordBatchBuilder.size_of(key, bytes(value_bytes), [])  # attrs, deltas
    return BATCH_HEADER_BYTES + body + size_of_varint(body)


def value_bytes_max(key: bytes | None) -> int:
    """The largest value the broker accepts in a record with this key."""
    size = BROKER_BATCH_BYTES_MAX - batch_bytes(key, 0)
    while batch_bytes(key, size) > BROKER_BATCH_BYTES_MAX:
        size -= 1
    return size


def _now() -> datetime:
    return datetime.now(UTC)


def _id() -> str:
    return uuid.uuid4().hex


def task_doc(kind: type[TaskRequested] | type[TaskStarted]) -> Callable[[str, str], Any]:
    def make(task_id: str, pad: str) -> dict[str, Any]:
        return kind(event_id=_id(), task_id=task_id, at=_now(),
                    input={"pad": pad}).model_dump(mode="json")
    return make


def webhook_doc(task_id: str, pad: str) -> dict[str, Any]:
    return WebhookReceived(
        provider="paysim", provider_event_id=f"evt_{_id()}", provider_event_type="charge.failed",
        object_id=f"ch_{_id()}", key=f"{task_id}:1", task_id=task_id, payload={"pad": pad},
        signed_at=_now(), received_at=_now()).model_dump(mode="json")


def claim_doc(subject: str, pad: str) -> dict[str, Any]:
    task_id = f"poison-{_id()[:8]}"
    return SubjectClaimed(event_id=_id(), at=_now(), subject=subject, tool=pad or "t",
                          step_id=f"{task_id}:1", task_id=task_id).model_dump(mode="json")


@dataclass(frozen=True)
class Input:
    """One input topic, the valid documents it holds, and who must dead-letter a bad record."""

    spec: TopicSpec
    doc: Callable[[str, str], dict[str, Any]]  # (owner: task id or subject, pad) -> valid
    groups: tuple[str | None, ...]  # consumer groups (suffixes; None: the guard view)


INPUTS = (
    Input(TASKS, task_doc(TaskRequested), ("decider",)),
    Input(JOURNAL, task_doc(TaskStarted),
          ("decider", "executor", "reconciler", "outcomes", "projector")),
    Input(WEBHOOKS, webhook_doc, ("reconciler",)),
    Input(GUARDS, claim_doc, (None,)),
)


@dataclass(frozen=True, eq=False)  # by identity: a value is a megabyte
class Poison:
    kind: str
    topic: str
    key: bytes | None
    value: bytes | None
    words: str  # what its dead letter's reason must say
    input: Input
    partition: int | None = None  # None: the key's


def _grown(text: bytes, size: int) -> bytes:
    """`text` (holding PAD once) with the pad grown so it is exactly `size` bytes."""
    return text.replace(PAD.encode(), b"x" * (size - len(text) + len(PAD)))


def poisons(settings: KafkaSettings, task_id: str, subject: str) -> list[Poison]:
    """Every bad kind, on every input topic, each as large as the broker takes it."""
    out: list[Poison] = []
    for source in INPUTS:
        owner = subject if source.spec is GUARDS else task_id
        key = owner.encode()
        size = value_bytes_max(key)
        valid = json.dumps(source.doc(owner, PAD)).encode()
        typo = json.dumps(source.doc(owner, "") | {"typo": PAD}).encode()
        other = json.dumps(source.doc(f"{owner}-other", PAD)).encode()  # another task's
        deep = valid.replace(f'"{PAD}"'.encode(),
                             b"[" * NESTING + f'"{PAD}"'.encode() + b"]" * NESTING)
        # Dated past the contract's calendar: folded, its time would overflow the services'
        # date arithmetic (sealing, backoffs) in every process, at every restart.
        far = source.doc(owner, PAD)
        far["received_at" if "received_at" in far else "at"] = "9999-12-31T23:59:59Z"
        bad: dict[str, tuple[bytes | None, str]] = {
            "not-utf8": ((b"\xff\xfe" * size)[:size], "Invalid JSON"),
            "unknown-field": (_grown(typo, size), "typo: Extra inputs are not permitted"),
            "not-json": ((b"not JSON at all " * size)[:size], "Invalid JSON"),
            "tombstone": (None, "tombstone"),
            "wrong-key": (_grown(other, size), "record key"),
            "nested": (_grown(deep, size), "recursion limit"),
            "year-9999": (_grown(json.dumps(far).encode(), size), "less than 9000"),
        }
        for kind, (value, words) in bad.items():
            assert value is None or len(value) == size, (kind, source.spec.suffix)
            out.append(Poison(kind, source.spec.name(settings.topic_prefix), key, value, words,
                              source))
        if source.spec is TASKS:
            # A valid event, but no request: folded, a caller could settle a step.
            forged = StepSettled(event_id=_id(), task_id=owner, at=_now(), step_id=f"{owner}:1",
                                 outcome=Outcome.DONE, source=SettlementSource.CALL,
                                 evidence={"pad": PAD}).model_dump(mode="json")
            out.append(Poison("not-a-request", source.spec.name(settings.topic_prefix), key,
                              _grown(json.dumps(forged).encode(), size),
                              "holds task.requested only", source))
        if source.spec in (TASKS, JOURNAL):
            # Valid events put where their task's events are not: folded there, a task would
            # be acted on by an instance that does not own it, out of its events' order.
            home = partition_of(key, source.spec.partitions)
            stray = _elsewhere(owner, home, source.spec.partitions)
            topic = source.spec.name(settings.topic_prefix)
            out.append(Poison("keyless", topic, None,
                              _grown(valid, value_bytes_max(None)), "has no key", source,
                              partition=home))
            stray_doc = json.dumps(source.doc(stray, PAD)).encode()
            out.append(Poison("wrong-partition", topic, stray.encode(),
                              _grown(stray_doc, value_bytes_max(stray.encode())),
                              "events are in partition", source, partition=home))
    return out


def _elsewhere(owner: str, home: int, partitions: int) -> str:
    """A task id like `owner` whose events belong in another partition than `home`."""
    return next(f"{owner}-{n}" for n in range(1000)
                if partition_of(f"{owner}-{n}".encode(), partitions) != home)


async def publish(settings: KafkaSettings, records: list[Poison]) -> dict[Poison, tuple[int, int]]:
    """Each record, alone in its batch; where each landed (partition, offset)."""
    producer = AIOKafkaProducer(**settings.client(), acks="all",
                                max_request_size=TEST_PRODUCER_REQUEST_BYTES)
    await producer.start()
    try:
        where = {}
        for poison in records:  # one at a time: a batch of one record each
            meta = await producer.send_and_wait(poison.topic, poison.value, key=poison.key,
                                                partition=poison.partition)
            where[poison] = (meta.partition, meta.offset)
        # The records are as large as can be: one byte more is refused by the broker.
        first = next(p for p in records if p.value is not None)
        with pytest.raises(MessageSizeTooLargeError):
            await producer.send_and_wait(first.topic, first.value + b" ", key=first.key)
        return where
    finally:
        await producer.stop()


# --- watching the dead-letter topic --------------------------------------------------------------


@dataclass(frozen=True)
class Letter:
    key: bytes | None
    record_bytes: int  # the letter's own size on the topic
    letter: DeadLetter


async def until_lettered(settings: KafkaSettings, wanted: set[tuple[bytes, str | None]],
                         alive: Callable[[], str | None]) -> list[Letter]:
    """Every letter on the dead-letter topic, once there is one per (key, consumer group) in
    `wanted`; bounded, failing early if a service died."""
    topic = DEAD_LETTERS.name(settings.topic_prefix)
    consumer = AIOKafkaConsumer(**settings.client(), group_id=None,
                                enable_auto_commit=False, **fetch_limits())
    await consumer.start()
    letters: list[Letter] = []
    try:
        tps = [TopicPartition(topic, p) for p in range(DEAD_LETTERS.partitions)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)

        def missing() -> set[tuple[bytes, str | None]]:
            return wanted - {(x.key or b"", x.letter.consumer_group) for x in letters}

        try:
            async with asyncio.timeout(WAIT_S):
                while missing():
                    if (gone := alive()) is not None:
                        raise AssertionError(f"a service stopped:\n{gone}")
                    batches = await consumer.getmany(timeout_ms=200)
                    letters += [Letter(r.key, len(r.value or b""),
                                       DeadLetter.model_validate_json(r.value or b""))
                                for records in batches.values() for r in records]
        except TimeoutError:
            raise AssertionError(f"no dead letter within {WAIT_S:g} s for "
                                 f"{sorted(missing(), key=str)[:10]}") from None
    finally:
        await consumer.stop()
    return letters


# --- the services --------------------------------------------------------------------------------


@pytest.fixture
async def read_model(kafka_settings: KafkaSettings) -> AsyncIterator[tuple[asyncpg.Connection,
                                                                             str]]:
    """A PostgreSQL connection and a schema of this test's own, dropped after."""
    conn = await store.connect(env.pg_dsn())  # kafka_settings: the infrastructure is up
    schema = f"t_{uuid.uuid4().hex[:8]}"
    try:
        yield conn, schema
    finally:
        await store.drop_schema(conn, schema)
        await conn.close()


def all_alive(procs: list[Proc]) -> Callable[[], str | None]:
    def why() -> str | None:
        dead = [p.tail() for p in procs if not p.alive]
        return "\n".join(dead) if dead else None
    return why


async def while_alive(alive: Callable[[], str | None], wait: Awaitable[T]) -> T:
    """`wait`, failing as soon as a service dies instead of at its timeout."""
    work = asyncio.ensure_future(wait)
    try:
        while not work.done():
            await asyncio.wait({work}, timeout=POLL_S)
            if not work.done() and (gone := alive()) is not None:
                raise AssertionError(f"a service stopped:\n{gone}")
        return work.result()
    finally:
        work.cancel()


async def until_outcome(settings: KafkaSettings, task_id: str, state: str,
                        alive: Callable[[], str | None]) -> None:
    """The outcomes topic tells users `task_id` reached `state`."""
    partition = partition_of(task_id.encode(), JOURNAL.partitions)
    try:
        async with asyncio.timeout(WAIT_S):
            while True:
                async for message in read_outcomes(settings, {partition}):
                    if message.task_id == task_id and message.state == state:
                        return
                if (gone := alive()) is not None:
                    raise AssertionError(f"a service stopped:\n{gone}")
                await asyncio.sleep(POLL_S)
    except TimeoutError:
        raise AssertionError(f"no outcome {state} for {task_id} within {WAIT_S:g} s") from None


async def until_projected(pg: asyncpg.Connection, schema: str, settings: KafkaSettings,
                          ends: dict[int, int], alive: Callable[[], str | None]) -> None:
    """The read model has applied the journal up to `ends`."""
    topic = JOURNAL.name(settings.topic_prefix)
    wanted = {p: e for p, e in ends.items() if e > 0}
    try:
        async with asyncio.timeout(WAIT_S):
            while True:
                applied = (await store.read_offsets(pg, schema, topic)
                           if await store.schema_exists(pg, schema) else {})
                if all(applied.get(p, 0) >= e for p, e in wanted.items()):
                    return
                if (gone := alive()) is not None:
                    raise AssertionError(f"a service stopped:\n{gone}")
                await asyncio.sleep(POLL_S)
    except TimeoutError:
        raise AssertionError(f"the projector did not reach {wanted} within {WAIT_S:g} s"
                             ) from None


# --- the test ------------------------------------------------------------------------------------


async def test_no_record_of_any_size_or_kind_stops_a_service_or_its_partition(
        core: Cluster, read_model: tuple[asyncpg.Connection, str], tmp_path: Path) -> None:
    pg, schema = read_model
    task_id = f"renewal-{uuid.uuid4().hex[:8]}"
    subject = f"invoice:INV-{task_id}"  # renewal_request's invoice, the charge's subject
    records = poisons(core.settings, task_id, subject)
    where = await publish(core.settings, records)
    partition = partition_of(task_id.encode(), JOURNAL.partitions)
    assert {where[p][0] for p in records if p.input.spec is not GUARDS} == {partition}

    procs = [await core.start(service)
             for service in ("decider", "executor", "reconciler", "outcomes")]
    procs.append(projector := await spawn_projector(core.settings, schema, tmp_path,
                                                     "projector"))
    core.procs.append(projector)  # its log in the report, and stopped with the others
    alive = all_alive(procs)
    await core.publish(renewal_request(task_id))  # behind every bad record, in their partitions

    state = (await while_alive(alive, core.journal.until_finished([task_id])))[task_id]
    assert state.final_state is FinalState.SUCCEEDED, state.finished
    await until_outcome(core.settings, task_id, "succeeded", alive)
    await until_projected(pg, schema, core.settings, await journal_end_offsets(core.settings),
                          alive)

    prefix = core.settings.topic_prefix
    wanted = {(f"{p.topic}/{where[p][0]}/{where[p][1]}".encode(),
               None if group is None else f"{prefix}{group}")
              for p in records for group in p.input.groups}
    letters = await until_lettered(core.settings, wanted, alive)
    for poison in records:
        partition_, offset = where[poison]
        key = f"{poison.topic}/{partition_}/{offset}".encode()
        mine = [x for x in letters if x.key == key]
        groups = {x.letter.consumer_group for x in mine}
        assert groups >= {None if g is None else f"{prefix}{g}" for g in poison.input.groups}
        value = poison.value or b""
        for x in mine:
            letter = x.letter
            what = f"{poison.kind} on {poison.topic}: {letter.reason}"
            assert poison.words in letter.reason, what
            assert (letter.source_topic, letter.source_partition, letter.source_offset) == (
                poison.topic, partition_, offset), what
            assert letter.value_bytes == len(value), what
            assert letter.value_sha256 == (
                None if poison.value is None else hashlib.sha256(value).hexdigest()), what
            assert letter.truncated == (len(value) > EXCERPT_BYTES_MAX), what
            assert (letter.value_b64 is not None) == (poison.kind == "not-utf8"), what
            assert x.record_bytes <= LETTER_BYTES_MAX, what

    for proc in procs:
        assert proc.alive, proc.tail()
        assert not proc.logged("dead letter lost: record skipped"), proc.tail()


async def test_a_valid_request_too_large_to_journal_is_rejected_and_the_decider_goes_on(
        core: Cluster) -> None:
    big_id, task_id = (f"{name}-{uuid.uuid4().hex[:8]}" for name in ("huge", "renewal"))
    key = big_id.encode()
    template = TaskRequested(event_id=_id(), task_id=big_id, at=_now(),
                             input={"pad": PAD}).model_dump_json().encode()
    huge = _grown(template, value_bytes_max(key))
    producer = AIOKafkaProducer(**core.settings.client(), acks="all",
                                max_request_size=TEST_PRODUCER_REQUEST_BYTES)
    await producer.start()
    try:
        await producer.send_and_wait(TASKS.name(core.settings.topic_prefix), huge, key=key)
    finally:
        await producer.stop()
    procs = [await core.start(service) for service in ("decider", "executor", "reconciler")]
    alive = all_alive(procs)
    await core.publish(renewal_request(task_id))

    rejected = await while_alive(alive, core.journal.first(
        lambda e: isinstance(e, TaskRejected) and e.task_id == big_id, "task.rejected"))
    assert isinstance(rejected, TaskRejected)
    assert "bytes" in rejected.reason, rejected.reason  # it says the request is too large
    state = (await while_alive(alive, core.journal.until_finished([task_id])))[task_id]
    assert state.final_state is FinalState.SUCCEEDED, state.finished
    assert alive() is None, alive()
