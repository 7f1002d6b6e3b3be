"""The outcomes publisher restarts from snapshots: it reads the journal after its image and the
outcomes topic after what the image knew, and still sends every message once.

Against the real broker, with the publisher in this process and journal events written by hand,
every task of a scenario on one journal partition. What reaches the outcomes topic is compared
with what `derive` makes of each task's whole journal: the same ids and contents, each once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from aiokafka import TopicPartition
from aiokafka.errors import KafkaTimeoutError

from halfway.client import OutcomeStream
from halfway.contract import Event, FinalState, Outcome
from halfway.contract.outcomes import OutcomeChanged
from halfway.contract.topics import OUTCOMES
from halfway.journal import JournalWriter
from halfway.journal.follower import SNAPSHOTS_ENV
from halfway.journal.reader import FETCH_RECORDS_MAX
from halfway.journal.snapshots import EVERY_S_ENV
from halfway.outcomes import OutcomesPublisher, messages
from halfway.outcomes.service import _Task
from halfway.settings import KafkaSettings
from tests.factories import Stamper
from tests.test_outcomes_sealing import (
    DAY,
    HOUR,
    T0,
    deployment,
    done_task,
    idle,
    on_topic,
    one_partition,
    publishing,
    until,
    until_seen,
)

pytestmark = pytest.mark.broker
MINUTE = timedelta(minutes=1)


@pytest.fixture(autouse=True)
def often(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(EVERY_S_ENV, "0")  # an image after every batch with news
    monkeypatch.setenv(SNAPSHOTS_ENV, "on")
    monkeypatch.setenv("HALFWAY_SEAL_AFTER_S", str(DAY.total_seconds()))


def open_task(task_id: str) -> tuple[list[Event], list[Event]]:
    """A charge that is in flight, and how it ends."""
    s = Stamper(task_id, now=T0 + HOUR)
    return ([s.started(), s.intended(1), s.attempted(1, 1)],
            [s.settled(1, Outcome.DONE, attempt=1, evidence={"charge_id": f"ch_{task_id}"}),
             s.finished(FinalState.SUCCEEDED)])


def images(publisher: OutcomesPublisher) -> tuple[list[tuple[int, int]], asyncio.Condition]:
    """(partition, journal offset) of each image the publisher's follower writes."""
    written: list[tuple[int, int]] = []
    changed = asyncio.Condition()
    follower = publisher.follower
    original = follower._write_snapshot

    async def write(tp: TopicPartition, image: Any) -> None:
        before = follower.snapshot_written_s
        try:
            await original(tp, image)
        finally:
            if follower.snapshot_written_s != before:
                written.append((tp.partition, image.journal_next))
            async with changed:
                changed.notify_all()

    follower._write_snapshot = write  # type: ignore[method-assign]
    return written, changed


def reads(publisher: OutcomesPublisher) -> list[dict[int, int] | None]:
    """Where each read of the outcomes topic started (`since`; None: whole)."""
    started: list[dict[int, int] | None] = []
    original = publisher._load_published

    async def load(partitions: set[int], since: dict[int, int] | None = None) -> None:
        started.append(since)
        await original(partitions, since)

    publisher._load_published = load  # type: ignore[method-assign]
    return started


def failing_after(publisher: OutcomesPublisher, sends: int) -> None:
    """The publisher's outcome sends after the first `sends` fail (the broker refuses them);
    its snapshots still go through."""
    writer = publisher.writer
    original = writer.append_raw
    left = [sends]

    async def append_raw(spec: Any, value: bytes | None, **kw: Any) -> Any:
        if spec is OUTCOMES:
            if left[0] <= 0:
                raise KafkaTimeoutError("not sent (the test's broker refuses it)")
            left[0] -= 1
        return await original(spec, value, **kw)

    writer.append_raw = append_raw  # type: ignore[method-assign]


async def image_at(changed: asyncio.Condition, written: list[tuple[int, int]], partition: int,
                   offset: int) -> None:
    await until(changed, lambda: (partition, offset) in written,
                f"an image of partition {partition} at {offset}")


