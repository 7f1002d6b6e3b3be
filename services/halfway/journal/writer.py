"""The journal writer: acks=all, idempotent, keyed by task id.

Write before acting: `append` returns only once the broker has the event (acks=all), so a
caller that acts after it can never act on something the journal does not know.
"""

from __future__ import annotations

from types import TracebackType
from typing import Self

from aiokafka import AIOKafkaProducer
from aiokafka.structs import RecordMetadata

from halfway.contract import Event
from halfway.contract.topics import JOURNAL, TopicSpec
from halfway.journal.records import record_headers, record_key, record_value
from halfway.settings import KafkaSettings


class JournalWriter:
    def __init__(self, settings: KafkaSettings, *, linger_ms: int = 0) -> None:
        self.settings = settings
        self._producer = AIOKafkaProducer(
            **settings.client(),
            acks="all",
            # Idempotence makes the producer's own retries safe: a resent batch is not written
            # twice. It does not dedupe a second writer; the fold's first-in-log rule does.
            enable_idempotence=True,
            linger_ms=linger_ms,
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
        return await self._producer.send_and_wait(
            self.topic(spec), value=record_value(event), key=record_key(event),
            headers=record_headers(event),
        )

    async def append_raw(self, spec: TopicSpec, value: bytes | None, *, key: bytes | None = None,
                         headers: list[tuple[str, bytes]] | None = None) -> RecordMetadata:
        """Write bytes that are not (or not yet) an event: dead letters, tests of bad input."""
        return await self._producer.send_and_wait(self.topic(spec), value=value, key=key,
                                                  headers=headers or [])
