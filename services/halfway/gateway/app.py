"""The webhook gateway: provider webhooks in, verified `webhook.received` records out.

`POST /webhooks/{provider}` checks the provider's signature over the raw body in the provider's
format (Stripe's `Stripe-Signature`, or Standard Webhooks' `webhook-*` headers), reads the body
through the provider's declared mapping (`halfway.webhooks.providers`: where the event's id,
type, object and our key are, and which types say done or not done: data, not code here), and
publishes one `WebhookReceived` to the webhooks topic, keyed by `record_key()`. It answers 200
only once the broker has the record (acks=all): a provider that got 200 may forget the event, so
we must not lose it after answering.

It starts only with at least one provider and a secret for each (`serve_gateway`: otherwise it
says why and exits 2, before connecting to anything); secrets are never logged nor answered.

The record is built whole before anything is published and read back with the reconciler's own
decoder (`decode_webhook`): what the gateway answers 200 for, the reconciler can read. When our
key names a task, the record is stamped with that task's journal partition and the partition's
end offset, read after the body was verified and before publishing: a provider cannot know our
key before we send it, so the webhook is evidence only about an attempt journaled below it.

Refusals publish and remember nothing, and say why in `{"error": ...}`. A 4xx but 408 is
permanent (the same request would be refused again); only a broker failure is a 503, which
providers retry:
- 404: a provider we do not serve;
- 400: no, garbled, forged, stale or future signature; a body that is not an event as the
  provider's mapping describes it, or that the reconciler could not read back (nested too deep,
  text that is not Unicode, ...), or an id, type or object id longer than the reconciler can
  journal (`_check_bounds`);
- 408: a body not in whole within BODY_READ_S of the handler starting to read it;
- 409: a replay, i.e. a request we already accepted (the same signed timestamp and body, and
  webhook-id), still inside the tolerance window (a captured request re-sent: the provider
  re-signs each retry);
- 413: a body, or the record made of it, larger than the journal takes;
- 500: the broker refuses the gateway's principal the right to publish (taken away after the
  start, which checks it): an operator must restore it;
- 503: the broker did not answer (the journal's end offset, or the publish) in time.

A connection must bring a request's headers within HEADERS_READ_S (of its start, or of the end
of its previous request), and at most CONNECTIONS_MAX are open at once; past it, the one that
has waited longest for its headers is closed to let a new one in (`gateway.connections`).

What the headers alone condemn (a Content-Length over the limit, a signature header missing or
unreadable, a timestamp already outside the window) is refused before the body is read and
before the request takes one of the REQUESTS_AT_ONCE_MAX slots; a request that takes one holds
it for at most BODY_READ_S while its body arrives. Values a provider chose are cut to
LOG_VALUE_CHARS_MAX in log lines.

A provider's redelivery of an event we already published (a new signature, the same event id)
is answered 200 `{"duplicate": true}` and not published again. Both memories (signatures and
event ids) live in this process and are bounded in size and age, so after a restart, an
eviction, or with several gateway instances, a duplicate can be published again: the webhooks
topic is at-least-once, and downstream (the reconciler) dedupes by `provider_event_id`.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import os
import re
import signal
import sys
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, NoReturn, Protocol, get_args

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import MessageSizeTooLargeError
from aiokafka.record.default_records import DefaultRecordBatchBuilder
from aiokafka.structs import ConsumerRecord
from pydantic import ValidationError
from structlog.typing import FilteringBoundLogger

from halfway import log, metrics
from halfway.contract.events import StepSettled
from halfway.contract.ids import KEY_PATTERN, parse_step_id, step_of_key
from halfway.contract.topics import JOURNAL, WEBHOOKS
from halfway.contract.webhooks import WebhookReceived
from halfway.gateway.connections import HEADERS_READ_S, Connections
from halfway.journal import JournalWriter
from halfway.journal.admin import (
    AUTHORIZATION_ERRORS,
    check_access,
    ensure_topics_once_up,
    topic_partitions,
    unless_stopped,
)
from halfway.journal.limits import WRITER_RECORD_BYTES_MAX
from halfway.journal.records import InvalidRecord, decode_webhook, describe, partition_of
from halfway.listening import CannotListen, authority, bound_socket, why_not
from halfway.settings import KafkaSettings, gateway_host, gateway_port
from halfway.webhooks import delivery, mapping, providers, standard
from halfway.webhooks.delivery import Delivery
from halfway.webhooks.providers import Provider, ProviderError
from halfway.webhooks.signature import HEADER as STRIPE_HEADER
from halfway.webhooks.signature import TOLERANCE_S_DEFAULT, Reason, SignatureError
from halfway.webhooks.signature import _timestamp as stripe_timestamp

BODY_BYTES_MAX = 1024 * 1024  # Stripe events are well under this; more is not a webhook
# A provider sends its event at once: a body still arriving after this is a stalled or hostile
# client holding a slot (then 408, and the slot is free again).
BODY_READ_S = 5.0
# Requests served at once (each may hold a body of BODY_BYTES_MAX and wait on the broker); past
# it a request is 503 with Retry-After at once, before its body is read: providers retry. What
# the headers alone refuse takes no slot.
REQUESTS_AT_ONCE_MAX = 256
BUSY_RETRY_AFTER_S = 1
MEMORY_ENTRIES_MAX = 100_000  # per memory; past it the oldest entry is forgotten
# A signature stays acceptable until its t is `tolerance` in the past, and t may be up to
# `tolerance` in the future when accepted: remembering it twice that long covers every case.
SIGNATURE_MEMORY_TOLERANCES = 2
EVENT_IDS_KEPT_S = 86_400.0  # Stripe retries for days; a day of ids catches most redeliveries
PUBLISH_TIMEOUT_S = 30.0  # then 503: the provider retries (the record may still land: dupe)
# Reading where the journal ends is one round trip to a healthy broker; past this, 503.
JOURNAL_END_TIMEOUT_S = 5.0
# The largest record we publish: the writer's limit (aiokafka's estimate of the record with its
# batch overhead), less room for the stamp added after the first check (two integers).
RECORD_HEADROOM_BYTES = 1024
RECORD_BYTES_MAX = WRITER_RECORD_BYTES_MAX - RECORD_HEADROOM_BYTES
SHUTDOWN_TIMEOUT_S = 5.0
ERROR_CHARS_MAX = 500
LOG_VALUE_CHARS_MAX = 200  # of each value a provider chose (ids, types), in a log line


def _chars_max(constraints: Iterable[object]) -> int:
    """The max_length among a field's declared constraints: the bound read where it is
    declared, so the gateway's and the contract's cannot drift apart."""
    bounds = [getattr(c, "max_length", None) for c in constraints]
    return next(b for b in bounds if isinstance(b, int))


# How long each value the mapping reads may be, so that the reconciler can journal what it
# settles from it. The object id becomes a settlement's effect_id.
OBJECT_ID_CHARS_MAX = _chars_max(StepSettled.model_fields["effect_id"].metadata)
# The event's type and id are quoted in settlements (evidence, reasons, a contradiction of at
# most 2000 characters): a type as long as a provider may declare one, an id as long as an
# object id.
EVENT_TYPE_CHARS_MAX = _chars_max(get_args(mapping.EventType)[1:])
EVENT_ID_CHARS_MAX = OBJECT_ID_CHARS_MAX

# A secret no provider signs with. Asked with it and an empty body, a verifier refuses only for
# what it read in the headers, or says "no match", which means nothing without the body.
_NOBODYS_SECRET = "whsec_" + base64.b64encode(os.urandom(32)).decode()
# Those verdicts that no body could change, by format. Stripe's library reads the whole header
# before it compares a signature. The Standard Webhooks library checks that its headers are
# there and the timestamp is in its window first; a garbled signature entry is left to the
# whole check (in some versions, it does not count once an earlier entry matched).
_HEADER_VERDICTS: dict[str, frozenset[Reason]] = {
    "stripe": frozenset({"missing", "garbled", "no_v1"}),
    "standardwebhooks": frozenset({"missing", "stale", "future"}),
}

_KEY = re.compile(KEY_PATTERN)


class _Memory:
    """Strings seen recently, oldest first, bounded in count and in age (wall-clock seconds).

    Eviction of a young entry only weakens deduplication, which downstream repeats anyway.
    """

    def __init__(self, entries_max: int, kept_s: float) -> None:
        self._entries: OrderedDict[tuple[str, str], float] = OrderedDict()
        self._entries_max = entries_max
        self._kept_s = kept_s

    def _forget_old(self, now_s: float) -> None:
        while self._entries:
            oldest, at_s = next(iter(self._entries.items()))
            # A wall clock that steps back keeps entries longer, never shorter.
            if now_s - at_s < self._kept_s:
                return
            del self._entries[oldest]

    def has(self, key: tuple[str, str], now_s: float) -> bool:
        self._forget_old(now_s)
        return key in self._entries

    def add(self, key: tuple[str, str], now_s: float) -> None:
        self._entries[key] = now_s
        self._entries.move_to_end(key)
        while len(self._entries) > self._entries_max:
            self._entries.popitem(last=False)

    def discard(self, key: tuple[str, str]) -> None:
        self._entries.pop(key, None)

    def __len__(self) -> int:
        return len(self._entries)


class JournalEnds(Protocol):
    async def end_of(self, task_id: str) -> tuple[int, int]:
        """(journal partition of the task, that partition's end offset now)."""
        ...


class KafkaJournalEnds:
    """Where the journal ends now, for the partition a task's events go to. The partition
    count is read once, at start; the end offset on every call (read_committed: what a
    follower of the journal can see)."""

    def __init__(self, settings: KafkaSettings, timeout_s: float = JOURNAL_END_TIMEOUT_S,
                 ) -> None:
        self.settings = settings
        self.topic = JOURNAL.name(settings.topic_prefix)
        self.timeout_s = timeout_s
        self.partitions = 0
        self._consumer: AIOKafkaConsumer | None = None

    async def start(self) -> None:
        self.partitions = len(await topic_partitions(self.settings, self.topic))
        self._consumer = AIOKafkaConsumer(**self.settings.client(),
                                          group_id=None, enable_auto_commit=False,
                                          isolation_level="read_committed")
        await self._consumer.start()

    async def stop(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()

    async def end_of(self, task_id: str) -> tuple[int, int]:
        if self._consumer is None:
            raise RuntimeError("the journal's ends are read only between start and stop")
        # The partition the writer's default partitioner gives the task id (the journal key).
        tp = TopicPartition(self.topic, partition_of(task_id.encode(), self.partitions))
        async with asyncio.timeout(self.timeout_s):
            ends = await self._consumer.end_offsets([tp])
        return tp.partition, ends[tp]


@dataclass
class Gateway:
    """What the handlers share: where to publish, the providers and the two memories."""

    settings: KafkaSettings
    writer: JournalWriter
    providers: dict[str, Provider]
    tolerance_s: float = TOLERANCE_S_DEFAULT
    journal: JournalEnds | None = None  # None: webhooks that name a task cannot be stamped
    body_read_s: float = BODY_READ_S
    signatures: _Memory = field(init=False)
    event_ids: _Memory = field(init=False)
    # Event ids being published right now, so a concurrent redelivery waits for the outcome
    # instead of publishing a second copy. One entry per request being served, removed as it
    # ends (whatever the outcome): it never outgrows the requests in flight.
    publishing: dict[tuple[str, str], asyncio.Future[bool]] = field(default_factory=dict)
    serving: int = 0  # requests being served: REQUESTS_AT_ONCE_MAX at most

    def __post_init__(self) -> None:
        # Standard Webhooks' window is its library's, whatever ours is.
        window_s = max(self.tolerance_s, standard.TOLERANCE_S)
        self.signatures = _Memory(MEMORY_ENTRIES_MAX, SIGNATURE_MEMORY_TOLERANCES * window_s)
        self.event_ids = _Memory(MEMORY_ENTRIES_MAX, max(EVENT_IDS_KEPT_S, self.tolerance_s))


# Refusals are logged at most once per this interval per kind, with how many went unlogged
# since: a flood of bad requests (300 connections holding every slot) wrote a line per request,
# 53 MB of log in 2.5 minutes. The /metrics counters count every answer.
REFUSAL_LOG_INTERVAL_S = 10.0
_REFUSALS = log.Throttled(REFUSAL_LOG_INTERVAL_S)


def _log_refusal(logger: Any, why: str, **fields: Any) -> None:
    _REFUSALS.warning(logger, why, "webhook refused", why=why, **fields)


GATEWAY = web.AppKey("gateway", Gateway)
CONNECTIONS = web.AppKey("connections", Connections)


class _Malformed(Exception):
    """A request refused for good: `status` (4xx) and the reason, for the provider."""

    def __init__(self, reason: str, status: int = 400) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


@dataclass(frozen=True, slots=True)
class _Record:
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]


def _refuse(status: int, reason: str) -> web.Response:
    return web.json_response({"error": reason[:ERROR_CHARS_MAX]}, status=status)


def _cut(value: str | None) -> str | None:
    """A value the provider chose, as a log line holds it: at most LOG_VALUE_CHARS_MAX
    characters, and the length when it was cut."""
    if value is None or len(value) <= LOG_VALUE_CHARS_MAX:
        return value
    return f"{value[:LOG_VALUE_CHARS_MAX]}… ({len(value)} characters)"


def _header_verdict(provider: Provider, headers: Mapping[str, str], now_s: float,
                    tolerance_s: float) -> SignatureError | None:
    """Why the request's headers alone say it will be refused whatever its body; None if only
    the body can tell. Never refuses what the whole check would accept."""
    try:
        delivery.verify(Provider(provider.declaration, (_NOBODYS_SECRET,)), b"", headers, now_s,
                        tolerance_s)
    except SignatureError as exc:
        if exc.kind in _HEADER_VERDICTS[provider.format]:
            return exc
        if exc.kind != "mismatch":
            return None
    if provider.format == "stripe":
        # Stripe checks the clock only once a signature matched; the header's t= (readable:
        # the library read it) tells already that it will be too old by then.
        signed_at_s = stripe_timestamp(headers[STRIPE_HEADER])
        if signed_at_s < now_s - tolerance_s:
            return SignatureError("stale", f"timestamp too old: signed {int(now_s) - signed_at_s}"
                                  f" s ago, beyond the {tolerance_s:g} s tolerance")
    return None


def _refused_by_headers(gateway: Gateway, provider: Provider, request: web.Request,
                        logger: FilteringBoundLogger) -> web.Response | None:
    """The refusal of a request its headers alone condemn, before its body is waited for and
    before it takes a slot: a client trickling such a body holds nothing."""
    length = request.content_length
    if length is not None and length > BODY_BYTES_MAX:
        _log_refusal(logger, "too_large", content_length=length)
        return _refuse(413, f"the body is larger than {BODY_BYTES_MAX} bytes "
                            f"(Content-Length: {length})")
    refusal = _header_verdict(provider, request.headers, time.time(), gateway.tolerance_s)
    if refusal is None:
        return None
    _log_refusal(logger, refusal.kind, reason=refusal.reason, body_read=False)
    return _refuse(400, refusal.reason)


def _check_bounds(provider: Provider, received: WebhookReceived) -> None:
    """_Malformed (400) naming the first value the mapping read that is longer than the field
    it feeds may be: what the gateway accepts, the reconciler can journal. (Our key needs no
    check: one that does not match the key pattern, which bounds it, is recorded as absent.)"""
    where = provider.mapping
    for what, place, value, chars_max, why in (
            ("id", where.event_id or f"the {standard.ID_HEADER} header",
             received.provider_event_id, EVENT_ID_CHARS_MAX, "settlements quote"),
            ("type", where.event_type, received.provider_event_type, EVENT_TYPE_CHARS_MAX,
             "a provider may declare, and settlements quote"),
            ("object id", where.object_id, received.object_id, OBJECT_ID_CHARS_MAX,
             "a settlement's effect_id holds")):
        if len(value) > chars_max:
            raise _Malformed(f"the event's {what} ({place}) is {len(value)} characters long, "
                             f"more than the {chars_max} {why}")


def _reject_constant(name: str) -> Any:
    raise _Malformed(f"the body is not JSON: {name} is not a JSON number")


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):  # 1e400: JSON would say null where the provider said 1e400
        raise _Malformed(f"the body is not JSON we can keep: {text[:40]} is out of range")
    return number


