"""The journal writer: acks=all, idempotent, keyed by task id.

Write before acting: `append` returns only once the broker has the event (acks=all), so a
caller that acts after it can never act on something the journal does not know.

Every journal event this process appends is also handed, once acknowledged, to the followers
of this process that listen (`local_appends`): a follower that has folded everything before the
event's offset folds it at once, instead of a fetch round trip later (`JournalFollower`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Self

from aiokafka import AIOKafkaProducer
from aiokafka.structs import RecordMetadata

from halfway import log
from halfway.contract import Event
from halfway.contract.topics import JOURNAL, TopicSpec
from halfway.journal.records import key_partitioner, record_headers, record_key, record_value
from halfway.settings import KafkaSettings

DEFAULT_BATCH_BYTES = 16_384  # aiokafka's
# A listener of this process's journal appends: (topic, event, partition, offset, writer).
Appended = Callable[[str, Event, int, int, "JournalWriter"], None]


class LocalAppends:
    """The followers of this process told of its journal appends (by any of its writers: a
    process that runs a decider and an executor has one writer each, per Kafka principal)."""

    def __init__(self) -> None:
        self._listeners: list[Appended] = []

    def add(self, listener: Appended) -> None:
        self._listeners.append(listener)

    def remove(self, listener: Appended) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def tell(self, topic: str, event: Event, partition: int, offset: int,
             writer: JournalWriter) -> None:
        for listener in list(self._listeners):
            try:
                listener(topic, event, partition, offset, writer)
            except Exception:  # the write stands; the fetch brings the event anyway
                log.get("halfway.journal").exception("a local fold of an append failed",
                                                     offset=offset, partition=partition)


local_appends = LocalAppends()


class JournalWriter:
    def __init__(self, settings: KafkaSettings, *, linger_ms: int = 0,
                 batch_bytes: int = DEFAULT_BATCH_BYTES) -> None:
        """`batch_bytes`: the most one partition's batch holds. A sender that finds it full
        waits until it is sent, and every such waiter wakes each time one is: a writer with
        hundreds of sends in flight to few partitions wants it larger."""
        self.settings = settings
        self._producer = AIOKafkaProducer(
            **settings.client(),
            acks="all",
            # Idempotence makes the producer's own retries safe: a resent batch is not written
            # twice. It does not dedupe a second writer; the fold's first-in-log rule does.
            enable_idempotence=True,
            linger_ms=linger_ms,
            max_batch_size=batch_bytes,
            partitioner=key_partitioner,
            request_timeout_ms=30_000,
        )

    async def start(self) -> None:
        await self._producer.start()

    async def stop(self) -> None:
        await self._producer.stop()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()

    def topic(self, spec: TopicSpec) -> str:
        return spec.name(self.settings.topic_prefix)

    async def append(self, event: Event, spec: TopicSpec = JOURNAL) -> RecordMetadata:
        """Write one event and wait until the broker has it."""
        return (await self.append_all((event,), spec))[0]

    async def append_all(self, events: Sequence[Event],
                         spec: TopicSpec = JOURNAL) -> list[RecordMetadata]:
        """Write events in this order and wait until the broker has every one. Events of one
        task share a partition and go in one produce request (queued without yielding to the
        sender), so they cost one round trip. Not atomic as a group: a caller that acts on
        them reads them back in its fold first (the executor's `place`)."""
        topic = self.topic(spec)
        sent = [await self._producer.send(topic, value=record_value(event),
                                          key=record_key(event), headers=record_headers(event))
                for event in events]
        metas: list[RecordMetadata] = [await sent[0]] if len(sent) == 1 else \
            list(await asyncio.gather(*sent))
        if spec is JOURNAL:
            for event, meta in zip(events, metas, strict=True):
                local_appends.tell(topic, event, meta.partition, meta.offset, self)
        return metas

    async def append_raw(self, spec: TopicSpec, value: bytes | None, *, key: bytes | None = None,
                         headers: list[tuple[str, bytes]] | None = None) -> RecordMetadata:
        """Write bytes that are not (or not yet) an event: dead letters, tests of bad input."""
        return await self._producer.send_and_wait(self.topic(spec), value=value, key=key,
                                                  headers=headers or [])
