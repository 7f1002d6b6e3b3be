"""The webhook gateway against hostile or careless clients: headers and bodies that trickle in
(slowloris), more connections than it keeps open,
requests their headers alone condemn, values longer than the reconciler can journal, values a
provider chose in log lines, and requests aiohttp's own HTTP parser refuses.

The gateway is served as `serve_gateway` serves it (`make_runner`: among others, a handler is
not cancelled when its client leaves), offline: a fake writer and a fake journal
(tests/test_webhooks.py). Nothing waits for time to pass: each test awaits the answer or the
state it expects, bounded so that a hang fails instead of blocking.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from aiohttp import web

from halfway import log
from halfway.contract import Outcome, SettlementSource
from halfway.contract.events import StepSettled
from halfway.core.fold import EffectState, fold
from halfway.core.reconcile import Settle, declared_report, weigh_webhook
from halfway.gateway import app as gateway_app
from halfway.gateway import make_app
from halfway.gateway.app import (
    CONNECTIONS,
    EVENT_ID_CHARS_MAX,
    EVENT_TYPE_CHARS_MAX,
    GATEWAY,
    LOG_VALUE_CHARS_MAX,
    OBJECT_ID_CHARS_MAX,
    Gateway,
    make_runner,
)
from halfway.gateway.connections import Connections
from halfway.webhooks import standard
from halfway.webhooks.providers import Provider, ProviderDeclaration, paysim
from halfway.webhooks.signature import sign
from tests.factories import Stamper
from tests.test_webhooks import OFFLINE, FakeJournal, FakeWriter, charge_event, encode

SECRET = "whsec_test_gateway_hostile"
SW_SECRET = "whsec_" + "aG9zdGlsZS1jbGllbnRzLWFnYWluc3QtdGhlLWdhdGV3YXk="
WAIT_S = 30.0  # bounds every await: a hang fails the test, it never blocks the suite
POLL_INTERVAL_S = 0.02
POLL_ATTEMPTS_MAX = 1500  # WAIT_S of polls, for a state the gateway reaches at once
SHORT_BODY_READ_S = 0.2  # the deadline where a test wants it to pass
LONG_BODY_READ_S = 3600.0  # where a test must not see it pass: any answer is not the deadline
TRICKLE_S = 0.05  # the slow client's pace: one body byte each
TRICKLED_BYTES_MAX = 1000  # its announced body, never all sent
# The headers' deadline where a test wants it to pass (a genuine request in the same test
# sends its headers at once, well within it even on a loaded machine).
SHORT_HEADERS_READ_S = 1.0
BODY_PIECES = 10  # a body sent in this many pieces, over longer than the headers' deadline
TRICKLERS = 20  # connections that trickle header lines and never end them
CONNECTIONS_CAP = 8  # where a test fills the gateway's connections
ATTEMPT_OFFSET = 3  # where the step's first attempt sits in its journal (FakeJournal ends at 41)

# A Standard Webhooks provider (the id comes from the webhook-id header), and a Stripe-format
# one that declares an event type as long as a declaration allows.
LONG_TYPE = "booking." + "t" * (EVENT_TYPE_CHARS_MAX - len("booking."))
HOTELS = Provider(ProviderDeclaration.model_validate(
    {"name": "hotels", "format": "standardwebhooks", "secret_env": "HOTELS_SECRET",
     "mapping": {"events": {"booking.confirmed": "done"}, "key": "data.metadata.halfway_key",
                 "object_id": "data.id"}}), (SW_SECRET,))
LONGIDS = Provider(ProviderDeclaration.model_validate(
    {"name": "longids", "format": "stripe", "secret_env": "LONGIDS_SECRET",
     "mapping": {"events": {LONG_TYPE: "done"}, "event_id": "id", "key": "data.metadata.k",
                 "object_id": "data.object.id"}}), (SECRET,))


@dataclass
class Served:
    port: int
    client: httpx.AsyncClient
    writer: FakeWriter
    gateway: Gateway
    connections: Connections


Serve = Callable[..., Awaitable[Served]]


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """Starts gateways served the way `serve_gateway` serves one, on free ports."""
    runners: list[web.AppRunner] = []
    clients: list[httpx.AsyncClient] = []

    async def start(*, body_read_s: float = gateway_app.BODY_READ_S,
                    **bounds: float) -> Served:
        writer = FakeWriter()
        app = make_app(OFFLINE, writer, [paysim(SECRET), HOTELS, LONGIDS],  # type: ignore[arg-type]
                       journal=FakeJournal(), body_read_s=body_read_s, **bounds)
        runner = make_runner(app)
        await runner.setup()
        runners.append(runner)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=WAIT_S)
        clients.append(client)
        return Served(port, client, writer, app[GATEWAY], app[CONNECTIONS])

    yield start
    for client in clients:
        await client.aclose()
    for runner in runners:
        await runner.cleanup()


async def send_raw(port: int, head: dict[str, str], body: bytes = b"", *,
                   path: str = "/webhooks/paysim",
                   ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection that sent a POST's headers and `body`, whatever Content-Length says."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{k}: {v}" for k, v in head.items())]
    writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
    await writer.drain()
    return reader, writer


async def answer(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    """The status and body of the next response on the connection."""
    async def read() -> tuple[int, bytes]:
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"(?im)^content-length:\s*(\d+)", head)
        assert length is not None, head
        return int(head.split(b" ", 2)[1]), await reader.readexactly(int(length.group(1)))
    return await asyncio.wait_for(read(), WAIT_S)


async def until(probe: Callable[[], bool], what: str) -> None:
    for _ in range(POLL_ATTEMPTS_MAX):
        if probe():
            return
        await asyncio.sleep(POLL_INTERVAL_S)
    raise AssertionError(f"gave up waiting for {what}")


def stripe_head(body: bytes, *, content_length: int | None = None,
                signature: str | None = None) -> dict[str, str]:
    """Headers that pass every check the headers alone allow: signed now, for `body`."""
    return {"Content-Type": "application/json",
            "Content-Length": str(len(body) if content_length is None else content_length),
            "Stripe-Signature": signature or sign(body, SECRET, int(time.time()))}


async def post_signed(served: Served, event: dict[str, Any], *,
                      provider: str = "paysim") -> httpx.Response:
    body = encode(event)
    return await served.client.post(f"/webhooks/{provider}", content=body,
                                     headers=stripe_head(body))


# --- 1. slow bodies, and what the headers alone condemn -------------------------------------------


async def test_a_client_trickling_its_body_is_408_and_frees_the_slot_for_a_valid_webhook(
        serve: Serve, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gateway_app, "REQUESTS_AT_ONCE_MAX", 1)  # the trickler takes them all
    served = await serve(body_read_s=SHORT_BODY_READ_S)
    body = b"x" * TRICKLED_BYTES_MAX
    # A fresh, well-formed signature: nothing in the headers condemns it, so it takes a slot.
    reader, writer = await send_raw(served.port, stripe_head(body), body[:1])

    async def trickle() -> None:
        for byte in body[1:]:
            await asyncio.sleep(TRICKLE_S)
            writer.write(bytes([byte]))

    trickling = asyncio.create_task(trickle())
    try:
        status, text = await answer(reader)
    finally:
        trickling.cancel()
    assert status == 408, text
    assert "did not arrive within" in json.loads(text)["error"]
    writer.close()
    assert served.gateway.serving == 0

    response = await post_signed(served, charge_event(None))
    assert response.status_code == 200, response.text
    assert len(served.writer.records) == 1


def _stale() -> str:
    return f"t={int(time.time()) - 3600},v1={'0' * 64}"


def _sw(**overrides: str) -> dict[str, str]:
    now = int(time.time())
    headers = {standard.ID_HEADER: "msg_1", standard.TIMESTAMP_HEADER: str(now),
               standard.SIGNATURE_HEADER: "v1,AAAA"}
    return {k: v for k, v in (headers | overrides).items() if v}


@pytest.mark.parametrize(("path", "make_head", "status", "words"), [
    pytest.param("/webhooks/paysim", lambda: stripe_head(b"{}", content_length=2 * 1024 * 1024),
                 413, "larger than 1048576 bytes", id="content-length-over-the-limit"),
    pytest.param("/webhooks/paysim", lambda: {"Content-Length": "1000"},
                 400, "missing Stripe-Signature", id="stripe-missing"),
    pytest.param("/webhooks/paysim", lambda: stripe_head(b"{}", signature="garbage"),
                 400, "garbled Stripe-Signature", id="stripe-garbled"),
    pytest.param("/webhooks/paysim",
                 lambda: stripe_head(b"{}", signature=f"t={int(time.time())},v0={'0' * 64}"),
                 400, "no v1 signature", id="stripe-no-v1"),
    pytest.param("/webhooks/paysim", lambda: stripe_head(b"{}", signature=_stale()),
                 400, "too old", id="stripe-stale"),
    pytest.param("/webhooks/hotels",
                 lambda: {"Content-Length": "1000"} | _sw(**{standard.ID_HEADER: ""}),
                 400, "missing webhook-id", id="standard-missing-id"),
    pytest.param("/webhooks/hotels", lambda: {"Content-Length": "1000"} | _sw(
        **{standard.TIMESTAMP_HEADER: str(int(time.time()) - 3600)}),
                 400, "too old", id="standard-stale"),
    pytest.param("/webhooks/hotels", lambda: {"Content-Length": "1000"} | _sw(
        **{standard.TIMESTAMP_HEADER: str(int(time.time()) + 3600)}),
                 400, "in the future", id="standard-future"),
])
async def test_what_the_headers_condemn_is_refused_without_its_body_and_without_a_slot(
        serve: Serve, monkeypatch: pytest.MonkeyPatch, path: str,
        make_head: Callable[[], dict[str, str]], status: int, words: str) -> None:
    # No slot at all: a request that needed one would be 503. No body either, and a deadline
    # that never passes here: the answer can only come from the headers.
    monkeypatch.setattr(gateway_app, "REQUESTS_AT_ONCE_MAX", 0)
    served = await serve(body_read_s=LONG_BODY_READ_S)
    reader, writer = await send_raw(served.port, make_head(), path=path)
    try:
        got, text = await answer(reader)
    finally:
        writer.close()
    assert got == status, text
    assert words in json.loads(text)["error"]
    assert served.writer.records == []


@pytest.mark.parametrize(("path", "make_head"), [
    # Forged, but only the body can tell: Stripe's library compares signatures last.
    pytest.param("/webhooks/paysim",
                 lambda: stripe_head(b"{}", signature=sign(b"{}", "whsec_guessed",
                                                           int(time.time()))), id="forged"),
    # Stripe accepts a timestamp from the future (a holder of the secret made it).
    pytest.param("/webhooks/paysim",
                 lambda: stripe_head(b"{}", signature=sign(b"{}", SECRET,
                                                           int(time.time()) + 3600)),
                 id="stripe-future"),
    # A garbled entry after one that may match: some library versions accept the request.
    pytest.param("/webhooks/hotels",
                 lambda: {"Content-Length": "2"} | _sw(**{
                     standard.SIGNATURE_HEADER: "v1,AAAA v1,not,base64"}), id="standard-entry"),
])
async def test_what_only_the_body_can_tell_is_left_to_the_whole_check(
        serve: Serve, monkeypatch: pytest.MonkeyPatch, path: str,
        make_head: Callable[[], dict[str, str]]) -> None:
    """The headers' check never refuses what the whole check might accept (these pass on the
    gateway before the header check too: they keep it from refusing too much)."""
    monkeypatch.setattr(gateway_app, "REQUESTS_AT_ONCE_MAX", 0)
    served = await serve()
    reader, writer = await send_raw(served.port, make_head(), b"{}", path=path)
    try:
        got, text = await answer(reader)
    finally:
        writer.close()
    assert got == 503, text  # it went on to take a slot


async def test_a_client_that_leaves_mid_body_frees_its_slot_and_logs_no_error(
        serve: Serve, caplog: pytest.LogCaptureFixture) -> None:
    served = await serve(body_read_s=LONG_BODY_READ_S)
    body = encode(charge_event(None))
    with caplog.at_level(logging.WARNING):
        _, writer = await send_raw(served.port, stripe_head(body), body[:10])
        await until(lambda: served.gateway.serving == 1, "the request to take its slot")
        writer.close()
        await until(lambda: served.gateway.serving == 0, "the slot to be freed")
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]


async def test_a_garbled_chunked_body_is_a_json_4xx_never_a_500(
        serve: Serve, monkeypatch: pytest.MonkeyPatch) -> None:
    reading = asyncio.Event()
    read_body = gateway_app._read_body

    async def noted(*args: Any) -> bytes | web.Response:
        reading.set()
        return await read_body(*args)

    monkeypatch.setattr(gateway_app, "_read_body", noted)
    served = await serve(body_read_s=SHORT_BODY_READ_S)
    head = stripe_head(b"{}") | {"Transfer-Encoding": "chunked"}
    del head["Content-Length"]
    reader, writer = await send_raw(served.port, head)
    try:
        # Once our handler reads the body (garbled with the headers, aiohttp refuses it itself).
        await asyncio.wait_for(reading.wait(), WAIT_S)
        writer.write(b"zz\r\nab\r\n")
        status, text = await answer(reader)
    finally:
        writer.close()
    # aiohttp's C parser stalls the body (408 at the deadline); its Python parser raises (400).
    assert status in (400, 408), text
    assert json.loads(text)["error"]


# --- 2. slow headers, and more connections than the gateway keeps open ---------------------------


PARTIAL_HEAD = b"POST /webhooks/paysim HTTP/1.1\r\nHost: 127.0.0.1\r\n"  # never ended


async def trickler(port: int, start: bytes = PARTIAL_HEAD,
                   ) -> tuple[asyncio.StreamReader, asyncio.Task[None]]:
    """A connection that sends `start` and then a header line every TRICKLE_S, never the
    blank line that ends the headers, until it is closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(start)

    async def trickle() -> None:
        try:
            while not reader.at_eof():
                await asyncio.sleep(TRICKLE_S)
                writer.write(b"X-Slow: 1\r\n")
                await writer.drain()
        except ConnectionError:
            pass  # closed by the gateway
        finally:
            writer.close()

    return reader, asyncio.create_task(trickle())


