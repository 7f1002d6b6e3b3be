"""Rebuild the read model from the journal, compare it with the live one, and swap them.

The journal is read from offset zero up to the end offsets it has when the rebuild starts, folded,
and written into a fresh schema (`{live}_rebuild`) whose `applied_offsets` are those ends. The
rebuilt copy is then compared with the live one row for row (every table, `applied_offsets`
included: a live projector that is behind or ahead shows there). Unless `check_only`, the
rebuilt schema replaces the live one in one transaction (live -> `{live}_old`, dropped;
rebuild -> live); a projector running meanwhile notices that the offsets moved and writes again
from the rebuilt ones (see `service`). With `check_only` the rebuilt schema is dropped after the
comparison: the report holds the differences.

Tasks are sealed as the live projector seals them (`service.Sealing`, with the same
`seal_after_s`), so late events of a sealed task are not folded here either, and the rows are
the live ones. A sealed task's rows are written as it is sealed and its fold dropped: memory
follows live work here too.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from halfway.contract.topics import JOURNAL
from halfway.core.fold import TaskState
from halfway.journal import read_topic
from halfway.journal.admin import cluster_id
from halfway.projector import store
from halfway.projector.rows import Row
from halfway.projector.service import FROM_ENV, FromEnv, Sealing, journal_end_offsets, seal_after
from halfway.settings import KafkaSettings

Progress = Callable[[int, int], None]  # (records read, records to read)
Write = Callable[[list[TaskState]], Awaitable[None]]
PROGRESS_EVERY_EVENTS = 1000
WRITE_TASKS_MAX = 1000  # tasks per COPY batch into the rebuilt schema (sealed ones too)
EXAMPLES_MAX = 5  # differing rows shown per table
EXAMPLE_CHARS_MAX = 400
REBUILT_SUFFIX = "_rebuild"
OLD_SUFFIX = "_old"


def schemas_of(live: str) -> tuple[str, str]:
    """(the rebuilt schema, the old one) beside `live`; ValueError if one is not a plain name
    (a live name near the 63-byte limit leaves no room for the suffixes)."""
    store.checked(live)
    return store.checked(live + REBUILT_SUFFIX), store.checked(live + OLD_SUFFIX)


@dataclass
class TableDiff:
    table: str
    live_rows: int
    rebuilt_rows: int
    only_live: int = 0
    only_rebuilt: int = 0
    changed: int = 0
    examples: list[str] = field(default_factory=list)  # the first few differences, in words

    def line(self) -> str:
        return (f"{self.table}: live {self.live_rows} rows, rebuilt {self.rebuilt_rows}; "
                f"{self.only_live} only live, {self.only_rebuilt} only rebuilt, "
                f"{self.changed} differ")


@dataclass
class RebuildReport:
    live: str
    rebuilt: str
    events: int
    tasks: int
    invalid: int
    end_offsets: dict[int, int]
    build_s: float  # read, fold and write
    events_per_s: float
    live_existed: bool
    differences: list[TableDiff]
    swapped: bool

    @property
    def equal(self) -> bool:
        return not self.differences

    @property
    def matches_live(self) -> bool:
        """A check's answer: the live copy exists and equals the rebuilt one (a live schema
        that is missing equals nothing, though an empty journal rebuilds no rows)."""
        return self.live_existed and self.equal

    def lines(self) -> list[str]:
        out = [f"rebuilt {self.tasks} tasks from {self.events} events ({self.invalid} invalid "
               f"skipped) in {self.build_s:.2f} s: {self.events_per_s:,.0f} events/s"]
        if not self.live_existed:
            out.append(f"no live schema {self.live} to compare with" + (
                "" if self.swapped else ": the read model does not exist (is the projector "
                "running, halfway run projector? HALFWAY_PG_SCHEMA names it)"))
        elif self.equal:
            out.append(f"the rebuilt copy equals {self.live}, row for row")
        else:
            out.append(f"the rebuilt copy differs from {self.live}:")
            for diff in self.differences:
                out.append(f"  {diff.line()}")
                out.extend(f"    {example}" for example in diff.examples)
        out.append(f"swapped: {self.rebuilt} is now {self.live}" if self.swapped
                   else f"not swapped ({self.rebuilt} dropped)")
        return out


async def rebuild(settings: KafkaSettings, dsn: str, *, progress: Progress | None = None,
                  check_only: bool = False, live: str = "halfway",
                  seal_after_s: float | FromEnv | None = FROM_ENV) -> RebuildReport:
    """Replay the journal into `{live}_rebuild`, compare with `live`, swap unless check_only.
    `seal_after_s` must be the live projector's (by default both read HALFWAY_SEAL_AFTER_S)."""
    rebuilt, old = schemas_of(live)
    conn = await store.connect(dsn)
    try:
        await store.drop_schema(conn, rebuilt)  # a fresh copy: nothing of an earlier try
        await store.migrate(conn, rebuilt)
        await store.claim_source(conn, rebuilt, await cluster_id(settings),
                                 JOURNAL.name(settings.topic_prefix))
        started = time.monotonic()

        async def write_sealed(chunk: list[TaskState]) -> None:
            await store.apply_batch(conn, rebuilt, chunk, {})

        states, ends, events, invalid, sealed = await _fold_journal(
            settings, progress, seal_after(seal_after_s), write_sealed)
        topic = JOURNAL.name(settings.topic_prefix)
        chunk: list[TaskState] = []
        for state in states.values():
            chunk.append(state)
            if len(chunk) >= WRITE_TASKS_MAX:
                await store.apply_batch(conn, rebuilt, chunk, {})
                chunk = []
        # Only partitions with records, as the projector writes them (an empty partition has
        # nothing applied, and no row).
        await store.apply_batch(conn, rebuilt, chunk,
                                {(topic, p): offset for p, offset in ends.items() if offset})
        build_s = time.monotonic() - started
        live_existed = await store.schema_exists(conn, store.checked(live))
        current = await store.snapshot(conn, live) if live_existed else {}
        differences = compare(current, await store.snapshot(conn, rebuilt))
        if check_only:
            await store.drop_schema(conn, rebuilt)
        else:
            await store.swap(conn, live=live, rebuilt=rebuilt, old=old)
    finally:
        await conn.close()
    return RebuildReport(
        live=live, rebuilt=rebuilt, events=events, tasks=len(states) + sealed, invalid=invalid,
        end_offsets=ends, build_s=build_s, events_per_s=events / build_s if build_s else 0.0,
        live_existed=live_existed, differences=differences, swapped=not check_only)


