"""The webhook gateway: provider webhooks in, verified `webhook.received` records out.

`POST /webhooks/{provider}` checks the provider's signature over the raw body, reads the body as
a Stripe-style event, and publishes one `WebhookReceived` to the webhooks topic, keyed by
`record_key()`. It answers 200 only once the broker has the record (acks=all): a provider that
got 200 may forget the event, so we must not lose it after answering.

Refusals publish and remember nothing, and say why in `{"error": ...}`:
- 404: a provider we have no secret for;
- 400: no, garbled, forged, stale or future signature; a body that is not such an event;
- 409: a replay, i.e. the exact `Stripe-Signature` value of a request we already accepted, still
  inside the tolerance window (a captured request re-sent: the provider re-signs each retry);
- 503: the broker did not take the record in time; the provider retries.

A provider's redelivery of an event we already published (a new signature, the same event id)
is answered 200 `{"duplicate": true}` and not published again. Both memories (signatures and
event ids) live in this process and are bounded in size and age, so after a restart, an
eviction, or with several gateway instances, a duplicate can be published again: the webhooks
topic is at-least-once, and downstream (the reconciler) dedupes by `provider_event_id`.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aiohttp import web
from pydantic import ValidationError
from structlog.typing import FilteringBoundLogger

from halfway import log
from halfway.contract.ids import KEY_PATTERN, UNDO_SUFFIX, parse_step_id
from halfway.contract.topics import WEBHOOKS
from halfway.contract.webhooks import WebhookReceived
from halfway.journal import JournalWriter, ensure_topics
from halfway.settings import KafkaSettings, gateway_host, gateway_port, paysim_webhook_secret
from halfway.webhooks.signature import TOLERANCE_S_DEFAULT, SignatureError, verify

SIGNATURE_HEADER = "Stripe-Signature"
BODY_BYTES_MAX = 1024 * 1024  # Stripe events are well under this; more is not a webhook
MEMORY_ENTRIES_MAX = 100_000  # per memory; past it the oldest entry is forgotten
# A signature stays acceptable until its t is `tolerance` in the past, and t may be up to
# `tolerance` in the future when accepted: remembering it twice that long covers every case.
SIGNATURE_MEMORY_TOLERANCES = 2
EVENT_IDS_KEPT_S = 86_400.0  # Stripe retries for days; a day of ids catches most redeliveries
PUBLISH_TIMEOUT_S = 30.0  # then 503: the provider retries (the record may still land: dupe)
SHUTDOWN_TIMEOUT_S = 5.0
ERROR_CHARS_MAX = 500

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


@dataclass
class Gateway:
    """What the handlers share: where to publish, the secrets and the two memories."""

    settings: KafkaSettings
    writer: JournalWriter
    secrets: dict[str, str]
    tolerance_s: float = TOLERANCE_S_DEFAULT
    signatures: _Memory = field(init=False)
    event_ids: _Memory = field(init=False)
    # Event ids being published right now, so a concurrent redelivery waits for the outcome
    # instead of publishing a second copy. One entry per request being served, removed as it
    # ends (whatever the outcome): it never outgrows the requests in flight.
    publishing: dict[tuple[str, str], asyncio.Future[bool]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.signatures = _Memory(MEMORY_ENTRIES_MAX,
                                  SIGNATURE_MEMORY_TOLERANCES * self.tolerance_s)
        self.event_ids = _Memory(MEMORY_ENTRIES_MAX, max(EVENT_IDS_KEPT_S, self.tolerance_s))


GATEWAY = web.AppKey("gateway", Gateway)


class _Malformed(Exception):
    pass


def _refuse(status: int, reason: str) -> web.Response:
    return web.json_response({"error": reason[:ERROR_CHARS_MAX]}, status=status)


def _reject_constant(name: str) -> Any:
    raise _Malformed(f"the body is not JSON: {name} is not a JSON number")


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise _Malformed(f"the event has no {where} (a non-empty string)")
    return value


def _task_of(key: Any) -> tuple[str | None, str | None]:
    """(key, task id) from metadata.halfway_key; a malformed key counts as absent: the record
    is then keyed by the provider's object id, and the reconciler cannot mistake it for ours."""
    if not isinstance(key, str) or _KEY.fullmatch(key) is None:
        return None, None
    task_id, _ = parse_step_id(key.removesuffix(UNDO_SUFFIX))
    return key, task_id


