"""The projector: folds the journal into the PostgreSQL read model, at least once, idempotently.

Theory of operation
-------------------
The projector is a member of the consumer group `{prefix}projector`, so several instances
share the journal's partitions. Kafka's committed offsets are never used: the offsets that
count are in PostgreSQL (`applied_offsets`), written in the same transaction as the rows.

On assignment a partition is replayed from offset zero, because a row is a function of a
task's whole fold and the fold lives only in memory. Rows are written only for tasks with an
event at or after the partition's stored offset (`written_to`); the replay below it rebuilds
the fold without writing. Records are applied in batches (at most about BATCH_EVENTS_MAX
events) and every batch commits its tasks' rows and the partitions' new offsets together, so a
kill -9 at any point leaves PostgreSQL at a batch boundary, and the next instance resumes there.
Rewriting a row is harmless (a row is a pure function of the fold), so redelivery is too.

Each batch states the offsets it expects to be stored; if another writer moved them (a zombie
that lost the partition, a rebuild swapped in), the batch is refused whole, the partition is
re-synced from what is stored, and every task changed since then is written again.

A record that is not an event (any kind, any size) never stops the projector: it is folded as
nothing, and dead-lettered (`halfway.journal.deadletters`) the first time the projector passes
it, before the batch that stores an offset beyond it; a replay below the stored offset skips
it quietly. The consumer fetches any record the broker accepts (`halfway.journal.limits`).

Memory follows live work: tasks are sealed as the services seal them (`Sealing`, the
follower's rule, by the journal's clock: the same records seal the same tasks live, on a
replay and in a rebuild). A sealed task's fold is dropped once its row is stored, and only an
8-byte digest kept; its late events are not folded (the row stays as it was; logged, the first
time past them) and do not move the clock. A re-sync below the offset of a dropped task's last
event (a lagging rebuild swapped in) cannot write that row again: the partition is replayed from
zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import MutableMapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta

import asyncpg
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import IllegalStateError
from aiokafka.structs import ConsumerRecord

from halfway import log
from halfway import settings as env
from halfway.contract import Event, TaskRequested
from halfway.contract.topics import DEAD_LETTERS, JOURNAL
from halfway.core.fold import TaskState, TaskStatus, apply
from halfway.journal.admin import cluster_id, ensure_topics_once_up, topic_partitions
from halfway.journal.deadletters import DeadLetters
from halfway.journal.follower import settled_for_good
from halfway.journal.limits import fetch_limits
from halfway.journal.records import InvalidRecord, decode
from halfway.journal.sealed import EndedTasks, SealedTasks
from halfway.journal.writer import JournalWriter
from halfway.projector import store
from halfway.settings import KafkaSettings

FETCH_TIMEOUT_MS = 200  # how long one fetch waits when the journal is quiet
FETCH_RECORDS_MAX = 500
# Events per PostgreSQL transaction while catching up: big enough to amortise the commit,
# small enough that a batch's tasks and its COPY stay cheap. A batch may exceed it by at most
# one fetch (FETCH_RECORDS_MAX).
BATCH_EVENTS_MAX = 2000
# When idle, compare the stored offsets with ours this often, so a rebuild swapped in under a
# quiet projector is noticed without waiting for the next event.
VERIFY_INTERVAL_S = 2.0
_ENDED = (TaskStatus.FINISHED, TaskStatus.REJECTED)


class FromEnv:
    """`seal_after_s` not given: HALFWAY_SEAL_AFTER_S (`settings.seal_after_s`)."""


FROM_ENV = FromEnv()


def seal_after(seal_after_s: float | FromEnv | None) -> timedelta | None:
    seconds = env.seal_after_s() if isinstance(seal_after_s, FromEnv) else seal_after_s
    return None if seconds is None else timedelta(seconds=seconds)


class Sealing:
    """One journal partition's sealing, by the follower's rule (`halfway.journal.follower`,
    `settled_for_good`): a task that ended with every effect settled `after` before the `at` of
    the partition's newest folded record is sealed, and its later events are not folded. It
    depends only on the records and their order: the live projector, its replays and a rebuild
    seal the same tasks at the same records."""

    def __init__(self, number: int, after: timedelta | None) -> None:
        self.number = number
        self.after = after  # None: never seal
        self.sealed = SealedTasks()  # this partition's only: 8 bytes a task
        self.ended = EndedTasks()  # those that ended within `after` of the clock: live work

    def has(self, task_id: str) -> bool:
        return self.sealed.has(self.number, task_id)

    def fold(self, states: MutableMapping[str, TaskState], event: Event,
             ) -> tuple[TaskState | None, list[TaskState]]:
        """Fold `event` into `states`, unless its task is sealed (late news: None). Also the
        states of the tasks sealed at this record: still in `states` (the caller drops them,
        once their rows are stored)."""
        task_id = event.task_id
        if self.has(task_id):
            if not isinstance(event, TaskRequested):
                return None, []  # nor does it move the clock, as in the follower
            after = None  # (the follower folds a request, to refuse a second start)
        else:
            after = apply(states.get(task_id) or TaskState(task_id=task_id), event)
            states[task_id] = after
            if self.after is not None and after.status in _ENDED:
                self.ended.add(event.at, task_id)
        return after, self._due(event.at, states)

    def _due(self, now: datetime, states: MutableMapping[str, TaskState]) -> list[TaskState]:
        """Seal the tasks due (`EndedTasks.due`, as the follower does) that are settled for
        good."""
        if self.after is None:
            return []
        out = []
        for task_id in self.ended.due(now, self.after):
            state = states.get(task_id)
            if state is None or not settled_for_good(state):
                continue  # needs attention, or an effect is open: its next event re-enters it
            assert state.status is not None
            self.sealed.add(self.number, task_id, state.status)
            out.append(state)
        return out


@dataclass
class _Partition:
    """One journal partition this instance owns: its fold and what PostgreSQL has of it."""

    number: int
    seals: Sealing
    written_to: int | None = None  # the stored next_offset; None until read from PostgreSQL
    position: int = 0  # every record below this offset is folded
    states: dict[str, TaskState] = field(default_factory=dict)
    changed_at: dict[str, int] = field(default_factory=dict)  # task -> offset of its last event
    dirty: set[str] = field(default_factory=set)  # tasks with an event at >= written_to
    # Sealed, their fold kept until their rows are stored: dirty ones only, so no more than a
    # batch's tasks (BATCH_EVENTS_MAX + FETCH_RECORDS_MAX).
    sealing: set[str] = field(default_factory=set)
    dropped_to: int = 0  # every dropped (sealed) task's last event is below this offset

    def resync(self, stored: int) -> None:
        """PostgreSQL holds `stored`: every task changed at or after it must be written."""
        self.written_to = stored
        self.dirty = {t for t, offset in self.changed_at.items() if offset >= stored}
        self.drop_sealed(self.sealing - self.dirty)

    def seal(self, task_id: str) -> None:
        """The task is sealed: drop its fold now, or once its row is stored."""
        if task_id in self.dirty:
            self.sealing.add(task_id)
        else:
            self.drop_sealed({task_id})

    def drop_sealed(self, task_ids: set[str]) -> None:
        """Forget sealed tasks whose rows are stored."""
        for task_id in task_ids:
            self.sealing.discard(task_id)
            del self.states[task_id]
            self.dropped_to = max(self.dropped_to, self.changed_at.pop(task_id) + 1)

    @property
    def unwritten(self) -> int:
        """Offsets folded but not yet stored (0 while replaying below the stored offset)."""
        if self.written_to is None:
            return 0
        return max(0, self.position - self.written_to)


class _Listener(ConsumerRebalanceListener):
    """No PostgreSQL here: the main loop may be in the middle of a batch on the connection.
    Assigned partitions get their stored offsets from the main loop, before their first record.

    aiokafka rebalances eagerly (everything is revoked, then everything assigned), so a
    partition this instance keeps through a rebalance is revoked and assigned again at once.
    Its fold is still exact up to its position (nobody consumes during a rebalance, and the
    journal only grows), so it goes on from there instead of replaying from zero; only its
    stored offset is read again, since another instance may have written meanwhile."""

    def __init__(self, projector: Projector) -> None:
        self.projector = projector
        self._kept: dict[int, _Partition] = {}  # revoked, perhaps about to be assigned again

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        for tp in revoked:
            part = self.projector._partitions.pop(tp.partition, None)
            if part is not None:
                self._kept[tp.partition] = part

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        kafka = self.projector._kafka()
        new, resumed = [], []
        for tp in assigned:
            if tp.partition in self.projector._partitions:
                continue
            part = self._kept.pop(tp.partition, None)
            if part is None:
                self.projector._partitions[tp.partition] = self.projector._new_partition(
                    tp.partition)
                new.append(tp)
            else:
                part.written_to = None  # read again before the next record
                self.projector._partitions[tp.partition] = part
                kafka.seek(tp, part.position)
                resumed.append(tp)
        self._kept.clear()  # went to another instance: its fold is no use here
        if new:
            await kafka.seek_to_beginning(*new)  # replay: the fold is in memory only
        self.projector._log.info("partitions assigned",
                                 replayed=sorted(tp.partition for tp in new),
                                 resumed=sorted(tp.partition for tp in resumed))


class Projector:
    def __init__(self, settings: KafkaSettings, dsn: str, schema: str = "halfway",
                 group: str | None = None, *, batch_events_max: int = BATCH_EVENTS_MAX,
                 writer: JournalWriter | None = None,
                 seal_after_s: float | FromEnv | None = FROM_ENV) -> None:
        """`writer` (started) writes the dead letters; without one, `run` starts its own.
        `seal_after_s`: see `Sealing` (None: never seal; by default HALFWAY_SEAL_AFTER_S)."""
        self.settings = settings
        self.schema = store.checked(schema)
        self.group = group or f"{settings.topic_prefix}projector"  # one group per deployment
        self.topic = JOURNAL.name(settings.topic_prefix)
        self.batch_events_max = batch_events_max
        self.seal_after = seal_after(seal_after_s)
        self._dsn = dsn
        self._partitions: dict[int, _Partition] = {}
        self._consumer: AIOKafkaConsumer | None = None
        self._conn: asyncpg.Connection | None = None
        self._verify_at = 0.0
        self._log = log.get("halfway.projector", group=self.group, schema=self.schema)
        self._writer = writer
        self._dead_letters: DeadLetters | None = None
        self.batches = 0
        self.invalid = 0  # records that are not events, folded as nothing
        self.late = 0  # events of sealed tasks, not folded

    def _new_partition(self, number: int) -> _Partition:
        return _Partition(number, Sealing(number, self.seal_after))

    @property
    def dead_letters(self) -> DeadLetters | None:
        """This projector's letters (written, failed), once `run` has started."""
        return self._dead_letters

    @property
    def partitions(self) -> frozenset[int]:
        """The journal partitions this instance projects now (assigned, offsets read)."""
        return frozenset(n for n, p in self._partitions.items() if p.written_to is not None)

    def _kafka(self) -> AIOKafkaConsumer:
        assert self._consumer is not None
        return self._consumer

    async def run(self) -> None:
        """Project until cancelled."""
        if self._writer is not None:
            await self._project(self._writer)
            return
        async with JournalWriter(self.settings) as writer:
            await self._project(writer)

    async def _project(self, writer: JournalWriter) -> None:
        self._dead_letters = DeadLetters(writer, group=self.group, logger=self._log)
        self._conn = await store.connect(self._dsn)
        try:
            await store.migrate(self._conn, self.schema)
            source = await cluster_id(self.settings)
            if not await store.claim_source(self._conn, self.schema, source, self.topic):
                # Built from another journal: its offsets would skip this one's events.
                self._log.warning("the read model was built from another Kafka cluster's "
                                  "journal; dropping it and rebuilding from this one",
                                  schema=self.schema, cluster_id=source)
                async with self._conn.transaction():  # readers see the old or the new, whole
                    await store.drop_schema(self._conn, self.schema)
                    await store.migrate(self._conn, self.schema)
                    await store.claim_source(self._conn, self.schema, source, self.topic)
            self._consumer = AIOKafkaConsumer(
                **self.settings.client(), group_id=self.group,
                enable_auto_commit=False,  # the offsets that count are in PostgreSQL
                auto_offset_reset="earliest", isolation_level="read_committed",
                **fetch_limits())
            await self._consumer.start()
            try:
                self._consumer.subscribe([self.topic], listener=_Listener(self))
                self._log.info("projector starting", topic=self.topic)
                while True:
                    await self._round()
            finally:
                await self._consumer.stop()
        finally:
            await self._conn.close()

    async def _round(self) -> None:
        kafka = self._kafka()
        batches = await kafka.getmany(timeout_ms=FETCH_TIMEOUT_MS, max_records=FETCH_RECORDS_MAX)
        # The records belong to the assignment at this moment (aiokafka drops records of a
        # partition whose assignment changed); note which tracker each was fetched for, since
        # a rebalance may replace trackers while _adopt waits for PostgreSQL.
        owners = {tp: self._partitions.get(tp.partition) for tp in batches}
        await self._adopt()
        fetched = 0
        refused: list[tuple[ConsumerRecord, str]] = []
        for tp, records in batches.items():
            part = self._partitions.get(tp.partition)
            if part is None or part is not owners[tp] or part.written_to is None:
                continue  # revoked or re-assigned meanwhile: the new owner replays from zero
            fetched += len(records)
            refused += self._fold(part, records)
        # Before the flush that stores offsets past them: once stored, a restart's replay
        # passes them quietly.
        for record, reason in refused:
            assert self._dead_letters is not None
            await self._dead_letters.send(record, reason)
        await self._advance_positions()
        backlog = sum(p.unwritten for p in self._partitions.values())
        if backlog and (backlog >= self.batch_events_max or fetched < FETCH_RECORDS_MAX):
            await self._flush()
        elif not backlog and time.monotonic() >= self._verify_at:
            await self._verify()

    def _fold(self, part: _Partition, records: list[ConsumerRecord],
              ) -> list[tuple[ConsumerRecord, str]]:
        """Fold `records` into `part`; returns the invalid ones to dead-letter (those at or
        past the stored offset: below it, an earlier run already passed them)."""
        assert part.written_to is not None
        refused: list[tuple[ConsumerRecord, str]] = []
        for record in records:
            if record.offset < part.position:
                continue  # already folded
            part.position = record.offset + 1
            try:
                event = decode(record)
            except InvalidRecord as exc:
                self.invalid += 1
                if record.offset >= part.written_to:
                    refused.append((record, exc.reason))
                continue
            after, sealed = part.seals.fold(part.states, event)
            if after is None:
                self.late += 1
                if record.offset >= part.written_to:  # the first time past it
                    self._log.info("late event of a sealed task: not folded",
                                   task_id=event.task_id, type=event.type,
                                   partition=part.number, offset=record.offset)
            else:
                part.changed_at[event.task_id] = record.offset
                if record.offset >= part.written_to:
                    part.dirty.add(event.task_id)
            for state in sealed:
                part.seal(state.task_id)
        return refused

    async def _adopt(self) -> None:
        """Read the stored offsets of newly assigned partitions, before their first record."""
        new = [p for p in self._partitions.values() if p.written_to is None]
        if not new:
            return
        assert self._conn is not None
        stored = await store.read_offsets(self._conn, self.schema, self.topic)
        for part in new:
            self._resync_partition(part, stored.get(part.number, 0))
        self._log.info("stored offsets read", offsets={p.number: stored.get(p.number, 0)
                                                       for p in new})

    async def _advance_positions(self) -> None:
        # The consumer's position, not the last record's offset + 1: control records (from
        # transactional writers) take offsets too, and the end offset counts them.
        kafka = self._kafka()
        for number, part in list(self._partitions.items()):
            if part.written_to is None:
                continue
            with contextlib.suppress(IllegalStateError):  # revoked meanwhile
                position = await kafka.position(TopicPartition(self.topic, number))
                if self._partitions.get(number) is part:
                    part.position = max(part.position, position)

    async def _flush(self) -> None:
        assert self._conn is not None
        parts = [p for p in self._partitions.values() if p.unwritten]
        states = [p.states[t] for p in parts for t in p.dirty]
        offsets = {(self.topic, p.number): p.position for p in parts}
        expected = {(self.topic, p.number): p.written_to or 0 for p in parts}
        try:
            await store.apply_batch(self._conn, self.schema, states, offsets, expected=expected)
        except store.OffsetConflict as exc:
            self._resync(exc.stored)
            return
        for part in parts:
            part.written_to = offsets[(self.topic, part.number)]
            part.dirty.clear()
            part.drop_sealed(set(part.sealing))  # their rows are stored now
        self.batches += 1

    async def _verify(self) -> None:
        assert self._conn is not None
        self._verify_at = time.monotonic() + VERIFY_INTERVAL_S
        stored = await store.read_offsets(self._conn, self.schema, self.topic)
        moved = {(self.topic, p.number): stored.get(p.number, 0)
                 for p in self._partitions.values()
                 if p.written_to is not None and stored.get(p.number, 0) != p.written_to}
        if moved:
            self._resync(moved)

    def _resync(self, stored: dict[tuple[str, int], int]) -> None:
        self._log.warning("applied offsets moved by another writer: writing again from them",
                          stored={p: o for (_, p), o in stored.items()})
        for (_, number), offset in stored.items():
            part = self._partitions.get(number)
            if part is not None:
                self._resync_partition(part, offset)

    def _resync_partition(self, part: _Partition, stored: int) -> None:
        """PostgreSQL holds `stored` for `part`: every task changed at or after it is written
        again."""
        if stored >= part.dropped_to or self._partitions.get(part.number) is not part:
            part.resync(stored)  # (not ours any more: revoked while the offsets were read)
            return
        # A task dropped (sealed) changed at or after `stored`: its row must be written
        # again, and only a replay from zero folds it again.
        self._log.warning("a sealed task's row must be written again: replaying from zero",
                          partition=part.number, stored=stored)
        fresh = self._new_partition(part.number)
        fresh.resync(stored)
        self._partitions[part.number] = fresh
        with contextlib.suppress(IllegalStateError):  # revoked meanwhile
            self._kafka().seek(TopicPartition(self.topic, part.number), 0)


async def journal_end_offsets(settings: KafkaSettings) -> dict[int, int]:
    """partition -> end offset of the journal now (read_committed, as the projector reads)."""
    topic = JOURNAL.name(settings.topic_prefix)
    partitions = await topic_partitions(settings, topic)
    consumer = AIOKafkaConsumer(**settings.client(), group_id=None,
                                enable_auto_commit=False, isolation_level="read_committed",
                                **fetch_limits())
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        ends = await consumer.end_offsets(tps)
        return {tp.partition: ends[tp] for tp in tps}
    finally:
        await consumer.stop()


async def serve() -> None:
    """The process entry point (`python -m halfway.projector`): project into the schema
    HALFWAY_PG_SCHEMA until SIGTERM or SIGINT."""
    log.configure()
    settings = KafkaSettings.from_env("projector")
    await ensure_topics_once_up(settings, (JOURNAL, DEAD_LETTERS))
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    projector = Projector(settings, env.pg_dsn(), schema=env.pg_schema(),
                          seal_after_s=env.seal_after_s())
    try:
        await projector.run()
    except asyncio.CancelledError:
        log.get("halfway.projector").info("projector stopped", batches=projector.batches)
