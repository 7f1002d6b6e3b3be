"""The outcomes publisher: the journal, told as users should read it, on the outcomes topic.

It follows the journal (a JournalFollower, one consumer group per deployment) and, for every
journal event, derives which subjects' visible state changed (`derive.changes`). Each subject's
changes are numbered 1, 2, ... in log order, so a message's id (`{task_id}/{about}/{seq}`) is a
function of the journal alone: deriving again after a restart gives the same ids. Messages are
published keyed by task id, so one task's messages keep their order.

Every event, not every batch: the follower reports changed tasks once per fetch, and a fetch
may hold `unknown` and `done` of the same step; users must see the `unknown` too, and the
numbering must not depend on how records happened to be batched.

Restarts and rebalances: on an assignment the follower restores each journal partition from
its snapshot (`halfway.journal.snapshots`) and reads the journal after it, or, without a usable
one, replays it from offset zero. Before that, this service reads the outcomes partition of the
same number (both topics are keyed by task id with the same partition count) to its end and
keeps the highest seq already published per subject; only changes numbered higher are published
again. What was read of a subject is kept only until the numbering reaches it (then the journal
knows more). From zero, the whole partition is read. From a snapshot, only its end: the image
holds, beside the follower's state, what this service knew of its topic when it was taken
(`_image`): the outcomes offset at or past which every message it had not seen acknowledged
lands (`outcomes_from`), and, per task with messages not acknowledged yet, each such subject's
highest seq that was (`unsent`). The restore folds the open tasks' events again, and their
changes are numbered again (the same numbers: a task's history is whole in the image); a change
from before the image is on the topic unless `unsent` says otherwise, and then the read of the
outcomes partition from `outcomes_from` says whether it got there since. Tasks restored dormant
with messages unsent are woken at once, so their messages are sent. No image is taken while a
sealed task of the partition owes messages (the image keeps nothing of it to send them from).

Memory follows live work (`HALFWAY_SEAL_AFTER_S`): the follower seals a task over for good (see
`halfway.journal.follower`), and this service then forgets it too (its numbering and what was
read of it), but only once every message of it is on the topic. A task may be sealed in the very
batch that observed its last changes (a replay, or a journal clock that jumps): the follower
reports a sealed task no more, so what it still owes is sent from here (`_send_owed`). A replay
seals a task at the same record as the live fold did (the journal's clock), after numbering the
same changes, so its messages on the topic are recognised and none is sent again. A replay into
an empty or lagging topic seals tasks faster than their messages go out: past OWED_MAX sealed
tasks owing messages, the fold waits for the sends before its next fetch (`_hold_while_owing`).

Memory while an assignment is loaded: from the read of the outcomes partitions until the replay
reaches the journal's end taken after that read, the highest seq per subject of every task with
a message in what was read (from zero, the partitions' whole history; from a snapshot, what
came after its image: a dict per task, a few hundred bytes each). It
shrinks as the replay goes: a task's entry goes when the replay has numbered up to what was
read, or seals the task; what is left once the replay reaches that end (tasks the journal does
not have) goes then. After that, nothing is held for a task the fold does not hold.

At-least-once: a crash after a message reached the broker but before the next one was sent
costs nothing (the restart reads it back and goes on from the next seq). What can happen is a
duplicate: a message in flight while we read the partition's end (the previous owner, a zombie
after a rebalance, or our own send whose ack was lost) is published again with the same
message_id and the same content. Subscribers dedupe by message_id (`HalfwayClient.outcomes`).
The topic never holds two different messages under one id, as long as derive's idea of a
change is unchanged: a release that changes it should publish to a fresh outcomes topic.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Coroutine, Set
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord
from pydantic import ValidationError

from halfway import log
from halfway import settings as env
from halfway.contract.outcomes import OutcomeChanged, parse_outcome
from halfway.contract.topics import JOURNAL, OUTCOMES
from halfway.core.fold import TaskState
from halfway.journal import JournalWriter
from halfway.journal.admin import topic_partitions
from halfway.journal.follower import JournalFollower
from halfway.journal.limits import fetch_limits
from halfway.journal.records import describe
from halfway.loops import run_until_cancelled
from halfway.outcomes.derive import Sequencer, changes
from halfway.settings import KafkaSettings

FETCH_TIMEOUT_MS = 500
# How long the broker may hold one fetch of the outcomes topic's read without data: an offsets
# request on the same connection waits behind it (500 ms at the client's default, per request).
READ_FETCH_WAIT_MS = 20
IDLE_TIMEOUT_S = 30.0  # no progress for this long while behind the end: the broker is gone
LOGGED_REASON_CHARS_MAX = 500
# Changed tasks whose messages are sent at once (a catch-up reports a partition's every live
# task): as many sends in flight as the owed ones'.
SENDING_AT_ONCE_MAX = 512
# Sealed tasks whose owed messages are sent at once (a replay may seal many that owe some):
# many sends in flight make the producer's batches large.
OWED_AT_ONCE_MAX = 512
# The publisher's writer's batches: larger than the OWED_AT_ONCE_MAX messages (a few hundred
# bytes each) in flight at once, so a send seldom waits for a full batch to go; far below a
# topic's 1 MiB message limit.
WRITER_BATCH_BYTES = 256 * 1024
# After a failure to send a sealed task's messages, they are tried again this much later.
OWED_RETRY_S = 1.0
# Sealed tasks owing messages past which the fold waits for sends (a replay into an empty or
# lagging topic seals the history faster than its messages go out: 1.7M tasks, 8 GiB, at 10M
# events), until half are sent or OWED_WAIT_S passed (the consumer must still poll).
OWED_MAX = 4096
OWED_WAIT_S = 10.0
# One wait for a replay to reach the end an assignment's read was checked against; the wait
# goes on while the partition (and what was read of it) is still ours.
REPLAY_WAIT_S = 60.0


@dataclass
class _Task:
    """One task's numbering, and its messages not yet known to be on the outcomes topic."""

    partition: int
    sequencer: Sequencer = field(default_factory=Sequencer)
    pending: list[OutcomeChanged] = field(default_factory=list)
    sealed: bool = False  # the follower sealed it: forgotten once `pending` is sent
    sending: bool = False  # one `_publish` at a time sends `pending` (in order)
    folded_to: int = -1  # journal offset of its last event numbered