async def closed_by_gateway(reader: asyncio.StreamReader) -> bytes:
    """What the gateway sent before it closed the connection (a reset counts as closed)."""
    async def rest() -> bytes:
        try:
            return await reader.read()
        except ConnectionError:
            return b""
    return await asyncio.wait_for(rest(), WAIT_S)


async def test_connections_trickling_headers_are_closed_at_the_deadline_and_logged_once(
        serve: Serve, capsys: pytest.CaptureFixture[str]) -> None:
    served = await serve(headers_read_s=SHORT_HEADERS_READ_S,
                         connections_max=10 * TRICKLERS)  # the cap plays no part here
    log.configure(json=True)
    try:
        capsys.readouterr()
        trickling = [await trickler(served.port) for _ in range(TRICKLERS)]
        # A kept-alive connection: one request answered, then the next one trickles.
        reader, writer = await send_raw(served.port, {"Content-Length": "0"},
                                        path="/webhooks/nobody")
        status, _ = await answer(reader)
        writer.write(PARTIAL_HEAD)
        # While they trickle, a genuine webhook is answered.
        response = await post_signed(served, charge_event(None))
        sent = [await closed_by_gateway(r) for r, _ in trickling]
        after_an_answer = await closed_by_gateway(reader)
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    finally:
        log.configure()
        for _, task in trickling:
            task.cancel()
        writer.close()
    assert (status, response.status_code) == (404, 200), response.text
    assert sent == [b""] * TRICKLERS  # closed without an answer: there was no request
    assert after_an_answer == b""
    assert served.connections.late >= TRICKLERS + 1
    assert len(served.writer.records) == 1
    # One line for the flood (then at most one a CLOSED_LOG_INTERVAL_S), not one a connection.
    [line] = [line for line in lines if line["event"] == "connections closed"]
    assert (line["why"], line["late"], line["unlogged_since"]) == ("late", 1, 0)  # the first
    assert line["headers_read_s"] == SHORT_HEADERS_READ_S