def _task_of(key: Any) -> tuple[str | None, str | None]:
    """(key, task id) from our key where the mapping found it; a malformed key counts as
    absent: the record is then keyed by the provider's object id, and the reconciler cannot
    mistake it for ours."""
    if not isinstance(key, str) or _KEY.fullmatch(key) is None:
        return None, None
    task_id, _ = parse_step_id(step_of_key(key))
    return key, task_id


def _read_event(provider: Provider, body: bytes, verified: Delivery) -> WebhookReceived:
    """The record to publish for an event body, read through the provider's mapping;
    _Malformed if it is not such an event."""
    try:
        event = json.loads(body, parse_constant=_reject_constant, parse_float=_finite)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, nesting,
        raise _Malformed(f"the body is not JSON: {exc}") from exc  # an int of 5000 digits
    if not isinstance(event, dict):
        raise _Malformed("the body is not a JSON object")
    try:
        mapped = mapping.read(provider.mapping, event, verified.delivery_id)
    except mapping.Unreadable as exc:
        raise _Malformed(exc.reason) from exc
    key, task_id = _task_of(mapped.key)
    try:
        return WebhookReceived(
            provider=provider.name,
            provider_event_id=mapped.event_id,
            provider_event_type=mapped.event_type,
            object_id=mapped.object_id,
            key=key, task_id=task_id, payload=event, outcome=mapped.outcome,
            signed_at=datetime.fromtimestamp(verified.signed_at_s, UTC),
            received_at=datetime.now(UTC),
        )
    except ValidationError as exc:
        raise _Malformed(describe(exc, "the event cannot be recorded: ")) from exc
    except (RecursionError, ValueError, OverflowError, OSError) as exc:  # t out of range
        raise _Malformed(f"the event cannot be recorded: {exc}") from exc


