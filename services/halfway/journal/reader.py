"""The typed consumer: valid events out, invalid records to the dead-letter topic.

A record that is not a valid event never crashes the service and never blocks its partition:
it is described on the dead-letter topic (the reason, where it lives, its size and digest, an
excerpt: `halfway.journal.deadletters`), then the consumer goes on with the next record. The
letter's write is awaited and retried; if it still fails, the record is skipped with an error
logged, never retried forever. Records of any size the broker accepts are fetched
(`halfway.journal.limits`). Offsets are committed by the caller, after it has acted on an
event: at-least-once, with every output idempotent.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import Any, Self

from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.structs import ConsumerRecord

from halfway import log
from halfway.contract import TaskRequested
from halfway.contract.topics import TASKS, WEBHOOKS, TopicSpec
from halfway.journal.deadletters import DeadLetters, RawWriter
from halfway.journal.limits import fetch_limits
from halfway.journal.membership import labelled_range
from halfway.journal.records import (
    Delivery,
    InvalidRecord,
    decode,
    decode_webhook,
)
from halfway.settings import KafkaSettings

FETCH_TIMEOUT_MS = 500
FETCH_RECORDS_MAX = 500
# With `gather_ms`, a fetch is answered once this much has gathered (or the time is up).
GATHER_BYTES = 256 * 1024
# Otherwise, how long the broker holds a fetch that finds nothing (aiokafka's default: 500 ms).
# A partition resumed meanwhile (its snapshot restored, its webhooks let through) joins only the
# next fetch, as aiokafka sends one fetch to a broker at a time: this bounds that wait, for ten
# empty fetches a second when the partitions are quiet.
QUIET_FETCH_WAIT_MS = 100


class Wake:
    """What an asyncio.Event does for `EventConsumer.batch`, plus a plain future for its next
    `set`: a batch waits on it without a task of its own (a follower's loop wakes for every
    local append, so this is paid per journal event)."""

    def __init__(self) -> None:
        self._set = False
        self._future: asyncio.Future[None] | None = None

    def set(self) -> None:
        self._set = True
        if self._future is not None and not self._future.done():
            self._future.set_result(None)

    def is_set(self) -> bool:
        return self._set

    def clear(self) -> None:
        self._set = False

    def future(self) -> asyncio.Future[None]:
        """Done at the next `set` (at once if set now)."""
        if self._future is None or self._future.done():
            self._future = asyncio.get_running_loop().create_future()
            if self._set:
                self._future.set_result(None)
        return self._future


def known_end(consumer: AIOKafkaConsumer, tp: TopicPartition) -> int | None:
    """The partition's end offset as of the consumer's last fetch, or None: not fetched yet,
    or no longer assigned. A metrics scrape asks from its own thread while the loop's may be
    revoking the partition: it must not fail."""
    if tp not in consumer.assignment():
        return None
    try:
        return consumer.highwater(tp)
    except (AssertionError, AttributeError):  # revoked since the line above (python -O: the
        return None                           # assertion gone, its state is None)


class EventConsumer:
    def __init__(self, settings: KafkaSettings, *, topics: tuple[TopicSpec, ...], group: str,
                 writer: RawWriter, listener: ConsumerRebalanceListener | None = None,
                 app_label: str | None = None, gather_ms: int = 0,
                 prompt: tuple[TopicSpec, ...] = ()) -> None:
        """`gather_ms`: how long the broker may hold a fetch to gather records (up to
        GATHER_BYTES) before answering; 0 answers at the first record. A follower off the
        step's critical path trades that much latency for far fewer fetches. `prompt`: those
        of `topics` whose records are wanted at once even so (see `_Prompt`)."""
        assert all(t in topics for t in prompt), "prompt topics are some of the topics read"
        self.group = group
        self.app_label = app_label
        self.gather_ms = gather_ms
        self.fetched: set[TopicPartition] = set()  # partitions the last `batch` had records of
        # Whether the last `batch` was woken before its fetch returned: no position moved.
        self.woken = False
        # Whether the last `batch` surely suspended (let the loop run others): it waited for
        # a fetch or a wake. One served from aiokafka's buffer may not have.
        self.waited = False
        # Every app label the group's members announced at the last rebalance (membership).
        self.group_apps: dict[str, int] = {}
        self._topics = [t.name(settings.topic_prefix) for t in topics]
        # Each topic's own contract: task events everywhere but on the webhooks topic, and
        # only requests on the tasks topic (callers write it: anything else is lettered).
        webhooks, tasks = WEBHOOKS.name(settings.topic_prefix), TASKS.name(settings.topic_prefix)
        self._decoders: dict[str, Callable[[ConsumerRecord], Any]] = {
            name: decode_webhook if name == webhooks
            else self._decode_request if name == tasks else self._decode
            for name in self._topics}
        self._partition_counts: dict[str, int] = {}  # per topic; a topic's count never changes
        self._log = log.get("halfway.journal", group=group)
        self._prompt = _Prompt(settings, {t.name(settings.topic_prefix) for t in prompt},
                               self) if prompt and gather_ms > 0 else None
        self._listener = listener if self._prompt is None else self._prompt.wrap(listener)
        self.dead_letters = DeadLetters(writer, group=group, logger=self._log)
        self._consumer = AIOKafkaConsumer(
            **settings.client(),
            group_id=group,
            enable_auto_commit=False,  # we commit after acting, never before
            auto_offset_reset="earliest",  # a new group reads the journal from the start
            isolation_level="read_committed",
            # Range assignment gives one instance the same partition number of every topic:
            # the tasks topic and the journal are both keyed by task id, so one instance sees
            # a task's request and its journal.
            partition_assignment_strategy=(
                RangePartitionAssignor if app_label is None
                else labelled_range(app_label, self._group_apps),),
            **fetch_limits(),
            **({"fetch_max_wait_ms": gather_ms, "fetch_min_bytes": GATHER_BYTES}
               if gather_ms > 0 else {"fetch_max_wait_ms": QUIET_FETCH_WAIT_MS}),
        )

    def _group_apps(self, labels: dict[str, int]) -> None:
        self.group_apps = labels
        if len(labels) > 1:
            self._log.error(
                "the members of this group serve different apps: tasks are split between "
                "them, and a step for a tool one lacks waits for one that has it; run one app "
                "per group (topic prefix)", apps=labels, this=self.app_label)

    @property
    def at_once(self) -> list[str]:
        """The topics fetched at once although the others are gathered."""
        return sorted(self._prompt.topics) if self._prompt is not None else []

    @property
    def dead_lettered(self) -> int:
        """Invalid records set aside so far (letters written, and records skipped without)."""
        return self.dead_letters.written + self.dead_letters.failed

    @property
    def kafka(self) -> AIOKafkaConsumer:
        """The underlying consumer, for positions and seeks in a rebalance listener."""
        return self._consumer

    async def start(self) -> None:
        if self._prompt is not None:
            await self._prompt.consumer.start()
        await self._consumer.start()
        if self._listener is None:
            self._consumer.subscribe(self._topics)
        else:
            self._consumer.subscribe(self._topics, listener=self._listener)

    async def stop(self) -> None:
        await self._consumer.stop()
        if self._prompt is not None:
            await self._prompt.consumer.stop()

    # -- partitions: each is read by one consumer (the group's, or the prompt one) ---------

    def _reader(self, tp: TopicPartition) -> AIOKafkaConsumer:
        prompt = self._prompt
        return prompt.consumer if prompt is not None and tp.topic in prompt.topics \
            else self._consumer

    async def position(self, tp: TopicPartition) -> int:
        return await self._reader(tp).position(tp)

    def highwater(self, tp: TopicPartition) -> int | None:
        return known_end(self._reader(tp), tp)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self._reader(tp).seek(tp, offset)

    def pause(self, *tps: TopicPartition) -> None:
        for tp in tps:
            self._reader(tp).pause(tp)

    def resume(self, *tps: TopicPartition) -> None:
        for tp in tps:
            self._reader(tp).resume(tp)

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()

    async def deliveries(self) -> AsyncIterator[Delivery]:
        """Valid events in log order per partition, forever."""
        while True:
            for delivery in await self.batch():
                yield delivery

    async def batch(self, timeout_ms: int = FETCH_TIMEOUT_MS,
                    wake: asyncio.Event | Wake | None = None,
                    folded: Callable[[str, int, int], bool] | None = None) -> list[Delivery]:
        """The valid events of one fetch (possibly none), invalid ones dead-lettered. With
        `wake`, a quiet fetch ends early (with nothing) once it is set, and one that starts
        set does not wait at all: the caller has work besides the records (a timer fired).
        Records `folded` says the caller has already (topic, partition, offset) are skipped
        without decoding."""
        batches = await self._fetch(timeout_ms, wake)
        self.fetched = set(batches)
        out = []
        for records in batches.values():
            for record in records:
                if folded is not None and folded(record.topic, record.partition, record.offset):
                    continue
                delivery = await self._accept(record)
                if delivery is not None:
                    out.append(delivery)
        return out

    def _readers(self) -> list[AIOKafkaConsumer]:
        if self._prompt is None or not self._prompt.consumer.assignment():
            return [self._consumer]
        return [self._consumer, self._prompt.consumer]

    async def _fetch(self, timeout_ms: int, wake: asyncio.Event | Wake | None,
                     ) -> dict[TopicPartition, list[ConsumerRecord]]:
        self.woken = self.waited = False
        readers = self._readers()
        if wake is not None and wake.is_set():
            wake.clear()
            timeout_ms = 0
        if len(readers) == 1 and (wake is None or timeout_ms == 0):
            return await readers[0].getmany(timeout_ms=timeout_ms,
                                            max_records=FETCH_RECORDS_MAX)
        self.waited = True  # on tasks just made: they run only once this coroutine suspends
        getters = [asyncio.ensure_future(r.getmany(timeout_ms=timeout_ms,
                                                   max_records=FETCH_RECORDS_MAX))
                   for r in readers]
        waker: asyncio.Future[Any] | None = None
        if isinstance(wake, Wake):
            waker = wake.future()  # kept for the next batch if not set meanwhile
        elif wake is not None:
            waker = asyncio.ensure_future(wake.wait())
        try:
            await asyncio.wait([*getters, *([waker] if waker else [])],
                               return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            for getter in getters:
                getter.cancel()
            raise
        finally:
            if waker is not None and not isinstance(wake, Wake):
                waker.cancel()
        if wake is not None:
            wake.clear()
        out: dict[TopicPartition, list[ConsumerRecord]] = {}
        self.woken = True
        # Safe: aiokafka drains its buffer and returns without awaiting in between, so a
        # getmany not done was only waiting and takes no record with it. Not awaited: telling
        # its CancelledError from our own would need this task's `cancelling()`, which a
        # TaskGroup whose child failed during its exit leaves at 1 on Python 3.11 and 3.12
        # (cpython#116720): every woken fetch would then end the loop as if it were stopped.
        waiting = [getter for getter in getters if not getter.done()]
        for getter in waiting:
            getter.cancel()
        for getter in getters:
            if getter not in waiting:
                out.update(getter.result())  # a fetch error is raised here, as by getmany
                self.woken = False  # a fetch came back: positions may have moved
        return out

    def _decode(self, record: ConsumerRecord) -> Any:
        """A task event, checked to sit in its task's partition."""
        count = self._partition_counts.get(record.topic)
        if count is None:
            count = len(self._consumer.partitions_for_topic(record.topic) or ())
            if count:
                self._partition_counts[record.topic] = count
        return decode(record, count or None)

    def _decode_request(self, record: ConsumerRecord) -> TaskRequested:
        """A record of the tasks topic: a `task.requested`, or invalid."""
        event = self._decode(record)
        if not isinstance(event, TaskRequested):
            raise InvalidRecord(f"the tasks topic holds task.requested only, not {event.type}")
        return event

    async def _accept(self, record: ConsumerRecord) -> Delivery | None:
        try:
            event = self._decoders[record.topic](record)
        except InvalidRecord as exc:
            # Written (or given up on) before the next record: a letter is never lost to a
            # commit that overtook it.
            await self.dead_letters.send(record, exc.reason)
            return None
        return Delivery(event, record.topic, record.partition, record.offset,
                        len(record.value or b""))

    async def commit(self, delivery: Delivery) -> None:
        """Everything up to and including `delivery` in its partition has been acted on."""
        tp = TopicPartition(delivery.topic, delivery.partition)
        await self._consumer.commit({tp: delivery.offset + 1})

    async def commit_consumed(self) -> None:
        """Everything handed out so far (and every dead-lettered record) has been acted on."""
        await self._consumer.commit()


