"""Webhooks: Stripe-style signatures, the gateway (offline with a fake writer and against the
real broker), paysim's deliveries.

Whether a refused request published nothing is proven per test, not assumed: we note the end of
every partition of the webhooks topic, send the bad request, then a valid sentinel (answered 200
only once the broker has it), and read every partition from the noted ends to its new end: the
sentinel must be the only record there. Waits are bounded polls, never fixed sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

import httpx
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaTimeoutError, MessageSizeTooLargeError
from aiokafka.structs import ConsumerRecord, RecordMetadata
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from halfway.contract.topics import JOURNAL, WEBHOOKS, TopicSpec
from halfway.contract.webhooks import WebhookReceived, parse_webhook
from halfway.gateway import app as gateway_app
from halfway.gateway import make_app
from halfway.gateway.app import RECORD_BYTES_MAX, _Malformed, _Memory, _read_event, _record
from halfway.journal import JournalWriter
from halfway.journal.records import decode_webhook, partition_of
from halfway.settings import KafkaSettings
from halfway.webhooks.delivery import Delivery
from halfway.webhooks.providers import paysim as paysim_provider
from halfway.webhooks.signature import SignatureError, sign, signature, verify
from tests.factories import Stamper
from tests.test_payment_simulator import _simulator

SECRET = "whsec_test_webhooks"
T0 = 1_700_000_000  # a fixed signing time for the pure tests
WAIT_S = 60.0  # upper bound for any await on the broker: a hang fails, it never blocks CI
HTTP_TIMEOUT_S = 30.0
POLL_INTERVAL_S = 0.05
POLL_ATTEMPTS_MAX = 600  # 30 s at most, for deliveries that land within a few seconds
broker = pytest.mark.broker

T = TypeVar("T")


# --- signatures ----------------------------------------------------------------------------------


def test_a_signature_round_trips_and_has_stripes_format() -> None:
    body = b'{"id":"evt_1"}'
    header = sign(body, SECRET, T0)

    assert re.fullmatch(r"t=1700000000,v1=[0-9a-f]{64}", header)
    assert verify(body, header, SECRET, now_s=T0 + 10) == T0
    assert verify(body, header, SECRET, now_s=T0 + 300) == T0  # the tolerance is inclusive


@pytest.mark.parametrize(("body", "secret"), [
    (b'{"id":"evt_2"}', SECRET),  # another body under a genuine signature
    (b'{"id":"evt_1"}', "whsec_guessed"),  # signed with the wrong secret
])
def test_a_forged_signature_is_refused(body: bytes, secret: str) -> None:
    header = sign(b'{"id":"evt_1"}', SECRET, T0)
    with pytest.raises(SignatureError) as refused:
        verify(body, header, secret, now_s=T0)
    assert refused.value.kind == "mismatch"
    assert "no v1 signature matches" in refused.value.reason


def test_a_stale_signature_is_refused() -> None:
    header = sign(b"{}", SECRET, T0)
    with pytest.raises(SignatureError) as refused:
        verify(b"{}", header, SECRET, now_s=T0 + 301)
    assert refused.value.kind == "stale"
    assert "too old" in refused.value.reason
    assert "300 s tolerance" in refused.value.reason


def test_a_signature_from_the_future_is_accepted_as_stripe_accepts_it() -> None:
    header = sign(b"{}", SECRET, T0)
    assert verify(b"{}", header, SECRET, now_s=T0 - 3600, tolerance_s=300) == T0


def test_a_signature_from_the_future_is_remembered_until_its_own_time_is_past() -> None:
    # It stays fresh while it is ahead: a replay must be recognised all that time.
    memory = _Memory(10, kept_s=600)
    key = ("paysim", "sig")
    memory.add(key, T0 + 3600)  # signed an hour ahead, remembered from its own time
    assert memory.has(key, T0 + 3600 + 599)
    assert not memory.has(key, T0 + 3600 + 600)


def test_a_forged_stale_signature_is_called_forged_not_stale() -> None:
    # The signature is checked first: only a genuine one learns about the clock check.
    with pytest.raises(SignatureError) as refused:
        verify(b"{}", f"t={T0},v1={'0' * 64}", SECRET, now_s=T0 + 10_000)
    assert refused.value.kind == "mismatch"


def test_any_v1_may_match_while_a_secret_is_rolled() -> None:
    body = b'{"id":"evt_roll"}'
    old, new = "whsec_old", "whsec_new"
    header = (f"t={T0},v1={signature(body, old, T0)},v1={signature(body, new, T0)},"
              f"v0={'f' * 64}")  # test mode's fake v0 is ignored

    assert verify(body, header, old, now_s=T0) == T0
    assert verify(body, header, new, now_s=T0) == T0
    with pytest.raises(SignatureError) as refused:
        verify(body, header, "whsec_other", now_s=T0)
    assert refused.value.kind == "mismatch"


@pytest.mark.parametrize(("header", "kind", "words"), [
    (None, "missing", "missing Stripe-Signature"),
    ("  ", "missing", "missing Stripe-Signature"),
    # What Stripe's own verifier (which decides) cannot read, or finds no v1 in:
    ("garbage", "garbled", "no timestamp (t=) and signatures could be read"),
    ("t=,v1=abc", "garbled", "could be read"),
    (f"t=yesterday,v1={'0' * 64}", "garbled", "could be read"),
    (f"v1={'0' * 64}", "garbled", "could be read"),
    (f"t={T0},v0={'0' * 64}", "no_v1", "no v1 signature"),
    # Readable, so only the signature can refuse them: Stripe takes the first t=, a negative
    # or very long t, and any number of v1 entries.
    (f"t=-5,v1={'0' * 64}", "mismatch", "no v1 signature matches"),
    (f"t={T0},t=1,v1={'0' * 64}", "mismatch", "no v1 signature matches"),
    ("t=1," + ",".join(["v1=00"] * 17), "mismatch", "no v1 signature matches"),
    (f"t={'1' * 13},v1={'0' * 64}", "mismatch", "no v1 signature matches"),
    (f"t={T0},v1=é{'0' * 63}", "mismatch", "no v1 signature matches"),  # non-ASCII: no crash
    # 5000 digits would not even convert to an int (Python's 4300-digit limit): not a 500
    (f"t={'9' * 5000},v1={'0' * 64}", "garbled", "could be read"),
    ("t=1,v1=" + "0" * 9000, "garbled", "longer than 8192"),
])
def test_a_missing_or_garbled_header_is_refused_with_its_reason(
        header: str | None, kind: str, words: str) -> None:
    with pytest.raises(SignatureError) as refused:
        verify(b"{}", header, SECRET, now_s=T0)
    assert refused.value.kind == kind
    assert words in refused.value.reason


@given(header=st.text(max_size=300) | st.from_regex(r"t=[0-9]{0,30},v1=[0-9a-f]{0,70}"))
def test_any_header_is_verified_or_refused_never_an_error(header: str) -> None:
    with contextlib.suppress(SignatureError):  # anything else (ValueError: a 500) fails
        verify(b"{}", header, SECRET, now_s=T0)


# --- helpers for the broker tests ----------------------------------------------------------------


def _new_task() -> str:
    return f"renewal-{uuid.uuid4().hex[:12]}"


def charge_event(key: str | None, *, event_id: str | None = None,
                 kind: str = "charge.succeeded") -> dict[str, Any]:
    metadata = {"invoice": "INV-2291"} | ({"halfway_key": key} if key is not None else {})
    return {"id": event_id or f"evt_{uuid.uuid4().hex[:24]}", "object": "event",
            "api_version": "2024-06-20", "type": kind, "created": int(time.time()),
            "data": {"object": {"id": f"ch_{uuid.uuid4().hex[:24]}", "object": "charge",
                                "amount": 4900, "currency": "usd", "customer": "cus_1",
                                "status": "succeeded" if kind == "charge.succeeded" else "failed",
                                "metadata": metadata}},
            "request": {"id": f"req_{uuid.uuid4().hex[:12]}", "idempotency_key": key},
            "livemode": False, "pending_webhooks": 1}


def encode(event: dict[str, Any]) -> bytes:
    return json.dumps(event).encode()


async def post(client: httpx.AsyncClient, body: bytes, header: str | None, *,
               provider: str = "paysim") -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    if header is not None:
        headers["Stripe-Signature"] = header
    return await client.post(f"/webhooks/{provider}", content=body, headers=headers)


async def post_signed(client: httpx.AsyncClient, event: dict[str, Any], *,
                      signed_at_s: int | None = None) -> httpx.Response:
    body = encode(event)
    return await post(client, body, sign(body, SECRET, signed_at_s or int(time.time())))


async def topic_ends(settings: KafkaSettings) -> dict[TopicPartition, int]:
    consumer = AIOKafkaConsumer(**settings.client(), group_id=None,
                                enable_auto_commit=False)
    await consumer.start()
    try:
        topic = WEBHOOKS.name(settings.topic_prefix)
        return await asyncio.wait_for(consumer.end_offsets(
            [TopicPartition(topic, p) for p in range(WEBHOOKS.partitions)]), WAIT_S)
    finally:
        await consumer.stop()


async def published_since(settings: KafkaSettings, since: dict[TopicPartition, int],
                          ) -> list[tuple[bytes | None, WebhookReceived]]:
    """(record key, webhook) of every record after `since`, up to each partition's end now."""
    consumer = AIOKafkaConsumer(**settings.client(), group_id=None,
                                enable_auto_commit=False)
    await consumer.start()
    out: list[tuple[bytes | None, WebhookReceived]] = []
    try:
        consumer.assign(list(since))
        for tp, offset in since.items():
            consumer.seek(tp, offset)
        end = await consumer.end_offsets(list(since))

        async def pull() -> None:
            behind = {tp for tp in since if since[tp] < end[tp]}
            while behind:
                batches = await consumer.getmany(*behind, timeout_ms=1000)
                for records in batches.values():
                    out.extend((r.key, parse_webhook(r.value)) for r in records)
                behind = {tp for tp in behind if await consumer.position(tp) < end[tp]}

        await asyncio.wait_for(pull(), WAIT_S)
    finally:
        await consumer.stop()
    return out


