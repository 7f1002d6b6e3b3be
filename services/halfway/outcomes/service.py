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
already published per subject; only changes numbered higher are published again.

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
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord
from pydantic import ValidationError

from halfway import log
from halfway.contract.outcomes import OutcomeChanged, parse_outcome
from halfway.contract.topics import OUTCOMES
from halfway.core.fold import TaskState
from halfway.journal import JournalWriter
from halfway.journal.admin import topic_partitions
from halfway.journal.follower import JournalFollower
from halfway.journal.limits import fetch_limits
from halfway.journal.records import describe
from halfway.outcomes.derive import Sequencer, changes
from halfway.settings import KafkaSettings

FETCH_TIMEOUT_MS = 500
IDLE_TIMEOUT_S = 30.0  # no progress for this long while behind the end: the broker is gone
LOGGED_REASON_CHARS_MAX = 500


@dataclass
class _Task:
    """One task's numbering, and its messages not yet known to be on the outcomes topic."""

    partition: int
    sequencer: Sequencer = field(default_factory=Sequencer)
    pending: list[OutcomeChanged] = field(default_factory=list)


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
                                        on_revoke=self._forget)
        self._tasks: dict[str, _Task] = {}
        # Highest seq on the outcomes topic: partition -> task -> about -> seq, for the
        # partitions we own (an outcomes partition holds the tasks of the same journal one).
        self._published: dict[int, dict[str, dict[str, int]]] = {}
        self.published = 0  # messages this instance wrote (duplicates included)
        self._log = log.get("halfway.outcomes")

    async def run(self) -> None:
        await self.follower.start()
        try:
            await self.follower.run()
        finally:
            await self.follower.stop()

    # -- called by the follower ------------------------------------------------------------

    def _observe(self, before: TaskState | None, after: TaskState, partition: int) -> None:
        task = self._tasks.get(after.task_id)
        if before is None or task is None:
            # The follower folds this task from scratch (first event, or a replay after a
            # reassignment): so does the numbering.
            task = self._tasks[after.task_id] = _Task(partition)
        done = self._published.get(partition, {}).get(after.task_id, {})
        for change in changes(before, after):
            message = task.sequencer.number(change)
            if message.seq > done.get(message.about, 0):
                task.pending.append(message)

    async def _load_published(self, partitions: set[int]) -> None:
        for p in partitions:
            self._published[p] = {}
        count = 0
        try:
            async for partition, message in _read(self.settings, partitions):
                seqs = self._published[partition].setdefault(message.task_id, {})
                seqs[message.about] = max(seqs.get(message.about, 0), message.seq)
                count += 1
        except Exception:
            # Called from the rebalance listener: failing here would leave the partitions
            # unadopted and the service silently idle. Knowing less only costs duplicates
            # (same ids, same content), which subscribers drop.
            self._log.exception("could not read the outcomes topic; publishing from seq 1",
                                partitions=sorted(partitions))
            return
        self._log.info("outcomes read", partitions=sorted(partitions), messages=count)

    def _forget(self, partitions: set[int]) -> None:
        for task_id in [t for t, task in self._tasks.items() if task.partition in partitions]:
            del self._tasks[task_id]
        for p in partitions:
            self._published.pop(p, None)

    async def _on_change(self, task_ids: set[str]) -> None:
        # Tasks in parallel, each task's messages one after another: a message is sent only
        # once the one before it is on the broker, so the topic never has a gap in a subject's
        # numbering that a later message skips over.
        async with asyncio.TaskGroup() as group:
            for task_id in task_ids:
                group.create_task(self._publish(task_id))

    async def _publish(self, task_id: str) -> None:
        task = self._tasks.get(task_id)
        if task is None:
            return
        done = self._published.setdefault(task.partition, {}).setdefault(task_id, {})
        while task.pending:  # bounded: only what the follower has folded so far
            message = task.pending[0]
            await self.writer.append_raw(
                OUTCOMES, message.model_dump_json().encode(), key=message.record_key(),
                headers=[("type", message.type.encode()),
                         ("message_id", message.message_id.encode())])
            done[message.about] = max(done.get(message.about, 0), message.seq)
            task.pending.pop(0)
            self.published += 1
            self._log.info("outcome published", task_id=task_id, message_id=message.message_id,
                           state=message.state)


async def read_outcomes(settings: KafkaSettings, partitions: set[int] | None = None,
                        ) -> AsyncIterator[OutcomeChanged]:
    """Every valid message of the outcomes topic (or of these partitions), from the beginning
    to the end it had when we started, in order per partition."""
    async for _, message in _read(settings, partitions):
        yield message


async def _read(settings: KafkaSettings, partitions: set[int] | None,
                ) -> AsyncIterator[tuple[int, OutcomeChanged]]:
    # Invalid records (any kind, any size) are skipped: this topic is ours, so one is a bug,
    # logged with where it is, and it must not stop a publisher from starting.
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