def _read_event(provider: str, body: bytes, signed_at_s: int) -> WebhookReceived:
    """The record to publish for a Stripe-style event body; _Malformed if it is not one."""
    try:
        event = json.loads(body, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, UnicodeDecodeError, nesting
        raise _Malformed(f"the body is not JSON: {exc}") from exc
    if not isinstance(event, dict):
        raise _Malformed("the body is not a JSON object")
    data = event.get("data")
    obj = data.get("object") if isinstance(data, dict) else None
    if not isinstance(obj, dict):
        raise _Malformed("the event has no data.object")
    metadata = obj.get("metadata")
    key, task_id = _task_of(metadata.get("halfway_key") if isinstance(metadata, dict) else None)
    try:
        return WebhookReceived(
            provider=provider,
            provider_event_id=_text(event.get("id"), "id"),
            provider_event_type=_text(event.get("type"), "type"),
            object_id=_text(obj.get("id"), "data.object.id"),
            key=key, task_id=task_id, payload=event,
            signed_at=datetime.fromtimestamp(signed_at_s, UTC),
            received_at=datetime.now(UTC),
        )
    except (ValidationError, RecursionError) as exc:
        raise _Malformed(f"the event cannot be recorded: {exc}") from exc


async def receive(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    provider = request.match_info["provider"]
    secret = gateway.secrets.get(provider)
    if secret is None:
        known = ", ".join(sorted(gateway.secrets)) or "none"
        return _refuse(404, f"unknown provider {provider!r}: webhooks are accepted for {known}")
    logger = log.get("halfway.gateway", provider=provider)
    try:
        body = await request.read()
    except web.HTTPRequestEntityTooLarge:
        return _refuse(413, f"the body is larger than {BODY_BYTES_MAX} bytes")
    header = request.headers.get(SIGNATURE_HEADER)
    now_s = time.time()
    try:
        signed_at_s = verify(body, header, secret, now_s, gateway.tolerance_s)
    except SignatureError as exc:
        logger.warning("webhook refused", why=exc.kind, reason=exc.reason)
        return _refuse(400, exc.reason)
    assert header is not None  # verify refuses a missing header
    seen = (provider, header)
    if gateway.signatures.has(seen, now_s):
        logger.warning("webhook refused", why="replayed")
        return _refuse(409, "replayed: this exact Stripe-Signature was already accepted; a "
                       "provider signs every delivery afresh")
    try:
        received = _read_event(provider, body, signed_at_s)
    except _Malformed as exc:
        logger.warning("webhook refused", why="malformed", reason=str(exc))
        return _refuse(400, str(exc))
    # Reserved now, before any await, so a concurrent replay of this request is a 409 too.
    gateway.signatures.add(seen, now_s)
    accepted = False
    try:
        with log.bound(task_id=received.task_id):
            response = await _publish_once(gateway, received, logger)
        accepted = response.status == 200
    finally:
        if not accepted:
            gateway.signatures.discard(seen)  # not accepted: the same request may come again
    return response


async def _publish_once(gateway: Gateway, received: WebhookReceived,
                        logger: FilteringBoundLogger) -> web.Response:
    event = (received.provider, received.provider_event_id)
    fields = {"event_id": received.provider_event_id, "event_type": received.provider_event_type,
              "object_id": received.object_id, "key": received.key}
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
            WEBHOOKS, received.model_dump_json().encode(), key=received.record_key(),
            headers=[("type", received.type.encode()),
                     ("schema_version", str(received.schema_version).encode()),
                     ("provider_event_id", received.provider_event_id.encode())]),
            PUBLISH_TIMEOUT_S)
        published = True
    except Exception as exc:  # the broker's errors are many; each means "not acknowledged"
        logger.error("webhook not published", error=repr(exc), **fields)
        return _refuse(503, f"could not publish the webhook ({type(exc).__name__}); retry")
    finally:
        del gateway.publishing[event]
        if published:
            gateway.event_ids.add(event, time.time())
        done.set_result(published)  # also on cancellation: waiters must not hang
    logger.info("webhook published", partition=meta.partition, offset=meta.offset, **fields)
    return web.json_response({"received": True, "duplicate": False,
                              "event_id": received.provider_event_id})


def make_app(settings: KafkaSettings, writer: JournalWriter, secrets: dict[str, str], *,
             tolerance_s: float = TOLERANCE_S_DEFAULT) -> web.Application:
    """The gateway for providers named in `secrets` (provider -> endpoint secret).

    `writer` must be started; the app neither starts nor stops it."""
    if tolerance_s <= 0:
        raise ValueError(f"tolerance_s must be positive, got {tolerance_s}")
    app = web.Application(client_max_size=BODY_BYTES_MAX)
    app[GATEWAY] = Gateway(settings, writer, dict(secrets), tolerance_s)
    app.router.add_post("/webhooks/{provider}", receive)
    return app


async def serve_gateway(host: str | None = None, port: int | None = None) -> None:
    """The process entry point (`halfway run gateway`): serve until SIGTERM or SIGINT.

    Prints one line, `listening on http://HOST:PORT`, once it accepts connections (port 0
    picks a free port, which the line then names)."""
    log.configure()
    logger = log.get("halfway.gateway")
    settings = KafkaSettings.from_env()
    await ensure_topics(settings, (WEBHOOKS,))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with JournalWriter(settings) as writer:
        app = make_app(settings, writer, {"paysim": paysim_webhook_secret()})
        # Our own socket, so that with port 0 we can read back the port the kernel chose.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        host = host or gateway_host()
        sock.bind((host, gateway_port() if port is None else port))
        runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
        await runner.setup()
        try:
            await web.SockSite(runner, sock).start()
            url = f"http://{host}:{sock.getsockname()[1]}"
            print(f"listening on {url}", flush=True)  # the one line a parent process reads
            logger.info("gateway listening", url=url, providers=["paysim"],
                        topic=WEBHOOKS.name(settings.topic_prefix))
            await stop.wait()
        finally:
            await runner.cleanup()  # finishes requests in flight while the writer still runs
    logger.info("gateway stopped")
