"""The projector: folds the journal into the PostgreSQL read model, at least once, idempotently.

Theory of operation
-------------------
The projector is a member of the consumer group `{prefix}projector`, so several instances
share the journal's partitions. The offsets that count are in PostgreSQL (`applied_offsets`),
written in the same transaction as the rows; the group's commit in Kafka only points at a
snapshot.

A row is a function of a task's whole fold, and the fold lives only in memory. On assignment a
partition's fold is restored from its snapshot (`halfway.journal.snapshots`, the followers'
image: its open tasks' records, its sealed tasks' digests, its ended tasks waiting to be
sealed) and the journal read from the image's offset X; without a usable one (none, aged out,
corrupt, or X past the stored offset: the read model went back) it is replayed from offset
zero, logged. Rows are written only for tasks with an event at or after the partition's stored
offset (`written_to`); the records read below it rebuild the fold without writing, so an image
at X <= written_to always serves. The projector writes a partition's image (pointer in this
group's commit on the partition, as the followers do) between two batches, only once its fold
is stored (`position == written_to`: no sealed task waits for its row), in the background,
one at a time, when due (`snapshots.due`); HALFWAY_SNAPSHOTS=off never reads or writes one. A
snapshot is only an optimisation: a replay from zero writes the same rows.

Records are applied in batches (at most about BATCH_EVENTS_MAX events) and every batch commits
its tasks' rows and the partitions' new offsets together, so a kill -9 at any point leaves
PostgreSQL at a batch boundary, and the next instance resumes there.
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
zero (after a restore, below the image's offset: what it sealed left no offsets). The records
kept for the image are those of tasks still folded, dropped with their fold.

With snapshots, a task over for good keeps no fold either once its row is stored and a minute
has passed by the journal's clock (DORMANT_AFTER_S, as the followers): until it is sealed it is
kept as its events' compressed JSON (`snaps.Dormant`, a few hundred bytes), imaged as it is, so
a restore neither decodes nor folds the day's ended tasks; news of one folds it again first.
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

from halfway import log, metrics
from halfway import settings as env
from halfway.contract import Event, TaskRequested
from halfway.contract.topics import DEAD_LETTERS, JOURNAL
from halfway.core.fold import TaskState, TaskStatus, apply
from halfway.journal import snapshots as snaps
from halfway.journal.admin import cluster_id, ensure_topics_once_up, topic_partitions
from halfway.journal.deadletters import DeadLetters
from halfway.journal.follower import DORMANT_AFTER_S, RESTORE_BATCH, settled_for_good
from halfway.journal.limits import fetch_limits
from halfway.journal.reader import known_end
from halfway.journal.records import InvalidRecord, decode
from halfway.journal.sealed import ByTime, EndedTasks, SealedTasks
from halfway.journal.writer import JournalWriter
from halfway.loops import LoopWatch, run_until_cancelled
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
_DORMANT_AFTER = timedelta(seconds=DORMANT_AFTER_S)


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
        # Tasks over and settled for good, kept as their events' compressed JSON until sealed
        # (the live projector's `_Partition.quiet_due`; a rebuild keeps none). Not in `states`:
        # the caller wakes one (folds it again) before folding news of it.
        self.dormant: dict[str, snaps.Dormant] = {}

    def has(self, task_id: str) -> bool:
        return self.sealed.has(self.number, task_id)

    def fold(self, states: MutableMapping[str, TaskState], event: Event,
             ) -> tuple[TaskState | None, list[str]]:
        """Fold `event` into `states`, unless its task is sealed (late news: None). Also the
        tasks sealed at this record: those folded still in `states` (the caller drops them,
        once their rows are stored)."""
        task_id = event.task_id
        assert task_id not in self.dormant, "a dormant task is woken before its news"
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

    def _due(self, now: datetime, states: MutableMapping[str, TaskState]) -> list[str]:
        """Seal the tasks due (`EndedTasks.due`, as the follower does) that are settled for
        good."""
        if self.after is None:
            return []
        out = []
        for task_id in self.ended.due(now, self.after):
            dormant = self.dormant.pop(task_id, None)
            if dormant is not None:  # no news since it went dormant: settled for good still
                self.sealed.add(self.number, task_id, TaskStatus(dormant.status))
                out.append(task_id)
                continue
            state = states.get(task_id)
            if state is None or not settled_for_good(state):
                continue  # needs attention, or an effect is open: its next event re-enters it
            assert state.status is not None
            self.sealed.add(self.number, task_id, state.status)
            out.append(task_id)
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
    # Snapshots: the records folded into each task held (those of `states`, in log order), which
    # is what an image holds; dropped with the task's fold.
    history: dict[str, list[tuple[int, Event]]] = field(default_factory=dict)
    # Tasks that ended (`at`, id), oldest first, until DORMANT_AFTER_S later by the journal's
    # clock (`quiet_due`); None: no task goes dormant (no snapshots, or no sealing).
    quieting: ByTime | None = None
    quiet_later: dict[str, datetime] = field(default_factory=dict)  # due, row not stored yet
    ready: bool = True  # False while its snapshot is read and restored (`Projector._load`)
    restored_from: int | None = None  # the offset of the image it was restored from
    since_snapshot: int = 0  # records folded since its last snapshot (or its assignment)
    snapshot_s: float = field(default_factory=time.monotonic)  # monotonic, when that was

    def resync(self, stored: int) -> None:
        """PostgreSQL holds `stored`: every task changed at or after it must be written."""
        self.written_to = stored
        self.dirty = {t for t, offset in self.changed_at.items() if offset >= stored}
        for task_id in self.dirty & self.seals.dormant.keys():
            self.wake(task_id)  # and dormant again once its row is stored:
            at = self.seals.ended.last_end(task_id)
            if at is not None:
                self.quiet_later[task_id] = at
        self.drop_sealed(self.sealing - self.dirty)
        self.quiet_written()  # (those still dirty wait again)

    def stored(self, offset: int) -> None:
        """PostgreSQL holds the rows of every task changed below `offset` (a flush)."""
        self.written_to = offset
        self.dirty.clear()
        self.drop_sealed(set(self.sealing))
        self.quiet_written()

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
            self.states.pop(task_id, None)  # (a dormant one has none)
            self.history.pop(task_id, None)
            self.quiet_later.pop(task_id, None)
            self.dropped_to = max(self.dropped_to, self.changed_at.pop(task_id) + 1)

    def quiet_due(self, now: datetime) -> None:
        """Keep the tasks that ended DORMANT_AFTER_S before `now` (the `at` of the record
        just folded), settled for good and with no news since, as their events' compressed
        JSON (`snaps.Dormant`, as the followers do): a few hundred bytes a task instead of its
        fold, and an image whose restore neither decodes nor folds them. One whose row is not
        stored yet waits for the flush (`quiet_written`)."""
        if self.quieting:
            for at, task_id in self.quieting.due(now, _DORMANT_AFTER):
                self._quiet(task_id, at)

    def quiet_written(self) -> None:
        """Rows are stored (a flush, or a re-sync): the tasks due meanwhile whose rows are
        stored go dormant now."""
        later, self.quiet_later = self.quiet_later, {}
        for task_id, at in later.items():
            self._quiet(task_id, at)

    def _quiet(self, task_id: str, at: datetime) -> None:
        if not self.seals.ended.is_last(task_id, at) or task_id not in self.states:
            return  # news since (a later end decides), sealed, or dormant already
        if task_id in self.dirty:
            self.quiet_later[task_id] = at
            return
        state, history = self.states[task_id], self.history.get(task_id)
        if history is None or not settled_for_good(state):
            return  # needs attention, or an effect is open: its next end re-enters it
        self.seals.dormant[task_id] = snaps.Dormant.of(task_id, str(state.status), history,
                                                       None, first_attempts=False)
        del self.states[task_id], self.history[task_id]

    def wake(self, task_id: str) -> None:
        """Fold a dormant task's events again: news of it came, or its row is written again.
        Its state is the fold of the same records as before it went dormant."""
        history, _ = self.seals.dormant.pop(task_id).decode()
        state = TaskState(task_id=task_id)
        for _, event in history:
            state = apply(state, event)
        self.states[task_id], self.history[task_id] = state, history

    @property
    def exact_and_stored(self) -> bool:
        """Its fold is exactly the records below `position`, all of them stored with their
        rows: an image of it now is usable by any restart whose stored offset is not behind
        (nothing sealed waits for its row; a sealed task's row is never written again)."""
        return self.written_to == self.position and not self.sealing

    @property
    def unwritten(self) -> int:
        """Offsets folded but not yet stored (0 while replaying below the stored offset)."""
        if self.written_to is None:
            return 0
        return max(0, self.position - self.written_to)


class _Listener(ConsumerRebalanceListener):
    """No PostgreSQL here: the main loop may be in the middle of a batch on the connection.
    Assigned partitions are paused until the main loop has read their stored offsets
    (`Projector._adopt`), which then reads each from its tracker's position: not from the
    group's committed offset, where the consumer would start by itself (a snapshot's).

    aiokafka rebalances eagerly (everything is revoked, then everything assigned), so a
    partition this instance keeps through a rebalance is revoked and assigned again at once.
    Its fold is still exact up to its position (nobody consumes during a rebalance, and the
    journal only grows), so it goes on from there instead of being restored again; only its
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
        projector = self.projector
        new: list[_Partition] = []
        resumed: list[int] = []
        for tp in assigned:
            if tp.partition in projector._partitions:
                continue
            part = self._kept.pop(tp.partition, None)
            if part is None:
                part = projector._new_partition(tp.partition)
                new.append(part)
            else:
                part.written_to = None  # read again before its next record
                resumed.append(tp.partition)
            projector._partitions[tp.partition] = part
        self._kept.clear()  # went to another instance: its fold is no use here
        projector._kafka().pause(*(TopicPartition(projector.topic, n)
                                   for n, p in projector._partitions.items()
                                   if p.written_to is None))
        loading = projector._load_snapshots(new)
        projector._log.info("partitions assigned",
                            replayed=sorted(p.number for p in new if p.ready),
                            loading=sorted(loading), resumed=sorted(resumed))


class Projector:
    def __init__(self, settings: KafkaSettings, dsn: str, schema: str = "halfway",
                 group: str | None = None, *, batch_events_max: int = BATCH_EVENTS_MAX,
                 writer: JournalWriter | None = None,
                 seal_after_s: float | FromEnv | None = FROM_ENV,
                 snapshots: bool = True) -> None:
        """`writer` (started) writes the dead letters and snapshots; without one, `run` starts
        its own. `seal_after_s`: see `Sealing` (None: never seal; by default
        HALFWAY_SEAL_AFTER_S). `snapshots`: restore partitions from snapshots and write them
        (`halfway.journal.snapshots`), unless HALFWAY_SNAPSHOTS=off."""
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
        self._journal_partitions: int | None = None  # see _partition_count
        self._watch = LoopWatch("projector's loop")  # stops the projector if a round gets stuck
        self._writer = writer
        self._out: JournalWriter | None = None  # the writer `run` uses (dead letters, images)
        self._dead_letters: DeadLetters | None = None
        self.snapshots = snaps.enabled(snapshots)
        self._snapshot_every_s = snaps.every_s()
        self._snapshotting: asyncio.Task[None] | None = None  # one image written at a time
        self._loaders: set[asyncio.Task[None]] = set()  # one per rebalance at most, short-lived
        self.batches = 0
        self.invalid = 0  # records that are not events, folded as nothing
        self.late = 0  # events of sealed tasks, not folded
        self.folded = 0  # records folded (valid or not), replays included
        self.restored: dict[int, int] = {}  # partition -> offset of the image restored, used
        self.snapshots_written: dict[int, int] = {}  # partition -> offset of its last image
        self.snapshot_written_s: float | None = None  # monotonic, the last one written
        metrics.watch(self)

    def _new_partition(self, number: int) -> _Partition:
        quiets = self.snapshots and self.seal_after is not None  # (a Dormant needs a history)
        return _Partition(number, Sealing(number, self.seal_after),
                          quieting=ByTime() if quiets else None)

    @property
    def dead_letters(self) -> DeadLetters | None:
        """This projector's letters (written, failed), once `run` has started."""
        return self._dead_letters

    @property
    def partitions(self) -> frozenset[int]:
        """The journal partitions this instance projects now (assigned, offsets read)."""
        return frozenset(n for n, p in self._partitions.items() if p.written_to is not None)

    # -- what /metrics reads (`halfway.metrics`: the followers' gauges) -------------------

    @property
    def applied_by_topic(self) -> dict[str, int]:
        return {self.topic: self.folded}

    # A scrape runs in the metrics server's thread: each map is copied in one call (`list`).

    @property
    def states(self) -> dict[str, TaskState]:
        """The folded tasks of every partition (built at each scrape)."""
        out: dict[str, TaskState] = {}
        for part in list(self._partitions.values()):
            out.update(list(part.states.items()))
        return out

    @property
    def dormant(self) -> list[str]:
        return [t for part in list(self._partitions.values()) for t in list(part.seals.dormant)]

    def partition_lags(self) -> list[tuple[str, int, int, bool]]:
        """(topic, partition, records not stored in PostgreSQL yet, stored up to the end of
        the last fetch) of each partition adopted."""
        out = []
        for number, part in list(self._partitions.items()):
            if part.written_to is None or self._consumer is None:
                continue
            end = known_end(self._consumer, TopicPartition(self.topic, number))
            behind = max(0, (part.position if end is None else end) - part.written_to)
            out.append((self.topic, number, behind, behind == 0))
        return out

    @property
    def _partition_count(self) -> int | None:
        """The journal's partition count (it never changes): a record must sit in its task's
        partition (`decode`)."""
        if self._journal_partitions is None and self._consumer is not None:
            self._journal_partitions = len(
                self._consumer.partitions_for_topic(self.topic) or ()) or None
        return self._journal_partitions

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
        self._out = writer
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
                # A round stuck (PostgreSQL not answering, a fetch that never returns) stops
                # the projector, its partitions to another instance: aiokafka would not.
                await run_until_cancelled(self._rounds(), self._watch.watch())
            finally:
                await self._stop_background()
                await self._consumer.stop()
        finally:
            await self._conn.close()

    async def _rounds(self) -> None:
        while True:
            self._watch.turned()
            await self._round()

    async def _round(self) -> None:
        kafka = self._kafka()
        batches = await kafka.getmany(timeout_ms=FETCH_TIMEOUT_MS, max_records=FETCH_RECORDS_MAX)
        # The records belong to the assignment at this moment (aiokafka drops records of a
        # partition whose assignment changed); note which tracker each was fetched for, since
        # a rebalance may replace trackers while _adopt waits for PostgreSQL. A partition
        # adopted only now is read again from its position (`_adopt` seeks it there).
        owners = {tp: part for tp in batches
                  if (part := self._partitions.get(tp.partition)) is not None
                  and part.written_to is not None}
        await self._adopt()
        fetched = 0
        refused: list[tuple[ConsumerRecord, str]] = []
        for tp, records in batches.items():
            part = self._partitions.get(tp.partition)
            if part is None or part is not owners.get(tp) or part.written_to is None:
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
        self._maybe_snapshot()

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
            part.since_snapshot += 1
            self.folded += 1
            try:
                event = decode(record, self._partition_count)
            except InvalidRecord as exc:
                self.invalid += 1
                if record.offset >= part.written_to:
                    refused.append((record, exc.reason))
                continue
            if event.task_id in part.seals.dormant:
                part.wake(event.task_id)
            after, sealed = part.seals.fold(part.states, event)
            if after is None:
                self.late += 1
                if record.offset >= part.written_to:  # the first time past it
                    self._log.info("late event of a sealed task: not folded",
                                   task_id=event.task_id, type=event.type,
                                   partition=part.number, offset=record.offset)
            else:
                part.changed_at[event.task_id] = record.offset
                if self.snapshots:
                    part.history.setdefault(event.task_id, []).append((record.offset, event))
                if record.offset >= part.written_to:
                    part.dirty.add(event.task_id)
                if part.quieting is not None:
                    if after.status in _ENDED:
                        part.quieting.add(event.at, event.task_id)
                    part.quiet_due(event.at)
            for task_id in sealed:
                part.seal(task_id)
        return refused

    async def _adopt(self) -> None:
        """Read the stored offsets of newly assigned partitions (restored, or to replay from
        zero: `ready`), then read each from its position."""
        new = [p for p in self._partitions.values() if p.written_to is None and p.ready]
        if not new:
            return
        assert self._conn is not None
        stored = await store.read_offsets(self._conn, self.schema, self.topic)
        kafka = self._kafka()
        for part in new:
            if self._partitions.get(part.number) is not part:
                continue  # revoked while the offsets were read: adopted when assigned again
            offset = stored.get(part.number, 0)
            part = self._usable(part, offset)
            tp = TopicPartition(self.topic, part.number)
            with contextlib.suppress(IllegalStateError):  # revoked meanwhile
                kafka.seek(tp, part.position)  # below the log's start: the earliest
                kafka.resume(tp)
            self._resync_partition(part, offset)
        self._log.info("stored offsets read", offsets={p.number: stored.get(p.number, 0)
                                                       for p in new})

    def _usable(self, part: _Partition, stored: int) -> _Partition:
        """`part`, if it is restored from an image at or below the stored offset (the replay
        up to it writes nothing); else a tracker to replay from zero."""
        if part.restored_from is None:
            return part
        if part.restored_from <= stored:
            self.restored[part.number] = part.restored_from
            self._log.info("partition restored from its snapshot", partition=part.number,
                           journal_next=part.restored_from, stored=stored)
            return part
        # The read model went back (a rebuild swapped in, PostgreSQL restored): tasks sealed
        # before the image may have no row now, and only a replay from zero folds them again.
        self._log.warning("snapshot ahead of the stored offset: replaying from zero",
                          partition=part.number, journal_next=part.restored_from,
                          stored=stored)
        fresh = self._new_partition(part.number)
        self._partitions[part.number] = fresh
        return fresh

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
            refused = await store.apply_batch(self._conn, self.schema, states, offsets,
                                              expected=expected)
        except store.OffsetConflict as exc:
            self._resync(exc.stored)
            return
        for task_id, reason in refused:
            self._log.error("PostgreSQL refused a task's rows: a placeholder row says why",
                            task_id=task_id, reason=reason)
        for part in parts:
            part.stored(offsets[(self.topic, part.number)])
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


    # -- snapshots (halfway.journal.snapshots) ---------------------------------------------

    def _load_snapshots(self, new: list[_Partition]) -> list[int]:
        """Restore the newly assigned partitions from their snapshots in the background (each
        is adopted as soon as its own is in); returns their numbers. Without snapshots they
        replay from zero."""
        if not self.snapshots or not new:
            return []
        for part in new:
            part.ready = False
        loader = asyncio.create_task(self._load(new))
        self._loaders.add(loader)
        loader.add_done_callback(self._loaders.discard)
        return [p.number for p in new]

    async def _load(self, parts: list[_Partition]) -> None:
        """Restore each of `parts` from its image as it is read; one without a usable image
        (none, aged out, corrupt: logged by `load_each`) replays from zero."""
        waiting = {p.number: p for p in parts}
        try:
            tps = [TopicPartition(self.topic, n) for n in waiting]
            async for number, image in snaps.load_each(
                    self.settings, self.group, tps,
                    seal_after_s=snaps.seal_window(self.seal_after)):
                part = waiting.pop(number)
                if image is not None and self._partitions.get(number) is part:
                    try:
                        await self._restore(part, image)
                    except Exception:  # untouched: it replays from zero
                        self._log.exception("snapshot not restored; replaying from zero",
                                            partition=number)
                part.ready = True
        finally:
            for part in waiting.values():  # stopping, or the reads failed: replay from zero
                part.ready = True

    async def _restore(self, part: _Partition, image: snaps.Image) -> None:
        """The fold of the journal before `image.journal_next`, from its image, into `part`
        (in one step at the end: `part` is fresh until then). Yields to the loop every
        RESTORE_BATCH items: the consumer's heartbeat goes on meanwhile."""
        seals = Sealing(part.number, self.seal_after)
        seals.sealed.restore(part.number, image.sealed, checked=True)  # by snaps.encode
        for i, (at, task_id) in enumerate(image.ended):
            seals.ended.add(at, task_id)
            if i % RESTORE_BATCH == RESTORE_BATCH - 1:
                await asyncio.sleep(0)
        changed_at: dict[str, int] = {}
        for dormant in image.dormant:  # not decoded: only if news of it comes
            seals.dormant[dormant.task_id] = dormant
            changed_at[dormant.task_id] = dormant.offsets[-1]
        states: dict[str, TaskState] = {}
        history: dict[str, list[tuple[int, Event]]] = {}
        for i, (offset, event) in enumerate(image.events):
            task_id = event.task_id
            states[task_id] = apply(states.get(task_id) or TaskState(task_id=task_id), event)
            changed_at[task_id] = offset
            history.setdefault(task_id, []).append((offset, event))
            if i % RESTORE_BATCH == RESTORE_BATCH - 1:
                await asyncio.sleep(0)
        part.seals, part.states, part.changed_at, part.history = seals, states, changed_at, \
            history
        if part.quieting is not None:  # those ended within DORMANT_AFTER_S of the image's clock
            part.quieting.extend((at, t) for at, t in image.ended if t in states)
        # Tasks sealed before the image left no offset: all below it (a re-sync below it
        # replays from zero, as for a task dropped here).
        part.position = part.dropped_to = part.restored_from = image.journal_next
        if image.format < snaps.FORMAT:  # written by the build before: rewrite it soon
            part.since_snapshot = snaps.EVERY_RECORDS

    def _image(self, part: _Partition) -> snaps.Image:
        """The image of `part` now (`exact_and_stored`): its folded tasks' records, its
        dormant and sealed tasks, its ended tasks waiting to be sealed."""
        events = sorted((item for items in part.history.values() for item in items),
                        key=lambda item: item[0])
        return snaps.Image(partition=part.number, journal_next=part.position, side_next=None,
                           events=events, sealed=part.seals.sealed.packed(part.number),
                           ended=part.seals.ended.entries(),
                           dormant=list(part.seals.dormant.values()),
                           seal_after_s=snaps.seal_window(self.seal_after))

    def _maybe_snapshot(self) -> None:
        """Start writing one due snapshot (one at a time, in the background), between two
        batches, of a partition whose fold is exact and stored."""
        if not self.snapshots or (self._snapshotting and not self._snapshotting.done()):
            return
        now_s = time.monotonic()
        for part in self._partitions.values():
            if (not part.position or not part.exact_and_stored
                    or not snaps.due(part.since_snapshot, now_s - part.snapshot_s,
                                     self._snapshot_every_s)):
                continue
            image = self._image(part)
            part.since_snapshot, part.snapshot_s = 0, now_s
            self._snapshotting = asyncio.create_task(self._write_snapshot(part, image))
            return

    async def _write_snapshot(self, part: _Partition, image: snaps.Image) -> None:
        """Write the image and commit its pointer in this group's commit of the journal
        partition, as the followers do."""
        async def commit(metadata: str) -> bool:
            if self._partitions.get(part.number) is not part:
                return False
            await self._kafka().commit({TopicPartition(self.topic, part.number): (
                image.journal_next, metadata)})
            return True

        assert self._out is not None
        if await snaps.write_and_point(self._out, self.group, image, commit, self._log):
            self.snapshots_written[part.number] = image.journal_next
            self.snapshot_written_s = time.monotonic()

    async def _stop_background(self) -> None:
        for task in [*self._loaders, self._snapshotting]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task


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
    from halfway.serve import check_settings

    log.configure()
    check_settings()
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
        await run_until_cancelled(projector.run())  # a cancellation not ours: LoopEnded
    except asyncio.CancelledError:
        log.get("halfway.projector").info("projector stopped", batches=projector.batches)
