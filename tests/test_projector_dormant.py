"""The projector keeps a task over for good as its events' compressed JSON a minute after it
ended by the journal's clock (`_Partition.quiet_due`, as the followers do), and folds it again
only if news of it comes: memory and a restart's work follow the tasks still open, not the
day of ended ones that waits to be sealed.

Property (pure: records folded by hand, no broker): against a projector that keeps every fold
(no snapshots: nothing goes dormant), over any interleaving of task lives, news after their
ends, a clock that jumps, flushes and re-syncs, the one with dormant tasks holds the same state
of every task (a dormant one's events fold to it), seals the same tasks, has the same rows to
write, and an image of it restores to the same again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

import pytest
from aiokafka.structs import ConsumerRecord
from hypothesis import given, settings
from hypothesis import strategies as st

from halfway.contract import Event, Outcome, SettlementSource, TaskFinished
from halfway.core.fold import TaskState, fold
from halfway.journal import snapshots
from halfway.journal.follower import DORMANT_AFTER_S, settled_for_good
from halfway.journal.records import record_key, record_value
from halfway.projector.service import Projector, _Partition
from halfway.settings import KafkaSettings
from tests.factories import EPOCH, Stamper

DAY = timedelta(days=1)
TASKS = 4
LATE = ("confirmed", "contradicted", "requested again")
# Under a minute, past it (twice as likely: what makes tasks dormant), past the seal window.
WAITS_S = (1, 61, 61, 3600, 2 * 86400)


def projector(*, dormant: bool) -> Projector:
    return Projector(KafkaSettings("127.0.0.1:1", "t.", 1), "postgresql://unused",
                     schema="unused", seal_after_s=DAY.total_seconds(), snapshots=dormant)


def life(task_id: str, late: str) -> tuple[Stamper, list[Callable[[], Event]]]:
    """A task's events, each made when its time comes (`at` from the stamper's `now`)."""
    s = Stamper(task_id, tick=timedelta(0))
    news = {"confirmed": lambda: s.settled(1, Outcome.DONE, source=SettlementSource.WEBHOOK),
            "contradicted": lambda: s.settled(1, Outcome.NOT_DONE,
                                              source=SettlementSource.WEBHOOK),
            "requested again": s.requested}[late]
    return s, [s.started, lambda: s.intended(1), lambda: s.attempted(1, 1),
               lambda: s.settled(1, Outcome.DONE, attempt=1), s.finished, news]


def record(event: Event, offset: int) -> ConsumerRecord:
    value = record_value(event)
    key = record_key(event)
    return ConsumerRecord(topic="t.journal", partition=0, offset=offset, timestamp=0,
                          timestamp_type=0, key=key, value=value, checksum=None,
                          serialized_key_size=len(key), serialized_value_size=len(value),
                          headers=[])


def state_of(part: _Partition, task_id: str) -> TaskState | None:
    """The task's fold: folded, or its dormant events folded again (without waking it)."""
    if task_id in part.seals.dormant:
        history, _ = part.seals.dormant[task_id].decode()
        return fold([e for _, e in history])
    return part.states.get(task_id)


def assert_same(mine: _Partition, theirs: _Partition, task_ids: list[str]) -> None:
    assert mine.seals.sealed == theirs.seals.sealed
    assert mine.dirty == theirs.dirty
    assert mine.changed_at == theirs.changed_at
    assert mine.sealing == theirs.sealing
    assert not mine.seals.dormant.keys() & mine.states.keys()
    assert not mine.seals.dormant.keys() & mine.history.keys()
    assert mine.dirty <= mine.states.keys()  # the rows to write are of folds at hand
    for task_id in task_ids:
        assert state_of(mine, task_id) == theirs.states.get(task_id), task_id


# (move, argument, then a flush or not): mostly events (a task's next one: argument % TASKS),
# then waits (WAITS_S[argument % 5]) and re-syncs (argument: how far above what sealing
# dropped).
moves = st.lists(st.tuples(st.sampled_from(["event"] * 5 + ["wait"] * 2 + ["resync"]),
                           st.integers(0, 100), st.booleans()), min_size=10, max_size=80)


@pytest.fixture(autouse=True)
def _snapshots_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(snapshots.ENABLED_ENV, raising=False)


def assert_quiet_ones_dormant(part: _Partition, clock: datetime | None) -> None:
    """A folded task whose last event is its end, a minute or more before the clock (the `at`
    of the newest record folded), settled for good and with its row stored, is dormant."""
    for task_id, state in part.states.items():
        _, last = part.history[task_id][-1]
        assert not (isinstance(last, TaskFinished) and clock is not None
                    and last.at + timedelta(seconds=DORMANT_AFTER_S) <= clock
                    and settled_for_good(state) and task_id not in part.dirty), task_id


def restored(p: Projector, part: _Partition) -> _Partition:
    """A fresh tracker restored from an image of `part` (whose rows are stored)."""
    part.stored(part.position)
    image = snapshots.decode(snapshots.encode(p._image(part)))
    out = p._new_partition(0)
    asyncio.run(p._restore(out, image))
    out.written_to = part.written_to
    assert out.seals.dormant.keys() == part.seals.dormant.keys()
    return out


