"""Webhooks the reconciler holds until the journal is read past their stamp, against records a
holder of the gateway's credentials forged: bounded in bytes, not only in number, and a stamp
past the journal's end is quarantined once the broker confirms it, not held for
HELD_WEBHOOK_S_MAX (or, past HELD_WEBHOOKS_MAX of them, with the partition paused that long,
a genuine webhook waiting behind them).

The first tests fold records into a follower that is never started (`tests/followers.py`);
the last runs the reconciler in this process against the real broker, on topics of its own.
Each waits for the state or the records it expects, bounded so that a hang fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from halfway.contract import DeadLetter
from halfway.contract.topics import DEAD_LETTERS, JOURNAL, WEBHOOKS
from halfway.contract.webhooks import WebhookReceived
from halfway.journal import JournalWriter
from halfway.journal import follower as follower_module
from halfway.journal import reader as reader_module
from halfway.journal.admin import topic_partitions
from halfway.journal.follower import JournalFollower
from halfway.journal.records import partition_of
from halfway.reconciler.service import Reconciler
from halfway.settings import KafkaSettings
from halfway.tools.registry import Registry
from tests.factories import Stamper
from tests.followers import unstarted

pytestmark = pytest.mark.broker

WAIT_S = 60.0  # bounds every await on the broker: a hang fails, it never blocks the suite
FAR = 10**15  # a journal offset no journal reaches
PARTITION = 0
BUDGET_BYTES = 64 * 1024  # the held bytes a test allows, where it wants the budget reached
RECORD_BYTES = 16 * 1024
HELD_MAX = 4  # the held count a test allows, where it wants forged records to pause
FETCH_RECORDS = 2  # records a fetch brings, where a test wants them to come a few at a time


def hook(task_id: str, offset: int, *, event_id: str | None = None,
         partition: int = PARTITION) -> WebhookReceived:
    now = Stamper(task_id).stamp()["at"]
    return WebhookReceived(
        provider="paysim", provider_event_id=event_id or f"evt_{uuid.uuid4().hex}",
        provider_event_type="charge.succeeded", object_id=f"ch_{uuid.uuid4().hex[:12]}",
        key=f"{task_id}:1", task_id=task_id, payload={}, outcome="done", signed_at=now,
        received_at=now, journal_partition=partition, journal_offset=offset)


class Pauses:
    """Stands in for the consumer's pause and resume on a follower never started."""

    def __init__(self) -> None:
        self.paused: set[TopicPartition] = set()

    def pause(self, *tps: TopicPartition) -> None:
        self.paused.update(tps)

    def resume(self, *tps: TopicPartition) -> None:
        self.paused.difference_update(tps)


def holding(kafka_settings: KafkaSettings, monkeypatch: pytest.MonkeyPatch,
            ) -> tuple[JournalFollower, Pauses, TopicPartition, TopicPartition]:
    """A reconciler's follower that owns journal and webhooks partition PARTITION, caught up,
    the journal read to nothing yet."""
    journal = TopicPartition(JOURNAL.name(kafka_settings.topic_prefix), PARTITION)
    webhooks = TopicPartition(WEBHOOKS.name(kafka_settings.topic_prefix), PARTITION)
    f = unstarted(kafka_settings, f"held-{uuid.uuid4().hex[:8]}", [journal, webhooks],
                  caught_up=True, side=WEBHOOKS)
    pauses = Pauses()
    monkeypatch.setattr(f._consumer, "pause", pauses.pause)
    monkeypatch.setattr(f._consumer, "resume", pauses.resume)
    return f, pauses, journal, webhooks