async def until(probe: Callable[[], Awaitable[T | None]], what: str) -> T:
    """Poll `probe` until it returns something, a bounded number of times."""
    for _ in range(POLL_ATTEMPTS_MAX):
        found = await probe()
        if found is not None:
            return found
        await asyncio.sleep(POLL_INTERVAL_S)
    raise AssertionError(f"gave up waiting for {what}")


@pytest.fixture
async def gateway(topics: KafkaSettings, writer: JournalWriter,
                  ) -> AsyncIterator[httpx.AsyncClient]:
    """A client of a fresh in-process gateway (empty memories) on the session's topics."""
    server = TestServer(make_app(topics, writer, [paysim_provider(SECRET)]))
    await server.start_server()
    try:
        async with httpx.AsyncClient(base_url=str(server.make_url("")),
                                     timeout=HTTP_TIMEOUT_S) as client:
            yield client
    finally:
        await server.close()


async def only_the_sentinel_follows(client: httpx.AsyncClient, settings: KafkaSettings,
                                    since: dict[TopicPartition, int], task_id: str,
                                    before: Sequence[str] = ()) -> None:
    """Publish a sentinel for `task_id`; assert the records since `since` are exactly the
    events `before` (ids, in order) and then the sentinel."""
    sentinel = charge_event(f"{task_id}:9")
    assert (await post_signed(client, sentinel)).status_code == 200
    published = await published_since(settings, since)
    assert [hook.provider_event_id for _, hook in published] == [*before, sentinel["id"]]


