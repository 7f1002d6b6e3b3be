"""The projector restores each journal partition from its snapshot and reads only the journal
after it: the rows it writes are those a replay from zero writes, and a snapshot it cannot use
(corrupt, or ahead of the offset PostgreSQL holds) is passed over for a replay from zero.

The journal is the sealing tests' story (`test_projector_sealing`: one partition, the clock
from the events' `at`) and more: a task that ended recently (in the ended queue of the image,
sealed by the tail), late news of sealed tasks, a task started in the tail. Snapshots are due
after every batch with news (`HALFWAY_SNAPSHOT_EVERY_S=0`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import asyncpg
import pytest
from aiokafka import TopicPartition

from halfway import settings as env
from halfway.contract import Event, Outcome, SettlementSource
from halfway.contract.topics import JOURNAL
from halfway.core.fold import fold
from halfway.journal import JournalWriter, snapshots
from halfway.projector import store
from halfway.projector.rebuild import compare, rebuild
from halfway.projector.rows import TABLES
from halfway.projector.service import Projector, journal_end_offsets
from halfway.settings import KafkaSettings
from tests.factories import EPOCH, Stamper
from tests.test_projector import (  # noqa: F401  (the projector tests' fixtures)
    assert_equals_replay,
    histories,
    journal,
    projecting,
    task_alive,
    until,
    write_all,
)
from tests.test_projector_sealing import (
    DAY,
    LATER,
    Story,
    append,
    assert_rows,
    held,
    one_partition_ids,
    project_to_end,
    projector,
    sealed,
    story,
)
from tests.test_snapshots import _commit

pytestmark = pytest.mark.broker


@pytest.fixture(autouse=True)
def _snapshot_after_every_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(snapshots.EVERY_S_ENV, "0")
    monkeypatch.delenv("HALFWAY_SNAPSHOTS", raising=False)


@dataclass
class Journal:
    """The story, a task `recent` that ended at the clock's time, and what comes after the
    snapshot (`tail`)."""

    story: Story
    recent: list[Event]
    tail: list[Event]

    @property
    def partition(self) -> int:
        return self.story.partition

    @property
    def head(self) -> list[Event]:
        s = self.story
        return [*s.done, *s.stuck, *s.clock, *self.recent]

    @property
    def recent_id(self) -> str:
        return self.recent[0].task_id


def journal_with_a_tail() -> Journal:
    s = story()
    _, (recent, fresh) = one_partition_ids("recent", "fresh", partition=s.partition)
    r = Stamper(recent, now=LATER)
    far = LATER + 3 * DAY  # a day past `recent`'s end and more: the tail seals it
    tail = [
        s.late_done(),  # `done` was sealed before the image: not folded
        s.late_stuck(),  # `stuck` needs attention: folded
        Stamper(fresh, now=LATER + timedelta(hours=1)).started(),  # open
        Stamper(s.clock[0].task_id, now=far).attempted(1, 1),  # the clock, three days on
        Stamper(recent, now=far + timedelta(hours=1)).settled(  # late: `recent` is sealed
            1, Outcome.NOT_DONE, source=SettlementSource.WEBHOOK),
    ]
    return Journal(s, [r.started(), r.intended(1), r.attempted(1, 1),
                       r.settled(1, Outcome.DONE, attempt=1), r.finished()], tail)


async def snapshotted(journal: KafkaSettings, pg: asyncpg.Connection,  # noqa: F811
                      schema: str, events: list[Event], partition: int) -> int:
    """Project `events` (appended now) with a first projector, until it committed a snapshot
    of the partition at its end; that offset."""
    async with JournalWriter(journal) as writer:
        await append(writer, events, partition)
    p = projector(journal, schema)
    end = (await journal_end_offsets(journal))[partition]
    async with projecting(journal, schema, p) as task:
        await project_to_end(pg, schema, journal, p, task_alive(task))

        async def written() -> bool:
            return p.snapshots_written.get(partition) == end

        await until(written, "a snapshot of the partition at its end was written",
                    task_alive(task))
    return end


async def assert_rows_of_a_replay_from_zero(journal: KafkaSettings,  # noqa: F811
                                            pg: asyncpg.Connection, schema: str,
                                            late: int) -> None:
    """The schema's rows are those a projector without snapshots writes into an empty read
    model (its own schema and group), which passes `late` events of sealed tasks; and those
    `rebuild` writes."""
    live = await store.snapshot(pg, schema)
    name = f"{schema}_zero"
    try:
        zero = Projector(journal, env.pg_dsn(), schema=name,
                         group=f"{journal.topic_prefix}projector-zero",
                         seal_after_s=DAY.total_seconds(), snapshots=False)
        async with projecting(journal, name, zero) as task:
            await project_to_end(pg, name, journal, zero, task_alive(task))
        assert zero.late == late
        assert zero.restored == {}
        differences = compare(live, await store.snapshot(pg, name))
        assert not differences, [d.line() for d in differences] + [
            e for d in differences for e in d.examples]
    finally:
        await store.drop_schema(pg, name)
    report = await rebuild(journal, env.pg_dsn(), check_only=True, live=schema,
                           seal_after_s=DAY.total_seconds())
    assert report.equal, "\n".join(report.lines())


async def restart(journal: KafkaSettings, pg: asyncpg.Connection,  # noqa: F811
                  schema: str, tail: list[Event], partition: int) -> Projector:
    """Append `tail`, then run a second projector (same group) until it stored the end."""
    async with JournalWriter(journal) as writer:
        await append(writer, tail, partition)
    p = projector(journal, schema)
    async with projecting(journal, schema, p) as task:
        await project_to_end(pg, schema, journal, p, task_alive(task))
    return p


async def assert_restart_replays_from_zero(journal: KafkaSettings,  # noqa: F811
                                           pg: asyncpg.Connection, schema: str,
                                           j: Journal) -> None:
    """A restart after `j.tail` uses no snapshot: it folds the whole journal, and writes the
    rows of a replay from zero."""
    p = await restart(journal, pg, schema, j.tail, j.partition)
    assert p.restored == {}
    assert p.folded == len(j.head) + len(j.tail)  # from zero
    await assert_rows_of_a_replay_from_zero(journal, pg, schema, late=2)


async def test_snapshot_and_tail_write_the_rows_a_replay_from_zero_writes(
        journal: KafkaSettings, pg: asyncpg.Connection, schema: str,  # noqa: F811
) -> None:
    j = journal_with_a_tail()
    s = j.story
    at = await snapshotted(journal, pg, schema, j.head, j.partition)

    # The image holds live work: the records of the tasks not sealed (open, needing attention,
    # ended within the seal window), the sealed one as a digest, the ended one queued.
    tp = TopicPartition(JOURNAL.name(journal.topic_prefix), j.partition)
    image = (await snapshots.load(journal, f"{journal.topic_prefix}projector", [tp]))[
        j.partition]
    assert image.journal_next == at
    assert {e.task_id for _, e in image.events} == {s.stuck_id, s.clock[0].task_id, j.recent_id}
    assert len(image.sealed) == 8  # `done`
    assert [task_id for _, task_id in image.ended] == [j.recent_id]

    p = await restart(journal, pg, schema, j.tail, j.partition)
    assert p.restored == {j.partition: at}
    assert p.folded == len(j.tail)  # the tail only
    assert p.late == 2  # `done`'s and `recent`'s late news
    assert sealed(p, j.recent_id)  # by the restored queue of ended tasks
    assert not held(p, j.recent_id)
    assert not held(p, s.done_id)
    await assert_rows_of_a_replay_from_zero(journal, pg, schema, late=2)


async def test_a_restart_restores_every_partition_and_reads_only_what_came_after(
        journal: KafkaSettings, pg: asyncpg.Connection, schema: str,  # noqa: F811
) -> None:
    first = projector(journal, schema)
    async with JournalWriter(journal) as writer:
        await write_all(writer, histories("head", 300))
        async with projecting(journal, schema, first) as task:
            await project_to_end(pg, schema, journal, first, task_alive(task))
            head = {n: e for n, e in (await journal_end_offsets(journal)).items() if e}

            async def written() -> bool:
                return all(first.snapshots_written.get(n) == e for n, e in head.items())

            await until(written, "every partition's snapshot at its end", task_alive(task))
        await write_all(writer, histories("tail", 60))
    second = projector(journal, schema)
    async with projecting(journal, schema, second) as task:
        await project_to_end(pg, schema, journal, second, task_alive(task))
    ends = await journal_end_offsets(journal)
    assert second.restored == head
    assert second.folded == sum(ends.values()) - sum(head.values()) == 60
    await assert_equals_replay(pg, schema, journal)


@pytest.mark.parametrize("damage", ["digest", "garbage"])
async def test_a_corrupt_snapshot_is_passed_over_for_a_replay_from_zero(
        journal: KafkaSettings, pg: asyncpg.Connection, schema: str,  # noqa: F811
        damage: str) -> None:
    j = journal_with_a_tail()
    at = await snapshotted(journal, pg, schema, j.head, j.partition)
    group = f"{journal.topic_prefix}projector"
    tp = TopicPartition(JOURNAL.name(journal.topic_prefix), j.partition)
    if damage == "digest":  # the chunks are not what the pointer says
        (offset, metadata), = (await snapshots.pointers(journal, group, [tp])).values()
        assert offset == at
        real = snapshots.Pointer.parse(metadata)
        forged = snapshots.Pointer(real.snapshot_id, real.topic_partition, real.first_offset,
                                   real.chunks, real.size, "0" * 64)
    else:  # chunks that are not an image, whose digest matches
        async with JournalWriter(journal) as writer:
            forged = await snapshots.write(
                writer, group, snapshots.Image(j.partition, at, None), b"not an image")
    await _commit(journal, group, tp, at, forged.metadata())

    await assert_restart_replays_from_zero(journal, pg, schema, j)


async def test_a_snapshot_ahead_of_the_stored_offset_is_passed_over_for_a_replay_from_zero(
        journal: KafkaSettings, pg: asyncpg.Connection, schema: str,  # noqa: F811
) -> None:
    """PostgreSQL went back (restored from a backup) to before the snapshot: tasks sealed
    before the image may need their rows again, which only a replay from zero writes."""
    j = journal_with_a_tail()
    s = j.story
    at = await snapshotted(journal, pg, schema, j.head, j.partition)
    back = len(s.done)  # just after `done`'s end: the rows of every other task are lost
    assert back < at
    async with pg.transaction():
        await pg.execute(f"update {schema}.applied_offsets set next_offset = $1 "
                         "where topic = $2 and partition = $3",
                         back, JOURNAL.name(journal.topic_prefix), j.partition)
        for table in TABLES:
            await pg.execute(f"delete from {schema}.{table} where "
                             + ("task_id" if table in ("tasks", "steps", "compensations")
                                else "split_part(step_id, ':', 1)")
                             + " <> $1", s.done_id)

    await assert_restart_replays_from_zero(journal, pg, schema, j)


async def test_tasks_dormant_in_the_snapshot_are_restored_unfolded_and_folded_again_on_news(
        journal: KafkaSettings, pg: asyncpg.Connection, schema: str,  # noqa: F811
) -> None:
    """Tasks over for good a minute before the clock are kept (and imaged) as their events'
    bytes: the restore folds none of them; news of one folds it again, and the tail seals the
    other straight from its bytes. The rows are a replay from zero's."""
    number, (quiet, woken, clock) = one_partition_ids("quiet", "woken", "clock")
    q, w = Stamper(quiet, now=EPOCH), Stamper(woken, now=EPOCH)
    c = Stamper(clock, now=EPOCH + timedelta(minutes=5))

    def life(s: Stamper) -> list[Event]:
        return [s.started(), s.intended(1), s.attempted(1, 1),
                s.settled(1, Outcome.DONE, attempt=1), s.finished()]

    woken_head = life(w)
    head = [*life(q), *woken_head, c.started()]
    at = await snapshotted(journal, pg, schema, head, number)
    tp = TopicPartition(JOURNAL.name(journal.topic_prefix), number)
    image = (await snapshots.load(journal, f"{journal.topic_prefix}projector", [tp]))[number]
    assert image.journal_next == at
    assert {d.task_id for d in image.dormant} == {quiet, woken}
    assert {e.task_id for _, e in image.events} == {clock}

    w.now = EPOCH + timedelta(minutes=10)
    news = w.settled(1, Outcome.NOT_DONE, source=SettlementSource.WEBHOOK)  # contradicts
    c.now = EPOCH + 3 * DAY
    p = await restart(journal, pg, schema, [news, c.intended(1)], number)
    assert p.restored == {number: at}
    assert p.folded == 2
    part = p._partitions[number]
    assert sealed(p, quiet)  # from its bytes: never folded here
    assert not held(p, quiet)
    assert part.states[woken] == fold([*woken_head, news])  # folded again, news and all
    assert part.states[woken].needs_attention
    await assert_rows(pg, schema, woken, [*woken_head, news])
    await assert_rows_of_a_replay_from_zero(journal, pg, schema, late=0)
