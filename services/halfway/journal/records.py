"""Events as Kafka records, and records back into events (or into a reason they are not one)."""

from __future__ import annotations

import base64
import codecs
import functools
import hashlib
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

from aiokafka.partitioner import murmur2
from aiokafka.structs import ConsumerRecord
from pydantic import ValidationError

from halfway.contract import Event, encode_event, parse_event
from halfway.contract.events import DeadLetter, new_event_id
from halfway.contract.guards import GuardRecord, parse_guard_record
from halfway.contract.webhooks import WebhookReceived, parse_webhook

Headers = list[tuple[str, bytes]]
REASON_LENGTH_MAX = 2000  # DeadLetter.reason's bound, and any reason's
# A reason names where and what, never the input: these bound each part of it.
REASON_LOC_CHARS_MAX = 120  # one path element (a field name may be a megabyte)
REASON_MSG_CHARS_MAX = 300  # one message
REASON_QUOTE_CHARS_MAX = 60  # a value a message quotes (pydantic quotes a bad tag whole)
REASON_ERRORS_LISTED_MAX = 1000  # more errors than this are counted, not formatted
REASON_KEY_BYTES_MAX = 100  # a record key quoted in a reason
# A dead letter's bounds (see DeadLetter): it must always fit the broker.
EXCERPT_BYTES_MAX = 2048
LETTER_KEY_CHARS_MAX = 1000
LETTER_HEADERS_MAX = 16
LETTER_HEADER_CHARS_MAX = 200
_UTF8_CHAR_BYTES_MAX = 4


def stamp(task_id: str, at: datetime | None = None) -> dict[str, Any]:
    """The envelope a writer stamps on a new event, once, before its first send."""
    return {"event_id": new_event_id(), "task_id": task_id, "at": at or datetime.now(UTC)}


def record_key(event: Event) -> bytes:
    # The partition key is the task id: one task's events are totally ordered.
    return event.task_id.encode()


# The newest keys' murmur2 hashes kept: a live task's key is hashed on every append of it
# (aiokafka's murmur2 is pure Python, about 1% of a worker's CPU uncached).
KEY_HASHES_KEPT = 8192


@functools.lru_cache(maxsize=KEY_HASHES_KEPT)
def _key_hash(key: bytes) -> int:
    return murmur2(key) & 0x7FFFFFFF


def partition_of(key: bytes, partitions: int) -> int:
    """The partition the producer's default partitioner gives `key` (murmur2, as Java's)."""
    return _key_hash(key) % partitions


def key_partitioner(key: bytes | None, all_partitions: list[int],
                    available: list[int]) -> int:
    """aiokafka's default partitioner, with the hash cached (`partition_of`): the same
    partition for every key, so it mixes with writers that use the default."""
    if key is None:
        return random.choice(available or all_partitions)
    return all_partitions[partition_of(key, len(all_partitions))]


def record_headers(event: Event) -> Headers:
    # Headers let a reader route or filter without parsing the value; the value stays authoritative.
    return [
        ("type", event.type.encode()),
        ("schema_version", str(event.schema_version).encode()),
        ("event_id", event.event_id.encode()),
    ]


def record_value(event: Event) -> bytes:
    return encode_event(event)