# --- the gateway, offline: a fake writer and a fake journal ---------------------------------------

OFFLINE = KafkaSettings("127.0.0.1:9", "offline.", 1)  # never connected to


class FakeWriter:
    """Keeps what would be published; fails with `error` if set; with `hold` set, each append
    is put in `entered` and waits for `hold`."""

    def __init__(self) -> None:
        self.records: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]] = []
        self.error: BaseException | None = None
        self.hold: asyncio.Event | None = None
        self.entered: asyncio.Queue[bytes | None] = asyncio.Queue()

    async def append_raw(self, spec: TopicSpec, value: bytes | None, *, key: bytes | None = None,
                         headers: list[tuple[str, bytes]] | None = None) -> RecordMetadata:
        assert spec is WEBHOOKS
        if self.hold is not None:
            self.entered.put_nowait(value)
            await self.hold.wait()
        if self.error is not None:
            raise self.error
        self.records.append((key, value, headers or []))
        tp = TopicPartition(WEBHOOKS.name(OFFLINE.topic_prefix), 0)
        return RecordMetadata(tp.topic, 0, tp, len(self.records) - 1, None, 0, None)

    def published(self) -> list[WebhookReceived]:
        """What was published, read back as the reconciler reads it."""
        return [decode_webhook(ConsumerRecord(
            topic=WEBHOOKS.name(OFFLINE.topic_prefix), partition=0, offset=n, timestamp=0,
            timestamp_type=0, key=key, value=value, checksum=None, serialized_key_size=0,
            serialized_value_size=0, headers=headers))
            for n, (key, value, headers) in enumerate(self.records)]


class FakeJournal:
    """Where the journal ends, as told: `ends` per task, or `error`."""

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.offset = 41
        self.error: BaseException | None = None

    async def end_of(self, task_id: str) -> tuple[int, int]:
        self.asked.append(task_id)
        if self.error is not None:
            raise self.error
        return partition_of(task_id.encode(), JOURNAL.partitions), self.offset


class Offline:
    def __init__(self, client: httpx.AsyncClient, writer: FakeWriter,
                 journal: FakeJournal) -> None:
        self.client, self.writer, self.journal = client, writer, journal


@pytest.fixture
async def offline() -> AsyncIterator[Offline]:
    writer, journal = FakeWriter(), FakeJournal()
    server = TestServer(make_app(OFFLINE, writer, [paysim_provider(SECRET)],  # type: ignore[arg-type]
                                 journal=journal))
    await server.start_server()
    try:
        async with httpx.AsyncClient(base_url=str(server.make_url("")),
                                     timeout=HTTP_TIMEOUT_S) as client:
            yield Offline(client, writer, journal)
    finally:
        await server.close()


async def post_body(client: httpx.AsyncClient, body: bytes) -> httpx.Response:
    return await post(client, body, sign(body, SECRET, int(time.time())))


def nested(depth: int) -> Any:
    value: Any = "deep"
    for _ in range(depth):
        value = [value]
    return value


async def test_a_webhook_naming_a_task_is_stamped_with_where_its_journal_ends(
        offline: Offline) -> None:
    task_id = _new_task()
    event = charge_event(f"{task_id}:2")
    offline.journal.offset = 1234

    response = await post_signed(offline.client, event)

    assert response.status_code == 200, response.text
    [hook] = offline.writer.published()
    assert offline.journal.asked == [task_id]
    assert (hook.task_id, hook.journal_partition, hook.journal_offset) == (
        task_id, partition_of(task_id.encode(), JOURNAL.partitions), 1234)


async def test_a_webhook_naming_no_task_is_not_stamped(offline: Offline) -> None:
    response = await post_signed(offline.client, charge_event(None))

    assert response.status_code == 200, response.text
    [hook] = offline.writer.published()
    assert (hook.task_id, hook.journal_partition, hook.journal_offset) == (None, None, None)
    assert offline.journal.asked == []