async def _fold_journal(settings: KafkaSettings, progress: Progress | None,
                        after: timedelta | None, write_sealed: Write,
                        ) -> tuple[dict[str, TaskState], dict[int, int], int, int, int]:
    """(states of the tasks not sealed, end offsets, events read, invalid records, tasks
    sealed) of the journal up to its ends now. Sealed tasks go to `write_sealed`, in chunks."""
    # The ends are taken first, and records at or past them skipped: the rebuilt offsets then
    # say exactly what the rows contain, even while writers go on appending.
    ends = await journal_end_offsets(settings)
    total = sum(ends.values())
    invalid_seen: list[tuple[int, int, str]] = []
    states: dict[str, TaskState] = {}
    seals: dict[int, Sealing] = {}  # by partition
    sealed: list[TaskState] = []  # to write: at most WRITE_TASKS_MAX
    sealed_total = 0
    events = 0
    async for delivery in read_topic(settings, JOURNAL, invalid_seen):
        if delivery.offset >= ends.get(delivery.partition, 0):
            continue
        events += 1
        if progress is not None and events % PROGRESS_EVERY_EVENTS == 0:
            progress(events + len(invalid_seen), total)
        sealing = seals.get(delivery.partition)
        if sealing is None:
            sealing = seals[delivery.partition] = Sealing(delivery.partition, after)
        _, now_sealed = sealing.fold(states, delivery.event)  # (late news: not folded)
        for task_id in now_sealed:
            sealed.append(states.pop(task_id))
            sealed_total += 1
            if len(sealed) >= WRITE_TASKS_MAX:
                await write_sealed(sealed)
                sealed = []
    if sealed:
        await write_sealed(sealed)
    invalid = sum(1 for p, offset, _ in invalid_seen if offset < ends.get(p, 0))
    if progress is not None:
        progress(events + invalid, total)
    return states, ends, events, invalid, sealed_total


def compare(live: dict[str, list[Row]], rebuilt: dict[str, list[Row]],
            examples_max: int = EXAMPLES_MAX) -> list[TableDiff]:
    """The tables whose rows differ between two snapshots (a missing table has no rows)."""
    out = []
    for table in sorted(set(live) | set(rebuilt)):
        key = store.SNAPSHOT_KEYS[table]
        mine = {_key(row, key): row for row in live.get(table, [])}
        theirs = {_key(row, key): row for row in rebuilt.get(table, [])}
        diff = TableDiff(table, len(mine), len(theirs))
        for k in sorted(set(mine) | set(theirs)):
            a, b = mine.get(k), theirs.get(k)
            if a == b:
                continue
            if b is None:
                diff.only_live += 1
                what = f"only live {k}: {a}"
            elif a is None:
                diff.only_rebuilt += 1
                what = f"only rebuilt {k}: {b}"
            else:
                diff.changed += 1
                changes = {c: (a.get(c), b.get(c)) for c in sorted(set(a) | set(b))
                           if a.get(c) != b.get(c)}
                what = f"{k} differs (live, rebuilt): {changes}"
            if len(diff.examples) < examples_max:
                diff.examples.append(what[:EXAMPLE_CHARS_MAX])
        if diff.only_live or diff.only_rebuilt or diff.changed:
            out.append(diff)
    return out


def _key(row: Row, key: tuple[str, ...]) -> tuple[Any, ...]:
    return tuple(row[c] for c in key)
