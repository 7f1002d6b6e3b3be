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

Offsets are never committed: every (re)start replays from zero, which is correct by
construction and costs a full read of the owned partitions (snapshots would shorten it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from aiokafka import ConsumerRebalanceListener, TopicPartition

from halfway import log
from halfway.contract import Event, TaskRequested
from halfway.contract.topics import JOURNAL, TASKS, WEBHOOKS, TopicSpec
from halfway.contract.webhooks import WebhookReceived
from halfway.core.fold import TaskState, apply
from halfway.journal.reader import EventConsumer
from halfway.journal.writer import JournalWriter
from halfway.settings import KafkaSettings

OnChange = Callable[[set[str]], Awaitable[None]]
# Optional hooks for services that must see every step of the fold, not only which tasks
# changed in a batch (the outcomes publisher): each applied event's before and after state...
OnEvent = Callable[[TaskState | None, TaskState, int], None]
# ...and partitions (numbers) newly assigned, before their replay starts, or revoked.
OnAssign = Callable[[set[int]], Awaitable[None]]
OnRevoke = Callable[[set[int]], None]
# How long one fetch waits when the journal is quiet: also the latency of a timer the service
# set (a due lookup) being acted on.
IDLE_FETCH_MS = 100


@dataclass
class _Partition:
    end_at_assign: int
    applied_to: int = -1  # offset of the last record applied (valid or not)
    caught_up: bool = False
    tasks: set[str] = field(default_factory=set)


class _Listener(ConsumerRebalanceListener):
    def __init__(self, follower: JournalFollower) -> None:
        self.follower = follower

    async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
        self.follower._forget(revoked)

    async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
        await self.follower._adopt(assigned)


class JournalFollower:
    """`side` is a second topic keyed like the journal (by task id) and read with it: the
    tasks topic for the decider (requests), the webhooks topic for the reconciler."""

    def __init__(self, settings: KafkaSettings, *, group: str, writer: JournalWriter,
                 on_change: OnChange, side: TopicSpec | None = None,
                 on_event: OnEvent | None = None, on_assign: OnAssign | None = None,
                 on_revoke: OnRevoke | None = None) -> None:
        assert side in (None, TASKS, WEBHOOKS), "side topics must be keyed by task id"
        topics: tuple[TopicSpec, ...] = (JOURNAL,) if side is None else (JOURNAL, side)
        self._journal = JOURNAL.name(settings.topic_prefix)
        self._consumer = EventConsumer(settings, topics=topics, group=group, writer=writer,
                                       listener=_Listener(self))
        self._on_change = on_change
        self._on_event = on_event
        self._on_assign = on_assign
        self._on_revoke = on_revoke
        self._log = log.get("halfway.follower", group=group)
        self.states: dict[str, TaskState] = {}
        self.requests: dict[str, TaskRequested] = {}  # first request per task, tasks topic
        # Verified webhooks by our key (step or undo key), in log order; kept until the
        # partition is revoked, so one that arrives before its step is matched when it appears.
        self.webhooks: dict[str, list[WebhookReceived]] = {}
        self._partitions: dict[TopicPartition, _Partition] = {}
        self._awaiting: dict[str, tuple[TopicPartition, int]] = {}
        self._dirty: set[str] = set()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        await self._consumer.start()

    async def stop(self) -> None:
        await self._consumer.stop()

    async def run(self) -> None:
        """Fold and report changes until cancelled."""
        while True:
            deliveries = await self._consumer.batch(IDLE_FETCH_MS)
            for d in deliveries:
                self._apply(d.event, TopicPartition(d.topic, d.partition), d.offset)
            await self._refresh_positions()
            ready = {t for t in self._dirty if self._ready(t)}
            if ready:
                self._dirty -= ready
                await self._on_change(ready)

    # -- what services call ----------------------------------------------------------------

    def note_write(self, task_id: str, partition: int, offset: int) -> None:
        """The service appended to the journal: hold the task until the follower sees it."""
        tp = TopicPartition(self._journal, partition)
        self._awaiting[task_id] = (tp, offset)
        self._dirty.add(task_id)

    def owns(self, task_id: str) -> bool:
        return any(task_id in p.tasks for tp, p in self._partitions.items()
                   if tp.topic == self._journal)

    def touch(self, task_id: str) -> None:
        """Report the task again at the next batch (a timer fired)."""
        self._dirty.add(task_id)

    # -- internals -------------------------------------------------------------------------

    def _apply(self, event: Event | WebhookReceived, tp: TopicPartition, offset: int) -> None:
        part = self._partitions.get(tp)
        if part is None:
            return  # a record fetched just before its partition was revoked
        if isinstance(event, WebhookReceived):
            if event.key is None or event.task_id is None:
                return  # not about any effect of ours: nothing to match it with
            part.tasks.add(event.task_id)
            self.webhooks.setdefault(event.key, []).append(event)
            self._dirty.add(event.task_id)
            return
        part.tasks.add(event.task_id)
        if isinstance(event, TaskRequested) and tp.topic != self._journal:
            self.requests.setdefault(event.task_id, event)
        else:
            before = self.states.get(event.task_id)
            after = apply(before or TaskState(task_id=event.task_id), event)
            self.states[event.task_id] = after
            if self._on_event is not None and after is not before:
                self._on_event(before, after, tp.partition)
        self._dirty.add(event.task_id)

    async def _refresh_positions(self) -> None:
        kafka = self._consumer.kafka
        for tp, part in list(self._partitions.items()):
            try:
                position = await kafka.position(tp)
            except Exception:  # revoked meanwhile
                continue
            part.applied_to = position - 1
            if not part.caught_up and position >= part.end_at_assign:
                part.caught_up = True
                self._dirty |= part.tasks
                self._log.info("caught up", topic=tp.topic, partition=tp.partition,
                               offset=position, tasks=len(part.tasks))

    def _ready(self, task_id: str) -> bool:
        journal_parts = [p for tp, p in self._partitions.items()
                         if tp.topic == self._journal and task_id in p.tasks]
        request_parts = [p for tp, p in self._partitions.items()
                         if tp.topic != self._journal and task_id in p.tasks]
        if not journal_parts and not request_parts:
            return False  # not ours (any more)
        # The task's journal partition (same number as its tasks partition) must be caught up.
        number = next(tp.partition for tp, p in self._partitions.items() if task_id in p.tasks)
        journal = self._partitions.get(TopicPartition(self._journal, number))
        if journal is None or not journal.caught_up:
            return False
        if not all(p.caught_up for p in request_parts):
            return False
        awaiting = self._awaiting.get(task_id)
        if awaiting is not None:
            tp, offset = awaiting
            part = self._partitions.get(tp)
            if part is None or part.applied_to < offset:
                return False
            del self._awaiting[task_id]
        return True

    def _forget(self, revoked: list[TopicPartition]) -> None:
        for tp in revoked:
            part = self._partitions.pop(tp, None)
            if part is None:
                continue
            for task_id in part.tasks:
                if not any(task_id in p.tasks for p in self._partitions.values()):
                    self.states.pop(task_id, None)
                    self.requests.pop(task_id, None)
                    for key in [k for k in self.webhooks if k.startswith(f"{task_id}:")]:
                        del self.webhooks[key]
                    self._awaiting.pop(task_id, None)
                    self._dirty.discard(task_id)
        if revoked:
            self._log.info("partitions revoked", partitions=sorted(tp.partition for tp in revoked))
            if self._on_revoke is not None:
                self._on_revoke({tp.partition for tp in revoked if tp.topic == self._journal})

    async def _adopt(self, assigned: list[TopicPartition]) -> None:
        kafka = self._consumer.kafka
        new = [tp for tp in assigned if tp not in self._partitions]
        if not new:
            return
        if self._on_assign is not None:
            await self._on_assign({tp.partition for tp in new if tp.topic == self._journal})
        ends = await kafka.end_offsets(new)
        for tp in new:
            self._partitions[tp] = _Partition(end_at_assign=ends[tp])
        await kafka.seek_to_beginning(*new)  # replay: the journal is the only state
        self._log.info("partitions assigned", partitions=sorted(tp.partition for tp in new))


async def run_until_cancelled(*coros: Awaitable[None]) -> None:
    """Run a service's loops together; the first to fail stops them all."""
    async with asyncio.TaskGroup() as group:
        for coro in coros:
            group.create_task(coro)  # type: ignore[arg-type]