async def test_when_the_journal_end_cannot_be_read_nothing_is_published_and_it_is_503(
        offline: Offline) -> None:
    event = charge_event(f"{_new_task()}:1")
    body = encode(event)
    header = sign(body, SECRET, int(time.time()))
    offline.journal.error = KafkaTimeoutError()

    refused = await post(offline.client, body, header)

    assert refused.status_code == 503
    assert "journal's end" in refused.json()["error"]
    assert offline.writer.records == []
    offline.journal.error = None  # the provider retries (the same request): not a replay
    assert (await post(offline.client, body, header)).status_code == 200
    assert [h.provider_event_id for h in offline.writer.published()] == [event["id"]]


def _event_with(**fields: Any) -> Callable[[dict[str, Any]], bytes]:
    def make(event: dict[str, Any]) -> bytes:
        return encode(event | fields)
    return make


def _object_with(**fields: Any) -> Callable[[dict[str, Any]], bytes]:
    def make(event: dict[str, Any]) -> bytes:
        event["data"]["object"] |= fields
        return encode(event)
    return make


@pytest.mark.parametrize(("make_body", "status", "words"), [
    # Accepted by json and by the model, refused by the reconciler's decoder: 400, not lost.
    pytest.param(_object_with(lines=nested(250)), 400, "recursion limit", id="nested-250-deep"),
    pytest.param(lambda event: _object_with(lines="@@")(event).replace(
        b'"@@"', b"[" * 1500 + b"]" * 1500), 400, "not JSON", id="nested-1500-deep"),
    # JSON may escape a lone surrogate; it is not Unicode, so it cannot be recorded: for good.
    pytest.param(lambda event: encode(event).replace(b'"object": "charge"',
                                                     b'"object": "\\ud800"'),
                 400, "cannot be recorded", id="lone-surrogate"),
    pytest.param(lambda event: encode(event).replace(b'"type": "charge',
                                                     b'"type": "\\udfff charge'),
                 400, "cannot be recorded", id="lone-surrogate-in-type"),
    # The record holds the id three times (payload, field, header): too big for the journal.
    pytest.param(_event_with(id="evt_" + "9" * 900_000), 413, "more than", id="900kb-event-id"),
    pytest.param(lambda event: encode(event).replace(b'"amount": 4900', b'"amount": 1e400'),
                 400, "out of range", id="float-overflow"),
    pytest.param(lambda event: encode(event).replace(b'"amount": 4900',
                                                     b'"amount": ' + b"9" * 5000),
                 400, "not JSON", id="5000-digit-int"),
])
async def test_a_body_the_journal_cannot_keep_is_refused_for_good_never_503(
        offline: Offline, make_body: Callable[[dict[str, Any]], bytes], status: int,
        words: str) -> None:
    body = make_body(charge_event(f"{_new_task()}:1"))
    assert len(body) < 1024 * 1024  # under the body limit: the record is the problem

    response = await post_body(offline.client, body)

    assert response.status_code == status, response.text
    assert words in response.json()["error"]
    assert offline.writer.records == []


async def test_a_garbled_timestamp_of_5000_digits_is_400(offline: Offline) -> None:
    body = encode(charge_event(f"{_new_task()}:1"))

    response = await post(offline.client, body, f"t={'9' * 5000},v1={'0' * 64}")

    assert response.status_code == 400
    assert "garbled" in response.json()["error"]


@pytest.mark.parametrize(("error", "status"), [
    (KafkaTimeoutError(), 503),  # the broker: the provider retries
    (MessageSizeTooLargeError(), 413),  # not the broker's fault: retrying cannot help
])
async def test_only_a_broker_failure_is_503(offline: Offline, error: BaseException,
                                            status: int) -> None:
    offline.writer.error = error

    response = await post_signed(offline.client, charge_event(f"{_new_task()}:1"))

    assert response.status_code == status


async def test_past_the_requests_at_once_a_webhook_is_503_with_retry_after_and_not_kept(
        offline: Offline, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gateway_app, "REQUESTS_AT_ONCE_MAX", 2)
    answered_before = {status: answered("paysim", status) for status in ("200", "503")}
    serving_before = sample("halfway_webhooks_serving")
    offline.writer.hold = asyncio.Event()
    held = [asyncio.create_task(post_signed(offline.client, charge_event(None)))
            for _ in range(2)]
    for _ in held:  # both are being published, waiting on the broker
        await asyncio.wait_for(offline.writer.entered.get(), HTTP_TIMEOUT_S)
    assert sample("halfway_webhooks_serving") == serving_before + 2

    busy = charge_event(None)
    response = await post_signed(offline.client, busy)
    assert response.status_code == 503, response.text
    assert response.headers["Retry-After"] == "1"
    assert "retry" in response.json()["error"]

    offline.writer.hold.set()
    assert [(await r).status_code for r in held] == [200, 200]
    # Nothing of the refused one was kept: the provider's retry is published.
    again = await post_signed(offline.client, busy)
    assert again.status_code == 200, again.text
    assert again.json()["duplicate"] is False
    assert len(offline.writer.records) == 3
    # /metrics counts each answer, and the requests served at once.
    assert answered("paysim", "503") == answered_before["503"] + 1
    assert answered("paysim", "200") == answered_before["200"] + 3
    assert sample("halfway_webhooks_serving") == serving_before


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def answered(provider: str, status: str) -> float:
    return sample("halfway_webhooks_answered_total", provider=provider, status=status)