class InvalidRecord(Exception):
    """A record that is not a valid event; `reason` says why in words a caller can act on."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def decode(record: ConsumerRecord, partitions: int | None = None) -> Event:
    """The event a record holds. Raises InvalidRecord with the reason. `partitions`: the
    topic's partition count, to check the record sits where its task's events are."""
    if record.value is None:
        raise InvalidRecord("the record has no value (a tombstone): these topics hold task "
                            "events only")
    event = _parse(parse_event, record.value)
    # A task's events must share a partition: the fold needs their order, and the one service
    # instance that owns the partition acts on the task. A keyless record, or one a writer put
    # in another partition, would be folded (and acted on) where its task is not.
    key = record_key(event)
    if record.key is None:
        raise InvalidRecord(f"the record has no key: a task's events are keyed by its task id "
                            f"{_quote(key)}")
    if record.key != key:
        raise InvalidRecord(f"record key {_quote(record.key)} is not the event's task id "
                            f"{_quote(key)}")
    if partitions is not None and record.partition != (home := partition_of(key, partitions)):
        raise InvalidRecord(f"the record is in partition {record.partition}, but task "
                            f"{_quote(key)}'s events are in partition {home}")
    return event


def decode_webhook(record: ConsumerRecord) -> WebhookReceived:
    """The verified webhook a record of the webhooks topic holds, or InvalidRecord."""
    return _decode_keyed(record, parse_webhook, "the webhook's")


def decode_guard(record: ConsumerRecord) -> GuardRecord:
    """The claim or release a record of the guards topic holds, or InvalidRecord. Claims on one
    subject must share a partition, or the log cannot order them: the key must be the subject."""
    return _decode_keyed(record, parse_guard_record, "the subject's")


class _KeyedRecord(Protocol):
    def record_key(self) -> bytes: ...


R = TypeVar("R", bound=_KeyedRecord)
P = TypeVar("P")


def _decode_keyed(record: ConsumerRecord, parse: Callable[[bytes], R], whose: str) -> R:
    if record.value is None:
        raise InvalidRecord("the record has no value (a tombstone)")
    out = _parse(parse, record.value)
    if record.key is not None and record.key != out.record_key():
        raise InvalidRecord(f"record key {_quote(record.key)} is not {whose} "
                            f"{_quote(out.record_key())}")
    return out


def _parse(parse: Callable[[bytes], P], value: bytes) -> P:
    try:
        return parse(value)
    except ValidationError as exc:
        raise InvalidRecord(describe(exc)) from exc
    except Exception as exc:
        # Not a validation error: a validator that broke on this input. Whatever it is, the
        # record cannot be applied, and a consumer must go on past it.
        raise InvalidRecord(f"the record could not be read: {type(exc).__name__}: "
                            f"{_cut(str(exc), REASON_MSG_CHARS_MAX)}") from exc


def describe(exc: ValidationError, prefix: str = "invalid event: ") -> str:
    """Why pydantic refused an input, bounded in length and in work whatever the input's size:
    each error's place and message, cut, never the input itself."""
    count = exc.error_count()
    if count > REASON_ERRORS_LISTED_MAX:
        # Formatting hundreds of thousands of errors costs seconds; the count says enough.
        return _cut(f"{prefix}{count} errors validating {exc.title} (more than "
                    f"{REASON_ERRORS_LISTED_MAX}: not listed)", REASON_LENGTH_MAX)
    parts: list[str] = []
    length = len(prefix)
    for err in exc.errors(include_url=False, include_input=False):
        where = ".".join(_cut(str(p), REASON_LOC_CHARS_MAX) for p in err["loc"]) or "(record)"
        msg = err["msg"]
        # What a message quotes comes from its context: cut there, the words around it stay.
        for value in (err.get("ctx") or {}).values():
            if isinstance(value, str) and len(value) > REASON_QUOTE_CHARS_MAX:
                msg = msg.replace(value, _cut(value, REASON_QUOTE_CHARS_MAX))
        part = f"{where}: {_cut(msg, REASON_MSG_CHARS_MAX)}"
        parts.append(part)
        length += len(part) + 2
        if length >= REASON_LENGTH_MAX:
            break
    if len(parts) < count:
        parts.append(f"({count - len(parts)} more)")
    return _cut(prefix + "; ".join(parts), REASON_LENGTH_MAX)


def _cut(text: str, chars_max: int) -> str:
    return text if len(text) <= chars_max else text[: chars_max - 1] + "…"


def _quote(key: bytes) -> str:
    """A record key for a reason: its start, as Python shows bytes."""
    shown = repr(key[:REASON_KEY_BYTES_MAX])
    return shown if len(key) <= REASON_KEY_BYTES_MAX else f"{shown}… ({len(key)} bytes)"


@dataclass(frozen=True, slots=True)
class Delivery:
    """A valid record (a task event, or a verified webhook) and where it sits in the log."""

    event: Any  # Event, or WebhookReceived on the webhooks topic
    topic: str
    partition: int
    offset: int
    size: int = 0  # the record's value, in bytes (what a held webhook counts)


def dead_letter(record: ConsumerRecord, reason: str, *, group: str | None,
                at: datetime) -> DeadLetter:
    """The dead-letter record for `record`: the reason, where the original lives (topics keep
    everything), its size and digest, and a bounded excerpt, so a letter always fits the
    broker whatever the size of the record it describes. A tombstone is a letter too."""
    value = record.value
    head = b"" if value is None else value[:EXCERPT_BYTES_MAX]
    truncated = value is not None and len(value) > len(head)
    text, valid = _utf8_excerpt(head, final=not truncated)
    return DeadLetter(
        reason=_cut(reason, REASON_LENGTH_MAX),
        source_topic=record.topic,
        source_partition=record.partition,
        source_offset=record.offset,
        key=None if record.key is None else _text_start(record.key, LETTER_KEY_CHARS_MAX),
        value=text,
        value_b64=None if valid else base64.b64encode(head).decode(),
        value_bytes=0 if value is None else len(value),
        value_sha256=None if value is None else hashlib.sha256(value).hexdigest(),
        truncated=truncated,
        headers={_cut(name, LETTER_HEADER_CHARS_MAX):
                 _text_start(header or b"", LETTER_HEADER_CHARS_MAX)
                 for name, header in itertools.islice(record.headers or (), LETTER_HEADERS_MAX)},
        consumer_group=group,
        at=at,
    )


def _utf8_excerpt(head: bytes, *, final: bool) -> tuple[str, bool]:
    """(text, whether `head` is valid UTF-8). When `head` is the start of a longer value
    (`final` False), a character cut at its end is left out, not called invalid."""
    try:
        return codecs.getincrementaldecoder("utf-8")().decode(head, final=final), True
    except UnicodeDecodeError:
        return codecs.getincrementaldecoder("utf-8")("replace").decode(head, final=final), False


def _text_start(data: bytes, chars_max: int) -> str:
    """The first `chars_max` characters of `data` as UTF-8 (invalid bytes replaced), decoding
    no more of it than that needs."""
    head = data[: chars_max * _UTF8_CHAR_BYTES_MAX]
    text = codecs.getincrementaldecoder("utf-8")("replace").decode(
        head, final=len(head) == len(data))
    return text[:chars_max]
