"""JournalFollower: the state of every task in the partitions this instance owns.

Both the decider and the executor are "fold the journal, then act" loops. The follower is the
fold half. On every partition assignment it reads the journal partition from offset zero (the
journal is the only state; nothing lives in a process that a restart or a rebalance could
lose), and it reports a task as changed only once its partition has caught up with the end it
had when it was assigned. Acting on a half-read history would ask the model again for a step
that is already decided further on in the log.

Two rules keep a service from acting twice on its own writes:
- `note_write(task_id, partition, offset)`: after a service appends an event, the task is not
  reported again until the follower has applied that offset, so the service never decides on
  a state that does not yet contain its own last move;
- services keep their own set of moves in flight (a call, a model question) and skip those.

A newly owned partition is replayed from zero, which is correct by construction, unless a
usable snapshot of it exists (`snapshots=True`: `halfway.journal.snapshots`): then its live
state is restored from the snapshot and only the journal after it is read. The follower writes
a partition's snapshot every so many records or seconds once it has caught up; the image is
taken between two batches, so it is exactly the state the records before its offset give.

Memory follows live work, not history (`seal_after_s`): a task that ended (finished or
rejected) with every effect settled, `seal_after_s` before the newest record of its partition
(the journal's own clock, so a replay seals exactly what the live follower sealed), is
*sealed*: only its status is kept (enough to say it is over and to refuse a second start). Later
step events for it are not folded, and its webhooks are weighed as orphans (quarantined, with
the reason), so late news of a task sealed a day ago reaches an operator as a letter, not as a
change of its state. A task that needs attention is never sealed.

Nothing a task holds can stop the others: a service acts on each changed task through
`for_each`, which catches what the act raises, logs it, and tries that task again later with a
bounded backoff (after FAILURES_MAX failures in a row the service is told once, to give up on
the task visibly); the loop, the partition and every other task go on.

Webhooks (the reconciler's side topic) are held until the journal partition of the same number
has been read past the offset the gateway stamped on them (`WebhookReceived.journal_offset`):
only then is it known whether the step they name was attempted before they arrived. Then they
are handed over once (`take_webhooks`); the follower keeps no webhook longer than that. Held
webhooks are bounded in number and in bytes (the webhooks partition is paused past
HELD_WEBHOOKS_MAX or HELD_WEBHOOK_BYTES_MAX) and in time (past HELD_WEBHOOK_S_MAX one is handed
over marked unordered, and quarantined). One stamped past every end of its journal partition
this process knows sends it to ask the broker (`_ask_ends`, at most once per
END_CHECK_INTERVAL_S, for every partition that needs it): still past the end the broker gave
after it arrived, it is handed over marked `past_end` (no gateway can have read that end:
forged), and quarantined instead of held.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Set
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta
from typing import Any

from aiokafka import ConsumerRebalanceListener, TopicPartition

from halfway import log, metrics
from halfway.contract import (
    CompensationAttempted,
    Event,
    StepAttempted,
    StepSettled,
    TaskRequested,
)
from halfway.contract.topics import JOURNAL, TASKS, WEBHOOKS, TopicSpec
from halfway.contract.webhooks import WebhookReceived
from halfway.core.fold import StepStatus, TaskState, TaskStatus
from halfway.journal import snapshots as snaps
from halfway.journal.reader import EventConsumer, Wake
from halfway.journal.records import Delivery, partition_of
from halfway.journal.sealed import ByTime, EndedTasks, SealedTasks
from halfway.journal.shared_fold import shared_folds
from halfway.journal.writer import JournalWriter, local_appends
from halfway.loops import LoopWatch, run_until_cancelled
from halfway.settings import KafkaSettings

OnChange = Callable[[set[str]], Awaitable[None]]
# Optional hooks for services that must see every step of the fold, not only which tasks
# changed in a batch (the outcomes publisher): each event folded, with its task's state before
# and after, its journal partition and offset (a restore and a dormant task's waking fold its
# history again: those offsets come again, in order)...
OnEvent = Callable[[TaskState | None, TaskState, int, int], None]
# ...and partitions (numbers) about to be read from offset zero, or revoked.
OnAssign = Callable[[set[int]], Awaitable[None]]
OnRevoke = Callable[[set[int]], None]
# ...and a partition about to be restored from its image (its number, the image's journal
# offset, what the service put in it with `OnImage`, or None): it returns the tasks restored
# dormant to wake at once.
OnRestore = Callable[[int, int, dict[str, Any] | None], Awaitable[set[str]]]
# ...and what to put in the image of a partition taken now; None: no image now (tried again
# after the next batch).
OnImage = Callable[[int], dict[str, Any] | None]
# ...and a task sealed (journal partition number, task id), once it reads as sealed.
OnSeal = Callable[[int, str], None]
# ...and, of a partition's dormant tasks, those with something left to do when it catches up
# (a claim still held, messages still owed): asked once per catch-up, with the set of them.
WakeOnCatchUp = Callable[[Set[str]], Iterable[str]]
# Awaited before each fetch: a service with too much to send of what was folded holds the fold
# back until it has sent some (bounded by the service: the consumer must still poll).
Hold = Callable[[], Awaitable[None]]
SNAPSHOTS_ENV = snaps.ENABLED_ENV
RESTORE_BATCH = 2000  # items restored from an image between two yields to the loop
# Every this many records folded, the process's objects are collected once and then frozen
# (`gc.freeze`): the cycle collector no longer walks the state already built. A full collection
# over millions of task states stops the loop for seconds, long enough, on a busy machine, for
# the group to take the partitions away mid-replay. Frozen objects are still freed by their
# reference counts (task states and events hold no cycles); only cycles among them would stay.
GC_FREEZE_EVERY_RECORDS = 100_000
# A task over and settled for good this long before the newest record of its partition (the
# journal's clock) is kept as the JSON of its events until it is sealed (`snaps.Dormant`): a
# few hundred bytes a record instead of its folded objects.
DORMANT_AFTER_S = 60.0
_DORMANT_AFTER = timedelta(seconds=DORMANT_AFTER_S)
# Tasks a service acts on at once, of one batch's changed tasks (each act is one task's: its
# own state, its own writes).
ACTS_AT_ONCE_MAX = 64
# How long one fetch waits when the journal is quiet (a `touch` ends the wait at once).
IDLE_FETCH_MS = 100
# Own appends acknowledged ahead of a record not folded yet (another writer's, or one of this
# process's whose acknowledgement is still coming: a worker appends with two producers), kept
# per partition to be folded as soon as the gap is; past this many the fetch brings them.
LOCAL_AHEAD_MAX = 1024
# A task whose act failed is tried again after RETRY_S_MIN, doubling up to RETRY_S_MAX; after
# FAILURES_MAX failures in a row the service's `on_give_up` is called (once).
RETRY_S_MIN = 0.5
RETRY_S_MAX = 60.0
FAILURES_MAX = 8
# Webhooks waiting for the journal to be read past their offset, per partition; past this the
# webhooks partition is paused until the journal catches up (resumed below half of it).
HELD_WEBHOOKS_MAX = 10_000
# ...and their records' bytes (a record may be 1 MiB: 10,000 of them per partition would be
# gigabytes). Genuine webhooks are a few KiB, so the count binds first for them.
HELD_WEBHOOK_BYTES_MAX = 32 * 1024 * 1024
# A webhook held this long (its journal offset beyond anything the journal reaches: not a real
# gateway's stamp) is handed over as unordered, and quarantined.
HELD_WEBHOOK_S_MAX = 300.0
# A webhook stamped past every end of its journal partition known here has the broker asked
# for the ends: at most this often (one request for every partition that needs it), so a flood
# of forged stamps costs a request a second. A genuine webhook never waits for it: it is
# handed over once the journal is read past its stamp, whatever the broker says.
END_CHECK_INTERVAL_S = 1.0
END_CHECK_TIMEOUT_S = 10.0  # then asked again at the next interval
# How often the webhooks partitions' "weighed up to here" offsets are committed.
WEBHOOK_COMMIT_INTERVAL_S = 1.0


# What `_ready` says of a dirty task: report it now; keep it dirty (its own write is not
# folded yet); or drop it (its partitions are catching up, or it is not ours).
_READY, _LATER, _PARKED = object(), object(), object()


@dataclass
class _Partition:
    end_at_assign: int
    applied_to: int = -1  # offset of the last record applied (valid or not)
    caught_up: bool = False
    tasks: set[str] = field(default_factory=set)
    # Webhooks partitions: every webhook below this offset has been weighed by some instance
    # (the group's committed offset).
    noticed_to: int = 0
    # Journal partitions: records applied since the last snapshot, and when that was
    # (monotonic; the adoption counts as one).
    since_snapshot: int = 0
    snapshot_s: float = field(default_factory=time.monotonic)
    # Own appends past a gap, by offset (LOCAL_AHEAD_MAX at most): see `_appended`.
    ahead: dict[int, Event] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class HeldWebhook:
    """A verified webhook, handed to the reconciler once the journal was read past its stamp."""

    hook: WebhookReceived
    partition: int  # where it is on the webhooks topic
    offset: int
    # Not weighed by any instance before (at or past the group's committed offset): notices
    # about it (a quarantine letter) are written now, not again at every replay.
    fresh: bool
    unordered: bool = False  # held too long: its journal offset was never reached
    received_s: float = 0.0  # monotonic, when this process read it
    size: int = 0  # its record's bytes
    # Its journal offset is past this end of its journal partition, which the broker gave
    # after it arrived (unordered too): no gateway stamped it.
    past_end: int | None = None


class _States(dict[str, TaskState]):
    """Task states by id. A sealed task (in `sealed`, 8 bytes, and nothing here) reads as the
    state of its status only, made when asked: not a TaskState (hundreds of bytes each, millions
    of them after months). A dormant task (restored from a snapshot as bytes) is decoded and
    folded the first time it is asked for."""

    def __init__(self, sealed: SealedTasks, dormant: dict[str, snaps.Dormant],
                 wake: Callable[[str], None]) -> None:
        super().__init__()
        self.sealed = sealed
        self.dormant = dormant
        self.wake = wake

    def __contains__(self, task_id: object) -> bool:
        return super().__contains__(task_id) or task_id in self.dormant

    def get(self, task_id: str, default: TaskState | None = None) -> TaskState | None:  # type: ignore[override]
        if task_id in self.dormant:
            self.wake(task_id)
        state = super().get(task_id)
        if state is not None:
            return state
        status = self.sealed.get(task_id)
        return default if status is None else TaskState(task_id=task_id, status=status)

    def __missing__(self, task_id: str) -> TaskState:
        if task_id in self.dormant:
            self.wake(task_id)
            return self[task_id]
        status = self.sealed.get(task_id)
        if status is None:
            raise KeyError(task_id)
        return TaskState(task_id=task_id, status=status)


class _Listener(ConsumerRebalanceListener):
    def __init__(self, follower: JournalFollower) -> None:
        self.follower = follower

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        self.follower._forget(revoked)

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        await self.follower._adopt(assigned)


class JournalFollower:
    """`side` is a second topic keyed like the journal (by task id) and read with it: the
    tasks topic for the decider (requests), the webhooks topic for the reconciler.
    `gather_ms`: the broker may gather fetches that long (`EventConsumer`); with
    `side_at_once`, the side topic's records are fetched at once even so."""

    def __init__(self, settings: KafkaSettings, *, group: str, writer: JournalWriter,
                 on_change: OnChange, side: TopicSpec | None = None,
                 on_event: OnEvent | None = None, on_assign: OnAssign | None = None,
                 on_revoke: OnRevoke | None = None, app_label: str | None = None,
                 seal_after_s: float | None = None, snapshots: bool = False,
                 wake_on_catch_up: WakeOnCatchUp | None = None,
                 gather_ms: int = 0, side_at_once: bool = False,
                 on_seal: OnSeal | None = None, on_restore: OnRestore | None = None,
                 on_image: OnImage | None = None, hold: Hold | None = None) -> None:
        assert side in (None, TASKS, WEBHOOKS), "side topics must be keyed by task id"
        topics: tuple[TopicSpec, ...] = (JOURNAL,) if side is None else (JOURNAL, side)
        # Settings from the environment first: a wrong one fails before any client is made.
        self.snapshots = snaps.enabled(snapshots)
        self._snapshot_every_s = snaps.every_s()
        self.group = group
        self._settings = settings
        self._side = None if side is None else side.name(settings.topic_prefix)
        self._writer = writer
        self._journal = JOURNAL.name(settings.topic_prefix)
        self._webhooks = WEBHOOKS.name(settings.topic_prefix) if side is WEBHOOKS else None
        self._consumer = EventConsumer(settings, topics=topics, group=group, writer=writer,
                                       listener=_Listener(self), app_label=app_label,
                                       gather_ms=gather_ms,
                                       prompt=(side,) if side_at_once and side else ())
        self._on_change = on_change
        self._on_event = on_event
        self._on_assign = on_assign
        self._on_revoke = on_revoke
        self._on_seal = on_seal
        self._on_restore = on_restore
        self._on_image = on_image
        self._hold = hold
        self._log = log.get("halfway.follower", group=group)
        self.sealed = SealedTasks()  # task id -> how it ended; only that is kept
        # Restored from a snapshot over and settled for good, not decoded (yet): see `_wake`.
        self.dormant: dict[str, snaps.Dormant] = {}
        self.states: dict[str, TaskState] = _States(self.sealed, self.dormant, self._wake_task)
        # A dormant task is not looked at when its partition catches up (there is nothing to
        # do for it) unless this says so (the decider: it still holds a claim).
        self._wake_on_catch_up = wake_on_catch_up
        self.requests: dict[str, TaskRequested] = {}  # first request per task, tasks topic
        # The journal offset of each effect's first attempt record, by its key (step or undo
        # key): what a webhook's stamp is compared with.
        self.first_attempt: dict[str, int] = {}
        self._held: dict[int, list[HeldWebhook]] = {}  # partition number -> waiting webhooks
        self._held_tasks: Counter[str] = Counter()  # task id -> its webhooks in `_held`
        self._held_bytes: Counter[int] = Counter()  # partition number -> bytes in `_held`
        # Journal partition number -> (its end offset, monotonic time it was asked for).
        self._asked_ends: dict[int, tuple[int, float]] = {}
        self._ends_wanted: set[int] = set()  # journal partitions to ask the end of
        self._ends_asked_s = -END_CHECK_INTERVAL_S  # monotonic, the last time they were
        self._asking_ends: asyncio.Task[None] | None = None
        self._weighable: dict[str, list[HeldWebhook]] = {}  # task id -> webhooks to weigh now
        self._paused: set[TopicPartition] = set()
        self._partitions: dict[TopicPartition, _Partition] = {}
        self._awaiting: dict[str, tuple[TopicPartition, int]] = {}
        self._dirty: set[str] = set()
        self._ahead: set[TopicPartition] = set()  # partitions with own appends past a gap
        self._failures: dict[str, int] = {}
        self._retries: dict[str, asyncio.TimerHandle] = {}
        self._progress = asyncio.Condition()
        self._wake = Wake()  # set by `touch`: the quiet fetch ends at once
        # Partitions adopted while a fetch was under way: (adoption number, start offset).
        self._adoptions = 0
        # Partitions whose snapshot is being read (paused until restored): number -> their
        # journal and side partitions' state in the making; the tasks loading them.
        self._loading: dict[int, dict[TopicPartition, _Partition]] = {}
        self._loaders: set[asyncio.Task[None]] = set()
        self._since_freeze = 0  # records folded since the last gc.freeze
        self._watch = LoopWatch(f"{group} fold")  # stops the service if the loop gets stuck
        self._adopted: dict[TopicPartition, tuple[int, int]] = {}
        self._committed_at_s = 0.0
        self.on_give_up: Callable[[str, BaseException], Awaitable[None]] | None = None
        self._seal_after = None if seal_after_s is None else timedelta(seconds=seal_after_s)
        # Per journal partition, ended tasks in the order their last event came.
        self._ended: dict[int, EndedTasks] = {}
        # The same, waiting to go dormant (snapshots only: dormant tasks need their history).
        self._quieting: dict[int, ByTime] = {}
        # Snapshots (whether, and how often: read first, above): the journal records folded
        # into each task's state since it was last sealed (all of them for a live task),
        # which is what an image of its partition holds.
        self._history: dict[str, list[tuple[int, Event]]] = {}
        self._snapshotting: asyncio.Task[None] | None = None
        self.snapshot_written_s: float | None = None  # monotonic, the last one written
        self.restored: dict[int, int] = {}  # partition -> offset its snapshot was taken at
        # Counted here as plain numbers, read at scrape time (metrics.py): a Prometheus
        # counter takes a lock on every increment, and this is once per record.
        self.applied_by_topic: Counter[str] = Counter(
            {t.name(settings.topic_prefix): 0 for t in topics})
        self.settled_by: Counter[tuple[str, str]] = Counter()  # (outcome, source) -> steps
        metrics.watch(self)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        await self._consumer.start()
        local_appends.add(self._appended)

    async def stop(self) -> None:
        local_appends.remove(self._appended)
        await self._consumer.stop()

    async def run(self) -> None:
        """Fold and report changes until cancelled; LoopStalled if the loop gets stuck."""
        try:
            await run_until_cancelled(self._loop(), self._watch.watch())
        finally:
            for handle in self._retries.values():
                handle.cancel()
            self._retries.clear()
            for loader in list(self._loaders):
                loader.cancel()
            if self._asking_ends is not None:
                self._asking_ends.cancel()
            if self._snapshotting is not None:
                self._snapshotting.cancel()
                with contextlib.suppress(BaseException):
                    await self._snapshotting

    async def _loop(self) -> None:
        while True:
            self._watch.turned()
            if self._hold is not None:  # the service has too much to send: it waits
                await self._hold()
            # Yield to the loop once per batch: a fetch served from aiokafka's prefetched
            # buffer returns without suspending, and a long replay that never suspends
            # starves the consumer's heartbeat (the group then takes the partitions away
            # and the replay starts over). A batch that waited has yielded already.
            if not self._consumer.waited:
                await asyncio.sleep(0)
            adoptions = self._adoptions
            deliveries = await self._consumer.batch(IDLE_FETCH_MS, wake=self._wake,
                                                    folded=self._folded)
            if self._adoptions != adoptions:
                deliveries = self._not_before_adoption(deliveries, adoptions)
            for d in deliveries:
                self._apply(d.event, TopicPartition(d.topic, d.partition), d.offset, d.size)
            self._since_freeze += len(deliveries)
            if self._since_freeze >= GC_FREEZE_EVERY_RECORDS:
                self._since_freeze = 0
                gc.collect()  # walks only what was not frozen yet: the newest records'
                gc.freeze()
            await self._refresh_positions()
            if self._ahead:
                self._fold_all_ahead()
            self._release_webhooks()
            await self._commit_webhooks()
            async with self._progress:
                self._progress.notify_all()
            self._maybe_snapshot()
            ready = self._take_ready()
            if ready:
                try:
                    await self._on_change(ready)
                except Exception:
                    # A service's own isolation (`for_each`) should have caught it; if not,
                    # the loop still goes on and the tasks are looked at again later.
                    self._log.exception("acting on changed tasks failed",
                                        tasks=len(ready))
                    for task_id in ready:
                        self._retry_later(task_id)

    # -- what services call ----------------------------------------------------------------

    def partition_lags(self) -> list[tuple[str, int, int, bool]]:
        """(topic, partition, records behind its end, caught up) of each owned partition."""
        out = []
        for tp, part in list(self._partitions.items()):
            end = self._consumer.highwater(tp)  # None once revoked meanwhile
            end = part.end_at_assign if end is None else end
            out.append((tp.topic, tp.partition, max(0, end - part.applied_to - 1),
                        part.caught_up))
        return out

    def note_write(self, task_id: str, partition: int, offset: int) -> None:
        """The service appended to the journal: hold the task until the follower sees it
        (then it is reported again)."""
        tp = TopicPartition(self._journal, partition)
        known = self._awaiting.get(task_id)
        if known is None or known[0] != tp or known[1] < offset:
            self._awaiting[task_id] = (tp, offset)
        self._dirty.add(task_id)
        self._wake.set()

    def owns(self, task_id: str) -> bool:
        return any(task_id in p.tasks for tp, p in self._partitions.items()
                   if tp.topic == self._journal)

    def holds(self, task_id: str) -> bool:
        """The task's journal partition is assigned here and read to its end, whether or not
        the task has an event yet (one being started)."""
        for tp, part in self._partitions.items():
            if task_id in part.tasks and tp.topic == self._journal:
                return part.caught_up  # the common case: no hash to compute
        count = len(self._consumer.kafka.partitions_for_topic(self._journal) or ())
        if not count:
            return False
        part = self._partitions.get(
            TopicPartition(self._journal, partition_of(task_id.encode(), count)))
        return part is not None and part.caught_up

    def touch(self, task_id: str) -> None:
        """Report the task again at the next batch (a timer fired), without waiting out a
        quiet fetch."""
        self._dirty.add(task_id)
        self._wake.set()

    async def for_each(self, task_ids: Iterable[str], act: Callable[[str], Awaitable[None]],
                       at_once: int = ACTS_AT_ONCE_MAX) -> None:
        """`act` on each task, up to `at_once` at a time (one task's act never waits on
        another's journal write); a task whose act raises is logged and tried again later
        (bounded backoff), and never stops the others."""
        async def one(task_id: str) -> None:
            if not any(task_id in p.tasks for p in self._partitions.values()):
                return  # revoked while other tasks of the batch were acted on
            if self.write_pending(task_id):
                # The service wrote for this task after the batch was read (a move that ran
                # meanwhile): acting on the older state would undo what it just decided. It
                # is reported again once its write is folded (note_write marked it).
                return
            try:
                await act(task_id)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await self._failed(task_id, exc)
            else:
                self._failures.pop(task_id, None)

        ids = list(task_ids)
        if len(ids) == 1:
            await one(ids[0])  # the common case when tasks come one by one: no task of its own
            return
        for start in range(0, len(ids), at_once):
            await asyncio.gather(*(one(t) for t in ids[start:start + at_once]))

    async def applied(self, partition: int, offset: int, timeout_s: float) -> bool:
        """Wait until the journal partition's record at `offset` is folded here. A partition
        revoked meanwhile may come back (a rebalance takes every partition away before it
        assigns them again): then it is once it is read that far again. False if that has
        not happened within `timeout_s` (the partition went to another instance)."""
        tp = TopicPartition(self._journal, partition)

        def reached() -> bool:
            part = self._partitions.get(tp)
            return part is not None and part.applied_to >= offset

        if reached():  # folded as it was appended, the common case: no lock, no timer
            return True
        try:
            async with asyncio.timeout(timeout_s), self._progress:
                await self._progress.wait_for(reached)
        except TimeoutError:
            return False
        return True

    def take_webhooks(self, task_id: str) -> list[HeldWebhook]:
        """The task's webhooks whose order against the journal is now known, once."""
        taken = self._weighable.pop(task_id, [])
        if (taken and task_id not in self.states and task_id not in self.requests
                and task_id not in self._held_tasks):
            # Webhooks for a task the journal does not know (orphans, weighed now): nothing of
            # it stays in memory once they are, or a flood of them would stay for good.
            for tp, part in self._partitions.items():
                if tp.topic == self._webhooks:
                    part.tasks.discard(task_id)
        return taken

    def put_back_webhooks(self, task_id: str, items: list[HeldWebhook]) -> None:
        """Webhooks taken but not weighed yet: handed over again with the task's next change."""
        if items:
            self._weighable[task_id] = [*items, *self._weighable.get(task_id, [])]
            self._dirty.add(task_id)

    # -- internals -------------------------------------------------------------------------

    async def _failed(self, task_id: str, exc: BaseException) -> None:
        failures = self._failures.get(task_id, 0) + 1
        self._failures[task_id] = failures
        self._log.error("acting on a task failed; it is tried again later", task_id=task_id,
                        failures=failures, error=f"{type(exc).__name__}: {exc}"[:500],
                        exc_info=exc)
        self._retry_later(task_id)
        if failures == FAILURES_MAX and self.on_give_up is not None:
            try:
                await self.on_give_up(task_id, exc)
            except Exception:
                self._log.exception("giving up on a task failed too", task_id=task_id)

    def _retry_later(self, task_id: str) -> None:
        failures = max(1, self._failures.get(task_id, 1))
        delay_s = min(RETRY_S_MAX, RETRY_S_MIN * 2 ** (failures - 1))
        if (old := self._retries.pop(task_id, None)) is not None:
            old.cancel()

        def again() -> None:
            self._retries.pop(task_id, None)
            self.touch(task_id)

        self._retries[task_id] = asyncio.get_running_loop().call_later(delay_s, again)

    def _appended(self, topic: str, event: Event, partition: int, offset: int,
                  writer: JournalWriter) -> None:
        """This process appended `event` at `offset` of the journal: fold it now if every
        record before it is folded (the fold stays in log order); its fetched copy is then
        skipped. Past a gap it waits (bounded) for the gap to be folded, by the fetch or by
        this process's own append there; the fetch brings it too, whichever comes first.
        The loop is woken for another service's append (a worker's partner: its next move
        may be ours); for our own service's, `note_write` wakes it, just after: the partner
        that has a move to make goes first."""
        if topic != self._journal:
            return
        tp = TopicPartition(topic, partition)
        part = self._partitions.get(tp)
        if part is None or not part.caught_up or offset <= part.applied_to:
            return
        if offset != part.applied_to + 1:
            if len(part.ahead) < LOCAL_AHEAD_MAX:
                part.ahead[offset] = event
                self._ahead.add(tp)
            return
        self._apply(event, tp, offset)
        self._fold_ahead(tp, part)
        if writer is not self._writer:
            self._wake.set()

    def _fold_ahead(self, tp: TopicPartition, part: _Partition) -> None:
        """Fold the own appends that waited for what is folded now; forget those fetched."""
        ahead = part.ahead
        while (event := ahead.pop(part.applied_to + 1, None)) is not None:
            self._apply(event, tp, part.applied_to + 1)
        for offset in [o for o in ahead if o <= part.applied_to]:
            del ahead[offset]
        if not ahead:
            self._ahead.discard(tp)

    def _fold_all_ahead(self) -> None:
        for tp in list(self._ahead):
            part = self._partitions.get(tp)
            if part is None:
                self._ahead.discard(tp)  # revoked: its appends go with it
            else:
                self._fold_ahead(tp, part)

    def _folded(self, topic: str, partition: int, offset: int) -> bool:
        """Whether a fetched record is folded already (this process's own append)."""
        part = self._partitions.get(TopicPartition(topic, partition))
        return part is not None and offset <= part.applied_to

    def _apply(self, event: Event | WebhookReceived, tp: TopicPartition, offset: int,
               size: int = 0) -> None:
        part = self._partitions.get(tp)
        if part is None:
            return  # a record fetched just before its partition was revoked
        if offset <= part.applied_to:
            return  # folded when this process appended it
        part.applied_to = offset
        self.applied_by_topic[tp.topic] += 1
        if isinstance(event, WebhookReceived):
            if event.key is None or event.task_id is None:
                return  # not about any effect of ours: nothing to match it with
            part.tasks.add(event.task_id)
            held = self._held.setdefault(tp.partition, [])
            self._held_tasks[event.task_id] += 1
            held.append(HeldWebhook(event, tp.partition, offset,
                                    fresh=offset >= part.noticed_to,
                                    received_s=time.monotonic(), size=size))
            self._held_bytes[tp.partition] += size
            held_bytes = self._held_bytes[tp.partition]
            if (len(held) >= HELD_WEBHOOKS_MAX or held_bytes >= HELD_WEBHOOK_BYTES_MAX) \
                    and tp not in self._paused:
                self._consumer.pause(tp)  # the journal catches up first
                self._paused.add(tp)
                self._log.warning("webhooks paused until the journal catches up",
                                  partition=tp.partition, held=len(held),
                                  held_bytes=held_bytes)
            return
        if tp.topic != self._journal and self.sealed.has(tp.partition, event.task_id):
            # A request again for a task over for good: nothing to start, so nothing is kept
            # (held, it would stay in every snapshot: nothing seals a task twice).
            return
        part.tasks.add(event.task_id)
        part.since_snapshot += 1
        if isinstance(event, StepSettled):
            self.settled_by[event.outcome.value, event.source.value] += 1
        if tp.topic != self._journal:
            if not isinstance(event, TaskRequested):
                # Callers write the tasks topic: what they write there is a request or
                # nothing. Folding anything else would let a caller settle a step.
                self._log.warning("ignored: not a request, on the tasks topic",
                                  type=event.type, task_id=event.task_id, offset=offset)
                return
            if event.task_id in self.dormant:
                self._wake_task(event.task_id)  # its first request comes back first
            self.requests.setdefault(event.task_id, event)
        elif self.sealed.has(tp.partition, event.task_id) and not isinstance(
                event, TaskRequested):
            return  # late news of a sealed task: not folded (see the module docstring)
        else:
            _, after = self._fold(event, offset, tp.partition)
            if self._seal_after is not None:
                if after.status in (TaskStatus.FINISHED, TaskStatus.REJECTED):
                    ended = self._ended.get(tp.partition)
                    if ended is None:
                        ended = self._ended[tp.partition] = EndedTasks()
                    ended.add(event.at, event.task_id)
                    if self.snapshots:
                        self._quieting.setdefault(tp.partition, ByTime()).add(
                            event.at, event.task_id)
                self._seal_due(tp.partition, event.at)
                self._quiet_due(tp.partition, event.at)
        self._dirty.add(event.task_id)

    def _fold(self, event: Event, offset: int,
              partition: int) -> tuple[TaskState | None, TaskState]:
        """Fold one journal record into its task's state (and the snapshot's history)."""
        if isinstance(event, StepAttempted | CompensationAttempted):
            self.first_attempt.setdefault(event.key, offset)
        before = self.states.get(event.task_id)
        after = shared_folds.apply(before, event)  # the worker's other follower's, if it has it
        self.states[event.task_id] = after
        if self.snapshots:
            self._history.setdefault(event.task_id, []).append((offset, event))
        if self._on_event is not None and after is not before:
            self._on_event(before, after, partition, offset)
        return before, after

    def _wake_task(self, task_id: str, partition: int | None = None) -> None:
        """Decode and fold a dormant task's events (news of it came, or a service asked)."""
        dormant = self.dormant.pop(task_id)
        history, request = dormant.decode()
        if request is not None:
            self.requests.setdefault(task_id, request)
        if partition is None:
            partition = self._journal_partition_of(task_id)
        for offset, event in history:
            self._fold(event, offset, partition)

    def _journal_partition_of(self, task_id: str) -> int:
        for tp, part in self._partitions.items():
            if tp.topic == self._journal and task_id in part.tasks:
                return tp.partition
        count = len(self._consumer.kafka.partitions_for_topic(self._journal) or ())
        return partition_of(task_id.encode(), count) if count else -1

    def _seal_due(self, number: int, now: datetime) -> None:
        """Seal the tasks of journal partition `number` that ended `seal_after` before `now`
        (the `at` of the record just folded) with every effect settled."""
        assert self._seal_after is not None
        ended = self._ended.get(number)
        for task_id in ended.due(now, self._seal_after) if ended is not None else ():
            dormant = self.dormant.pop(task_id, None)
            if dormant is not None:  # no news since the snapshot: settled for good still
                self._seal(number, task_id, TaskStatus(dormant.status))
                for key, _ in dormant.first_attempts:
                    self.first_attempt.pop(key, None)
                self._weighable.pop(task_id, None)
                self._failures.pop(task_id, None)
                continue
            state = self.states.get(task_id)
            if state is None or not settled_for_good(state):
                continue  # needs attention, or an effect is open: its next event re-enters it
            self.states.pop(task_id, None)  # a sealed task reads from `sealed`
            assert state.status is not None
            self._seal(number, task_id, state.status)
            self._history.pop(task_id, None)
            self.requests.pop(task_id, None)
            self._weighable.pop(task_id, None)
            self._failures.pop(task_id, None)
            for step in state.steps.values():
                for key in (step.intent.key, *step.undo_keys):
                    self.first_attempt.pop(key, None)

    def _quiet_due(self, number: int, now: datetime) -> None:
        """Keep the tasks of journal partition `number` that ended DORMANT_AFTER_S before
        `now`, settled for good and without news since, as bytes (see `_wake_task`)."""
        quieting = self._quieting.get(number)
        ended = self._ended.get(number)
        for at, task_id in quieting.due(now, _DORMANT_AFTER) if quieting else ():
            if ended is None or not ended.is_last(task_id, at) or task_id in self.dormant:
                continue  # sealed, news since, or dormant already
            state = dict.get(self.states, task_id)
            history = self._history.get(task_id)
            if state is None or history is None or not settled_for_good(state):
                continue
            self.dormant[task_id] = snaps.Dormant.of(task_id, str(state.status), history,
                                                     self.requests.pop(task_id, None))
            dict.pop(self.states, task_id)
            del self._history[task_id]

    def _seal(self, number: int, task_id: str, status: TaskStatus) -> None:
        self.sealed.add(number, task_id, status)
        for tp, part in self._partitions.items():  # its id is kept in `sealed` only
            if tp.partition == number:
                part.tasks.discard(task_id)
        if self._on_seal is not None:
            self._on_seal(number, task_id)

    def _not_before_adoption(self, deliveries: list[Delivery],
                             adoptions: int) -> list[Delivery]:
        """A fetch that was under way while partitions were adopted may hold their records
        from before the adoption's seek (from wherever the consumer started by itself), out
        of order with what the seek reads. They are dropped, and the partition is sought to
        its start again, so whatever of them came from after the seek is read once more."""
        kept, again = [], {}
        for d in deliveries:
            tp = TopicPartition(d.topic, d.partition)
            adopted = self._adopted.get(tp)
            if adopted is not None and adopted[0] > adoptions:
                again[tp] = adopted[1]
            else:
                kept.append(d)
        for tp, start in again.items():
            if tp in self._partitions:
                self._consumer.seek(tp, start)
        return kept

    async def _refresh_positions(self) -> None:
        """Positions of the partitions the last fetch returned records of, of those still
        catching up, and after a quiet fetch of all (a position moves only with a fetch: none
        after a batch woken before its fetch returned, as for each own append)."""
        fetched = self._consumer.fetched
        woken = self._consumer.woken
        for tp, part in list(self._partitions.items()):
            if part.caught_up and (woken or (fetched and tp not in fetched)):
                continue
            try:
                position = await self._consumer.position(tp)
            except Exception:  # revoked meanwhile
                continue
            # Past the records skipped as invalid too; never back over a local fold.
            part.applied_to = max(part.applied_to, position - 1)
            if not part.caught_up and position >= part.end_at_assign:
                part.caught_up = True
                for other_tp, other in self._partitions.items():  # its tasks, on every topic
                    if other_tp.partition == tp.partition:
                        self._dirty |= self._open(other.tasks)
                self._log.info("caught up", topic=tp.topic, partition=tp.partition,
                               offset=position, tasks=len(part.tasks))

    def _open(self, tasks: set[str]) -> set[str]:
        """Those of a partition's `tasks` that may have something to do as it catches up. A
        sealed or dormant task with no news is over: nothing to look at, but for the dormant
        ones the service names (`wake_on_catch_up`). A partition holds thousands of dormant
        tasks at most (those over within the seal window): set operations sort them out, not
        a call for each (10-20 ms on the loop per partition caught up at 10M journal events)."""
        dormant = tasks & self.dormant.keys()
        out = {t for t in tasks - dormant
               if dict.__contains__(self.states, t) or t in self.requests or t not in self.sealed}
        if dormant and self._wake_on_catch_up is not None:
            out.update(t for t in self._wake_on_catch_up(dormant) if t in dormant)
        return out

    def _release_webhooks(self) -> None:
        """Hand over every held webhook whose journal offset the journal has been read past."""
        now_s = time.monotonic()
        for number, held in list(self._held.items()):
            journal = self._partitions.get(TopicPartition(self._journal, number))
            if journal is None:
                continue
            waiting = []
            fetched = self._consumer.highwater(TopicPartition(self._journal, number)) or 0
            for item in held:
                stamp = item.hook.journal_offset
                ordered = (stamp is None or item.hook.journal_partition != number
                           or journal.applied_to >= stamp - 1)
                past_end = None if ordered else self._past_end(number, stamp, item.received_s,
                                                               fetched)
                overdue = now_s - item.received_s > HELD_WEBHOOK_S_MAX
                if ordered or overdue or past_end is not None:
                    ready = item if ordered else replace(item, unordered=True,
                                                         past_end=past_end)
                    task_id = item.hook.task_id
                    assert task_id is not None
                    self._held_tasks[task_id] -= 1
                    if not self._held_tasks[task_id]:
                        del self._held_tasks[task_id]
                    self._weighable.setdefault(task_id, []).append(ready)
                    self._dirty.add(task_id)
                else:
                    waiting.append(item)
            self._held[number] = waiting
            self._held_bytes[number] = sum(item.size for item in waiting)
            tp = next((t for t in self._paused if t.partition == number), None)
            if tp is not None and len(waiting) < HELD_WEBHOOKS_MAX // 2 \
                    and self._held_bytes[number] < HELD_WEBHOOK_BYTES_MAX // 2:
                self._consumer.resume(tp)
                self._paused.discard(tp)
        self._ask_ends_soon()

    def _past_end(self, number: int, stamp: int | None, received_s: float,
                  fetched: int) -> int | None:
        """The end of journal partition `number` the broker gave after a webhook stamped
        `stamp` arrived (at `received_s`), if the stamp is past it; else None, and the end is
        asked for when the stamp is past every end known here (`fetched`: as of the last
        fetch). A genuine stamp is an end the gateway read before publishing: the broker's
        ends since are at or past it."""
        assert stamp is not None
        asked = self._asked_ends.get(number)
        if asked is not None and asked[1] >= received_s:
            return asked[0] if stamp > asked[0] else None
        if stamp > max(fetched, asked[0] if asked is not None else 0):
            self._ends_wanted.add(number)
        return None

    def _ask_ends_soon(self) -> None:
        """Ask the broker for the ends `_past_end` wants, unless it was asked less than
        END_CHECK_INTERVAL_S ago (then at a later turn of the loop) or is being asked."""
        now_s = time.monotonic()
        if (not self._ends_wanted or self._asking_ends is not None
                or now_s - self._ends_asked_s < END_CHECK_INTERVAL_S):
            return
        numbers, self._ends_wanted = self._ends_wanted, set()
        self._ends_asked_s = now_s
        self._asking_ends = asyncio.create_task(self._ask_ends(numbers, now_s))

    async def _ask_ends(self, numbers: set[int], asked_s: float) -> None:
        """The journal partitions' ends now, as `_past_end` reads them; the loop is woken to
        hand over what they show forged. A failure is logged: asked again when wanted."""
        tps = [TopicPartition(self._journal, n) for n in sorted(numbers)]
        try:
            async with asyncio.timeout(END_CHECK_TIMEOUT_S):
                ends = await self._consumer.kafka.end_offsets(tps)
        except Exception as exc:  # the broker's errors are many; each means "not known now"
            self._log.warning("journal ends not read", error=repr(exc)[:500],
                              partitions=sorted(numbers))
            return
        finally:
            self._asking_ends = None
        for tp, end in ends.items():
            self._asked_ends[tp.partition] = (end, asked_s)
        self._wake.set()

    async def _commit_webhooks(self) -> None:
        """Commit, per webhooks partition, the offset below which every webhook was weighed
        (its notices written), so a restart writes no notice twice. At most once a second."""
        now_s = time.monotonic()
        if now_s - self._committed_at_s < WEBHOOK_COMMIT_INTERVAL_S:
            return
        self._committed_at_s = now_s
        offsets = {}
        for tp, part in self._partitions.items():
            if tp.topic != self._webhooks or not part.caught_up:
                continue
            pending = [h.offset for h in self._held.get(tp.partition, ())]
            pending += [h.offset for items in self._weighable.values() for h in items
                        if h.partition == tp.partition]
            upto = min(pending) if pending else part.applied_to + 1
            if upto > part.noticed_to:
                offsets[tp] = upto
        if not offsets:
            return
        try:
            await self._consumer.kafka.commit(offsets)
        except Exception as exc:  # a rebalance under way: the next owner weighs them again
            self._log.warning("could not commit webhook offsets", error=repr(exc))
            return
        for tp, upto in offsets.items():
            if tp in self._partitions:
                self._partitions[tp].noticed_to = upto

    def write_pending(self, task_id: str) -> bool:
        """The service wrote for the task and this fold does not have it yet."""
        awaiting = self._awaiting.get(task_id)
        if awaiting is None:
            return False
        part = self._partitions.get(awaiting[0])
        return part is not None and part.applied_to < awaiting[1]

    def _take_ready(self) -> set[str]:
        """The dirty tasks to report now. A task waiting for its own write stays dirty (few:
        one per move in flight); one whose partitions are still catching up is dropped, and
        dirtied again, with every task of its partitions, when they catch up. So the work per
        batch follows the batch, never the number of tasks replayed so far: a long catch-up
        does not starve the consumer's loop (and its heartbeat)."""
        ready: set[str] = set()
        for task_id in list(self._dirty):
            verdict = self._ready(task_id)
            if verdict is not _LATER:
                self._dirty.discard(task_id)
            if verdict is _READY:
                ready.add(task_id)
        return ready

    def _ready(self, task_id: str) -> object:
        numbers = {tp.partition for tp, p in self._partitions.items() if task_id in p.tasks}
        if not numbers:
            return _PARKED  # not ours (any more)
        # The task's journal partition (same number as its tasks partition) and its side
        # partition, if any, must be caught up.
        number = min(numbers)
        journal = self._partitions.get(TopicPartition(self._journal, number))
        if journal is None or not journal.caught_up:
            return _PARKED
        if not all(p.caught_up for tp, p in self._partitions.items()
                   if tp.partition == number and task_id in p.tasks):
            return _PARKED
        awaiting = self._awaiting.get(task_id)
        if awaiting is not None:
            tp, offset = awaiting
            part = self._partitions.get(tp)
            if part is not None and part.applied_to < offset:
                return _LATER
            del self._awaiting[task_id]
        return _READY

    def _forget(self, revoked: list[TopicPartition]) -> None:
        for tp in revoked:
            loading = self._loading.get(tp.partition)
            if loading is not None and tp in loading:
                # Its snapshot is still being read: the loader finds it gone and drops what
                # it restored.
                del self._loading[tp.partition]
            part = self._partitions.pop(tp, None)
            if part is None:
                continue
            self._drop(tp, part)
        if revoked:
            self._log.info("partitions revoked", partitions=sorted(tp.partition for tp in revoked))
            if self._on_revoke is not None:
                self._on_revoke({tp.partition for tp in revoked if tp.topic == self._journal})

    def _drop(self, tp: TopicPartition, part: _Partition) -> None:
        """Forget what a partition no longer ours held (its tasks, unless another owned
        partition has them too)."""
        self._paused.discard(tp)
        self._adopted.pop(tp, None)
        if tp.topic == self._journal:
            self._ended.pop(tp.partition, None)
            self._quieting.pop(tp.partition, None)
            self.restored.pop(tp.partition, None)
            self.sealed.drop(tp.partition)
        if tp.topic != self._journal:
            self._held_bytes.pop(tp.partition, None)
            for item in self._held.pop(tp.partition, ()):
                self._held_tasks[item.hook.task_id or ""] -= 1
            self._held_tasks = +self._held_tasks  # drop the zeros
        for task_id in part.tasks:
            if not any(task_id in p.tasks for p in self._partitions.values()):
                state = self.states.pop(task_id, None)
                dormant = self.dormant.pop(task_id, None)
                for key, _ in (dormant.first_attempts if dormant is not None else ()):
                    self.first_attempt.pop(key, None)
                self.requests.pop(task_id, None)
                self._history.pop(task_id, None)
                self._weighable.pop(task_id, None)
                for step in (state.steps.values() if state is not None else ()):
                    for key in (step.intent.key, *step.undo_keys):
                        self.first_attempt.pop(key, None)
                self._awaiting.pop(task_id, None)
                self._dirty.discard(task_id)
                self._failures.pop(task_id, None)
                if (handle := self._retries.pop(task_id, None)) is not None:
                    handle.cancel()

    async def _adopt(self, assigned: list[TopicPartition]) -> None:
        kafka = self._consumer.kafka
        new = [tp for tp in assigned if tp not in self._partitions]
        if not new:
            return
        # Partitions that may have a snapshot, or whose service reads something first
        # (`on_assign`), are paused and loaded in the background, each served as soon as its
        # own load is done (a restart acts on one partition's tasks without waiting for every
        # image); nothing here waits on the network: a rebalance listener that runs past the
        # session timeout loses the partitions, and it starts over.
        candidates = self._loadable(new)
        numbers = {tp.partition for tp in candidates}
        ends = await kafka.end_offsets(new)
        parts = {tp: _Partition(end_at_assign=ends[tp]) for tp in new}
        for tp in new:
            if tp.topic == self._webhooks:
                parts[tp].noticed_to = await kafka.committed(tp) or 0
        later = {tp: part for tp, part in parts.items() if tp.partition in numbers}
        for number in numbers:
            self._loading[number] = {tp: part for tp, part in later.items()
                                     if tp.partition == number}
        if later:
            self._consumer.pause(*later)
            loader = asyncio.create_task(self._load(candidates))
            self._loaders.add(loader)
            loader.add_done_callback(self._loaders.discard)
        self._serve({tp: part for tp, part in parts.items() if tp not in later}, {})
        self._log.info("partitions assigned", partitions=sorted(tp.partition for tp in new),
                       loading=sorted(numbers), gather_ms=self._consumer.gather_ms,
                       at_once=self._consumer.at_once)

    def _serve(self, parts: dict[TopicPartition, _Partition],
               starts: dict[TopicPartition, int]) -> None:
        """Start reading `parts` (at `starts`, else from zero). They join `_partitions` only
        now, with no await in between: until then `_apply` drops what the consumer fetched
        for them (from wherever it started by itself: the group's committed offset, which
        points at the snapshot), and nothing reports them caught up. The seeks make the
        consumer read those records again; a fetch under way meanwhile is sorted out by
        `_not_before_adoption`."""
        if not parts:
            return
        self._partitions.update(parts)
        self._adoptions += 1
        for tp in parts:
            offset = starts.get(tp, 0)
            self._consumer.seek(tp, offset)  # below the log's start: the earliest
            self._adopted[tp] = (self._adoptions, offset)

    # -- snapshots (halfway.journal.snapshots) ---------------------------------------------

    def _loadable(self, new: list[TopicPartition]) -> list[TopicPartition]:
        """The journal partitions newly owned that may be loaded in the background (restored
        from a snapshot, or read from zero once `on_assign` is done): those whose side
        partition (if any) is newly owned too, as the image covers both."""
        if not self.snapshots and self._on_assign is None:
            return []
        return [tp for tp in new if tp.topic == self._journal
                and (self._side is None or TopicPartition(self._side, tp.partition) in new)]

    async def _load(self, journal: list[TopicPartition]) -> None:
        """Restore each partition from its image as it is read (or, without a usable one,
        read it from zero), then resume it; each partition's own work (the service's hook, the
        restore) goes on beside the others', one task per partition just assigned."""
        pending = {tp.partition for tp in journal}
        async with asyncio.TaskGroup() as group:
            try:
                async for number, image in snaps.load_each(
                        self._settings, self.group, journal, wanted=self.snapshots,
                        seal_after_s=snaps.seal_window(self._seal_after), side=self._side):
                    pending.discard(number)
                    group.create_task(self._load_one(number, image))
            except Exception:  # the reads failed as a whole: never leave a partition paused
                self._log.exception("snapshots not read; partitions read from zero",
                                    partitions=sorted(pending))
                for number in sorted(pending):
                    group.create_task(self._load_one(number, None))

    async def _load_one(self, number: int, image: snaps.Image | None) -> None:
        """One partition's load. A partition revoked meanwhile is dropped; one whose load
        fails is read from zero (logged), never left paused."""
        try:
            await self._load_partition(number, image)
        except asyncio.CancelledError:
            raise
        except Exception:
            self._log.exception("partition not loaded; it is read from zero", partition=number)
            parts = self._loading.pop(number, None)
            if parts is None:
                return
            for tp, part in parts.items():
                self._drop(tp, part)
            fresh = {tp: _Partition(end_at_assign=part.end_at_assign)
                     for tp, part in parts.items()}
            self._serve(fresh, {})
            self._consumer.resume(*fresh)
            self._wake.set()

    async def _load_partition(self, number: int, image: snaps.Image | None) -> None:
        parts = self._loading.get(number)
        if parts is None:
            return  # revoked while its image was read
        tp = TopicPartition(self._journal, number)
        starts: dict[TopicPartition, int] = {}
        wake: set[str] = set()
        if image is None and self._on_assign is not None:
            await self._on_assign({number})
        elif image is not None and self._on_restore is not None:
            wake = await self._on_restore(number, image.journal_next, image.service)
        if self._loading.get(number) is not parts:
            # Revoked meanwhile: what the hook made of it goes too, unless it is ours again.
            if (self._on_revoke is not None and number not in self._loading
                    and tp not in self._partitions):
                self._on_revoke({number})
            return
        if image is not None:
            await self._restore(tp, image, parts, wake)
            if self._loading.get(number) is not parts:  # revoked while restoring
                for revoked_tp, part in parts.items():
                    self._drop(revoked_tp, part)
                return
            starts[tp] = image.journal_next
            side = None if self._side is None else TopicPartition(self._side, number)
            if side in parts and image.side_next is not None:
                parts[side].applied_to = image.side_next - 1
                starts[side] = image.side_next
        del self._loading[number]
        self._serve(parts, starts)
        self._consumer.resume(*parts)
        self._wake.set()  # a quiet fetch under way ends: the next one reads these too
        self._log.info("partition restored" if image is not None else
                       "partition read from zero", partition=number)

    async def _restore(self, tp: TopicPartition, image: snaps.Image,
                       parts: dict[TopicPartition, _Partition],
                       wake: set[str] | frozenset[str] = frozenset()) -> None:
        """The state the journal before `image.journal_next` gives, from its image, into the
        partitions being adopted; the dormant tasks in `wake` decoded. Yields to the loop every
        RESTORE_BATCH items: the consumer's heartbeat goes on meanwhile."""
        part = parts[tp]
        self.sealed.restore(tp.partition, image.sealed, checked=True)  # by snaps.encode
        ids = [dormant.task_id for dormant in image.dormant]  # (thousands: no call for each)
        self.dormant.update(zip(ids, image.dormant, strict=True))
        part.tasks.update(ids)
        self.first_attempt.update(pair for dormant in image.dormant
                                  for pair in dormant.first_attempts)
        await asyncio.sleep(0)
        for i, (offset, event) in enumerate(image.events):
            self._fold(event, offset, tp.partition)
            part.tasks.add(event.task_id)
            if i % RESTORE_BATCH == RESTORE_BATCH - 1:
                await asyncio.sleep(0)
        for task_id in wake & self.dormant.keys():
            self._wake_task(task_id, tp.partition)
        side = None if self._side is None else parts.get(TopicPartition(self._side, tp.partition))
        for request in image.requests:
            self.requests.setdefault(request.task_id, request)
            if side is not None:
                side.tasks.add(request.task_id)
        if image.ended:
            self._ended[tp.partition] = EndedTasks(image.ended)
        part.applied_to = image.journal_next - 1
        if image.format < snaps.FORMAT:  # written by the build before: rewrite it once caught up
            part.since_snapshot = snaps.EVERY_RECORDS
        self.restored[tp.partition] = image.journal_next

    def image(self, number: int,
              service: dict[str, Any] | None = None) -> snaps.Image | None:
        """The image of journal partition `number` now (between two batches), if owned, with
        what the service keeps in it (`OnImage`)."""
        tp = TopicPartition(self._journal, number)
        part = self._partitions.get(tp)
        if part is None:
            return None
        # Tasks over and settled for good go in as dormant (a restore does not fold them).
        quiet = {t for t in part.tasks if t in self._history and not self.sealed.has(number, t)
                 and settled_for_good(dict.__getitem__(self.states, t))}
        events = sorted((item for task_id in part.tasks if task_id not in quiet
                         for item in self._history.get(task_id, ())), key=lambda item: item[0])
        dormant = [self.dormant[t] for t in part.tasks if t in self.dormant]
        side_tp = None if self._side is None else TopicPartition(self._side, number)
        side = None if side_tp is None else self._partitions.get(side_tp)
        requests, side_next = [], None
        if side is not None:
            requests = [self.requests[t] for t in side.tasks
                        if t in self.requests and t not in quiet]
            side_next = side.applied_to + 1
            if self._side == self._webhooks:
                # Webhooks not weighed yet are read again after a restore; the journal has the
                # outcome of every one weighed (at or after the image's offset, in its tail).
                pending = [h.offset for h in self._held.get(number, ())]
                pending += [h.offset for items in self._weighable.values() for h in items
                            if h.partition == number]
                side_next = min([side_next, side.noticed_to, *pending])
        status = {t: dict.__getitem__(self.states, t).status for t in quiet}
        return snaps.Image(partition=number, journal_next=part.applied_to + 1,
                           side_next=side_next, events=events, requests=requests,
                           sealed=self.sealed.packed(number),
                           ended=self._ended[number].entries() if number in self._ended
                           else [],
                           dormant=dormant,
                           quiet=[(t, str(status[t]), self._history[t], self.requests.get(t))
                                  for t in quiet],
                           service=service, seal_after_s=snaps.seal_window(self._seal_after))

    def _maybe_snapshot(self) -> None:
        """Start writing one due snapshot (one at a time, in the background)."""
        if not self.snapshots or (self._snapshotting and not self._snapshotting.done()):
            return
        now_s = time.monotonic()
        for tp, part in self._partitions.items():
            if tp.topic != self._journal or not part.caught_up or part.applied_to < 0:
                continue
            side = None if self._side is None else self._partitions.get(
                TopicPartition(self._side, tp.partition))
            if side is not None and not side.caught_up:
                continue
            age_s = now_s - part.snapshot_s
            if not snaps.due(part.since_snapshot, age_s, self._snapshot_every_s):
                continue
            service = None if self._on_image is None else self._on_image(tp.partition)
            if self._on_image is not None and service is None:
                continue  # the service has none now: the next batch asks again
            image = self.image(tp.partition, service)
            assert image is not None
            part.since_snapshot, part.snapshot_s = 0, now_s
            self._snapshotting = asyncio.create_task(self._write_snapshot(tp, image))
            return

    async def _write_snapshot(self, tp: TopicPartition, image: snaps.Image) -> None:
        async def commit(metadata: str) -> bool:
            if tp not in self._partitions:
                return False
            await self._consumer.kafka.commit({tp: (image.journal_next, metadata)})
            return True

        if await snaps.write_and_point(self._writer, self.group, image, commit, self._log):
            self.snapshot_written_s = time.monotonic()


def settled_for_good(state: TaskState) -> bool:
    """Over, and nothing about it is open: every step and every undo settled, nobody needs to
    look. Such a task can be sealed."""
    if state.status not in (TaskStatus.FINISHED, TaskStatus.REJECTED) or state.needs_attention:
        return False
    final = (StepStatus.DONE, StepStatus.NOT_DONE)
    return all(step.status in final
               and (step.compensation is None or step.undo.status in final)
               for step in state.steps.values())