async def test_a_webhook_for_a_provider_not_served_is_counted_as_unknown(
        offline: Offline) -> None:
    """A caller's path names the provider: counted under `unknown`, never a series of its own."""
    before = answered("unknown", "404")
    body = encode(charge_event(None))
    response = await post(offline.client, body, sign(body, SECRET, int(time.time())),
                          provider="anything-a-caller-makes-up")
    assert response.status_code == 404
    assert answered("unknown", "404") == before + 1
    assert answered("anything-a-caller-makes-up", "404") == 0


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False)
    | st.text(st.characters(codec="utf-8") | st.sampled_from(["\ud800", "\udfff"])),
    lambda children: st.lists(children, max_size=3)
    | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=30)


@settings(max_examples=200, deadline=None)
@given(extra=_json, event_id=st.text(max_size=20), depth=st.integers(0, 260))
def test_any_event_is_recorded_so_the_reconciler_reads_it_or_refused(
        extra: Any, event_id: str, depth: int) -> None:
    event = charge_event(f"{_new_task()}:1")
    event["id"] = event_id
    event["data"]["object"]["extra"] = extra
    event["data"]["object"]["deep"] = nested(depth)
    try:
        body = json.dumps(event).encode("utf-8", "surrogatepass")
    except UnicodeEncodeError:  # pragma: no cover - surrogatepass encodes everything
        return
    refused: _Malformed | None = None
    try:
        received = _read_event(paysim_provider(SECRET), body, Delivery(T0, "", None))
        record = _record(OFFLINE, received)
    except _Malformed as exc:
        refused = exc
    if refused is not None:
        assert refused.status in (400, 413)
        assert refused.reason
    else:
        assert len(record.value) <= RECORD_BYTES_MAX
        assert parse_webhook(record.value) == received


# --- the gateway, against the broker -------------------------------------------------------------


@broker
@pytest.mark.parametrize(("key", "task_id"), [
    ("renewal-{t}:3", "renewal-{t}"),
    ("renewal-{t}:3:undo", "renewal-{t}"),
    ("renewal-{t}:3:undo3", "renewal-{t}"),  # the undo's last successor key
    ("renewal-{t}:0", None),  # malformed keys count as absent: keyed by the charge instead
    ("renewal-{t}:3:undo9", None),  # past the undo's keys: signed, but no key of ours
    ("not a key", None),
    (None, None),
])
async def test_a_valid_event_is_published_with_its_key_and_whole_payload(
        gateway: httpx.AsyncClient, topics: KafkaSettings, key: str | None,
        task_id: str | None) -> None:
    task = _new_task().removeprefix("renewal-")
    key = key.format(t=task) if key is not None else None
    task_id = task_id.format(t=task) if task_id is not None else None
    event = charge_event(key)
    signed_at_s = int(time.time()) - 5
    since = await topic_ends(topics)

    response = await post_signed(gateway, event, signed_at_s=signed_at_s)

    assert response.status_code == 200, response.text
    assert response.json() == {"received": True, "duplicate": False, "event_id": event["id"]}
    [(record_key, hook)] = await published_since(topics, since)
    charge_id = event["data"]["object"]["id"]
    assert record_key == (task_id or charge_id).encode()
    assert hook.record_key() == record_key
    valid_key = key if task_id is not None else None
    assert (hook.provider, hook.provider_event_id, hook.provider_event_type, hook.object_id,
            hook.key, hook.task_id) == ("paysim", event["id"], "charge.succeeded", charge_id,
                                        valid_key, task_id)
    assert hook.payload == event
    assert int(hook.signed_at.timestamp()) == signed_at_s
    if task_id is None:
        assert (hook.journal_partition, hook.journal_offset) == (None, None)
    else:
        assert hook.journal_partition == partition_of(task_id.encode(), JOURNAL.partitions)
        assert hook.journal_offset is not None


@broker
async def test_the_stamp_is_where_the_tasks_journal_partition_ends_when_it_arrives(
        gateway: httpx.AsyncClient, topics: KafkaSettings, writer: JournalWriter) -> None:
    task_id = _new_task()
    last = await writer.append(Stamper(task_id).started())  # the task's latest journal record
    since = await topic_ends(topics)

    response = await post_signed(gateway, charge_event(f"{task_id}:1"))

    assert response.status_code == 200, response.text
    [(_, hook)] = await published_since(topics, since)
    assert (hook.journal_partition, hook.journal_offset) == (last.partition, last.offset + 1)