class OutcomesPublisher:
    def __init__(self, settings: KafkaSettings, writer: JournalWriter,
                 group: str | None = None) -> None:
        # Same partition number on both topics holds the same tasks only if the counts agree
        # (halfway.journal.admin.check_layout refuses to start otherwise).
        self.settings = settings
        self.writer = writer
        group = group or f"{settings.topic_prefix}outcomes"  # one group per deployment
        # Every event, not every batch: one fetch may hold both `unknown` and `done` for a
        # step, and users must see both, numbered the same way after any restart.
        self.follower = JournalFollower(settings, group=group, writer=writer,
                                        on_change=self._on_change, on_event=self._observe,
                                        on_assign=self._load_published,
                                        on_restore=self._restoring, on_image=self._image,
                                        on_revoke=self._forget, on_seal=self._sealed,
                                        seal_after_s=env.seal_after_s(), snapshots=True,
                                        wake_on_catch_up=self._owes,
                                        hold=self._hold_while_owing)
        self._tasks: dict[str, _Task] = {}
        # Highest seq on the outcomes topic when the partition was assigned, for what the
        # replay has not numbered yet: partition -> task -> about -> seq, for the partitions we
        # own (an outcomes partition holds the tasks of the same journal one). See the module
        # docstring for how long an entry stays.
        self._published: dict[int, dict[str, dict[str, int]]] = {}
        # Partitions restored from an image: the image's journal offset (changes from records
        # before it are on the topic, but for `_unsent`'s)...
        self._restored_at: dict[int, int] = {}
        # ...and, from the image, per task, each subject's highest seq on the topic then, for
        # subjects with messages not acknowledged then. Kept until the task is sealed.
        self._unsent: dict[int, dict[str, dict[str, int]]] = {}
        # Per outcomes partition: every message of ours not acknowledged yet lands at or past
        # this offset (the end read at assignment, then past each acknowledgement).
        self._topic_next: dict[int, int] = {}
        # Sealed tasks with messages not on the topic yet: the follower reports them no more.
        self._owed: dict[str, _Task] = {}
        self._owed_due = asyncio.Event()
        self._owed_room = asyncio.Event()  # set once the owed are down to half OWED_MAX
        self._background: set[asyncio.Task[None]] = set()
        self.published = 0  # messages this instance wrote (duplicates included)
        self._log = log.get("halfway.outcomes")

    async def run(self) -> None:
        await self.follower.start()
        try:
            await run_until_cancelled(self.follower.run(), self._send_owed())
        finally:
            for task in list(self._background):
                task.cancel()
            await self.follower.stop()

    # -- called by the follower ------------------------------------------------------------

    async def _hold_while_owing(self) -> None:
        """Before each fetch: past OWED_MAX sealed tasks owing messages, wait until half of
        them are sent (or OWED_WAIT_S): what a replay holds stays bounded whatever the
        history's length."""
        if len(self._owed) < OWED_MAX:
            return
        self._owed_room.clear()
        self._log.info("replay held while sealed tasks' messages are sent", owed=len(self._owed))
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(OWED_WAIT_S):
                await self._owed_room.wait()

    def _unowe(self, task_id: str) -> None:
        self._owed.pop(task_id, None)
        if len(self._owed) <= OWED_MAX // 2:
            self._owed_room.set()

    def _owes(self, dormant: Set[str]) -> list[str]:
        """Of a partition's tasks the follower made dormant (over for a minute by the
        journal's clock), those with messages to send: looked at as the partition catches
        up."""
        tasks = self._tasks
        return [t for t in dormant if (task := tasks.get(t)) is not None and task.pending]

    def _observe(self, before: TaskState | None, after: TaskState, partition: int,
                 offset: int) -> None:
        task = self._tasks.get(after.task_id)
        if task is not None and offset <= task.folded_to:
            return  # its history folded again (a dormant task woken): numbered already
        if (task is None and before is not None) or (task is not None and task.sealed):
            # Sealed: the follower folds nothing more of it but a request, which users are not
            # told of; its numbering is gone (from 1 again, it would reuse ids).
            return
        if before is None or task is None:
            # The follower folds this task from scratch (first event, a replay after a
            # reassignment, a restore, a dormant task woken): so does the numbering.
            task = self._tasks[after.task_id] = _Task(partition)
        task.folded_to = offset
        read = self._published.get(partition, {}).get(after.task_id)
        # Before the image: on the topic then, but for the subjects it says were not yet.
        unsent = (self._unsent.get(partition, {}).get(after.task_id, {})
                  if offset < self._restored_at.get(partition, 0) else None)
        for change in changes(before, after):
            message = task.sequencer.number(change)
            if unsent is not None and message.seq <= unsent.get(message.about, message.seq):
                continue
            if read is not None and message.about in read:
                on_topic = read[message.about]
                if message.seq >= on_topic:
                    del read[message.about]  # the replay has caught up with what was read
                if message.seq <= on_topic:
                    continue  # on the topic already
            task.pending.append(message)
        if read is not None and not read:
            del self._published[partition][after.task_id]

    async def _restoring(self, partition: int, journal_next: int,
                         service: dict[str, Any] | None) -> set[str]:
        """The follower restores `partition` from its image: read the outcomes partition from
        where the image says messages not known then can be. Returns the tasks to wake (those
        with messages not known to be on the topic then)."""
        try:
            assert service is not None, "the image has no outcomes part"
            since = int(service["outcomes_from"])
            unsent = {str(task_id): {str(about): int(seq) for about, seq in subjects.items()}
                      for task_id, subjects in service["unsent"].items()}
        except Exception as exc:
            # Not an image of ours as it should be: every change of the restored tasks is
            # compared with the whole partition (duplicates at worst, never a gap).
            self._log.warning("snapshot without the outcomes' part; the topic is read whole",
                              partition=partition, error=repr(exc)[:LOGGED_REASON_CHARS_MAX])
            await self._load_published({partition})
            return set()
        await self._load_published({partition}, since={partition: since})
        self._restored_at[partition] = journal_next
        self._unsent[partition] = unsent
        return set(unsent)

    def _image(self, partition: int) -> dict[str, Any] | None:
        """What the partition's image keeps of this service (see the module docstring), or
        None while a sealed task of it owes messages."""
        if any(task.partition == partition for task in self._owed.values()):
            return None
        unsent: dict[str, dict[str, int]] = {}
        for task_id, task in self._tasks.items():
            if task.partition == partition and task.pending:
                # A subject's messages not acknowledged are the last of its numbering.
                waiting = Counter(message.about for message in task.pending)
                unsent[task_id] = {about: task.sequencer.seqs[about] - n
                                   for about, n in waiting.items()}
        return {"outcomes_from": self._topic_next.get(partition, 0), "unsent": unsent}

    async def _load_published(self, partitions: set[int],
                              since: dict[int, int] | None = None) -> None:
        """Read the outcomes partitions (from `since`, else whole) into `_published`."""
        if not partitions:
            return
        for p in partitions:  # what an earlier image said (the caller says it again)
            self._restored_at.pop(p, None)
            self._unsent.pop(p, None)
        loaded: dict[int, dict[str, dict[str, int]]] = {p: {} for p in partitions}
        self._published.update(loaded)
        journal_ends: dict[int, int] = {}
        outcomes_ends: dict[int, int] = {}
        count = 0
        try:
            async for partition, message in _read(self.settings, partitions, since=since,
                                                   journal_ends=journal_ends,
                                                   outcomes_ends=outcomes_ends):
                seqs = loaded[partition].setdefault(message.task_id, {})
                seqs[message.about] = max(seqs.get(message.about, 0), message.seq)
                count += 1
        except Exception:
            # Called from the rebalance listener: failing here would leave the partitions
            # unadopted and the service silently idle. Knowing less only costs duplicates
            # (same ids, same content), which subscribers drop. What was read is dropped: no
            # end was taken to say when the replay has passed it.
            self._log.exception("could not read the outcomes topic; publishing from seq 1",
                                partitions=sorted(partitions))
            for seqs in loaded.values():
                seqs.clear()
            return
        self._topic_next.update(outcomes_ends)
        self._log.info("outcomes read", partitions=sorted(partitions), messages=count,
                       tasks=sum(map(len, loaded.values())), since=since)
        for p in partitions:
            self._in_background(self._prune_when_replayed(p, loaded[p], journal_ends[p]))

    async def _prune_when_replayed(self, partition: int, loaded: dict[str, dict[str, int]],
                                   end: int) -> None:
        """Once the replay has folded the journal partition up to `end` (its end taken after
        the outcomes partition was read: every message read came from a record before it),
        drop what was read of tasks the fold does not hold (sealed, or not in the journal)."""
        while self._published.get(partition) is loaded:  # else revoked: dropped with it
            if end > 0 and not await self.follower.applied(partition, end - 1, REPLAY_WAIT_S):
                continue
            if self._published.get(partition) is loaded:
                for task_id in [t for t in loaded if t not in self._tasks]:
                    del loaded[task_id]
            return

    def _in_background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)

        def done(task: asyncio.Task[None]) -> None:
            self._background.discard(task)
            if not task.cancelled() and task.exception() is not None:
                self._log.error("outcomes housekeeping failed", exc_info=task.exception())

        task.add_done_callback(done)

    def _sealed(self, partition: int, task_id: str) -> None:
        """The follower sealed the task: forget it, once its messages are all on the topic."""
        self._published.get(partition, {}).pop(task_id, None)  # nothing more of it is numbered
        self._unsent.get(partition, {}).pop(task_id, None)
        task = self._tasks.get(task_id)
        if task is None:
            return
        task.sealed = True
        if task.pending:
            # Sealed in the batch that observed its last changes, or while they are sent: the
            # follower reports it no more, so what it owes is sent from here.
            self._owed[task_id] = task
            self._owed_due.set()
        else:
            del self._tasks[task_id]

    def _forget(self, partitions: set[int]) -> None:
        for task_id in [t for t, task in self._tasks.items() if task.partition in partitions]:
            del self._tasks[task_id]
            self._unowe(task_id)  # the new owner's replay sends what is owed
        for p in partitions:
            for held in (self._published, self._restored_at, self._unsent, self._topic_next):
                held.pop(p, None)

    async def _on_change(self, task_ids: set[str]) -> None:
        # Tasks in parallel, each task's messages one after another: a message is sent only
        # once the one before it is on the broker, so the topic never has a gap in a subject's
        # numbering that a later message skips over. A task whose send fails is tried again
        # later (backing off) and never stops the others'.
        await self.follower.for_each(task_ids, self._publish_held, at_once=SENDING_AT_ONCE_MAX)

    async def _publish_held(self, task_id: str) -> None:
        task = self._tasks.get(task_id)
        if task is not None:
            await self._publish(task_id, task)

    async def _send_owed(self) -> None:
        """Send what sealed tasks still owe (the follower reports them no more); what fails is
        tried again OWED_RETRY_S later."""
        at_once = asyncio.Semaphore(OWED_AT_ONCE_MAX)

        async def send(task_id: str, task: _Task) -> None:
            async with at_once:
                await self._publish(task_id, task)

        while True:
            await self._owed_due.wait()
            self._owed_due.clear()
            owed = [(t, task) for t, task in self._owed.items() if not task.sending]
            # One coroutine per task owed: at most OWED_MAX and a batch's (`_hold_while_owing`).
            results = await asyncio.gather(*(send(t, task) for t, task in owed),
                                           return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                self._log.warning("sealed tasks' outcomes not sent; tried again later",
                                  tasks=len(errors),
                                  error=repr(errors[0])[:LOGGED_REASON_CHARS_MAX])
                await asyncio.sleep(OWED_RETRY_S)
                self._owed_due.set()

    async def _publish(self, task_id: str, task: _Task) -> None:
        if task.sending:
            return  # its sender sends what came meanwhile too
        task.sending = True
        try:
            # Bounded: only what the follower has folded so far. A task revoked meanwhile is
            # its new owner's to send.
            while task.pending and self._tasks.get(task_id) is task:
                message = task.pending[0]
                sent = await self.writer.append_raw(
                    OUTCOMES, message.model_dump_json().encode(), key=message.record_key(),
                    headers=[("type", message.type.encode()),
                             ("message_id", message.message_id.encode())])
                task.pending.pop(0)
                if sent.offset >= self._topic_next.get(sent.partition, 0):
                    self._topic_next[sent.partition] = sent.offset + 1
                self.published += 1
                self._log.debug("outcome published", task_id=task_id,
                                message_id=message.message_id, state=message.state)
        finally:
            task.sending = False
            if task.sealed:
                if not task.pending:
                    if self._tasks.get(task_id) is task:
                        del self._tasks[task_id]
                    if self._owed.get(task_id) is task:
                        self._unowe(task_id)
                elif self._owed.get(task_id) is task:
                    self._owed_due.set()  # not sent: tried again by `_send_owed`


async def read_outcomes(settings: KafkaSettings, partitions: set[int] | None = None,
                        ) -> AsyncIterator[OutcomeChanged]:
    """Every valid message of the outcomes topic (or of these partitions), from the beginning
    to the end it had when we started, in order per partition."""
    async for _, message in _read(settings, partitions):
        yield message


async def _read(settings: KafkaSettings, partitions: set[int] | None, *,
                since: dict[int, int] | None = None,
                journal_ends: dict[int, int] | None = None,
                outcomes_ends: dict[int, int] | None = None,
                ) -> AsyncIterator[tuple[int, OutcomeChanged]]:
    # Invalid records (any kind, any size) are skipped: this topic is ours, so one is a bug,
    # logged with where it is, and it must not stop a publisher from starting.
    # Each partition is read from its offset in `since` (else from its beginning) to the end it
    # had when we started, put in `outcomes_ends` (if given). `journal_ends` (if given) is
    # filled, once all is read, with the end of each journal partition of the same numbers:
    # every message read came from a record before it.
    topic = OUTCOMES.name(settings.topic_prefix)
    consumer = AIOKafkaConsumer(**settings.client(), group_id=None,
                                enable_auto_commit=False, isolation_level="read_committed",
                                fetch_max_wait_ms=READ_FETCH_WAIT_MS, **fetch_limits())
    await consumer.start()
    try:
        numbers = partitions if partitions is not None else await topic_partitions(settings,
                                                                                    topic)
        tps = [TopicPartition(topic, p) for p in sorted(numbers)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        for tp in tps:
            if since and tp.partition in since:
                consumer.seek(tp, max(since[tp.partition],
                                      (await consumer.beginning_offsets([tp]))[tp]))
        end = await consumer.end_offsets(tps)
        if outcomes_ends is not None:
            outcomes_ends.update({tp.partition: offset for tp, offset in end.items()})
        behind = {tp for tp in tps if await consumer.position(tp) < end[tp]}
        progress_at = time.monotonic()
        while behind:  # bounded: up to the end at the start, or no progress for IDLE_TIMEOUT_S
            batches = await consumer.getmany(*behind, timeout_ms=FETCH_TIMEOUT_MS)
            for tp, records in batches.items():
                for record in records:
                    if record.offset >= end[tp]:
                        break
                    message = _outcome(record)
                    if message is not None:
                        yield tp.partition, message
            if batches:
                progress_at = time.monotonic()
            elif time.monotonic() - progress_at > IDLE_TIMEOUT_S:
                raise TimeoutError(f"reading {topic} made no progress for {IDLE_TIMEOUT_S} s")
            behind = {tp for tp in behind if await consumer.position(tp) < end[tp]}
        if journal_ends is not None:
            journal = JOURNAL.name(settings.topic_prefix)
            ends = await consumer.end_offsets([TopicPartition(journal, p) for p in numbers])
            journal_ends.update({tp.partition: offset for tp, offset in ends.items()})
    finally:
        await consumer.stop()


def _outcome(record: ConsumerRecord) -> OutcomeChanged | None:
    """The message a record of the outcomes topic holds; None (logged) if it holds none."""
    if record.value is None:
        reason = "the record has no value (a tombstone)"
    else:
        try:
            return parse_outcome(record.value)
        except ValidationError as exc:
            reason = describe(exc, prefix="invalid outcome: ")
        except Exception as exc:  # a validator broken by this input: still just a bad record
            reason = f"the record could not be read: {type(exc).__name__}"
    log.get("halfway.outcomes").warning(
        "invalid outcome record skipped", partition=record.partition, offset=record.offset,
        size_bytes=0 if record.value is None else len(record.value),
        sha256=None if record.value is None else hashlib.sha256(record.value).hexdigest(),
        reason=reason[:LOGGED_REASON_CHARS_MAX])
    return None
