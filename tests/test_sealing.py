"""Sealing: a follower keeps only the end of a task that is over for good, by the journal's clock.

Driven through the follower's fold path (`_apply`) on one partition, without a broker: what is
sealed depends only on the records and their order, so two followers fed the same log hold the
same states, and every task that is not sealed holds exactly the fold of its events.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from aiokafka import TopicPartition
from pydantic import ValidationError

from halfway.contract import Event, FinalState, Outcome, SettlementSource, TaskStarted
from halfway.core.decide import Idle, decide
from halfway.core.fold import TaskState, TaskStatus, fold
from halfway.journal.follower import JournalFollower
from halfway.journal.sealed import MERGE_AT_LEAST, EndedTasks, SealedTasks
from halfway.settings import KafkaSettings
from tests.factories import Stamper
from tests.followers import unstarted

SETTINGS = KafkaSettings(bootstrap="127.0.0.1:1", topic_prefix="seal.", replication_factor=1)
TP = TopicPartition("seal.journal", 0)
DAY = timedelta(days=1)
NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)


def follower() -> JournalFollower:
    """An executor-like follower, never started."""
    return unstarted(SETTINGS, "seal.executor", [TP], seal_after_s=DAY.total_seconds())


def done_task(task_id: str, at: datetime) -> list[Event]:
    s = Stamper(task_id, now=at)
    return [s.started(), s.intended(1), s.attempted(1, 1),
            s.settled(1, Outcome.DONE, attempt=1, evidence={"charge_id": f"ch_{task_id}"}),
            s.finished(FinalState.SUCCEEDED)]


def history() -> list[Event]:
    old = NOW - 2 * DAY
    unknown = Stamper("open-1", now=old)
    stuck = [unknown.started(), unknown.intended(1), unknown.attempted(1, 1),
             unknown.settled(1, Outcome.UNKNOWN, attempt=1),
             unknown.finished(FinalState.NEEDS_ATTENTION)]
    running = Stamper("running-1", now=old)
    return [*done_task("old-1", old), *stuck, *done_task("old-2", old + timedelta(hours=1)),
            running.started(), running.intended(1),
            *done_task("recent-1", NOW - timedelta(hours=1)),
            *done_task("today-1", NOW)]  # its records move the journal's clock to NOW


def feed(f: JournalFollower, events: list[Event]) -> None:
    for offset, event in enumerate(events):
        f._apply(event, TP, offset)


async def test_tasks_over_for_good_are_sealed_and_the_rest_kept_whole() -> None:
    events = history()
    f = follower()
    feed(f, events)

    assert "old-1" in f.sealed
    assert "old-2" in f.sealed
    assert len(f.sealed) == 2
    assert not any(t in f.sealed for t in ("open-1", "running-1", "recent-1", "today-1"))
    sealed = f.states["old-1"]
    assert sealed == TaskState(task_id="old-1", status=TaskStatus.FINISHED)  # its status only
    for task_id in ("open-1", "running-1", "recent-1", "today-1"):
        mine = [e for e in events if e.task_id == task_id]
        assert f.states[task_id] == fold(mine), task_id  # exactly the fold of its events
    # A sealed task is over: a second request for it starts nothing.
    assert decide(f.states["old-1"], known_tools={"charge_customer"}, requested=True,
                  now=NOW) == Idle()
    assert f.first_attempt.get("old-1:1") is None  # nothing of its steps is kept


async def test_late_news_of_a_sealed_task_is_not_folded() -> None:
    f = follower()
    feed(f, history())
    before = f.states["old-1"]
    late = Stamper("old-1", now=NOW).settled(1, Outcome.DONE, source=SettlementSource.WEBHOOK,
                                             evidence={"charge_id": "ch_other"})
    f._apply(late, TP, 1000)
    assert f.states["old-1"] == before  # still its status only
    assert "old-1" not in f.states  # no state object is kept for it, only the status


async def test_a_request_again_for_a_sealed_task_keeps_nothing() -> None:
    """A caller may repeat a request safely; for a task over for good nothing is started, and
    nothing of the request stays (it was held, and put in every snapshot, for good)."""
    from halfway.contract.topics import TASKS

    tasks_tp = TopicPartition(TASKS.name(SETTINGS.topic_prefix), 0)
    f = unstarted(SETTINGS, "seal.decider", [TP, tasks_tp], seal_after_s=DAY.total_seconds(),
                  side=TASKS)
    feed(f, history())
    again = Stamper("old-1", now=NOW).requested()
    fresh = Stamper("new-1", now=NOW).requested()
    f._apply(again, tasks_tp, 0)
    f._apply(fresh, tasks_tp, 1)
    assert "old-1" not in f.requests
    assert "old-1" not in f._partitions[tasks_tp].tasks
    assert "new-1" in f.requests  # a request for a task not sealed is kept as before
    assert "new-1" in f._partitions[tasks_tp].tasks


async def test_two_followers_fed_the_same_log_hold_the_same_states() -> None:
    events = history()
    first, second = follower(), follower()
    feed(first, events)
    feed(second, events)
    assert first.sealed == second.sealed
    assert first.states == second.states


async def test_a_task_with_news_since_it_ended_waits_a_full_grace_again() -> None:
    old = NOW - 2 * DAY
    s = Stamper("undone-1", now=old)
    events = [s.started(), s.intended(1), s.attempted(1, 1),
              s.settled(1, Outcome.UNKNOWN, attempt=1), s.finished(FinalState.NEEDS_ATTENTION)]
    f = follower()
    feed(f, events)
    # An operator settles it half a day before NOW: it is over for good from then on.
    resolve = Stamper("undone-1", now=NOW - DAY / 2).settled(
        1, Outcome.DONE, source=SettlementSource.OPERATOR, evidence={"charge_id": "ch_1"})
    f._apply(resolve, TP, len(events))
    feed_more = done_task("tick-1", NOW)
    for i, event in enumerate(feed_more):
        f._apply(event, TP, 100 + i)
    assert "undone-1" not in f.sealed  # only half a day since its last news
    for i, event in enumerate(done_task("tick-2", NOW + DAY)):
        f._apply(event, TP, 200 + i)
    assert "undone-1" in f.sealed


def test_an_end_dated_far_ahead_holds_back_no_other_and_no_date_overflows() -> None:
    """A writer's broken clock (an end dated 8999) waits alone: the ends after it are still
    sealed on time; times at the calendar's edges never overflow."""
    ended = EndedTasks()
    ended.add(datetime(8999, 12, 31, tzinfo=UTC), "far-1")
    ended.add(NOW - 2 * DAY, "old-1")
    ended.add(NOW, "today-1")
    assert ended.due(NOW, DAY) == ["old-1"]
    assert ended.due(datetime(1970, 1, 1, tzinfo=UTC), timedelta(days=365)) == []
    assert ended.is_last("far-1", datetime(8999, 12, 31, tzinfo=UTC))
    again = EndedTasks(ended.entries())  # as restored from an image: the same order
    assert again.due(NOW + DAY, DAY) == ["today-1"]