@broker
@pytest.mark.parametrize(("make_header", "words"), [
    pytest.param(lambda body, now: sign(body, "whsec_forged", now), "no v1 signature matches",
                 id="wrong-secret"),
    pytest.param(lambda body, now: sign(body + b" ", SECRET, now), "no v1 signature matches",
                 id="other-body"),
    pytest.param(lambda body, now: sign(body, SECRET, now - 3600), "too old", id="stale"),
    pytest.param(lambda body, now: None, "missing Stripe-Signature", id="missing"),
    pytest.param(lambda body, now: "t=soon", "garbled", id="garbled"),
    pytest.param(lambda body, now: f"t={now},v0={'0' * 64}", "no v1", id="no-v1"),
])
async def test_a_bad_signature_is_refused_with_400_and_nothing_is_published(
        gateway: httpx.AsyncClient, topics: KafkaSettings,
        make_header: Callable[[bytes, int], str | None], words: str) -> None:
    task_id = _new_task()
    body = encode(charge_event(f"{task_id}:1"))
    since = await topic_ends(topics)

    response = await post(gateway, body, make_header(body, int(time.time())))

    assert response.status_code == 400
    assert words in response.json()["error"]
    await only_the_sentinel_follows(gateway, topics, since, task_id)


def _without(path: str) -> Callable[[dict[str, Any]], dict[str, Any]]:
    def strip(event: dict[str, Any]) -> dict[str, Any]:
        *parents, last = path.split(".")
        node = event
        for name in parents:
            node = node[name]
        del node[last]
        return event
    return strip


@broker
@pytest.mark.parametrize(("make_body", "words"), [
    pytest.param(lambda event: b"not json", "not JSON", id="not-json"),
    pytest.param(lambda event: b"\xff\xfe{", "not UTF-8", id="not-text"),
    pytest.param(lambda event: b'{"id": NaN}', "not JSON", id="nan"),
    pytest.param(lambda event: b"[1, 2]", "not a JSON object", id="array"),
    pytest.param(lambda event: encode(_without("id")(event)), "no id", id="no-id"),
    pytest.param(lambda event: encode(_without("type")(event)), "no type", id="no-type"),
    pytest.param(lambda event: encode({**event, "id": 7}), "no id", id="number-id"),
    pytest.param(lambda event: encode(_without("data")(event)), "no data.object", id="no-data"),
    pytest.param(lambda event: encode(_without("data.object.id")(event)), "no data.object.id",
                 id="no-object-id"),
    pytest.param(lambda event: b"[" * 100_000 + b"]" * 100_000, "not JSON",
                 id="nested-too-deep"),
])
async def test_a_malformed_body_is_refused_with_400_and_nothing_is_published(
        gateway: httpx.AsyncClient, topics: KafkaSettings,
        make_body: Callable[[dict[str, Any]], bytes], words: str) -> None:
    task_id = _new_task()
    body = make_body(charge_event(f"{task_id}:1"))
    since = await topic_ends(topics)

    response = await post(gateway, body, sign(body, SECRET, int(time.time())))

    assert response.status_code == 400
    assert words in response.json()["error"]
    await only_the_sentinel_follows(gateway, topics, since, task_id)


@broker
async def test_an_unknown_provider_is_404_and_nothing_is_published(
        gateway: httpx.AsyncClient, topics: KafkaSettings) -> None:
    task_id = _new_task()
    body = encode(charge_event(f"{task_id}:1"))
    since = await topic_ends(topics)

    response = await post(gateway, body, sign(body, SECRET, int(time.time())),
                          provider="stripe")

    assert response.status_code == 404
    assert "unknown provider 'stripe'" in response.json()["error"]
    assert "paysim" in response.json()["error"]
    await only_the_sentinel_follows(gateway, topics, since, task_id)


@broker
async def test_a_body_too_large_is_413_and_nothing_is_published(
        gateway: httpx.AsyncClient, topics: KafkaSettings) -> None:
    task_id = _new_task()
    event = charge_event(f"{task_id}:1")
    event["data"]["object"]["description"] = "x" * 2_000_000
    body = encode(event)
    since = await topic_ends(topics)

    response = await post(gateway, body, sign(body, SECRET, int(time.time())))

    assert response.status_code == 413
    assert "larger than" in response.json()["error"]
    await only_the_sentinel_follows(gateway, topics, since, task_id)


@broker
@pytest.mark.parametrize("ahead_s", [0, 3600], ids=["now", "signed-an-hour-ahead"])
async def test_a_replayed_request_is_409_and_not_published_again(
        gateway: httpx.AsyncClient, topics: KafkaSettings, ahead_s: int) -> None:
    task_id = _new_task()
    event = charge_event(f"{task_id}:1")
    body = encode(event)
    header = sign(body, SECRET, int(time.time()) + ahead_s)
    since = await topic_ends(topics)

    assert (await post(gateway, body, header)).status_code == 200
    replayed = await post(gateway, body, header)

    assert replayed.status_code == 409
    assert "replayed" in replayed.json()["error"]
    await only_the_sentinel_follows(gateway, topics, since, task_id, [event["id"]])


@broker
async def test_a_refused_request_is_not_remembered(
        gateway: httpx.AsyncClient, topics: KafkaSettings) -> None:
    # A 400 keeps nothing: the same signature on a good body later is not called a replay.
    task_id = _new_task()
    event = charge_event(f"{task_id}:1")
    body = encode(event)
    header = sign(body, SECRET, int(time.time()))
    since = await topic_ends(topics)

    assert (await post(gateway, body + b" trailing garbage", header)).status_code == 400
    assert (await post(gateway, body, header)).status_code == 200

    await only_the_sentinel_follows(gateway, topics, since, task_id, [event["id"]])