def _record(settings: KafkaSettings, received: WebhookReceived) -> _Record:
    """The exact record to publish, read back as the reconciler will read it: _Malformed
    (400, or 413 when too large for the journal) if it could not be."""
    try:
        record = _Record(received.record_key(), received.model_dump_json().encode(), [
            ("type", received.type.encode()),
            ("schema_version", str(received.schema_version).encode()),
            ("provider_event_id", received.provider_event_id.encode())])
    except (ValueError, RecursionError) as exc:  # text that is not Unicode (a lone surrogate)
        raise _Malformed(f"the event cannot be recorded: {str(exc)[:ERROR_CHARS_MAX]}") from exc
    size = DefaultRecordBatchBuilder.estimate_size_in_bytes(record.key, record.value,
                                                            record.headers)
    if size > RECORD_BYTES_MAX:
        raise _Malformed(f"the event's record would be {size} bytes, more than the "
                         f"{RECORD_BYTES_MAX} the journal takes", status=413)
    try:
        decode_webhook(ConsumerRecord(
            topic=WEBHOOKS.name(settings.topic_prefix), partition=0, offset=0, timestamp=0,
            timestamp_type=0, key=record.key, value=record.value, checksum=None,
            serialized_key_size=len(record.key), serialized_value_size=len(record.value),
            headers=record.headers))
    except InvalidRecord as exc:
        raise _Malformed(f"the event cannot be recorded: {exc.reason}") from exc
    return record


