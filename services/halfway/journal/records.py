"""Events as Kafka records, and records back into events (or into a reason they are not one)."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol, TypeVar

from aiokafka.structs import ConsumerRecord
from pydantic import ValidationError

from halfway.contract import Event, encode_event, parse_event
from halfway.contract.events import DeadLetter
from halfway.contract.guards import GuardRecord, parse_guard_record
from halfway.contract.webhooks import WebhookReceived, parse_webhook

Headers = list[tuple[str, bytes]]
REASON_LENGTH_MAX = 2000


def stamp(task_id: str, at: datetime | None = None) -> dict[str, Any]:
    """The envelope a writer stamps on a new event, once, before its first send."""
    return {"event_id": uuid.uuid4().hex, "task_id": task_id, "at": at or datetime.now(UTC)}


def record_key(event: Event) -> bytes:
    # The partition key is the task id: one task's events are totally ordered.
    return event.task_id.encode()


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


def decode(record: ConsumerRecord) -> Event:
    """The event a record holds. Raises InvalidRecord with the reason."""
    if record.value is None:
        raise InvalidRecord("the record has no value (a tombstone): journals hold events only")
    try:
        event = parse_event(record.value)
    except ValidationError as exc:
        raise InvalidRecord(_describe(exc)) from exc
    if record.key is not None and record.key != record_key(event):
        # A task's events must share a partition; a wrong key breaks the order the fold needs.
        raise InvalidRecord(f"record key {record.key!r} is not the event's task id "
                            f"{event.task_id!r}")
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


def _decode_keyed(record: ConsumerRecord, parse: Callable[[bytes], R], whose: str) -> R:
    if record.value is None:
        raise InvalidRecord("the record has no value (a tombstone)")
    try:
        out = parse(record.value)
    except ValidationError as exc:
        raise InvalidRecord(_describe(exc)) from exc
    if record.key is not None and record.key != out.record_key():
        raise InvalidRecord(f"record key {record.key!r} is not {whose} {out.record_key()!r}")
    return out


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(str(p) for p in err["loc"]) or "(record)"
        parts.append(f"{where}: {err['msg']}")
    return ("invalid event: " + "; ".join(parts))[:REASON_LENGTH_MAX]


@dataclass(frozen=True, slots=True)
class Delivery:
    """A valid record (a task event, or a verified webhook) and where it sits in the log."""

    event: Any  # Event, or WebhookReceived on the webhooks topic
    topic: str
    partition: int
    offset: int


def dead_letter(record: ConsumerRecord, reason: str, *, group: str | None,
                at: datetime) -> DeadLetter:
    """The dead-letter record for `record`: whole, so nothing of it is lost."""
    value = record.value or b""
    try:
        text, raw = value.decode("utf-8"), None
    except UnicodeDecodeError:
        text, raw = value.decode("utf-8", errors="replace"), base64.b64encode(value).decode()
    return DeadLetter(
        reason=reason,
        source_topic=record.topic,
        source_partition=record.partition,
        source_offset=record.offset,
        key=None if record.key is None else record.key.decode("utf-8", errors="replace"),
        value=text,
        value_b64=raw,
        headers={k: v.decode("utf-8", errors="replace") for k, v in (record.headers or ())},
        consumer_group=group,
        at=at,
    )