@broker
async def test_a_provider_redelivery_is_200_duplicate_and_not_published_twice(
        gateway: httpx.AsyncClient, topics: KafkaSettings) -> None:
    task_id = _new_task()
    event = charge_event(f"{task_id}:1")
    now_s = int(time.time())
    since = await topic_ends(topics)

    first = await post_signed(gateway, event, signed_at_s=now_s - 1)
    again = await post_signed(gateway, event, signed_at_s=now_s)  # re-signed: a new header

    assert (first.status_code, first.json()["duplicate"]) == (200, False)
    assert again.status_code == 200
    assert again.json() == {"received": True, "duplicate": True, "event_id": event["id"]}
    await only_the_sentinel_follows(gateway, topics, since, task_id, [event["id"]])


@broker
async def test_concurrent_redeliveries_publish_once(
        gateway: httpx.AsyncClient, topics: KafkaSettings) -> None:
    task_id = _new_task()
    event = charge_event(f"{task_id}:1")
    now_s = int(time.time())
    since = await topic_ends(topics)

    answers = await asyncio.gather(*(post_signed(gateway, event, signed_at_s=now_s - n)
                                     for n in range(8)))

    assert [a.status_code for a in answers] == [200] * 8
    assert sorted(a.json()["duplicate"] for a in answers) == [False] + [True] * 7
    await only_the_sentinel_follows(gateway, topics, since, task_id, [event["id"]])


# --- paysim delivers webhooks --------------------------------------------------------------------


@pytest.fixture(scope="module")
async def gateway_url(topics: KafkaSettings, writer: JournalWriter) -> AsyncIterator[str]:
    """One in-process gateway for the simulator tests (its memories last the module)."""
    server = TestServer(make_app(topics, writer, [paysim_provider(SECRET)]))
    await server.start_server()
    try:
        yield str(server.make_url("/webhooks/paysim"))
    finally:
        await server.close()


@pytest.fixture(scope="module")
async def paysim_url(gateway_url: str) -> AsyncIterator[str]:
    async with _simulator("--webhook-url", gateway_url, "--webhook-secret", SECRET) as url:
        yield url


@pytest.fixture
async def paysim(paysim_url: str) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=paysim_url, timeout=HTTP_TIMEOUT_S) as client:
        (await client.post("/_sim/reset")).raise_for_status()
        yield client


async def charge(sim: httpx.AsyncClient, key: str, customer: str = "cus_1") -> httpx.Response:
    return await sim.post("/v1/charges", headers={"Idempotency-Key": key}, data={
        "amount": "4900", "currency": "usd", "customer": customer,
        "metadata[halfway_key]": key, "metadata[invoice]": "INV-2291"})


async def attempts(sim: httpx.AsyncClient) -> list[dict[str, Any]]:
    response = await sim.get("/_sim/webhooks")
    response.raise_for_status()
    return response.json()["attempts"]


async def until_final(sim: httpx.AsyncClient, deliveries: int) -> list[dict[str, Any]]:
    """Every attempt, once `deliveries` deliveries have ended (delivered or given up)."""
    async def probe() -> list[dict[str, Any]] | None:
        listed = await attempts(sim)
        return listed if sum(a["final"] for a in listed) >= deliveries else None
    return await until(probe, f"{deliveries} webhook deliveries to end")


@broker
@pytest.mark.parametrize(("customer", "kind", "status"), [
    ("cus_1", "charge.succeeded", "succeeded"),
    ("cus_declined", "charge.failed", "failed"),
])
async def test_paysim_delivers_a_signed_event_that_the_gateway_publishes(
        paysim: httpx.AsyncClient, topics: KafkaSettings, customer: str, kind: str,
        status: str) -> None:
    key = f"{_new_task()}:1"
    since = await topic_ends(topics)

    made = await charge(paysim, key, customer)
    [ledgered] = (await paysim.get("/_sim/ledger")).json()["charges"]

    [attempt] = await until_final(paysim, 1)
    assert (attempt["status"], attempt["attempt"], attempt["type"]) == (200, 1, kind)
    assert (attempt["charge_id"], attempt["key"]) == (ledgered["id"], key)
    [(record_key, hook)] = await published_since(topics, since)
    assert record_key == key.split(":")[0].encode()
    assert (hook.provider_event_type, hook.object_id, hook.key) == (kind, ledgered["id"], key)
    assert hook.payload["data"]["object"]["status"] == status  # type: ignore[index]
    assert hook.payload["request"]["idempotency_key"] == key  # type: ignore[index]
    assert made.status_code == (200 if status == "succeeded" else 402)