def test_a_record_dated_past_the_contracts_calendar_is_refused() -> None:
    """The contract's times end before year 9000 (else a dead letter): what the services add
    to a journaled time (a day to seal, a backoff) then always fits the calendar."""
    started = Stamper("far-2", now=NOW).started().model_dump(mode="json")
    with pytest.raises(ValidationError, match="less than 9000"):
        TaskStarted.model_validate(started | {"at": "9999-12-31T23:59:59Z"})
    with pytest.raises(ValidationError, match="greater than or equal to 1970"):
        TaskStarted.model_validate(started | {"at": "0001-01-01T00:00:00Z"})

def test_sealed_tasks_cost_a_digest_each_and_survive_packing() -> None:
    """The sealed set answers exactly for what it was given (digests, merged in batches, a
    status per task), and its packed bytes restore the same answers."""
    sealed = SealedTasks()
    ended = {f"t-{i}": (TaskStatus.REJECTED if i % 7 == 0 else TaskStatus.FINISHED)
             for i in range(3 * MERGE_AT_LEAST)}
    for task_id, status in ended.items():
        sealed.add(int(task_id[2:]) % 3, task_id, status)
    sealed.add(0, "t-0", TaskStatus.FINISHED)  # sealed again, as it ended the second time
    ended["t-0"] = TaskStatus.FINISHED
    assert len(sealed) == len(ended)
    assert all(sealed.get(t) is s for t, s in ended.items())
    assert all(sealed.has(int(t[2:]) % 3, t) for t in ended)  # in its own partition
    assert not any(sealed.has(int(t[2:]) % 3 + 1, t) for t in ended)  # and only there
    assert not any(f"u-{i}" in sealed for i in range(10_000))
    restored = SealedTasks()
    for n in range(3):
        restored.restore(n, sealed.packed(n))
    assert restored == sealed
    assert all(restored.get(t) is s for t, s in ended.items())
    sealed.drop(1)
    assert "t-1" not in sealed
    assert "t-0" in sealed
    with pytest.raises(ValueError, match="not 64-bit values"):
        restored.restore(0, b"\x00" * 7)
    with pytest.raises(ValueError, match="ascending"):
        restored.restore(0, (2).to_bytes(8, "little") + (1).to_bytes(8, "little"))
