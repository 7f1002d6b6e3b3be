"""The projector seals tasks as the services do (`Sealing`: the follower's rule, by the
journal's clock): a task over for good a day before its partition's newest record keeps no
fold in memory once its row is stored, its late events change no row, and a replay from zero
or a rebuild writes exactly the rows the live projector wrote. A task that needs attention is
never sealed.

Every journal here is one partition's: the clock is per partition. Times come from the events
(`at`), two days apart, never from the machine's clock.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import asyncpg
import pytest

from halfway import settings as env
from halfway.contract import Event, FinalState, Outcome, SettlementSource
from halfway.contract.topics import JOURNAL
from halfway.core.fold import StepStatus, fold
from halfway.journal import JournalWriter
from halfway.journal.records import partition_of
from halfway.projector import store
from halfway.projector.rebuild import compare, rebuild
from halfway.projector.rows import TABLES, Row, rows_of
from halfway.projector.service import Projector, journal_end_offsets
from halfway.settings import KafkaSettings
from tests.factories import EPOCH, Stamper
from tests.test_projector import (  # noqa: F401  (the projector tests' fixtures)
    journal,
    projecting,
    task_alive,
    until,
    until_applied,
)

pytestmark = pytest.mark.broker

DAY = timedelta(days=1)
LATER = EPOCH + 2 * DAY  # the clock task's time: a day past the others' ends and more


@dataclass
class Story:
    """Three tasks of one partition: `done` over for good, `stuck` over with its step settled
    but needing attention (two reports contradict each other), both at EPOCH; and `clock`, in
    flight two days later: its records move the partition's clock a day past both ends."""

    partition: int
    done: list[Event]
    stuck: list[Event]
    clock: list[Event]

    @property
    def done_id(self) -> str:
        return self.done[0].task_id

    @property
    def stuck_id(self) -> str:
        return self.stuck[0].task_id

    def late_done(self) -> Event:
        """News of `done` after it was sealed: a webhook contradicting its outcome."""
        return Stamper(self.done_id, now=LATER + timedelta(hours=1)).settled(
            1, Outcome.NOT_DONE, source=SettlementSource.WEBHOOK)

    def late_stuck(self) -> Event:
        """An operator settles the contradiction `stuck` waited on."""
        return Stamper(self.stuck_id, now=LATER + timedelta(hours=1)).settled(
            1, Outcome.DONE, source=SettlementSource.OPERATOR, evidence={"charge_id": "ch_9"})


def one_partition_ids(*names: str, partition: int | None = None) -> tuple[int, list[str]]:
    """Task ids, one per name, that the journal's partitioner puts in one partition (that of
    the first, unless `partition` says)."""
    tag = uuid.uuid4().hex[:8]
    ids: list[str] = []
    first: int | None = partition
    for name in names:
        for i in range(10_000):
            task_id = f"seal-{name}-{tag}-{i}"
            number = partition_of(task_id.encode(), JOURNAL.partitions)
            if first is None or number == first:
                first = number
                ids.append(task_id)
                break
    assert first is not None
    assert len(ids) == len(names)
    return first, ids


def story() -> Story:
    number, (done, stuck, clock) = one_partition_ids("done", "stuck", "clock")
    d, s, c = Stamper(done, now=EPOCH), Stamper(stuck, now=EPOCH), Stamper(clock, now=LATER)
    return Story(
        number,
        done=[d.started(), d.intended(1), d.attempted(1, 1),
              d.settled(1, Outcome.DONE, attempt=1), d.finished()],
        stuck=[s.started(), s.intended(1), s.attempted(1, 1),
               s.settled(1, Outcome.DONE, attempt=1),
               s.settled(1, Outcome.NOT_DONE, source=SettlementSource.WEBHOOK),
               s.finished(FinalState.NEEDS_ATTENTION)],
        clock=[c.started(), c.intended(1)])


def projector(settings: KafkaSettings, name: str, group: str | None = None) -> Projector:
    return Projector(settings, env.pg_dsn(), schema=name, group=group,
                     seal_after_s=DAY.total_seconds())


async def append(writer: JournalWriter, events: list[Event], partition: int) -> list[int]:
    """Append in order; their offsets (all in `partition`)."""
    offsets = []
    for event in events:
        meta = await writer.append(event)
        assert meta.partition == partition, "the story's tasks must share a partition"
        offsets.append(meta.offset)
    return offsets


