"""Snapshots: restoring a partition's image and reading the journal after it gives exactly the
state a replay from zero gives; an unusable snapshot falls back to that replay.

The equality is a property over generated logs (tasks of every kind interleaved, requests on
the side topic, late news of sealed tasks, duplicate starts, the journal's clock running over
days so that some tasks are sealed before the image and some after) and every cut point; the
image goes through its byte encoding on the way. Then, against the real broker: a decider
restarted after its snapshot was written restores it, and a snapshot whose chunks were tampered
with is refused and the partition replayed.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import TopicPartition
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from halfway.contract import Event, FinalState, Outcome, SettlementSource
from halfway.contract.topics import JOURNAL, TASKS
from halfway.journal import snapshots
from halfway.journal.follower import SNAPSHOTS_ENV, JournalFollower
from halfway.journal.writer import JournalWriter
from halfway.settings import KafkaSettings
from tests.factories import Stamper
from tests.followers import unstarted
from tests.processes import Cluster, charges_for, renewal_request, stop

WAIT_S = 120.0
POLL_S = 0.05

pytest_plugins = ["tests.processes"]

SETTINGS = KafkaSettings(bootstrap="127.0.0.1:1", topic_prefix="snap.", replication_factor=1)
JOURNAL_TP = TopicPartition("snap.journal", 0)
SIDE_TP = TopicPartition("snap.tasks", 0)
DAY = timedelta(days=1)
BASE = datetime(2026, 11, 20, tzinfo=UTC)

def follower() -> JournalFollower:
    """A decider-like follower (tasks as its side topic) that is never started."""
    return unstarted(SETTINGS, "snap.decider", [JOURNAL_TP, SIDE_TP], side=TASKS,
                     seal_after_s=DAY.total_seconds(), snapshots=True)


Record = tuple[TopicPartition, Event]


def task_records(kind: str, task_id: str, at: datetime) -> list[Record]:
    s = Stamper(task_id, now=at, tick=timedelta(minutes=7))
    request = [(SIDE_TP, s.requested())]
    if kind == "rejected":
        return [*request, (JOURNAL_TP, s.rejected())]
    opened = [*request, (JOURNAL_TP, s.started()), (JOURNAL_TP, s.intended(1)),
              (JOURNAL_TP, s.attempted(1, 1))]
    if kind == "running":
        return opened
    if kind == "unknown":
        return [*opened, (JOURNAL_TP, s.settled(1, Outcome.UNKNOWN, attempt=1)),
                (JOURNAL_TP, s.finished(FinalState.NEEDS_ATTENTION))]
    done = [*opened, (JOURNAL_TP, s.settled(1, Outcome.DONE, attempt=1,
                                            evidence={"charge_id": f"ch_{task_id}"})),
            (JOURNAL_TP, s.finished(FinalState.SUCCEEDED))]
    if kind == "late":  # news after its end, a day and more later: maybe sealed by then
        s.now += 2 * DAY
        return [*done, (JOURNAL_TP, s.settled(1, Outcome.DONE, source=SettlementSource.WEBHOOK,
                                              evidence={"charge_id": "ch_other"})),
                (SIDE_TP, s.requested()), (JOURNAL_TP, s.requested())]
    return done


@st.composite
def logs(draw: Any) -> list[Record]:
    kinds = draw(st.lists(st.sampled_from(["done", "rejected", "running", "unknown", "late"]),
                          min_size=1, max_size=12))
    per_task = [task_records(kind, f"t{i}-{kind}",
                             BASE + timedelta(hours=draw(st.integers(0, 24 * 5))))
                for i, kind in enumerate(kinds)]
    # Interleave the tasks, each one's records in its own order (one partition's log).
    order = draw(st.permutations([i for i, recs in enumerate(per_task) for _ in recs]))
    cursors = [0] * len(per_task)
    out = []
    for i in order:
        out.append(per_task[i][cursors[i]])
        cursors[i] += 1
    return out


def feed(f: JournalFollower, records: list[Record], offsets: dict[TopicPartition, int]) -> None:
    """Apply records as the run loop would, positions moving with them."""
    for tp, event in records:
        offset = offsets[tp]
        f._apply(event, tp, offset)
        f._partitions[tp].applied_to = offset
        offsets[tp] = offset + 1


def positions(records: list[Record]) -> dict[TopicPartition, int]:
    return {tp: sum(1 for t, _ in records if t == tp) for tp in (JOURNAL_TP, SIDE_TP)}


def view(f: JournalFollower) -> dict[str, Any]:
    """Everything a follower's decisions depend on (dormant tasks woken first: as they would
    be by any news of them or any question about them)."""
    for task_id in list(f.dormant):
        assert f.states.get(task_id) is not None
    assert not f.dormant
    return {"states": f.states, "sealed": f.sealed, "requests": f.requests,
            "first_attempt": f.first_attempt,
            # An empty queue is none; a task's newest end is only ever one of the queue's.
            "ended": {n: (e.entries(), e._last) for n, e in f._ended.items() if e.entries()},
            "history": f._history,
            "applied_to": {tp: p.applied_to for tp, p in f._partitions.items()}}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(log=logs(), data=st.data())
async def test_snapshot_and_tail_give_the_state_a_replay_from_zero_gives(
        log: list[Record], data: Any) -> None:
    cut = data.draw(st.integers(0, len(log)))
    head, tail = log[:cut], log[cut:]

    replayed = follower()
    feed(replayed, log, {JOURNAL_TP: 0, SIDE_TP: 0})

    before = follower()
    feed(before, head, {JOURNAL_TP: 0, SIDE_TP: 0})
    image = before.image(0)
    assert image is not None
    assert image.journal_next == positions(head)[JOURNAL_TP]
    assert image.side_next == positions(head)[SIDE_TP]

    restored = follower()
    await restored._restore(JOURNAL_TP, snapshots.decode(snapshots.encode(image)),
                            restored._partitions)
    restored._partitions[SIDE_TP].applied_to = image.side_next - 1
    feed(restored, tail, {JOURNAL_TP: image.journal_next, SIDE_TP: image.side_next})

    assert view(restored) == view(replayed)
    # The image holds live work, not history: no event of a sealed task from before it, and
    # tasks over and settled for good only as bytes.
    live = {task_id for _, event in image.events for task_id in [event.task_id]}
    quiet = {t for t, *_ in image.quiet}
    assert not live & quiet
    assert all(before.states[t].status in ("finished", "rejected") for t in quiet)
    assert all(t not in before.sealed or any(
        o >= 0 and e.task_id == t for o, e in before._history.get(t, ())) for t in live)


async def test_the_image_of_sealed_tasks_is_their_status_only() -> None:
    old = [*task_records("done", "old", BASE), *task_records("done", "new", BASE + 3 * DAY)]
    f = follower()
    feed(f, old, {JOURNAL_TP: 0, SIDE_TP: 0})
    image = f.image(0)
    assert image is not None
    assert "old" in f.sealed
    assert "new" not in f.sealed
    assert len(f.sealed) == 1
    assert len(image.sealed) == 8  # one sealed task: one 64-bit digest
    assert image.events == []
    assert [t for t, *_ in image.quiet] == ["new"]


@pytest.mark.parametrize("damage", [
    lambda blob: blob[:-10],
    lambda blob: b"not a snapshot" + blob,
    lambda blob: blob[:40] + bytes([blob[40] ^ 0xFF]) + blob[41:],
])
async def test_a_damaged_image_is_refused_with_a_reason(damage: Any) -> None:
    f = follower()
    feed(f, task_records("running", "r", BASE), {JOURNAL_TP: 0, SIDE_TP: 0})
    image = f.image(0)
    assert image is not None
    with pytest.raises(snapshots.UnusableSnapshot):
        snapshots.decode(damage(snapshots.encode(image)))


async def test_sealed_digests_out_of_order_are_never_written() -> None:
    """A read trusts the order of the sealed digests (their bytes match the pointer's sha256);
    so the writer checks it: an image out of order is logged and not written, and the
    partition's restart replays instead of looking tasks up in an unsorted array."""
    f = follower()
    feed(f, task_records("running", "r", BASE), {JOURNAL_TP: 0, SIDE_TP: 0})
    image = f.image(0)
    assert image is not None
    image.sealed = (4).to_bytes(8, "little") + (2).to_bytes(8, "little")
    with pytest.raises(ValueError, match="ascending"):
        snapshots.encode(image)

    warnings: list[str] = []
    logger = SimpleNamespace(warning=lambda event, **_: warnings.append(event))
    written = await snapshots.write_and_point(
        writer=None, group="g", image=image, commit=None, logger=logger)  # type: ignore[arg-type]
    assert written is False
    assert warnings == ["snapshot not written"]


async def test_a_partition_caught_up_looks_at_its_live_tasks_and_the_dormant_ones_named() -> None:
    """As a partition catches up, its live tasks are looked at, its sealed ones never, and of
    its dormant ones only those the service names (asked once, with the set of them: there
    may be thousands)."""
    asked: list[set[str]] = []

    def wake(dormant: Any) -> list[str]:
        asked.append(set(dormant))
        return ["new-1", "elsewhere"]  # a task not dormant here is not woken by it

    before = follower()
    feed(before, [*task_records("running", "live-1", BASE + 3 * DAY),
                  *task_records("done", "old-1", BASE),
                  *task_records("done", "new-1", BASE + 2 * DAY),
                  *task_records("done", "new-2", BASE + 2 * DAY),
                  *task_records("running", "live-2", BASE + 3 * DAY)], {JOURNAL_TP: 0, SIDE_TP: 0})
    image = before.image(0)
    assert image is not None
    f = unstarted(SETTINGS, "snap.decider", [JOURNAL_TP, SIDE_TP], side=TASKS,
                  seal_after_s=DAY.total_seconds(), snapshots=True, wake_on_catch_up=wake)
    await f._restore(JOURNAL_TP, snapshots.decode(snapshots.encode(image)), f._partitions)
    assert f.dormant.keys() == {"new-1", "new-2"}
    assert "old-1" in f.sealed

    assert f._open({"live-1", "live-2", "old-1", "new-1", "new-2"}) == {
        "live-1", "live-2", "new-1"}
    assert asked == [{"new-1", "new-2"}]
    assert f._open({"live-1"}) == {"live-1"}
    assert len(asked) == 1  # no dormant task among them: nothing asked


def format_4(image: snapshots.Image, version: int = 4) -> bytes:
    """The image as the build before this one wrote it (the dormant and ended tasks' index
    as JSON lists in the header)."""
    import json
    import zlib

    dormant = [*image.dormant, *(snapshots.Dormant.of(*q) for q in image.quiet)]
    header = {"v": version, "partition": image.partition, "journal_next": image.journal_next,
              "side_next": image.side_next, "offsets": [o for o, _ in image.events],
              "ended": [[at.isoformat(), task_id] for at, task_id in image.ended],
              "dormant": [[d.task_id, d.status, d.offsets, d.first_attempts, len(d.payload)]
                          for d in dormant]}
    packed = snapshots._framed([json.dumps(header).encode(),
                                snapshots._EVENTS.dump_json([e for _, e in image.events]),
                                snapshots._REQUESTS.dump_json(image.requests)])
    return snapshots.MAGIC + snapshots._framed([zlib.compress(packed),
                                                b"".join(d.payload for d in dormant),
                                                image.sealed])


async def test_an_image_of_the_format_before_is_read_the_same_and_rewritten_soon() -> None:
    """After an upgrade a restart reads the images the old build wrote (no replay from zero),
    and the partition is due for a snapshot in this build's format as soon as it caught up."""
    records = [*task_records("running", "live-1", BASE), *task_records("done", "old-1", BASE),
               *task_records("done", "new-1", BASE + 3 * DAY),
               *task_records("rejected", "no-1", BASE + 3 * DAY)]
    f = follower()
    feed(f, records, {JOURNAL_TP: 0, SIDE_TP: 0})
    image = f.image(0)
    assert image is not None
    assert image.quiet
    assert image.ended
    old, new = snapshots.decode(format_4(image)), snapshots.decode(snapshots.encode(image))
    assert (old.format, new.format) == (4, snapshots.FORMAT)
    for field in ("partition", "journal_next", "side_next", "events", "requests", "sealed",
                  "ended"):
        assert getattr(old, field) == getattr(new, field), field
    assert [(d.task_id, d.status, list(d.offsets), [tuple(p) for p in d.first_attempts],
             d.payload) for d in old.dormant] == [
        (d.task_id, d.status, list(d.offsets), [tuple(p) for p in d.first_attempts], d.payload)
        for d in new.dormant]

    restored, current = follower(), follower()
    await restored._restore(JOURNAL_TP, old, restored._partitions)
    await current._restore(JOURNAL_TP, new, current._partitions)
    assert view(restored) == view(current)
    assert restored._partitions[JOURNAL_TP].since_snapshot >= snapshots.EVERY_RECORDS
    assert current._partitions[JOURNAL_TP].since_snapshot == 0
    with pytest.raises(snapshots.UnusableSnapshot, match="format 3"):
        snapshots.decode(format_4(image, version=3))


async def test_the_seal_window_goes_with_the_image() -> None:
    f = follower()
    feed(f, task_records("running", "r", BASE), {JOURNAL_TP: 0, SIDE_TP: 0})
    image = f.image(0)
    assert image is not None
    assert image.seal_after_s == DAY.total_seconds()
    assert snapshots.decode(snapshots.encode(image)).seal_after_s == DAY.total_seconds()
    image.seal_after_s = snapshots.seal_window(None)  # never seal
    assert snapshots.decode(snapshots.encode(image)).seal_after_s == float("inf")
    assert snapshots.decode(format_4(image)).seal_after_s is None  # not recorded: any window


def test_an_unreadable_pointer_is_refused() -> None:
    with pytest.raises(snapshots.UnusableSnapshot):
        snapshots.Pointer.parse('{"v": 99}')
    with pytest.raises(snapshots.UnusableSnapshot):
        snapshots.Pointer.parse("garbage")


# -- through the broker --------------------------------------------------------------------


async def _commit(settings: KafkaSettings, group: str, tp: TopicPartition,
                  offset: int, metadata: str, *, fill: bool = True) -> None:
    """`group`'s commit of `offset` (the pointer in `metadata`) for `tp`; with `fill`, the
    partition is first written up to `offset` (an image past its log's end is refused)."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    consumer = AIOKafkaConsumer(**settings.client(), group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        consumer.assign([tp])
        missing = offset - (await consumer.end_offsets([tp]))[tp]
        if fill and missing > 0:
            producer = AIOKafkaProducer(**settings.client())
            await producer.start()
            try:
                for _ in range(missing):
                    await producer.send(tp.topic, b"filler", partition=tp.partition)
                await producer.flush()
            finally:
                await producer.stop()
        await consumer.commit({tp: (offset, metadata)})
    finally:
        await consumer.stop()


@pytest.mark.broker
async def test_a_snapshot_round_trips_through_the_broker_and_a_tampered_one_is_refused(
        topics: KafkaSettings, writer: JournalWriter) -> None:
    f = follower()
    records = [*task_records("running", "live-1", BASE), *task_records("done", "old-1", BASE),
               *task_records("done", "new-1", BASE + 3 * DAY)]
    feed(f, records, {JOURNAL_TP: 0, SIDE_TP: 0})
    image = f.image(0)
    assert image is not None
    blob = snapshots.encode(image)
    group = "snap-test-decider"
    tp = TopicPartition(JOURNAL.name(topics.topic_prefix), 0)
    pointer = await snapshots.write(writer, group, image, blob)
    await _commit(topics, group, tp, image.journal_next, pointer.metadata())

    images = await snapshots.load(topics, group, [tp])
    assert images[0].events == image.events
    assert images[0].sealed == image.sealed
    assert len(image.sealed) == 8
    # A task over and settled for good comes back as bytes, and decodes to its history.
    (dormant,) = images[0].dormant
    assert dormant.task_id == "new-1"
    history, request = dormant.decode()
    assert history == f._history["new-1"]
    assert request == f.requests["new-1"]

    # An image folded with another seal window than the restart's: refused (its sealed tasks
    # would not be a replay's); the same window, or none named: used.
    assert images[0].seal_after_s == DAY.total_seconds()
    for window, used in ((snapshots.seal_window(DAY), True), (None, True),
                         (snapshots.seal_window(2 * DAY), False),
                         (snapshots.seal_window(None), False)):
        loaded = await snapshots.load(topics, group, [tp], seal_after_s=window)
        assert (0 in loaded) is used, window

    # A pointer whose digest does not match what the chunks hold: refused, nothing restored.
    forged = snapshots.Pointer(pointer.snapshot_id, pointer.topic_partition,
                               pointer.first_offset, pointer.chunks, pointer.size, "0" * 64)
    await _commit(topics, group, tp, image.journal_next, forged.metadata())
    assert await snapshots.load(topics, group, [tp]) == {}
    # And one that names another offset than the commit's: refused too.
    await _commit(topics, group, tp, image.journal_next + 1, pointer.metadata())
    assert await snapshots.load(topics, group, [tp]) == {}


@pytest.mark.broker
async def test_an_image_that_starts_past_its_logs_end_is_refused(
        own_deployment: KafkaSettings) -> None:
    """Restored, it would skip every record the log writes up to there (a partition that
    looks caught up and never acts): the log lost records, or the image is not of this log.
    Topics of its own: the session's are written by every other test."""
    settings = own_deployment
    f = follower()
    feed(f, task_records("running", "live-1", BASE), {JOURNAL_TP: 0, SIDE_TP: 0})
    base = f.image(0)
    assert base is not None
    group = "snap-test-beyond"
    journal = TopicPartition(JOURNAL.name(settings.topic_prefix), 0)
    side = TopicPartition(TASKS.name(settings.topic_prefix), 0)
    image = replace(base, journal_next=base.journal_next + 300)
    async with JournalWriter(settings) as writer:
        pointer = await snapshots.write(writer, group, image, snapshots.encode(image))
    await _commit(settings, group, journal, image.journal_next, pointer.metadata(), fill=False)
    assert await snapshots.load(settings, group, [journal]) == {}
    # Written up to there, the same image is used; past its side topic's end, it is not
    # (then written up to there too: used).
    await _commit(settings, group, journal, image.journal_next, pointer.metadata())
    assert sorted(await snapshots.load(settings, group, [journal])) == [0]
    assert image.side_next is not None
    assert image.side_next > 0

    async def used() -> list[int]:
        return [n async for n, got in snapshots.load_each(settings, group, [journal],
                                                          side=side.topic) if got is not None]

    assert await used() == []
    await _commit(settings, "snap-test-filler", side, image.side_next, "")
    assert await used() == [0]


def test_an_image_that_unpacks_beyond_reason_is_refused_unread() -> None:
    """A zlib bomb: a few compressed bytes that unpack to gigabytes. Refused once it passes
    UNPACKED_RATIO_MAX times its size, never unpacked whole (a restart would run out of
    memory at every try: the pointer stays committed)."""
    import zlib

    bomb = zlib.compress(bytes(1024 * 1024 * 1024), 9)  # 1 GiB of zeros, about 1 MB
    blob = snapshots.MAGIC + snapshots._framed([bomb, b"", b""])
    with pytest.raises(snapshots.UnusableSnapshot, match="unpack to more than"):
        snapshots.decode(blob)
    dormant = snapshots.Dormant("t", "succeeded", (0,), (), zlib.compress(bytes(10 ** 9)))
    with pytest.raises(snapshots.UnusableSnapshot, match="unpack to more than"):
        dormant.decode()


@pytest.mark.broker
async def test_a_restart_reads_every_partitions_image_with_one_consumer(
        topics: KafkaSettings, writer: JournalWriter, monkeypatch: pytest.MonkeyPatch) -> None:
    """The images of several partitions, an older one of the same partition among them on the
    topic and one with a forged pointer, read through the one consumer a restart shares: each
    image comes back as written, the forged one is refused, the others are still read."""
    f = follower()
    feed(f, [*task_records("running", "live-1", BASE), *task_records("done", "old-1", BASE),
             *task_records("done", "new-1", BASE + 3 * DAY)], {JOURNAL_TP: 0, SIDE_TP: 0})
    base = f.image(0)
    assert base is not None
    group = "snap-test-shared"
    tps = [TopicPartition(JOURNAL.name(topics.topic_prefix), n) for n in range(4)]
    written: dict[int, snapshots.Image] = {}
    for n in (0, 1, 1, 2, 3):  # partition 1's first image is superseded by its second
        image = replace(base, partition=n, journal_next=base.journal_next + 10 * n + len(written))
        pointer = await snapshots.write(writer, group, image, snapshots.encode(image))
        if n == 2:
            pointer = replace(pointer, sha256="0" * 64)
        await _commit(topics, group, tps[n], image.journal_next, pointer.metadata())
        written[n] = image
    made: list[object] = []
    real_reader = snapshots.reader
    monkeypatch.setattr(snapshots, "reader", lambda s: made.append(s) or real_reader(s))

    images = await snapshots.load(topics, group, tps)

    assert len(made) == 1
    assert sorted(images) == [0, 1, 3]
    for n, image in images.items():
        assert (image.partition, image.journal_next) == (n, written[n].journal_next)
        assert image.events == base.events
        assert image.sealed == base.sealed
        assert [d.task_id for d in image.dormant] == ["new-1"]


@pytest.mark.broker
async def test_a_restarted_decider_restores_its_snapshot_and_acts_the_same(core: Cluster) -> None:
    """A decider that wrote snapshots is stopped and tasks are requested meanwhile; the next
    one restores the partitions that have a snapshot, asks nothing again for the tasks before
    them, and finishes the new tasks: one charge per task."""
    often = {"HALFWAY_SNAPSHOT_EVERY_S": "0"}  # a snapshot after every batch with news
    first = await core.start("decider", **often)
    await core.start("executor", **often)
    before = [f"snap-before-{i}" for i in range(4)]
    await core.publish(*(renewal_request(t) for t in before))
    await core.journal.until_finished(before)
    await first.until_logged("snapshot written")
    await stop(first)
    asked_before = len(core.model_calls())

    after = [f"snap-after-{i}" for i in range(4)]
    await core.publish(*(renewal_request(t) for t in after))
    second = await core.start("decider", **often)
    (assigned,) = await second.until_logged("partitions assigned")
    states = await core.journal.until_finished(after)

    written = {e["partition"] for e in first.logged("snapshot written")}
    assert set(assigned["loading"]) == set(assigned["partitions"])  # all: each may have one
    # Each partition is restored or read from zero, once; every one whose snapshot the first
    # logged is restored (one committed just as it stopped may be restored unlogged).
    everything = set(assigned["partitions"])
    async with asyncio.timeout(WAIT_S):
        while True:  # a log file has no notification: polled, bounded
            restored = [e["partition"] for e in second.logged("partition restored")]
            zero = [e["partition"] for e in second.logged("partition read from zero")]
            if set(restored) | set(zero) >= everything:
                break
            await asyncio.sleep(POLL_S)
    assert written <= set(restored)
    assert sorted(restored + zero) == sorted(everything)  # each once, by one way or the other
    assert all(s.final_state is FinalState.SUCCEEDED for s in states.values())
    asked = [c["task_id"] for c in core.model_calls()[asked_before:]]
    assert not set(asked) & set(before), "a task finished before the restart was asked again"
    charges = await core.ledger()
    for task_id in [*before, *after]:
        assert len(charges_for(charges, f"{task_id}:1")) == 1, task_id


async def test_a_task_over_for_a_minute_is_kept_as_bytes_and_comes_back_whole() -> None:
    done = task_records("done", "done-1", BASE)
    later = task_records("running", "later-1", BASE + timedelta(minutes=45))
    f = follower()
    feed(f, done, {JOURNAL_TP: 0, SIDE_TP: 0})
    assert "done-1" not in f.dormant  # just over: kept whole (its services may look again)
    whole = dict.__getitem__(f.states, "done-1")
    feed(f, later, {JOURNAL_TP: len(done) - 1, SIDE_TP: 1})
    assert "done-1" in f.dormant
    assert not dict.__contains__(f.states, "done-1")
    assert "done-1" not in f._history
    assert "done-1" not in f.requests
    assert f.states["done-1"] == whole  # asked for: decoded and folded again, the same
    assert "done-1" not in f.dormant
    assert f.requests["done-1"].task_id == "done-1"


# -- restoring partitions one by one ---------------------------------------------------------


class FakeKafka:
    """What `_adopt` and the loader ask of the consumer."""

    def __init__(self) -> None:
        self.paused: set[TopicPartition] = set()
        self.sought: dict[TopicPartition, int] = {}
        self.resumed = asyncio.Event()

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return {tp: 100 for tp in tps}

    async def committed(self, tp: TopicPartition) -> int:
        return 0

    def pause(self, *tps: TopicPartition) -> None:
        self.paused |= set(tps)

    def resume(self, *tps: TopicPartition) -> None:
        self.paused -= set(tps)
        self.resumed.set()

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.sought[tp] = offset


JOURNAL_1, SIDE_1 = TopicPartition("snap.journal", 1), TopicPartition("snap.tasks", 1)


def loading_follower(monkeypatch: pytest.MonkeyPatch) -> tuple[JournalFollower, FakeKafka,
                                                                asyncio.Queue[Any]]:
    """A follower with no partitions yet, whose snapshot reads yield what the test puts in
    the queue, in that order."""
    f = unstarted(SETTINGS, "snap.decider", [], side=TASKS, seal_after_s=DAY.total_seconds(),
                  snapshots=True)
    kafka = FakeKafka()
    monkeypatch.setattr(f._consumer, "_consumer", kafka)  # the real one back to be closed
    reads: asyncio.Queue[Any] = asyncio.Queue()

    async def load_each(settings: Any, group: str, tps: list[TopicPartition],
                        wanted: bool, seal_after_s: float | None, side: str | None) -> Any:
        for _ in tps:
            item = await reads.get()
            if isinstance(item, Exception):
                raise item
            yield item

    monkeypatch.setattr(snapshots, "load_each", load_each)
    return f, kafka, reads


def an_image() -> snapshots.Image:
    f = follower()
    feed(f, [*task_records("running", "live-1", BASE),
             *task_records("done", "new-1", BASE + 3 * DAY)], {JOURNAL_TP: 0, SIDE_TP: 0})
    image = f.image(0)
    assert image is not None
    return snapshots.decode(snapshots.encode(image))


async def settle(f: JournalFollower) -> None:
    await asyncio.gather(*f._loaders)


async def test_each_partition_is_served_as_soon_as_its_image_is_restored(
        monkeypatch: pytest.MonkeyPatch) -> None:
    f, kafka, reads = loading_follower(monkeypatch)
    await f._adopt([JOURNAL_TP, SIDE_TP, JOURNAL_1, SIDE_1])
    assert kafka.paused == {JOURNAL_TP, SIDE_TP, JOURNAL_1, SIDE_1}
    assert f._partitions == {}  # nothing is read (or reported) before its state is in

    await reads.put((1, None))  # no usable snapshot: read from zero, at once
    await kafka.resumed.wait()
    assert kafka.paused == {JOURNAL_TP, SIDE_TP}
    assert (kafka.sought[JOURNAL_1], kafka.sought[SIDE_1]) == (0, 0)
    assert "live-1" not in f.states

    image = an_image()
    await reads.put((0, image))
    await settle(f)
    assert kafka.paused == set()
    assert (kafka.sought[JOURNAL_TP], kafka.sought[SIDE_TP]) == (image.journal_next,
                                                                 image.side_next)
    assert f.owns("live-1")
    assert f.states["live-1"].status == "running"
    assert f.restored == {0: image.journal_next}


async def test_snapshot_reads_that_fail_as_a_whole_leave_no_partition_paused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    f, kafka, reads = loading_follower(monkeypatch)
    await f._adopt([JOURNAL_TP, SIDE_TP, JOURNAL_1, SIDE_1])
    image = an_image()
    await reads.put((0, image))
    await reads.put(RuntimeError("the snapshot reads broke"))
    await settle(f)
    assert kafka.paused == set()
    assert (kafka.sought[JOURNAL_1], kafka.sought[SIDE_1]) == (0, 0)  # from zero
    assert f.restored == {0: image.journal_next}


@pytest.mark.parametrize("when", ["while read", "while restored"])
async def test_a_partition_revoked_while_loading_leaves_nothing_behind(
        monkeypatch: pytest.MonkeyPatch, when: str) -> None:
    f, kafka, reads = loading_follower(monkeypatch)
    restore = f._restore

    async def revoked_meanwhile(tp: TopicPartition, image: Any, parts: Any,
                                wake: Any) -> None:
        await restore(tp, image, parts, wake)
        f._forget([JOURNAL_TP, SIDE_TP])  # a rebalance, at one of the restore's awaits

    if when == "while restored":
        monkeypatch.setattr(f, "_restore", revoked_meanwhile)
    await f._adopt([JOURNAL_TP, SIDE_TP])
    if when == "while read":
        f._forget([JOURNAL_TP, SIDE_TP])
    await reads.put((0, an_image()))
    await settle(f)
    assert f._partitions == {}
    assert f._loading == {}
    assert not dict(f.states)
    assert not f.dormant
    assert not f.requests
    assert not f.restored
    assert len(f.sealed) == 0
    assert JOURNAL_TP not in kafka.sought


async def test_what_a_service_reads_before_a_replay_is_read_outside_the_rebalance_listener(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`on_assign` (the outcomes publisher reads its whole topic) may take longer than the
    session timeout: in the listener, the group would take the partition away and the read
    start over. The listener returns at once; the partition waits, paused, until it is done."""
    monkeypatch.setenv(SNAPSHOTS_ENV, "off")
    reading, done_reading = asyncio.Event(), asyncio.Event()
    asked: list[set[int]] = []

    async def on_assign(partitions: set[int]) -> None:
        asked.append(partitions)
        reading.set()
        await done_reading.wait()

    f = unstarted(SETTINGS, "snap.outcomes", [], on_assign=on_assign)
    kafka = FakeKafka()
    monkeypatch.setattr(f._consumer, "_consumer", kafka)  # the real one back to be closed
    await f._adopt([JOURNAL_TP])  # the rebalance listener's part: returns with the read to do
    assert kafka.paused == {JOURNAL_TP}
    assert f._partitions == {}
    await asyncio.wait_for(reading.wait(), WAIT_S)  # the loader reads
    assert asked == [{0}]
    assert f._partitions == {}  # not read before that is done
    done_reading.set()
    await settle(f)
    assert JOURNAL_TP in f._partitions
    assert kafka.paused == set()
    assert kafka.sought[JOURNAL_TP] == 0  # from zero