@dataclass
class Scene:
    """A deployment of its own whose tasks (`logs`) are all on `partition`, a journal writer,
    and a subscriber that has `seen` what it read (by message id)."""

    settings: KafkaSettings
    journal: JournalWriter
    stream: OutcomeStream
    partition: int
    logs: dict[str, list[Event]]
    seen: dict[str, OutcomeChanged] = field(default_factory=dict)

    def told(self, *task_ids: str) -> list[OutcomeChanged]:
        """What `derive` makes of these tasks' journals (all of them: every task's)."""
        return [m for t in task_ids or self.logs for m in messages(self.logs[t], t)]

    async def until_told(self, publisher: OutcomesPublisher, changed: asyncio.Condition,
                         wanted: list[OutcomeChanged], what: str) -> None:
        """`wanted` seen by the subscriber, and the publisher with nothing left to send."""
        await until_seen(self.stream, self.seen, wanted, what)
        await until(changed, lambda: idle(publisher), f"{what}: the publisher is idle")

    async def each_once(self) -> None:
        """On the topic: every task's messages, each once, in order."""
        topic = await on_topic(self.settings, self.partition)
        for task_id in self.logs:
            assert topic.get(task_id) == self.told(task_id), task_id


@contextlib.asynccontextmanager
async def scene(base: KafkaSettings, partition: int,
                logs: dict[str, list[Event]]) -> AsyncIterator[Scene]:
    async with (deployment(base) as settings, JournalWriter(settings) as journal,
                OutcomeStream(settings, None, from_beginning=True) as stream):
        yield Scene(settings, journal, stream, partition, logs)


async def test_a_restart_reads_the_tails_after_the_image_and_tells_everything_once(
        kafka_settings: KafkaSettings) -> None:
    partition, ids = one_partition(["over", "live", "later"], kafka_settings.partitions)
    over, live, later = ids["over"], ids["live"], ids["later"]
    live_start, live_end = open_task(live)
    logs = {over: done_task(over, T0), live: [*live_start, *live_end],
            later: done_task(later, T0 + 2 * HOUR)}
    async with scene(kafka_settings, partition, logs) as s:
        async with publishing(s.settings) as (first, changed):
            written, imaged = images(first)
            await s.journal.append_all([*logs[over], *live_start])
            told = [*s.told(over), *messages(live_start, live)]
            await s.until_told(first, changed, told, "what the first publisher tells")
            # A record that changes nothing (a redelivery), so an image is taken after the
            # messages are acknowledged: it knows they are on the topic.
            (again,) = await s.journal.append_all([live_start[-1]])
            image_next = again.offset + 1
            await image_at(imaged, written, partition, image_next)
        # Down: the live task goes on and another one runs.
        await s.journal.append_all([*live_end, *logs[later]])

        async with publishing(s.settings) as (second, changed):
            started = reads(second)
            await s.until_told(second, changed, s.told(), "every message after the restart")
            assert second.follower.restored.get(partition, -1) >= image_next
            # Its read of the outcomes topic started where the first publisher's acks ended.
            assert {partition: len(told)} in started
            assert second.published == len(s.told()) - len(told)
        await s.each_once()


async def test_messages_not_acknowledged_when_the_image_was_taken_are_sent_after_it(
        kafka_settings: KafkaSettings) -> None:
    """The first publisher's sends fail after a few; its image is taken with messages of an
    open task and of a task over for good (restored dormant) not sent. The next publisher sends
    them, and none of those that were sent again."""
    partition, ids = one_partition(["sent", "over", "open"], kafka_settings.partitions)
    sent, over, open_ = ids["sent"], ids["over"], ids["open"]
    open_start, open_end = open_task(open_)
    logs = {sent: done_task(sent, T0), over: done_task(over, T0 + HOUR),
            open_: [*open_start, *open_end]}
    async with scene(kafka_settings, partition, logs) as s:
        async with publishing(s.settings) as (first, changed):
            written, imaged = images(first)
            await s.journal.append_all(logs[sent])
            await s.until_told(first, changed, s.told(sent), "the first task's messages")
            failing_after(first, sends=2)
            metas = await s.journal.append_all([*logs[over], *open_start])
            await image_at(imaged, written, partition, metas[-1].offset + 1)
            unsent = first._image(partition)
            assert unsent is not None
            # Two sends went through: the task over (restored dormant) has some held back.
            assert over in unsent["unsent"], unsent

        await s.journal.append_all(open_end)
        async with publishing(s.settings) as (second, changed):
            await s.until_told(second, changed, s.told(), "every message after the restart")
            assert partition in second.follower.restored
        await s.each_once()