@broker
async def test_paysim_duplicates_are_answered_duplicate_and_published_once(
        paysim: httpx.AsyncClient, topics: KafkaSettings) -> None:
    (await paysim.post("/_sim/webhooks", json={"duplicate_p": 1.0, "seed": 7})).raise_for_status()
    key = f"{_new_task()}:1"
    since = await topic_ends(topics)

    await charge(paysim, key)

    listed = await until_final(paysim, 2)
    assert sorted((a["delivery"], a["status"]) for a in listed) == [(1, 200), (2, 200)]
    assert len({a["event_id"] for a in listed}) == 1
    assert len({a["signed_at"] for a in listed}) == 2  # a retry is signed afresh
    answers = sorted(json.loads(a["answer"])["duplicate"] for a in listed)
    assert answers == [False, True]
    published = await published_since(topics, since)
    assert [hook.provider_event_id for _, hook in published] == [listed[0]["event_id"]]


@broker
async def test_a_paused_webhook_waits_until_released(
        paysim: httpx.AsyncClient, topics: KafkaSettings) -> None:
    (await paysim.post("/_sim/webhooks", json={"paused": True})).raise_for_status()
    key = f"{_new_task()}:1"
    since = await topic_ends(topics)

    await charge(paysim, key)
    held = (await paysim.get("/_sim/webhooks")).json()
    assert (held["pending"], held["attempts"]) == (1, [])  # queued, not attempted
    assert await published_since(topics, since) == []

    released = await paysim.post("/_sim/webhooks", json={"paused": False})
    assert released.json()["settings"]["paused"] is False
    [attempt] = await until_final(paysim, 1)
    assert (attempt["status"], attempt["key"]) == (200, key)
    [(_, hook)] = await published_since(topics, since)
    assert hook.key == key


# --- paysim against a stub receiver: retries -----------------------------------------------------


class StubPaysim:
    """A simulator that delivers to a stub receiver answering from a script of statuses."""

    def __init__(self, sim: httpx.AsyncClient, received: list[tuple[bytes, str]],
                 statuses: list[int]) -> None:
        self.sim = sim
        self.received = received  # (body, Stripe-Signature) per request
        self.statuses = statuses  # answered in order; 200 once used up


@pytest.fixture(scope="module")
async def stub_receiver() -> AsyncIterator[tuple[str, list[tuple[bytes, str]], list[int]]]:
    received: list[tuple[bytes, str]] = []
    statuses: list[int] = []

    async def receive(request: web.Request) -> web.Response:
        received.append((await request.read(), request.headers.get("Stripe-Signature", "")))
        status = statuses.pop(0) if statuses else 200
        return web.json_response({"stub": True}, status=status)

    app = web.Application()
    app.router.add_post("/hooks", receive)
    server = TestServer(app)
    await server.start_server()
    try:
        yield str(server.make_url("/hooks")), received, statuses
    finally:
        await server.close()


@pytest.fixture(scope="module")
async def stub_paysim_url(stub_receiver: tuple[str, list[tuple[bytes, str]], list[int]],
                          ) -> AsyncIterator[str]:
    async with _simulator("--webhook-url", stub_receiver[0], "--webhook-secret", SECRET) as url:
        yield url


@pytest.fixture
async def paysim_stub(stub_paysim_url: str,
                      stub_receiver: tuple[str, list[tuple[bytes, str]], list[int]],
                      ) -> AsyncIterator[StubPaysim]:
    _, received, statuses = stub_receiver
    received.clear()
    statuses.clear()
    async with httpx.AsyncClient(base_url=stub_paysim_url, timeout=HTTP_TIMEOUT_S) as client:
        (await client.post("/_sim/reset")).raise_for_status()
        yield StubPaysim(client, received, statuses)


async def test_a_receiver_that_fails_is_retried_with_fresh_signatures(
        paysim_stub: StubPaysim) -> None:
    paysim_stub.statuses.extend([500, 503])
    key = f"{_new_task()}:1"

    await charge(paysim_stub.sim, key)

    listed = await until_final(paysim_stub.sim, 1)
    assert [(a["attempt"], a["status"]) for a in listed] == [(1, 500), (2, 503), (3, 200)]
    assert [a["final"] for a in listed] == [False, False, True]
    assert len(paysim_stub.received) == 3
    bodies = {body for body, _ in paysim_stub.received}
    assert len(bodies) == 1  # the same event every time
    signed_at = [verify(body, header, SECRET, time.time())
                 for body, header in paysim_stub.received]
    assert signed_at == sorted(set(signed_at))  # re-signed, each later than the last
    event = json.loads(bodies.pop())
    assert event["type"] == "charge.succeeded"
    assert event["data"]["object"]["metadata"]["halfway_key"] == key


async def test_a_409_ends_a_delivery(paysim_stub: StubPaysim) -> None:
    paysim_stub.statuses.append(409)  # the receiver says it already accepted this signature

    await charge(paysim_stub.sim, f"{_new_task()}:1")

    [attempt] = await until_final(paysim_stub.sim, 1)
    assert (attempt["status"], attempt["final"]) == (409, True)
    assert len(paysim_stub.received) == 1


async def test_paysim_refuses_bad_webhook_settings(paysim_stub: StubPaysim) -> None:
    for bad in ({"duplicate_p": 1.5}, {"delay_s_max": -1}, {"surprise": True}):
        response = await paysim_stub.sim.post("/_sim/webhooks", json=bad)
        assert response.status_code == 400, bad