@settings(max_examples=300, deadline=None)
@given(moves, st.lists(st.sampled_from(LATE), min_size=TASKS, max_size=TASKS),
       st.none() | st.integers(0, 80))
def test_dormant_tasks_fold_seal_and_restore_as_if_kept_whole(
        script: list[tuple[str, int, bool]], late: list[str], restart_at: int | None,
) -> None:
    """`restart_at`: the move before which the projector with dormant tasks is restored from
    an image of itself (None, or past the script: only after it)."""
    mine_p, theirs_p = projector(dormant=True), projector(dormant=False)
    mine, theirs = mine_p._new_partition(0), theirs_p._new_partition(0)
    assert mine.quieting is not None
    assert theirs.quieting is None
    mine.written_to = theirs.written_to = 0
    task_ids = [f"dormant-{i}" for i in range(TASKS)]
    lives = [life(t, late[i]) for i, t in enumerate(task_ids)]
    clock, offset, folded_at = EPOCH, 0, None
    for i, (move, arg, flush) in enumerate(script):
        if i == restart_at:
            theirs.stored(theirs.position)
            mine = restored(mine_p, mine)
            assert_same(mine, theirs, task_ids)
        if move == "event":
            stamper, todo = lives[arg % TASKS]
            if todo:  # (else its life is over)
                stamper.now = clock
                event = todo.pop(0)()
                late_before = mine_p.late
                for p, part in ((mine_p, mine), (theirs_p, theirs)):
                    p._fold(part, [record(event, offset)])
                offset += 1
                if mine_p.late == late_before:  # folded: the clock moved (late news: not)
                    folded_at = event.at
        elif move == "wait":
            clock += timedelta(seconds=WAITS_S[arg % len(WAITS_S)])
        else:  # another writer moved the stored offset (above what sealing dropped, and
            # than a restore's image: below, the projector replays from zero)
            low = max(mine.dropped_to, theirs.dropped_to)
            stored = low + (mine.position - low) * arg // 100
            mine.resync(stored)
            theirs.resync(stored)
        if flush:
            mine.stored(mine.position)
            theirs.stored(theirs.position)
        assert_same(mine, theirs, task_ids)
        assert_quiet_ones_dormant(mine, folded_at)

    theirs.stored(theirs.position)
    assert_same(restored(mine_p, mine), theirs, task_ids)


@dataclass
class OneTask:
    """A projector's partition that folded one task's life, over for good (`done`), at EPOCH;
    `clock` stamps another task's records, to move the journal's clock."""

    p: Projector
    part: _Partition
    task: Stamper
    clock: Stamper
    done: list[Event]

    def later(self, seconds: float) -> None:
        """Another task starts `seconds` after the task's end (its record comes next)."""
        self.clock.now = self.task.now + timedelta(seconds=seconds)
        self.p._fold(self.part, [record(self.clock.started(), self.part.position)])


def one_task(task_id: str) -> OneTask:
    p = projector(dormant=True)
    part = p._new_partition(0)
    part.written_to = 0
    s = Stamper(task_id, now=EPOCH, tick=timedelta(seconds=1))
    done = [s.started(), s.intended(1), s.attempted(1, 1),
            s.settled(1, Outcome.DONE, attempt=1), s.finished()]
    p._fold(part, [record(e, i) for i, e in enumerate(done)])
    return OneTask(p, part, s, Stamper("dormant-clock"), done)


def test_a_task_over_for_good_goes_dormant_a_minute_after_it_ended_and_wakes_on_news() -> None:
    t = one_task("dormant-one")
    part = t.part
    t.later(61)
    assert "dormant-one" in part.states  # its row is not stored yet
    part.stored(part.position)
    assert "dormant-one" in part.seals.dormant
    assert "dormant-one" not in part.states
    assert "dormant-one" not in part.history
    # Its events as bytes, and not its attempts' keys: only the followers' fence needs them.
    assert part.seals.dormant["dormant-one"].first_attempts == ()

    t.task.now = t.clock.now
    news = t.task.settled(1, Outcome.NOT_DONE, source=SettlementSource.WEBHOOK)
    t.p._fold(part, [record(news, part.position)])
    assert "dormant-one" not in part.seals.dormant
    assert part.states["dormant-one"] == fold([*t.done, news])
    assert part.states["dormant-one"].needs_attention
    assert "dormant-one" in part.dirty  # its row is written again


def test_a_task_that_ended_just_before_the_image_goes_dormant_after_the_restore() -> None:
    t = one_task("dormant-late")
    t.part.stored(t.part.position)  # an image is of stored rows; the task ended a moment ago
    t.part = restored(t.p, t.part)
    assert "dormant-late" in t.part.states

    t.later(61)
    assert "dormant-late" in t.part.seals.dormant  # the restored queue took it on
    assert "dormant-late" not in t.part.states


def test_a_re_sync_below_a_dormant_task_folds_it_again_and_it_goes_dormant_once_written(
) -> None:
    t = one_task("dormant-resync")
    part = t.part
    part.stored(part.position)
    t.later(61)
    assert "dormant-resync" in part.seals.dormant

    part.resync(0)  # another writer moved the stored offset back: its row is written again
    assert part.states["dormant-resync"] == fold(t.done)
    assert "dormant-resync" in part.dirty
    part.stored(part.position)
    assert "dormant-resync" in part.seals.dormant
