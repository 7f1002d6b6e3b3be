"""The outcomes publisher: the journal, told as users should read it, on the outcomes topic.

It follows the journal (a JournalFollower, one consumer group per deployment) and, for every
journal event, derives which subjects' visible state changed (`derive.changes`). Each subject's
changes are numbered 1, 2, ... in log order, so a message's id (`{task_id}/{about}/{seq}`) is a
function of the journal alone: deriving again after a restart gives the same ids. Messages are
published keyed by task id, so one task's messages keep their order.

Every event, not every batch: the follower reports changed tasks once per fetch, and a fetch
may hold `unknown` and `done` of the same step; users must see the `unknown` too, and the
numbering must not depend on how records happened to be batched.

Restarts and rebalances: on every assignment the follower replays the journal partition from
offset zero. Before that, this service reads the outcomes partition of the same number (both
topics are keyed by task id with the same partition count) to its end and keeps the highest seq
already published per subject; only changes numbered higher are published again. What was read
of a subject is kept only until the replay's numbering reaches it (then the replay knows more).

Memory follows live work (`HALFWAY_SEAL_AFTER_S`): the follower seals a task over for good (see
`halfway.journal.follower`), and this service then forgets it too (its numbering and what was
read of it), but only once every message of it is on the topic. A task may be sealed in the very
batch that observed its last changes (a replay, or a journal clock that jumps): the follower
reports a sealed task no more, so what it still owes is sent from here (`_send_owed`). A replay
seals a task at the same record as the live fold did (the journal's clock), after numbering the
same changes, so its messages on the topic are recognised and none is sent again.

Memory while an assignment is loaded: from the read of the outcomes partitions until the replay
reaches the journal's end taken after that read, the highest seq per subject of every task with
a message there (the partitions' whole history: a dict per task, a few hundred bytes each). It
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
import hashlib
import time
from collections.abc import AsyncIterator, Coroutine
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
from halfway.journal.follower import JournalFollower, run_until_cancelled
from halfway.journal.limits import fetch_limits
from halfway.journal.records import describe
from halfway.outcomes.derive import Sequencer, changes
from halfway.settings import KafkaSettings

FETCH_TIMEOUT_MS = 500
IDLE_TIMEOUT_S = 30.0  # no progress for this long while behind the end: the broker is gone
LOGGED_REASON_CHARS_MAX = 500
# Sealed tasks whose owed messages are sent at once (a replay may seal many that owe some).
OWED_AT_ONCE_MAX = 64
# After a failure to send a sealed task's messages, they are tried again this much later.
OWED_RETRY_S = 1.0
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
        # Sealing, never snapshots: a restored state would skip `_observe`'s numbering.
        self.follower = JournalFollower(settings, group=group, writer=writer,
                                        on_change=self._on_change, on_event=self._observe,
                                        on_assign=self._load_published,
                                        on_revoke=self._forget, on_seal=self._sealed,
                                        seal_after_s=env.seal_after_s())
        self._tasks: dict[str, _Task] = {}
        # Highest seq on the outcomes topic when the partition was assigned, for what the
        # replay has not numbered yet: partition -> task -> about -> seq, for the partitions we
        # own (an outcomes partition holds the tasks of the same journal one). See the module
        # docstring for how long an entry stays.
        self._published: dict[int, dict[str, dict[str, int]]] = {}
        # Sealed tasks with messages not on the topic yet: the follower reports them no more.
        self._owed: dict[str, _Task] = {}
        self._owed_due = asyncio.Event()
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

    def _observe(self, before: TaskState | None, after: TaskState, partition: int) -> None:
        task = self._tasks.get(after.task_id)
        if (task is None and before is not None) or (task is not None and task.sealed):
            # Sealed: the follower folds nothing more of it but a request, which users are not
            # told of; its numbering is gone (from 1 again, it would reuse ids).
            return
        if before is None or task is None:
            # The follower folds this task from scratch (first event, or a replay after a
            # reassignment): so does the numbering.
            task = self._tasks[after.task_id] = _Task(partition)
        read = self._published.get(partition, {}).get(after.task_id)
        for change in changes(before, after):
            message = task.sequencer.number(change)
            if read is not None and message.about in read:
                on_topic = read[message.about]
                if message.seq >= on_topic:
                    del read[message.about]  # the replay has caught up with what was read
                if message.seq <= on_topic:
                    continue  # on the topic already
            task.pending.append(message)
        if read is not None and not read:
            del self._published[partition][after.task_id]

    async def _load_published(self, partitions: set[int]) -> None:
        if not partitions:
            return
        loaded: dict[int, dict[str, dict[str, int]]] = {p: {} for p in partitions}
        self._published.update(loaded)
        journal_ends: dict[int, int] = {}
        count = 0
        try:
            async for partition, message in _read(self.settings, partitions,
                                                   journal_ends=journal_ends):
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
        self._log.info("outcomes read", partitions=sorted(partitions), messages=count,
                       tasks=sum(map(len, loaded.values())))
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
            self._owed.pop(task_id, None)  # the new owner's replay sends what is owed
        for p in partitions:
            self._published.pop(p, None)

    async def _on_change(self, task_ids: set[str]) -> None:
        # Tasks in parallel, each task's messages one after another: a message is sent only
        # once the one before it is on the broker, so the topic never has a gap in a subject's
        # numbering that a later message skips over.
        async with asyncio.TaskGroup() as group:
            for task_id in task_ids:
                task = self._tasks.get(task_id)
                if task is not None:
                    group.create_task(self._publish(task_id, task))

    async def _send_owed(self) -> None:
        """Send what sealed tasks still owe (the follower reports them no more); what fails is
        tried again OWED_RETRY_S later."""
        while True:
            await self._owed_due.wait()
            self._owed_due.clear()
            owed = [(t, task) for t, task in self._owed.items() if not task.sending]
            errors: list[BaseException] = []
            for start in range(0, len(owed), OWED_AT_ONCE_MAX):
                results = await asyncio.gather(
                    *(self._publish(t, task) for t, task in owed[start:start + OWED_AT_ONCE_MAX]),
                    return_exceptions=True)
                errors += [r for r in results if isinstance(r, BaseException)]
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
                await self.writer.append_raw(
                    OUTCOMES, message.model_dump_json().encode(), key=message.record_key(),
                    headers=[("type", message.type.encode()),
                             ("message_id", message.message_id.encode())])
                task.pending.pop(0)
                self.published += 1
                self._log.info("outcome published", task_id=task_id,
                               message_id=message.message_id, state=message.state)
        finally:
            task.sending = False
            if task.sealed:
                if not task.pending:
                    if self._tasks.get(task_id) is task:
                        del self._tasks[task_id]
                    if self._owed.get(task_id) is task:
                        del self._owed[task_id]
                elif self._owed.get(task_id) is task:
                    self._owed_due.set()  # not sent: tried again by `_send_owed`


async def read_outcomes(settings: KafkaSettings, partitions: set[int] | None = None,
                        ) -> AsyncIterator[OutcomeChanged]:
    """Every valid message of the outcomes topic (or of these partitions), from the beginning
    to the end it had when we started, in order per partition."""
    async for _, message in _read(settings, partitions):
        yield message


async def _read(settings: KafkaSettings, partitions: set[int] | None, *,
                journal_ends: dict[int, int] | None = None,
                ) -> AsyncIterator[tuple[int, OutcomeChanged]]:
    # Invalid records (any kind, any size) are skipped: this topic is ours, so one is a bug,
    # logged with where it is, and it must not stop a publisher from starting.
    # `journal_ends` (if given) is filled, once all is read, with the end of each journal
    # partition of the same numbers: every message read came from a record before it.
    topic = OUTCOMES.name(settings.topic_prefix)
    consumer = AIOKafkaConsumer(**settings.client(), group_id=None,
                                enable_auto_commit=False, isolation_level="read_committed",
                                **fetch_limits())
    await consumer.start()
    try:
        numbers = partitions if partitions is not None else await topic_partitions(settings,
                                                                                    topic)
        tps = [TopicPartition(topic, p) for p in sorted(numbers)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
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