class _Prompt:
    """A second consumer, of no group, for the `prompt` topics of a gathering EventConsumer:
    a worker's decider gathers the journal (what it needs of it at once, its own process's
    appends, it folds as they are acknowledged: `halfway.journal.writer.local_appends`) but
    must hear a new task's request at once. One consumer cannot do both: the broker answers a
    fetch for all its partitions together, and aiokafka sends one fetch to a broker at a time.

    The group still assigns every partition, prompt topics' too (range assignment keeps a
    task's request and journal together); the group's consumer keeps those paused, and this
    one reads them from where the follower seeks. aiokafka's rebalances are eager (every
    partition is revoked, then the new assignment given), and a follower seeks each partition
    it adopts, so a new assignment here starts every partition anew."""

    def __init__(self, settings: KafkaSettings, topics: set[str], owner: EventConsumer) -> None:
        self.topics = topics
        self.owner = owner
        self.consumer = AIOKafkaConsumer(
            **settings.client(), group_id=None, enable_auto_commit=False,
            auto_offset_reset="earliest", isolation_level="read_committed",
            **fetch_limits(), fetch_max_wait_ms=QUIET_FETCH_WAIT_MS)

    def wrap(self, listener: ConsumerRebalanceListener | None) -> ConsumerRebalanceListener:
        prompt = self

        class Handover(ConsumerRebalanceListener):
            async def on_partitions_revoked(self, revoked: list[TopicPartition]) -> None:
                prompt.consumer.assign(sorted(prompt.consumer.assignment() - set(revoked)))
                if listener is not None:
                    await listener.on_partitions_revoked(revoked)

            async def on_partitions_assigned(self, assigned: list[TopicPartition]) -> None:
                mine = {tp for tp in assigned if tp.topic in prompt.topics}
                prompt.owner.kafka.pause(*mine)  # read by the prompt consumer only
                prompt.consumer.assign(sorted(prompt.consumer.assignment() | mine))
                if listener is not None:
                    await listener.on_partitions_assigned(assigned)

        return Handover()