def rows_for(snap: dict[str, list[Row]], task_id: str) -> dict[str, list[Row]]:
    def ours(row: Row) -> bool:
        return row.get("task_id", str(row.get("step_id", "")).rsplit(":", 1)[0]) == task_id
    return {t: [r for r in snap[t] if ours(r)] for t in TABLES}


async def assert_rows(conn: asyncpg.Connection, name: str, task_id: str,
                      events: list[Event]) -> None:
    """The task's rows are exactly those of the fold of `events`."""
    found = rows_for(await store.snapshot(conn, name), task_id)
    assert found["tasks"], f"no row for {task_id}"
    differences = compare(found, rows_of(fold(events)))
    assert not differences, [d.line() for d in differences] + [
        e for d in differences for e in d.examples]


async def project_to_end(conn: asyncpg.Connection, name: str, settings: KafkaSettings,
                         p: Projector, alive: Callable[[], str | None]) -> None:
    """Until PostgreSQL holds the journal's end and `p` has taken note of it (its memory is
    past the batch that stored it)."""
    ends = await journal_end_offsets(settings)
    await until_applied(conn, name, settings, ends, alive)

    async def noted() -> bool:
        parts = p._partitions
        return all(n in parts and (parts[n].written_to or 0) >= e
                   for n, e in ends.items() if e)

    await until(noted, "the projector noted the stored offsets", alive)


def held(p: Projector, task_id: str) -> bool:
    """Whether the projector keeps anything of the task's fold."""
    return any(task_id in part.states or task_id in part.changed_at
               for part in p._partitions.values())


def sealed(p: Projector, task_id: str) -> bool:
    return any(part.seals.has(task_id) for part in p._partitions.values())


async def test_a_task_over_for_good_a_day_before_the_clock_is_dropped_once_written(
        journal: KafkaSettings, pg: asyncpg.Connection, schema: str,  # noqa: F811
) -> None:
    s = story()
    async with JournalWriter(journal) as writer:
        # All before the projector starts: `done` is sealed in the batch that first writes its
        # row, so its fold must outlive the seal until that batch is stored.
        await append(writer, s.done + s.stuck + s.clock, s.partition)
    p = projector(journal, schema)
    async with projecting(journal, schema, p) as task:
        await project_to_end(pg, schema, journal, p, task_alive(task))
        assert not held(p, s.done_id), "a sealed task's fold is kept"
        assert sealed(p, s.done_id)
        assert held(p, s.stuck_id)
        assert not sealed(p, s.stuck_id)
        assert held(p, s.clock[0].task_id)  # in flight
    await assert_rows(pg, schema, s.done_id, s.done)  # its row is the whole fold's


async def test_a_late_event_of_a_sealed_task_changes_no_row(
        journal: KafkaSettings, pg: asyncpg.Connection, schema: str,  # noqa: F811
) -> None:
    s = story()
    late = s.late_done()
    assert rows_of(fold([*s.done, late])) != rows_of(fold(s.done))  # it would, if folded
    p = projector(journal, schema)
    async with JournalWriter(journal) as writer, projecting(journal, schema, p) as task:
        await append(writer, s.done + s.stuck + s.clock, s.partition)
        await project_to_end(pg, schema, journal, p, task_alive(task))
        assert sealed(p, s.done_id)
        await append(writer, [late], s.partition)  # while it runs
        await project_to_end(pg, schema, journal, p, task_alive(task))
        assert p.late == 1
        assert not held(p, s.done_id)
    await assert_rows(pg, schema, s.done_id, s.done)


