"""Dead letters: the one way every consumer sets a record aside and goes on.

A record no service can apply (not an event, a wrong key, a tombstone, anything) is described on
the dead-letter topic: the reason, where the original lives, its size and digest, and a bounded
excerpt (`records.dead_letter`), keyed `topic/partition/offset`, so copies written by several
consumers, or again after a restart, are recognisable as one.

Writing the letter is retried a few times with backoff. If it still fails, the record is
skipped anyway, with an error logged that says where it is: the original stays on its topic
(topics keep everything), and a consumer stuck on one record would stop every task behind it.
Nothing here raises, except cancellation.
"""

from __future__ import annotations

import asyncio
import hashlib
from datetime import UTC, datetime
from typing import Protocol

from aiokafka.structs import ConsumerRecord, RecordMetadata
from structlog.typing import FilteringBoundLogger

from halfway import log
from halfway.contract.topics import DEAD_LETTERS, TopicSpec
from halfway.journal.records import dead_letter

DEAD_LETTER_ATTEMPTS = 3
DEAD_LETTER_BACKOFF_S = 0.5  # before the second attempt; doubled before each later one
# One attempt: a healthy broker acknowledges in milliseconds; the writer's own request
# timeout (30 s) is longer than a consumer should stand still for one letter.
DEAD_LETTER_ATTEMPT_TIMEOUT_S = 10.0
LOGGED_REASON_CHARS_MAX = 300


class RawWriter(Protocol):
    """What a dead letter needs of a writer (JournalWriter is one)."""

    async def append_raw(self, spec: TopicSpec, value: bytes | None, *,
                         key: bytes | None = None,
                         headers: list[tuple[str, bytes]] | None = None) -> RecordMetadata: ...


def letter_key(record: ConsumerRecord) -> bytes:
    """Where the original lives: the dead letter's key."""
    return f"{record.topic}/{record.partition}/{record.offset}".encode()


async def send_dead_letter(writer: RawWriter, record: ConsumerRecord, reason: str, *,
                           group: str | None, logger: FilteringBoundLogger | None = None,
                           attempts: int = DEAD_LETTER_ATTEMPTS,
                           backoff_s: float = DEAD_LETTER_BACKOFF_S,
                           attempt_timeout_s: float = DEAD_LETTER_ATTEMPT_TIMEOUT_S) -> bool:
    """Write the dead letter of `record`; True once the broker has it. False if it could not
    be written after `attempts` tries: then an error is logged with where the record is, and
    the caller goes on all the same. Never raises, except CancelledError."""
    logger = logger or log.get("halfway.deadletters", group=group)
    size = 0 if record.value is None else len(record.value)
    where = {"topic": record.topic, "partition": record.partition, "offset": record.offset,
             "size_bytes": size, "reason": reason[:LOGGED_REASON_CHARS_MAX]}
    try:
        value = dead_letter(record, reason, group=group,
                            at=datetime.now(UTC)).model_dump_json().encode()
    except Exception as exc:  # a bug in the builder must not stop the consumer either
        logger.error("dead letter not built: record skipped", error=repr(exc)[:300],
                     sha256=_digest(record), **where)
        return False
    error: Exception | None = None
    for attempt in range(1, attempts + 1):
        if attempt > 1:
            await asyncio.sleep(backoff_s * 2 ** (attempt - 2))
        try:
            async with asyncio.timeout(attempt_timeout_s):
                await writer.append_raw(DEAD_LETTERS, value, key=letter_key(record),
                                        headers=[("type", b"dead_letter")])
        except Exception as exc:  # the broker's errors are many; each means "not written"
            error = exc
            logger.warning("dead letter not written", attempt=attempt, attempts=attempts,
                           error=repr(exc)[:300], **where)
            continue
        logger.warning("dead-lettered a record", **where)
        return True
    logger.error("dead letter lost: record skipped", attempts=attempts,
                 error=repr(error)[:300], sha256=_digest(record), **where)
    return False


def _digest(record: ConsumerRecord) -> str | None:
    return None if record.value is None else hashlib.sha256(record.value).hexdigest()


class DeadLetters:
    """One consumer's dead letters: written through `send_dead_letter`, and counted."""

    def __init__(self, writer: RawWriter, *, group: str | None,
                 logger: FilteringBoundLogger | None = None,
                 backoff_s: float = DEAD_LETTER_BACKOFF_S) -> None:
        self.writer = writer
        self.group = group
        self.backoff_s = backoff_s
        self._log = logger or log.get("halfway.deadletters", group=group)
        self.written = 0  # letters the broker has
        self.failed = 0  # records skipped without a letter (logged as errors)

    async def send(self, record: ConsumerRecord, reason: str) -> bool:
        ok = await send_dead_letter(self.writer, record, reason, group=self.group,
                                    logger=self._log, backoff_s=self.backoff_s)
        if ok:
            self.written += 1
        else:
            self.failed += 1
        return ok