async def test_held_webhooks_past_the_byte_budget_pause_their_partition_until_released(
        kafka_settings: KafkaSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(follower_module, "HELD_WEBHOOK_BYTES_MAX", BUDGET_BYTES)
    f, pauses, journal, webhooks = holding(kafka_settings, monkeypatch)
    stamp = 1  # ahead of the journal read so far: held
    count = BUDGET_BYTES // RECORD_BYTES  # far fewer than HELD_WEBHOOKS_MAX
    for offset in range(count - 1):
        f._apply(hook("held-task", stamp), webhooks, offset, RECORD_BYTES)
    assert pauses.paused == set()
    f._apply(hook("held-task", stamp), webhooks, count - 1, RECORD_BYTES)
    assert pauses.paused == {webhooks}
    # The journal is read past the stamp: every one is handed over, the partition resumed.
    f._partitions[journal].applied_to = stamp
    f._release_webhooks()
    assert pauses.paused == set()
    assert len(f.take_webhooks("held-task")) == count


async def test_a_stamp_past_the_end_is_judged_only_by_an_end_asked_after_it_arrived(
        kafka_settings: KafkaSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    f, _, _, _ = holding(kafka_settings, monkeypatch)
    asked_s = time.monotonic()
    f._asked_ends[PARTITION] = (7, asked_s)
    # Arrived before the broker was asked: its end then was at least its stamp, or forged.
    assert f._past_end(PARTITION, 8, asked_s - 1, fetched=7) == 7
    assert f._past_end(PARTITION, 7, asked_s - 1, fetched=7) is None  # the end: genuine
    assert f._ends_wanted == set()
    # Arrived after: that end proves nothing about it. Within the end fetched since, it is
    # only ahead of the fold; past it, the broker is asked again.
    assert f._past_end(PARTITION, 8, asked_s + 1, fetched=9) is None
    assert f._ends_wanted == set()
    assert f._past_end(PARTITION, 8, asked_s + 1, fetched=7) is None
    assert f._ends_wanted == {PARTITION}


# --- the reconciler, against the real broker ------------------------------------------------------


@pytest.fixture
async def deployment(own_deployment: KafkaSettings) -> AsyncIterator[tuple[KafkaSettings,
                                                                         JournalWriter]]:
    async with JournalWriter(own_deployment) as writer:
        yield own_deployment, writer


@contextlib.asynccontextmanager
async def reconciling(settings: KafkaSettings, writer: JournalWriter) -> AsyncIterator[None]:
    """The reconciler (no tools, lookups off) running in this process."""
    reconciler = Reconciler(settings, Registry([]), writer, lookups=False)
    running = asyncio.create_task(reconciler.run())
    try:
        yield
    finally:
        running.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await running


async def publish(writer: JournalWriter, received: WebhookReceived) -> None:
    """As the gateway publishes it (the gateway's credentials are all a forger needs)."""
    await writer.append_raw(WEBHOOKS, received.model_dump_json().encode(),
                            key=received.record_key(),
                            headers=[("type", received.type.encode()),
                                     ("schema_version", str(received.schema_version).encode()),
                                     ("provider_event_id",
                                      received.provider_event_id.encode())])


async def letters(settings: KafkaSettings, marker: str, count: int) -> list[DeadLetter]:
    """The first `count` dead letters whose excerpt holds `marker`."""
    consumer = AIOKafkaConsumer(DEAD_LETTERS.name(settings.topic_prefix), **settings.client(),
                                auto_offset_reset="earliest", group_id=None)
    await consumer.start()
    found: list[DeadLetter] = []
    try:
        async def pull() -> None:
            async for record in consumer:
                letter = DeadLetter.model_validate_json(record.value)
                if marker in letter.value:
                    found.append(letter)
                if len(found) == count:
                    return
        await asyncio.wait_for(pull(), WAIT_S)
    finally:
        await consumer.stop()
    return found


async def test_stamps_past_the_journals_end_are_quarantined_and_a_genuine_webhook_gets_by(
        deployment: tuple[KafkaSettings, JournalWriter],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Forged stamps, enough to pause their partition (as 10,050 would), then a genuine
    webhook behind them: the forged ones are quarantined naming both offsets, and the genuine
    one is weighed (an orphan here: its step was never attempted), not held behind them."""
    monkeypatch.setattr(follower_module, "HELD_WEBHOOKS_MAX", HELD_MAX)
    # A few records a fetch, so the genuine one comes after the partition was paused.
    monkeypatch.setattr(reader_module, "FETCH_RECORDS_MAX", FETCH_RECORDS)
    settings, writer = deployment
    count = len(await topic_partitions(settings, JOURNAL.name(settings.topic_prefix)))
    task_id = next(t for t in (f"held-{uuid.uuid4().hex[:8]}" for _ in range(1000))
                   if partition_of(t.encode(), count) == PARTITION)
    s = Stamper(task_id)
    await writer.append_all([s.requested(), s.started()])
    end = 2  # the journal partition's end: the task's two records, on topics of this test's
    marker = uuid.uuid4().hex
    for n in range(2 * HELD_MAX):
        await publish(writer, hook(task_id, FAR, event_id=f"evt_forged_{marker}_{n}"))
    await publish(writer, hook(task_id, end, event_id=f"evt_genuine_{marker}"))
    async with reconciling(settings, writer):
        forged = await letters(settings, f"evt_forged_{marker}", 2 * HELD_MAX)
        (genuine,) = await letters(settings, f"evt_genuine_{marker}", 1)
    for letter in forged:
        assert f"journal offset {FAR} of journal partition {PARTITION}" in letter.reason
        assert f"past its end {end}" in letter.reason
    assert "past its end" not in genuine.reason
    assert "too long" not in genuine.reason
    assert "not attempted" in genuine.reason or "orphan" in genuine.reason, genuine.reason