async def test_a_replay_from_zero_and_a_rebuild_write_the_live_rows(
        journal: KafkaSettings, pg: asyncpg.Connection, schema: str,  # noqa: F811
) -> None:
    s = story()
    async with JournalWriter(journal) as writer:
        first = projector(journal, schema)
        async with projecting(journal, schema, first) as task:
            await append(writer, s.done + s.stuck, s.partition)
            await project_to_end(pg, schema, journal, first, task_alive(task))
            clock_at = (await append(writer, s.clock, s.partition))[0]
            await append(writer, [s.late_done(), s.late_stuck()], s.partition)
            await project_to_end(pg, schema, journal, first, task_alive(task))
            assert first.late == 1  # `done`'s; `stuck` is not sealed: its news is folded
    live = await store.snapshot(pg, schema)
    await assert_rows(pg, schema, s.done_id, s.done)
    await assert_rows(pg, schema, s.stuck_id, [*s.stuck, s.late_stuck()])

    # A fresh projector into an empty read model replays from zero and writes every row.
    fresh_schema = f"{schema}_b"
    try:
        fresh = projector(journal, fresh_schema, group=f"{journal.topic_prefix}projector-b")
        async with projecting(journal, fresh_schema, fresh) as task:
            await project_to_end(pg, fresh_schema, journal, fresh, task_alive(task))
            assert not held(fresh, s.done_id)
            assert sealed(fresh, s.done_id)
        assert not compare(live, await store.snapshot(pg, fresh_schema))
    finally:
        await store.drop_schema(pg, fresh_schema)

    # Stored offsets between `done`'s end and its late news (the rows of tasks changed since
    # lost): the replay writes only from there, and the late news is not folded on the way.
    topic = JOURNAL.name(journal.topic_prefix)
    async with pg.transaction():
        await pg.execute(f"update {schema}.applied_offsets set next_offset = $1 "
                         "where topic = $2 and partition = $3", clock_at, topic, s.partition)
        await pg.execute(f"delete from {schema}.tasks where task_id <> $1", s.done_id)
    again = projector(journal, schema)
    async with projecting(journal, schema, again) as task:
        await project_to_end(pg, schema, journal, again, task_alive(task))
        assert not held(again, s.done_id)
        assert sealed(again, s.done_id)
        assert again.late == 1
    assert not compare(live, await store.snapshot(pg, schema))

    report = await rebuild(journal, env.pg_dsn(), check_only=True, live=schema,
                           seal_after_s=DAY.total_seconds())
    assert report.equal, "\n".join(report.lines())
    assert report.tasks == 3


async def test_a_task_that_needs_attention_is_never_sealed(
        journal: KafkaSettings, pg: asyncpg.Connection, schema: str,  # noqa: F811
) -> None:
    s = story()
    state = fold(s.stuck)
    assert state.needs_attention  # and nothing else open: that alone keeps it whole
    assert all(step.status in (StepStatus.DONE, StepStatus.NOT_DONE)
               for step in state.steps.values())
    resolved = s.late_stuck()
    assert rows_of(fold([*s.stuck, resolved])) != rows_of(state)
    far = Stamper(s.clock[0].task_id, now=LATER + 30 * DAY)  # the clock a month on
    p = projector(journal, schema)
    async with JournalWriter(journal) as writer, projecting(journal, schema, p) as task:
        await append(writer, [*s.done, *s.stuck, *s.clock, far.attempted(1, 1)], s.partition)
        await project_to_end(pg, schema, journal, p, task_alive(task))
        assert sealed(p, s.done_id)  # the clock did pass a day after both ended
        assert held(p, s.stuck_id)
        assert not sealed(p, s.stuck_id)
        # Its news is folded: the operator's settlement shows on its row.
        await append(writer, [resolved], s.partition)
        await project_to_end(pg, schema, journal, p, task_alive(task))
        assert p.late == 0
    await assert_rows(pg, schema, s.stuck_id, [*s.stuck, resolved])


async def test_a_lagging_rebuild_under_a_dropped_task_replays_its_partition(
        journal: KafkaSettings, pg: asyncpg.Connection, schema: str,  # noqa: F811
) -> None:
    """Offsets moved back below a sealed task's last event (as a rebuild that lags the
    projector leaves them), with its rows gone: only a replay from zero can write them again."""
    s = story()
    p = projector(journal, schema)
    async with JournalWriter(journal) as writer, projecting(journal, schema, p) as task:
        await append(writer, s.done + s.stuck + s.clock, s.partition)
        await project_to_end(pg, schema, journal, p, task_alive(task))
        assert not held(p, s.done_id)
        async with pg.transaction():
            await pg.execute(f"update {schema}.applied_offsets set next_offset = 0")
            for table in TABLES:
                await pg.execute(f"delete from {schema}.{table}")
        await append(writer, [s.late_done()], s.partition)
        await project_to_end(pg, schema, journal, p, task_alive(task))
        assert not held(p, s.done_id)
        assert sealed(p, s.done_id)
    await assert_rows(pg, schema, s.done_id, s.done)
    await assert_rows(pg, schema, s.stuck_id, s.stuck)
    report = await rebuild(journal, env.pg_dsn(), check_only=True, live=schema,
                           seal_after_s=DAY.total_seconds())
    assert report.equal, "\n".join(report.lines())