async def test_a_request_being_handled_is_not_closed_by_the_headers_deadline(
        serve: Serve) -> None:
    served = await serve(headers_read_s=SHORT_HEADERS_READ_S, body_read_s=LONG_BODY_READ_S)
    body = encode(charge_event(None))
    reader, writer = await send_raw(served.port, stripe_head(body))
    piece = -(-len(body) // BODY_PIECES)
    try:
        for start in range(0, len(body), piece):  # over more than twice the deadline
            await asyncio.sleep(SHORT_HEADERS_READ_S / (BODY_PIECES / 2.5))
            writer.write(body[start:start + piece])
        status, text = await answer(reader)
    finally:
        writer.close()
    assert status == 200, text
    assert served.connections.late == 0


async def test_past_the_connection_cap_the_idlest_is_closed_and_a_genuine_webhook_answered(
        serve: Serve) -> None:
    served = await serve(headers_read_s=LONG_BODY_READ_S, connections_max=CONNECTIONS_CAP)
    trickling = []
    try:
        for _ in range(CONNECTIONS_CAP):
            trickling.append(await trickler(served.port))
            await until(lambda: served.connections.open == len(trickling),
                        "the gateway to count the connection")
        response = await post_signed(served, charge_event(None))
        assert response.status_code == 200, response.text
        assert await closed_by_gateway(trickling[0][0]) == b""  # the one waiting longest
        assert served.connections.shed == 1
        assert not any(r.at_eof() for r, _ in trickling[1:])
    finally:
        for _, task in trickling:
            task.cancel()


async def test_at_the_cap_with_every_connection_inside_a_request_a_new_one_is_closed(
        serve: Serve) -> None:
    served = await serve(headers_read_s=LONG_BODY_READ_S, body_read_s=LONG_BODY_READ_S,
                         connections_max=1)
    body = encode(charge_event(None))
    reader, writer = await send_raw(served.port, stripe_head(body), body[:-1])
    try:
        await until(lambda: served.gateway.serving == 1, "the request to take its slot")
        late, _ = await trickler(served.port)
        assert await closed_by_gateway(late) == b""
        writer.write(body[-1:])
        status, text = await answer(reader)
    finally:
        writer.close()
    assert status == 200, text
    assert served.connections.shed == 1


# --- 3. what the gateway accepts, the reconciler can journal --------------------------------------


def _task() -> str:
    return f"renewal-{uuid.uuid4().hex[:12]}"


def at_the_bounds(task_id: str) -> dict[str, Any]:
    """A `longids` event whose id, type and object id are each as long as they may be."""
    return {"id": "evt_" + "e" * (EVENT_ID_CHARS_MAX - 4), "type": LONG_TYPE,
            "data": {"object": {"id": "bk_" + "o" * (OBJECT_ID_CHARS_MAX - 3)},
                     "metadata": {"k": f"{task_id}:1"}}}


def _longer(event: dict[str, Any], field: str) -> dict[str, Any]:
    if field == "object id":
        event["data"]["object"]["id"] += "o"
    else:
        event[field] += "x"
    return event


def journaled(s: Stamper, effect: EffectState, hook: Any) -> StepSettled:
    """What the reconciler journals for the webhook, for a tool that reads none itself."""
    move = weigh_webhook(effect, declared_report(hook, None), hook,
                         first_attempt_offset=ATTEMPT_OFFSET, has_lookup=False)
    assert isinstance(move, Settle), move
    return StepSettled(**s.stamp(), step_id=f"{s.task_id}:1", outcome=move.outcome,
                       evidence=move.evidence, reason=move.reason, effect_id=move.effect_id,
                       contradiction=move.contradiction, source=SettlementSource.WEBHOOK)


@pytest.mark.parametrize(("field", "place", "bound"), [
    ("id", "(id)", EVENT_ID_CHARS_MAX),
    ("type", "(type)", EVENT_TYPE_CHARS_MAX),
    ("object id", "(data.object.id)", OBJECT_ID_CHARS_MAX),
])
async def test_a_value_longer_than_the_reconciler_can_journal_is_400_naming_field_and_bound(
        serve: Serve, field: str, place: str, bound: int) -> None:
    served = await serve()
    task_id = _task()

    over = await post_signed(served, _longer(at_the_bounds(task_id), field), provider="longids")
    assert over.status_code == 400, over.text
    error = over.json()["error"]
    assert f"the event's {field} {place} is {bound + 1} characters long" in error
    assert f"more than the {bound}" in error
    assert served.writer.records == []

    # At every bound at once, it is accepted, and every settlement the reconciler can make of
    # it journals: done with the object as the effect, or a contradiction quoting them all.
    at = await post_signed(served, at_the_bounds(task_id), provider="longids")
    assert at.status_code == 200, at.text
    [hook] = served.writer.published()
    s = Stamper(task_id)
    opening = [s.started(), s.intended(1), s.attempted(1, 1),
               s.settled(1, Outcome.UNKNOWN, attempt=1)]
    done = journaled(s, fold(opening).step(1).effect, hook)
    assert done.effect_id == hook.object_id
    other = s.settled(1, Outcome.DONE, attempt=1, evidence={"object_id": "x"})
    other = other.model_copy(update={"effect_id": "x" * OBJECT_ID_CHARS_MAX})
    contradiction = journaled(s, fold([*opening, other]).step(1).effect, hook)
    assert contradiction.contradiction is not None


async def test_a_webhook_id_header_longer_than_an_event_id_may_be_is_400(serve: Serve) -> None:
    """Without `event_id` in its mapping, a Standard Webhooks event's id is its webhook-id."""
    served = await serve()
    body = encode({"type": "booking.confirmed", "data": {"id": "bk_1"}})

    async def post_as(msg_id: str) -> httpx.Response:
        headers = standard.sign(body, SW_SECRET, msg_id, int(time.time()))
        return await served.client.post("/webhooks/hotels", content=body, headers=headers)

    over = await post_as("m" * (EVENT_ID_CHARS_MAX + 1))
    assert over.status_code == 400, over.text
    assert (f"the event's id (the {standard.ID_HEADER} header) is {EVENT_ID_CHARS_MAX + 1} "
            f"characters long, more than the {EVENT_ID_CHARS_MAX}") in over.json()["error"]
    assert served.writer.records == []
    at = await post_as("m" * EVENT_ID_CHARS_MAX)
    assert at.status_code == 200, at.text


async def test_a_key_that_is_not_ours_feeds_no_field_and_is_published_unkeyed(
        serve: Serve) -> None:
    """Our key is checked against the key pattern, which bounds it: one that does not match
    (100,000 characters) is recorded as absent, as for any event of the provider's own, and
    never matches a step (a 4xx would have the provider retry an event that is fine)."""
    served = await serve()
    event = charge_event("k" * 100_000)

    response = await post_signed(served, event)

    assert response.status_code == 200, response.text
    [hook] = served.writer.published()
    assert (hook.key, hook.task_id) == (None, None)
    assert served.writer.records[0][0] == event["data"]["object"]["id"].encode()


# --- 4. values a provider chose, in log lines -----------------------------------------------------


async def test_values_a_provider_chose_are_cut_in_log_lines(
        serve: Serve, capsys: pytest.CaptureFixture[str]) -> None:
    served = await serve()
    long_id = "evt_" + "9" * 100_000
    accepted = at_the_bounds(_task())
    log.configure(json=True)
    try:
        capsys.readouterr()
        refused = await post_signed(served, charge_event(None, event_id=long_id))
        published = await post_signed(served, accepted, provider="longids")
        lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    finally:
        log.configure()
    assert (refused.status_code, published.status_code) == (400, 200)
    assert not any(long_id[:1000] in json.dumps(line) for line in lines)
    [line] = [line for line in lines if line["event"] == "webhook published"]
    for name, value in (("event_id", accepted["id"]),
                        ("object_id", accepted["data"]["object"]["id"])):
        assert line[name] == f"{value[:LOG_VALUE_CHARS_MAX]}… ({len(value)} characters)"


# --- 5. requests aiohttp's parser refuses ---------------------------------------------------------


async def test_a_header_over_aiohttps_limit_is_a_warning_without_a_traceback(
        serve: Serve, caplog: pytest.LogCaptureFixture) -> None:
    """aiohttp answers it (400, plain text) before any handler or middleware of ours runs:
    only its log is ours to set."""
    served = await serve()
    with caplog.at_level(logging.WARNING):
        reader, writer = await send_raw(served.port, stripe_head(
            b"{}", signature=f"t={int(time.time())},v1=" + "0" * 9000))
        try:
            status, _ = await answer(reader)
        finally:
            writer.close()
    assert status == 400
    [record] = [r for r in caplog.records if r.name == "aiohttp.server"]
    assert record.levelno == logging.WARNING
    assert record.exc_info is None
    assert "refused by the HTTP parser: Got more than 8190 bytes" in record.getMessage()


async def test_a_right_taken_away_after_start_is_said_not_retried(serve: Serve) -> None:
    """The broker refusing the gateway's principal is no temporary failure: not a 503 "retry",
    but a 500 that says what an operator must do."""
    from aiokafka.errors import KafkaTimeoutError, TopicAuthorizationFailedError

    served = await serve()
    served.writer.error = TopicAuthorizationFailedError("webhooks")
    refused = await post_signed(served, charge_event(None))
    assert refused.status_code == 500, refused.text
    assert "may not write the webhooks topic" in refused.json()["error"]
    assert "retry" not in refused.json()["error"]
    served.writer.error = KafkaTimeoutError()  # a broker that does not answer: retry
    busy = await post_signed(served, charge_event(None))
    assert busy.status_code == 503, busy.text


def test_refusals_are_logged_once_per_interval_per_kind_with_the_count_unlogged(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A flood of bad requests writes a line per kind every few seconds, not one a request
    (300 slow connections wrote 53 MB of log in 2.5 minutes); the line says how many went
    unlogged."""
    from halfway.gateway import app as gateway_app

    lines: list[dict[str, Any]] = []

    class Logger:
        def warning(self, event: str, **fields: Any) -> None:
            lines.append({"event": event, **fields})

    now = [1000.0]
    monkeypatch.setattr(log.time, "monotonic", lambda: now[0])
    refusals = log.Throttled(gateway_app.REFUSAL_LOG_INTERVAL_S)
    for _ in range(100):
        refusals.warning(Logger(), "busy", "webhook refused", why="busy", serving=256)
    refusals.warning(Logger(), "signature", "webhook refused", why="signature")
    now[0] += gateway_app.REFUSAL_LOG_INTERVAL_S
    refusals.warning(Logger(), "busy", "webhook refused", why="busy", serving=256)
    assert [(x["why"], x["unlogged_since"]) for x in lines] == [
        ("busy", 0), ("signature", 0), ("busy", 99)]
