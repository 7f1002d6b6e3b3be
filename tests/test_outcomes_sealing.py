"""The outcomes publisher seals tasks: memory follows live work, and no message is lost or sent
twice for it.

Against the real broker, on topics of each scenario's own, with the publisher in this process and
journal events written by hand: every task of a scenario is on one partition, so the records of a
later task move that partition's clock (`at`) past the others' ends. What the publisher holds is
read from its fields; what it published, from the outcomes topic, compared with what `derive`
makes of each task's journal.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from halfway.client import OutcomeStream
from halfway.contract import Event, FinalState, Outcome
from halfway.contract.outcomes import OutcomeChanged
from halfway.contract.topics import ALL_TOPICS, JOURNAL, OUTCOMES
from halfway.journal import JournalWriter, ensure_topics
from halfway.journal.admin import delete_topics
from halfway.journal.reader import FETCH_RECORDS_MAX
from halfway.journal.records import partition_of
from halfway.outcomes import OutcomesPublisher, messages, read_outcomes
from halfway.outcomes import service as outcomes_service
from halfway.outcomes.service import _Task
from halfway.settings import KafkaSettings
from tests.factories import Stamper

pytestmark = pytest.mark.broker

DAY = timedelta(days=1)
HOUR = timedelta(hours=1)
T0 = datetime(2026, 12, 1, 9, 0, tzinfo=UTC)
WAIT_S = 60.0


def done_task(task_id: str, at: datetime) -> list[Event]:
    """A task that charged once and succeeded: over for good, so it can be sealed."""
    s = Stamper(task_id, now=at)
    return [s.started(), s.intended(1), s.attempted(1, 1),
            s.settled(1, Outcome.DONE, attempt=1, evidence={"charge_id": f"ch_{task_id}"}),
            s.finished(FinalState.SUCCEEDED)]


def one_partition(names: Iterable[str], count: int) -> tuple[int, dict[str, str]]:
    """A task id per name, all on one partition (so they share a journal clock)."""
    run = uuid.uuid4().hex[:8]
    target: int | None = None
    ids: dict[str, str] = {}
    for name in names:
        for n in range(10_000):
            task_id = f"{run}-{name}-{n}"
            p = partition_of(task_id.encode(), count)
            if target is None:
                target = p
            if p == target:
                ids[name] = task_id
                break
    assert target is not None
    assert len(ids) == len(set(ids.values()))
    return target, ids


@contextlib.asynccontextmanager
async def deployment(base: KafkaSettings) -> AsyncIterator[KafkaSettings]:
    settings = base.with_prefix(f"own-{uuid.uuid4().hex[:8]}.")
    await ensure_topics(settings, ALL_TOPICS)
    try:
        yield settings
    finally:
        await delete_topics(settings, ALL_TOPICS)


def watched(publisher: OutcomesPublisher) -> asyncio.Condition:
    """A condition notified each time the publisher is done sending a task's messages, or with
    what it read of the outcomes topic: when what it holds may have changed."""
    changed = asyncio.Condition()

    def notifying(original: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
        async def call(*args: Any) -> None:
            try:
                await original(*args)
            finally:
                async with changed:
                    changed.notify_all()
        return call

    for name in ("_publish", "_prune_when_replayed"):
        setattr(publisher, name, notifying(getattr(publisher, name)))
    return changed


@contextlib.asynccontextmanager
async def publishing(settings: KafkaSettings,
                     ) -> AsyncIterator[tuple[OutcomesPublisher, asyncio.Condition]]:
    """A publisher of the deployment's group (the same one each time), `watched`, running until
    the block ends; it fails the test if it stopped by itself."""
    async with JournalWriter(settings) as writer:
        publisher = OutcomesPublisher(settings, writer)
        changed = watched(publisher)
        running = asyncio.create_task(publisher.run(), name="outcomes")
        try:
            yield publisher, changed
            assert not running.done(), f"the publisher stopped: {running.exception()}"
        finally:
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running


async def until_seen(stream: OutcomeStream, seen: dict[str, OutcomeChanged],
                     wanted: Iterable[OutcomeChanged], what: str) -> None:
    """Read the outcomes stream into `seen` (by message id) until every `wanted` is in."""
    missing = {m.message_id for m in wanted}
    try:
        async with asyncio.timeout(WAIT_S):
            while missing - seen.keys():
                message = await anext(stream)
                seen[message.message_id] = message
    except TimeoutError:
        raise AssertionError(f"{what}: not on the topic within {WAIT_S:g} s: "
                             f"{sorted(missing - seen.keys())}") from None


async def until(changed: asyncio.Condition, probe: Callable[[], bool], what: str) -> None:
    try:
        async with asyncio.timeout(WAIT_S), changed:
            await changed.wait_for(probe)
    except TimeoutError:
        raise AssertionError(f"not within {WAIT_S:g} s: {what}") from None


async def on_topic(settings: KafkaSettings, partition: int) -> dict[str, list[OutcomeChanged]]:
    """Every message of the outcomes partition, duplicates included, by task."""
    out: dict[str, list[OutcomeChanged]] = {}
    async for message in read_outcomes(settings, {partition}):
        out.setdefault(message.task_id, []).append(message)
    return out


def holds(publisher: OutcomesPublisher, partition: int, task_id: str) -> list[str]:
    """Where the publisher (and its follower) keep something of the task."""
    places = {
        "follower.states": task_id in publisher.follower.states,
        "_tasks": task_id in publisher._tasks,
        "_published": task_id in publisher._published.get(partition, {}),
        "_owed": task_id in publisher._owed,
    }
    return [place for place, held in places.items() if held]


def idle(publisher: OutcomesPublisher) -> bool:
    """Nothing left to send: no task owes a message, none is being sent."""
    return not publisher._owed and not any(t.pending or t.sending
                                           for t in publisher._tasks.values())


# --- 1: sealing forgets, and loses nothing -------------------------------------------------------


async def test_a_sealed_task_leaves_nothing_behind_and_every_message_of_it_on_the_topic(
        kafka_settings: KafkaSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HALFWAY_SEAL_AFTER_S", str(DAY.total_seconds()))
    partition, ids = one_partition(["first", "quick", "clock"], kafka_settings.partitions)
    first, quick, clock = ids["first"], ids["quick"], ids["clock"]
    logs = {first: done_task(first, T0), quick: done_task(quick, T0 + HOUR),
            clock: done_task(clock, T0 + 2 * DAY)}
    expected = {t: messages(log, t) for t, log in logs.items()}
    async with (deployment(kafka_settings) as settings, JournalWriter(settings) as journal,
                publishing(settings) as (publisher, changed),
                OutcomeStream(settings, None, from_beginning=True) as stream):
        seen: dict[str, OutcomeChanged] = {}
        await journal.append_all(logs[first])
        await until_seen(stream, seen, expected[first], "the first task's messages")
        assert holds(publisher, partition, first) == ["follower.states", "_tasks"]  # live still

        # The quick task's last changes and the records that seal it (and the first) come in
        # one go: folded one after another, it may be sealed before it was ever reported.
        metas = await journal.append_all([*logs[quick], *logs[clock]])
        assert {m.partition for m in metas} == {partition}
        assert await publisher.follower.applied(partition, metas[-1].offset, WAIT_S)
        assert first in publisher.follower.sealed
        assert quick in publisher.follower.sealed
        assert clock not in publisher.follower.sealed  # over a moment ago, by the journal
        await until_seen(stream, seen, [*expected[quick], *expected[clock]],
                         "the quick and the clock tasks' messages")
        await until(changed, lambda: idle(publisher), "the publisher has sent everything")

        for task_id in (first, quick):
            assert holds(publisher, partition, task_id) == [], task_id
        assert holds(publisher, partition, clock) == ["follower.states", "_tasks"]
        # Every partition loaded (in the background) and what was read of it pruned.
        await asyncio.gather(*publisher.follower._loaders, *publisher._background)
        assert publisher._published == {p: {} for p in range(settings.partitions)}
        topic = await on_topic(settings, partition)
        for task_id, wanted in expected.items():
            assert topic[task_id] == wanted, task_id  # each once, in order, as without sealing
        assert publisher.published == sum(map(len, expected.values()))


# --- 2 and 3: a restart -------------------------------------------------------------------------


@dataclass
class Restart:
    partition: int
    ids: dict[str, str]
    expected: dict[str, list[OutcomeChanged]]
    topic: dict[str, list[OutcomeChanged]]
    published_by_second: int
    new_for_live: list[OutcomeChanged]
    held: dict[str, list[str]]  # what the second publisher holds, once idle, per task
    read_left: dict[int, dict[str, dict[str, int]]]
    partitions: int
    sealed: set[str]


@pytest.fixture(scope="module")
async def restart(kafka_settings: KafkaSettings) -> Restart:
    """A publisher seals a task it published and is stopped with a live task half told; while
    it is down, a task ends and is sealed by the journal's clock without a message published
    (the restart's replay seals it again before catching up: its messages are owed), and the
    outcomes topic holds a message of a task the journal does not have. Then a second
    publisher of the same group takes over and the live task goes on."""
    partition, ids = one_partition(["sealed", "live", "ender", "owed", "mover", "ghost"],
                                   kafka_settings.partitions)
    sealed, live, ender, owed, mover, ghost = (
        ids[n] for n in ("sealed", "live", "ender", "owed", "mover", "ghost"))
    live_s = Stamper(live, now=T0)
    logs: dict[str, list[Event]] = {
        sealed: done_task(sealed, T0),
        live: [live_s.started(), live_s.intended(1), live_s.attempted(1, 1)],
        ender: done_task(ender, T0 + 2 * DAY),  # seals `sealed`
        owed: done_task(owed, T0 + 2 * DAY + HOUR),
        mover: done_task(mover, T0 + 4 * DAY),  # seals `ender` and `owed`
    }
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HALFWAY_SEAL_AFTER_S", str(DAY.total_seconds()))
        async with (deployment(kafka_settings) as settings, JournalWriter(settings) as journal,
                    OutcomeStream(settings, None, from_beginning=True) as stream):
            seen: dict[str, OutcomeChanged] = {}
            async with publishing(settings) as (first, first_changed):
                await journal.append_all([*logs[sealed], *logs[live], *logs[ender]])
                told = [m for t in (sealed, live, ender) for m in messages(logs[t], t)]
                await until_seen(stream, seen, told, "what the first publisher tells")
                await until(first_changed, lambda: not holds(first, partition, sealed),
                            "the first publisher forgot the sealed task")
                assert sealed in first.follower.sealed
            # Down: these are told by nobody yet.
            await journal.append_all([*logs[owed], *logs[mover]])
            phantom = messages(done_task(ghost, T0), ghost)[0]
            await journal.append_raw(OUTCOMES, phantom.model_dump_json().encode(),
                                     key=phantom.record_key(),
                                     headers=[("type", phantom.type.encode()),
                                              ("message_id", phantom.message_id.encode())])
            async with publishing(settings) as (second, second_changed):
                await until_seen(stream, seen, [*messages(logs[owed], owed),
                                                *messages(logs[mover], mover)],
                                 "what the second publisher owes")
                # The live task goes on, its records after the mover's (the clock moves on).
                live_s.now = T0 + 4 * DAY + HOUR
                logs[live] += [live_s.settled(1, Outcome.DONE, attempt=1,
                                              evidence={"charge_id": "ch_live"}),
                               live_s.finished(FinalState.SUCCEEDED)]
                metas = await journal.append_all(logs[live][3:])
                assert await second.follower.applied(partition, metas[-1].offset, WAIT_S)
                expected = {t: messages(log, t) for t, log in logs.items()}
                told_before = len(messages(logs[live][:3], live))
                new_for_live = expected[live][told_before:]
                await until_seen(stream, seen, new_for_live, "the live task's news")
                await until(second_changed,
                            lambda: idle(second) and ghost not in second._published[partition],
                            "the second publisher has sent everything and read the journal")
                return Restart(
                    partition=partition, ids=ids, expected=expected,
                    topic=await on_topic(settings, partition),
                    published_by_second=second.published, new_for_live=new_for_live,
                    held={t: holds(second, partition, t) for t in ids.values()},
                    read_left=second._published, partitions=settings.partitions,
                    sealed={t for t in ids.values() if t in second.follower.sealed})


async def test_a_restarted_publisher_sends_no_sealed_message_again_and_keeps_nothing_of_it(
        restart: Restart) -> None:
    ids = restart.ids
    for name in ("sealed", "ender", "owed", "mover"):
        task_id = ids[name]
        # Every message once: none sent again because the publisher forgot it had sent it,
        # and the owed task's, sealed in the replay before they were sent, not lost.
        assert restart.topic[task_id] == restart.expected[task_id], name
    assert restart.sealed == {ids["sealed"], ids["ender"], ids["owed"]}
    for name in ("sealed", "ender", "owed"):
        assert restart.held[ids[name]] == [], name
    # The phantom's entry (no journal record) and everything the replay passed are gone.
    assert restart.held[ids["ghost"]] == []
    assert restart.read_left == {p: {} for p in range(restart.partitions)}
    # What the second publisher sent: the owed task's, the mover's, and the live task's news.
    assert restart.published_by_second == (len(restart.expected[ids["owed"]])
                                           + len(restart.expected[ids["mover"]])
                                           + len(restart.new_for_live))


async def test_a_live_task_numbering_goes_on_across_the_restart(restart: Restart) -> None:
    live = restart.ids["live"]
    mine = restart.topic[live]
    assert mine == restart.expected[live]  # each id once, in order, no gap
    assert [(m.about, m.seq, m.state) for m in restart.new_for_live] == [
        (f"{live}:1", 3, "done"), ("task", 2, "succeeded")]
    assert restart.held[live] == ["follower.states", "_tasks"]  # live: kept, and only that


# --- a replay that seals faster than it sends waits for the sends --------------------------------


async def test_a_replay_waits_while_too_many_sealed_tasks_owe_messages(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`_hold_while_owing`: at once under OWED_MAX owed; else until half are sent, or, if none
    goes, OWED_WAIT_S (the consumer must still poll)."""
    monkeypatch.setattr(outcomes_service, "OWED_MAX", 4)
    monkeypatch.setattr(outcomes_service, "OWED_WAIT_S", 0.05)
    publisher = OutcomesPublisher(KafkaSettings("127.0.0.1:1", "hold.", 1), None)  # type: ignore[arg-type]
    try:
        await publisher._hold_while_owing()  # nothing owed
        for n in range(4):
            publisher._owed[f"t{n}"] = _Task(0, sealed=True)
        hold = asyncio.create_task(publisher._hold_while_owing())
        await asyncio.sleep(0)
        publisher._unowe("t0")
        await asyncio.sleep(0)
        assert not hold.done()  # 3 owed: more than half
        publisher._unowe("t1")
        await asyncio.wait_for(hold, WAIT_S)  # 2: half

        publisher._owed.update({f"u{n}": _Task(0, sealed=True) for n in range(4)})
        await asyncio.wait_for(publisher._hold_while_owing(), WAIT_S)  # none sent: times out
    finally:
        await publisher.follower._consumer.stop()  # never started: closed


async def test_a_replay_that_seals_faster_than_it_sends_holds_its_fold_and_loses_nothing(
        kafka_settings: KafkaSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    """A first start over a history each of whose tasks is sealed by the next one's records:
    past OWED_MAX owing, the fold waits for the sends (here held back until the fold waits)
    before reading on. Then every message is on the topic, once."""
    monkeypatch.setenv("HALFWAY_SEAL_AFTER_S", str(DAY.total_seconds()))
    monkeypatch.setattr(outcomes_service, "OWED_MAX", 4)
    tasks = FETCH_RECORDS_MAX // 5 + 40  # more records than one fetch
    partition, ids = one_partition([f"t{n}" for n in range(tasks)], kafka_settings.partitions)
    logs = {ids[f"t{n}"]: done_task(ids[f"t{n}"], T0 + n * (DAY + HOUR)) for n in range(tasks)}
    async with deployment(kafka_settings) as settings, JournalWriter(settings) as journal:
        await journal.append_all([e for log in logs.values() for e in log])
        async with JournalWriter(settings) as writer:
            gate, held_at = asyncio.Event(), asyncio.Future[int]()
            original_append = writer.append_raw

            async def append_raw(spec: Any, value: bytes | None, **kw: Any) -> Any:
                if spec is OUTCOMES:
                    await gate.wait()
                return await original_append(spec, value, **kw)

            writer.append_raw = append_raw  # type: ignore[method-assign]
            publisher = OutcomesPublisher(settings, writer)
            original_hold = publisher._hold_while_owing

            async def hold() -> None:
                if len(publisher._owed) >= outcomes_service.OWED_MAX and not held_at.done():
                    held_at.set_result(publisher.follower.applied_by_topic[journal_topic])
                    gate.set()
                await original_hold()

            journal_topic = JOURNAL.name(settings.topic_prefix)
            publisher.follower._hold = hold
            running = asyncio.create_task(publisher.run())
            try:
                folded = await asyncio.wait_for(held_at, WAIT_S)
                assert folded < tasks * 5  # held before the end of the history
                async with OutcomeStream(settings, None, from_beginning=True) as stream:
                    await until_seen(stream, {}, [m for t, log in logs.items()
                                                  for m in messages(log, t)], "every message")
            finally:
                running.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await running
        topic = await on_topic(settings, partition)
        for task_id, log in logs.items():
            assert topic.get(task_id) == messages(log, task_id), task_id