async def test_an_image_without_the_outcomes_part_falls_back_to_reading_the_whole_topic(
        kafka_settings: KafkaSettings) -> None:
    partition, ids = one_partition(["one", "two"], kafka_settings.partitions)
    one, two = ids["one"], ids["two"]
    logs = {one: done_task(one, T0), two: done_task(two, T0 + HOUR)}
    async with scene(kafka_settings, partition, logs) as s:
        async with publishing(s.settings) as (first, changed):
            written, imaged = images(first)
            first.follower._on_image = lambda partition: {}
            metas = await s.journal.append_all(logs[one])
            await s.until_told(first, changed, s.told(one), "the first task's messages")
            await image_at(imaged, written, partition, metas[-1].offset + 1)
        await s.journal.append_all(logs[two])
        async with publishing(s.settings) as (second, changed):
            started = reads(second)
            await s.until_told(second, changed, s.told(two), "the second task's messages")
            assert partition in second.follower.restored
            assert None in started  # the whole partition
            assert second.published == len(s.told(two))
        await s.each_once()


async def test_no_image_is_taken_while_a_sealed_task_owes_messages(
        kafka_settings: KafkaSettings) -> None:
    """The image would keep nothing of a sealed task to send its messages from."""
    partition, ids = one_partition(["owes"], kafka_settings.partitions)
    async with JournalWriter(kafka_settings) as writer:
        publisher = OutcomesPublisher(kafka_settings, writer)
        try:
            owes = publisher._tasks[ids["owes"]] = _Task(partition, sealed=True)
            first = messages(done_task(ids["owes"], T0), ids["owes"])[0]
            owes.sequencer.seqs[first.about] = first.seq
            owes.pending.append(first)
            publisher._owed[ids["owes"]] = owes
            assert publisher._image(partition) is None
            other = (partition + 1) % kafka_settings.partitions
            assert publisher._image(other) == {"outcomes_from": 0, "unsent": {}}
            del publisher._owed[ids["owes"]]
            assert publisher._image(partition) == {
                "outcomes_from": 0, "unsent": {ids["owes"]: {owes.pending[0].about: 0}}}
        finally:
            await publisher.follower._consumer.stop()  # never started: closed


async def test_a_task_gone_dormant_while_the_partition_caught_up_is_told(
        kafka_settings: KafkaSettings) -> None:
    """A task over for more than a minute of the journal's clock when the publisher reads it
    goes dormant during the replay (its history kept as bytes), before any of its messages is
    sent: they are still sent once the partition has caught up."""
    # More records than one fetch brings: the task goes dormant before the catch-up.
    fillers = [f"filler{n}" for n in range(FETCH_RECORDS_MAX // 5 + 20)]
    partition, ids = one_partition(["quiet", *fillers, "later"], kafka_settings.partitions)
    quiet, later = ids["quiet"], ids["later"]
    logs = {quiet: done_task(quiet, T0),
            **{ids[f]: done_task(ids[f], T0 + 2 * MINUTE) for f in fillers},
            later: done_task(later, T0 + HOUR)}
    async with scene(kafka_settings, partition, logs) as s:
        await s.journal.append_all([e for log in logs.values() for e in log])  # before it starts
        async with publishing(s.settings) as (publisher, changed):
            await s.until_told(publisher, changed, s.told(), "every message")
            assert quiet in publisher.follower.dormant  # it did go dormant
        await s.each_once()