async def receive(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    name = request.match_info["provider"]
    provider = gateway.providers.get(name)
    if provider is None:
        known = ", ".join(sorted(gateway.providers)) or "none"
        return _answered("unknown", _refuse(
            404, f"unknown provider {name[:100]!r}: webhooks are accepted for {known}"))
    logger = log.get("halfway.gateway", provider=name)
    refused = _refused_by_headers(gateway, provider, request, logger)
    if refused is not None:
        return _answered(name, refused)
    if gateway.serving >= REQUESTS_AT_ONCE_MAX:
        _log_refusal(logger, "busy", serving=gateway.serving)
        busy = _refuse(503, f"{REQUESTS_AT_ONCE_MAX} webhooks are being received; retry")
        busy.headers["Retry-After"] = str(BUSY_RETRY_AFTER_S)
        return _answered(name, busy)
    gateway.serving += 1
    metrics.WEBHOOKS_SERVING.inc()
    try:
        return _answered(name, await _receive(gateway, request, name, provider, logger))
    finally:
        gateway.serving -= 1
        metrics.WEBHOOKS_SERVING.dec()


def _answered(provider: str, response: web.Response) -> web.Response:
    metrics.WEBHOOKS_ANSWERED.labels(provider=provider, status=str(response.status)).inc()
    return response


async def _read_body(request: web.Request, deadline_s: float, logger: FilteringBoundLogger,
                     ) -> bytes | web.Response:
    """The whole body, or the refusal: a body not in within `deadline_s` (a slow or stalled
    client would hold its slot for as long as it likes), too large, or unreadable."""
    try:
        async with asyncio.timeout(deadline_s):
            return await request.read()
    except TimeoutError:
        _log_refusal(logger, "slow_body", deadline_s=deadline_s)
        late = _refuse(408, f"the body did not arrive within {deadline_s:g} s")
        late.force_close()  # no further request on this connection
        return late
    except web.HTTPRequestEntityTooLarge:
        return _refuse(413, f"the body is larger than {BODY_BYTES_MAX} bytes")
    except (HttpProcessingError, web.RequestPayloadError) as exc:  # a garbled chunked body
        _log_refusal(logger, "unreadable_body", reason=_cut(str(exc)))
        return _refuse(400, f"the body could not be read: {exc}")
    except ConnectionError:  # the client left; no one reads the answer
        _log_refusal(logger, "disconnected")
        return _refuse(400, "the connection closed before the body arrived")


async def _receive(gateway: Gateway, request: web.Request, name: str, provider: Provider,
                   logger: FilteringBoundLogger) -> web.Response:
    body = await _read_body(request, gateway.body_read_s, logger)
    if isinstance(body, web.Response):
        return body
    now_s = time.time()
    try:
        verified = delivery.verify(provider, body, request.headers, now_s, gateway.tolerance_s)
    except SignatureError as exc:
        _log_refusal(logger, exc.kind, reason=exc.reason)
        return _refuse(400, exc.reason)
    seen = (name, verified.replay_key)
    if gateway.signatures.has(seen, now_s):
        _log_refusal(logger, "replayed")
        return _refuse(409, "replayed: this signed request was already accepted; a provider "
                       "signs every delivery afresh")
    try:
        received = _read_event(provider, body, verified)
        record = _record(gateway.settings, received)
        _check_bounds(provider, received)
    except _Malformed as exc:
        _log_refusal(logger, "malformed", status=exc.status,
                       reason=exc.reason[:ERROR_CHARS_MAX])
        return _refuse(exc.status, exc.reason)
    # Reserved now, before any await, so a concurrent replay of this request is a 409 too. A
    # signature from the future stays fresh until its own time: remembered from then on.
    gateway.signatures.add(seen, max(now_s, float(verified.signed_at_s)))
    accepted = False
    try:
        with log.bound(task_id=received.task_id):
            if received.task_id is not None:
                stamped = await _stamp(gateway, received, logger)
                if isinstance(stamped, web.Response):
                    return stamped
                received, record = stamped
            response = await _publish_once(gateway, received, record, logger)
        accepted = response.status == 200
    finally:
        if not accepted:
            gateway.signatures.discard(seen)  # not accepted: the same request may come again
    return response


async def _stamp(gateway: Gateway, received: WebhookReceived, logger: FilteringBoundLogger,
                 ) -> tuple[WebhookReceived, _Record] | web.Response:
    """`received` stamped with its task's journal partition and that partition's end offset
    now, and its record; or the refusal. Without the stamp the reconciler could not tell an
    attempt journaled before the webhook from one after it: not published without it."""
    assert received.task_id is not None
    try:
        if gateway.journal is None:
            raise RuntimeError("the gateway was made without a journal to read offsets from")
        partition, offset = await gateway.journal.end_of(received.task_id)
    except Exception as exc:  # the broker's errors are many; each means "not known now"
        logger.error("journal end not read", error=repr(exc)[:ERROR_CHARS_MAX],
                     event_id=_cut(received.provider_event_id))
        return _refuse(503, f"could not read the journal's end ({type(exc).__name__}); retry")
    stamped = received.model_copy(update={"journal_partition": partition,
                                          "journal_offset": offset})
    try:
        return stamped, _record(gateway.settings, stamped)
    except _Malformed as exc:  # only if the stamp itself tipped it over
        return _refuse(exc.status, exc.reason)


async def _publish_once(gateway: Gateway, received: WebhookReceived, record: _Record,
                        logger: FilteringBoundLogger) -> web.Response:
    event = (received.provider, received.provider_event_id)
    fields = {"event_id": _cut(received.provider_event_id),
              "event_type": _cut(received.provider_event_type),
              "object_id": _cut(received.object_id), "key": _cut(received.key)}
    pending = gateway.publishing.get(event)
    # The same event being published by another request: its outcome is ours.
    if pending is not None and not await asyncio.shield(pending):
        return _refuse(503, "the same event was being published and that failed; retry")
    if pending is not None or gateway.event_ids.has(event, time.time()):
        logger.info("webhook duplicate", **fields)
        return web.json_response({"received": True, "duplicate": True,
                                  "event_id": received.provider_event_id})
    done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
    gateway.publishing[event] = done
    published = False
    try:
        meta = await asyncio.wait_for(gateway.writer.append_raw(
            WEBHOOKS, record.value, key=record.key, headers=record.headers), PUBLISH_TIMEOUT_S)
        published = True
    except MessageSizeTooLargeError as exc:  # checked before; kept permanent if it slips by
        logger.error("webhook not published", error=repr(exc)[:ERROR_CHARS_MAX], **fields)
        return _refuse(413, "the event's record is larger than the journal takes")
    except AUTHORIZATION_ERRORS as exc:  # a right taken away after start: no retry mends it
        logger.error("webhook not published: the gateway may not write the webhooks topic",
                     error=repr(exc)[:ERROR_CHARS_MAX], **fields)
        return _refuse(500, "the gateway's Kafka principal may not write the webhooks topic "
                            "(an operator must restore its rights: docs/security.md)")
    except Exception as exc:  # the broker's errors are many; each means "not acknowledged"
        logger.error("webhook not published", error=repr(exc)[:ERROR_CHARS_MAX], **fields)
        return _refuse(503, f"could not publish the webhook ({type(exc).__name__}); retry")
    finally:
        del gateway.publishing[event]
        if published:
            gateway.event_ids.add(event, time.time())
        done.set_result(published)  # also on cancellation: waiters must not hang
    logger.info("webhook published", partition=meta.partition, offset=meta.offset,
                journal_partition=received.journal_partition,
                journal_offset=received.journal_offset, **fields)
    return web.json_response({"received": True, "duplicate": False,
                              "event_id": received.provider_event_id})


def make_app(settings: KafkaSettings, writer: JournalWriter,
             served: Iterable[Provider] | Mapping[str, Provider], *,
             tolerance_s: float = TOLERANCE_S_DEFAULT,
             journal: JournalEnds | None = None,
             body_read_s: float = BODY_READ_S,
             headers_read_s: float = HEADERS_READ_S,
             connections_max: int | None = None) -> web.Application:
    """The gateway for the `served` providers (`webhooks.providers.load()`, or `paysim(secret)`
    in tests), each at `/webhooks/{name}`.

    `writer` must be started; the app neither starts nor stops it. `journal` says where the
    journal ends (the stamp on webhooks that name a task); without one the app reads the
    journal topic itself, from its startup to its cleanup. A body not in `body_read_s` after
    the handler starts reading it is answered 408. A connection without a request's headers
    `headers_read_s` after its start (or its previous request) is closed, and at most
    `connections_max` are open (default: CONNECTIONS_MAX, under the descriptor limit): both
    only when served with `make_runner`."""
    if tolerance_s <= 0:
        raise ValueError(f"tolerance_s must be positive, got {tolerance_s}")
    if body_read_s <= 0:
        raise ValueError(f"body_read_s must be positive, got {body_read_s}")
    connections = Connections(headers_read_s, connections_max)
    app = web.Application(client_max_size=BODY_BYTES_MAX, middlewares=[connections.middleware()])
    app[CONNECTIONS] = connections
    if journal is None:
        ends = KafkaJournalEnds(settings)
        journal = ends

        async def reading_the_journal(_: web.Application) -> AsyncIterator[None]:
            await ends.start()
            try:
                yield
            finally:
                await ends.stop()

        app.cleanup_ctx.append(reading_the_journal)
    listed = list(served.values() if isinstance(served, Mapping) else served)
    by_name = {p.name: p for p in listed}
    if len(by_name) != len(listed):
        raise ValueError("two providers of the same name")
    app[GATEWAY] = Gateway(settings, writer, by_name, tolerance_s, journal, body_read_s)
    app.router.add_post("/webhooks/{provider}", receive)
    return app


class _ServerLog(logging.LoggerAdapter[logging.Logger]):
    """aiohttp's log of the requests it serves (its `logger` option). A request its HTTP
    parser refuses (a header over its 8190 bytes, a garbled request line or chunk) is one any
    client can send: aiohttp answers it 400 itself, before any handler or middleware of ours,
    and logs it here as a warning, without a traceback. Anything else it logs stays an error
    with its traceback: a fault of ours."""

    def exception(self, msg: object, *args: object, exc_info: Any = True,
                  **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            self.warning(f"{msg}: refused by the HTTP parser: %s", *args,
                         _cut(str(exc_info.message)), **kwargs)
            return
        super().exception(msg, *args, exc_info=exc_info, **kwargs)


_SERVER_LOG = _ServerLog(logging.getLogger("aiohttp.server"))


class _Runner(web.AppRunner):
    """aiohttp's runner, whose server tells the app's `Connections` of every connection."""

    async def setup(self) -> None:
        await super().setup()
        assert self.server is not None
        self.app[CONNECTIONS].watch(self.server)

    async def cleanup(self) -> None:
        try:
            await super().cleanup()
        finally:
            self.app[CONNECTIONS].stop()


def make_runner(app: web.Application) -> web.AppRunner:
    """The runner the gateway's app is served with (`serve_gateway`, and tests)."""
    return _Runner(app, access_log=None, logger=_SERVER_LOG,
                   shutdown_timeout=SHUTDOWN_TIMEOUT_S)


async def serve_gateway(host: str | None = None, port: int | None = None) -> None:
    """The process entry point (`halfway run gateway`): serve until SIGTERM or SIGINT.

    Prints one line, `listening on http://HOST:PORT`, once it accepts connections (port 0
    picks a free port, which the line then names). Without a provider to serve, with one
    that cannot be served (a bad declaration, a missing secret), or with an address it cannot
    listen on, says why and exits 2 before connecting to anything: a configuration error,
    which restarting will not mend."""
    log.configure()
    logger = log.get("halfway.gateway")
    try:
        loaded = providers.load()
    except ProviderError as exc:
        _not_started(logger, str(exc))
    for why in loaded.not_served:
        logger.info("webhook provider not served", why=why)
    host = host or gateway_host()
    port = gateway_port() if port is None else port
    settings = KafkaSettings.from_env("gateway")  # a bad setting stops it before it binds
    # Bound first, so a port in use stops the start before the broker is waited for.
    try:
        sock = await bound_socket(host, port, **_SETTINGS)
    except CannotListen as exc:
        _not_started(logger, str(exc))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    with sock:  # closed however the gateway ends
        # A stop also ends the wait for the broker, which may never answer. The wrong
        # credentials stop it here: a webhook it may not publish is no temporary failure.
        if not await unless_stopped(stop, _ready(settings)):
            logger.info("gateway stopped")
            return
        async with JournalWriter(settings) as writer:
            app = make_app(settings, writer, loaded.providers)
            runner = make_runner(app)
            await runner.setup()
            try:
                try:
                    await web.SockSite(runner, sock).start()
                except OSError as exc:  # listen(): another process took the port since
                    _not_started(logger, why_not(host, port, exc, **_SETTINGS))
                url = f"http://{authority(host, sock.getsockname()[1])}"
                print(f"listening on {url}", flush=True)  # the one line a parent process reads
                logger.info("gateway listening", url=url, providers=sorted(loaded.providers),
                            topic=WEBHOOKS.name(settings.topic_prefix))
                await stop.wait()
            finally:
                await runner.cleanup()  # finishes requests in flight while the writer runs
    logger.info("gateway stopped")


_SETTINGS = {"host_setting": "HALFWAY_GATEWAY_HOST", "port_setting": "HALFWAY_GATEWAY_PORT"}


async def _ready(settings: KafkaSettings) -> None:
    """The broker answers, the topics exist, and this principal may write webhooks."""
    await ensure_topics_once_up(settings, (WEBHOOKS, JOURNAL))
    await check_access(settings, "gateway")


def _not_started(logger: FilteringBoundLogger, reason: str) -> NoReturn:
    logger.error("gateway not started", reason=reason)
    # The log may be JSON for a collector: the person who ran the command reads this line.
    print(f"halfway gateway: {reason}", file=sys.stderr, flush=True)
    raise SystemExit(2)
