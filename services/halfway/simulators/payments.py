"""paysim: a Stripe-like payment provider (API v1 charges, PaymentIntents, refunds) for demos
and tests, close enough to Stripe's wire format for the official `stripe` client.

Run it as its own process: `python -m halfway.simulators.payments --port 0 --key-ttl-s 86400`
prints exactly one line, `listening on http://127.0.0.1:PORT`, once it accepts connections.
Point the official client at it with `stripe.StripeClient("sk_test_...", base_addresses={"api":
URL})`. API keys are not checked unless `--api-key` is given (then a request under `/v1/`
without `Authorization: Bearer <that key>` is a 401, before anything else runs, like Stripe's
authentication, which runs before its idempotency layer). `Stripe-Version` is ignored.

Theory of operation. Every write (`POST /v1/charges`, `POST /v1/payment_intents`,
`POST /v1/payment_intents/{id}/confirm`, `POST /v1/refunds`) passes through Stripe's layers in
Stripe's order (research/providers.md §2.1), and each layer says whether its answer is saved
under the key:

1. Arrival: the request is numbered (from 1 since the fault rules were last set) and the first
   fault rule that matches it is consumed, once, here.
2. Rate limiter: a 429 fault answers now. Not saved: it runs before the idempotency layer.
3. Request checks: a bad `Idempotency-Key` or body is a 400; a full store is a 503. Not saved.
4. Idempotency layer, for a key younger than `key_ttl_s` (an older one is forgotten, so its
   reuse is a new request): other parameters, or another endpoint → 400 `idempotency_error`;
   the first request still executing → 409 `idempotency_key_in_use`; otherwise the saved status
   and body are replayed with `Idempotent-Replayed: true`. None of these answers is saved.
5. Validation: invalid parameters, an unknown PaymentIntent, one that cannot be confirmed or
   refunded now → 400 (404 for an unknown id in the path) `invalid_request_error`. Not saved
   (Stripe saves only once the endpoint began executing), so the key stays free for a corrected
   request.
6. Execution: the key is reserved as processing; a fault's delay runs, then a 5xx before commit,
   or the endpoint's act, then a 5xx after commit. Whatever the answer, 500s included, it is
   saved under the key. Execution is shielded from the client hanging up: a payment whose
   client gave up still lands, like at Stripe.
7. Reply: a `lose_reply` fault closes the connection instead of answering (the result is
   already committed and saved, so a retry with the key replays it).

A fault action's delay, 5xx and decline shape an execution; 429 and `lose_reply` apply to any
write the rule matched (a replay's reply can be lost too). Layers 1 to 7 are
`halfway.simulators.keyed`'s, shared with tripsim; this module adds the endpoints' acts.

The acts. A charge is made at once (a declined one is recorded as `failed` and answered 402
`card_error`). A PaymentIntent created without `confirm=true` waits in
`requires_payment_method` (or `requires_confirmation` when it has a payment method); confirming
it (`confirm=true` on create, or `/confirm`) makes one payment attempt: a Charge in the ledger
(carrying the intent's id, and its metadata copied once, as Stripe copies it), and the intent
becomes `succeeded`, or, when declined, `requires_payment_method` with `last_payment_error`,
answered 402 `card_error` with the intent in the error body. A confirm without a payment method
charges the customer's default card (paysim's shortcut; Stripe wants a `payment_method`).
Declined: the customer `cus_declined`, the test card `pm_card_chargeDeclined`, or a `decline`
fault. A refund (`payment_intent` or `charge`) succeeds at once for at most what is left to
refund; it is a record of its own (a refund never changes its charge object here). Saved
answers are snapshots: a later change of the intent never changes a replay.

Reads: `GET /v1/charges/{id}`, `GET /v1/payment_intents/{id}`, `GET /v1/refunds/{id}`; the
Search API (`GET /v1/charges/search`, `GET /v1/payment_intents/search`) for the one query the
harness needs, `metadata['name']:'value'`, answered in Stripe's `search_result` shape;
`GET /v1/refunds?payment_intent=|charge=` (strongly consistent, like Stripe's list); and
`GET /v1/events`, newest first, `type` filtering by a name or a `prefix.*` group,
`starting_after` paging, each event carrying the request's id and idempotency key
(`request: {id, idempotency_key}`). Events: `charge.succeeded` / `charge.failed` for every
charge (a PaymentIntent's too), `payment_intent.succeeded` / `payment_intent.payment_failed`
for every payment attempt of an intent, `refund.created` for every refund.

Search lag: Stripe's search can lag writes by up to a minute (an hour in outages);
`POST /_sim/search {"lag_s": N}` makes a charge or intent searchable only N seconds (on the
simulator's clock) after it was made, showing its current state then. Lists, events and
retrieves are never lagged. A reset restores no lag.

Time: keys expire on the simulator's clock, wall time plus an offset that `POST /_sim/clock`
moves forward, so tests can expire keys (and end search lag) without waiting. Delays are real
time.

Bounds: at most `STORE_ENTRIES_MAX` keys, records (charges, intents and refunds together) and
logged write requests, and `IN_FLIGHT_MAX` executions at once; past them a write is refused
with 503 (unsaved), never silently dropped, because the ledger is the ground truth tests
compare with.

Webhooks (with `--webhook-url`): every event above is delivered (the object as `data.object`,
our key in `request.idempotency_key`), POSTed with a `Stripe-Signature` header signed with
`--webhook-secret`. Like Stripe's: at least once, retried with backoff on a non-2xx answer or a
connection error (a bounded number of attempts, Stripe's days compressed into about a minute),
re-signed at every attempt with a fresh timestamp, and ended by a 2xx or by a 409 (the receiver
says it already accepted this exact signature). `POST /_sim/webhooks` makes it worse on purpose:
a second delivery of some events (`duplicate_p`, a provider retry), a random delay before each
delivery (`delay_s_max`, so events arrive out of order), and `paused` (deliveries wait until
unpaused, so a test decides when a webhook arrives). `GET /_sim/webhooks` lists every attempt.
A reset cancels the deliveries not yet made and restores the defaults.

Controls (not Stripe's): `/_sim/faults`, `/_sim/requests` (every write, with its endpoint),
`/_sim/reset`, `/_sim/clock` (keyed's), `GET /_sim/ledger` (charges, payment_intents, refunds),
`/_sim/webhooks`, `/_sim/search`.

Not modelled: list paging for anything but events, `payment_intent.created` and other
lifecycle events, 3-D Secure (`requires_action`), manual capture, thin (v2) events.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import secrets
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from copy import deepcopy
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from halfway.simulators import keyed
from halfway.simulators.keyed import (
    DELAY_S_MAX,
    METADATA_KEY_CHARS_MAX,
    METADATA_KEYS_MAX,
    METADATA_VALUE_CHARS_MAX,
    STORE_ENTRIES_MAX,
    Answer,
    BadBody,
    FaultAction,
)
from halfway.simulators.keyed import error as _error
from halfway.simulators.keyed import new_id as _new_id
from halfway.simulators.keyed import reply as _reply
from halfway.webhooks.signature import sign

AMOUNT_MAX = 99_999_999  # Stripe's largest amount, in the currency's minor unit
DECLINED_CUSTOMER = "cus_declined"  # charging this customer is always declined
# Stripe's test payment methods that are always declined.
DECLINED_PAYMENT_METHODS = frozenset({"pm_card_chargeDeclined", "pm_card_visa_chargeDeclined"})
DEFAULT_PAYMENT_METHOD = "pm_card_visa"  # a customer's default card (a confirm without one)
API_VERSION = "2024-06-20"
CHARGE_PARAMS = frozenset({"amount", "currency", "customer", "description", "metadata"})
INTENT_PARAMS = frozenset({"amount", "currency", "customer", "description", "metadata",
                           "confirm", "payment_method", "payment_method_types", "off_session"})
CONFIRM_PARAMS = frozenset({"payment_method", "off_session"})
REFUND_PARAMS = frozenset({"payment_intent", "charge", "amount", "metadata", "reason"})
REFUND_REASONS = frozenset({"duplicate", "fraudulent", "requested_by_customer"})
PAYMENT_METHOD_TYPES = frozenset({"card"})
CONFIRMABLE = frozenset({"requires_payment_method", "requires_confirmation"})
SEARCH_LAG_S_MAX = 3_600.0  # Stripe's search: up to an hour behind during outages
WEBHOOK_SECRET_DEFAULT = "whsec_halfway_dev"
WEBHOOK_ATTEMPTS_MAX = 12  # per delivery; then it is given up (and listed as such)
WEBHOOK_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 4.0)  # after attempt 1, 2, ...; then the last, again
WEBHOOK_TIMEOUT_S = 10.0  # one POST, connect to last byte
WEBHOOK_DELIVERIES_MAX = 2 * STORE_ENTRIES_MAX  # pending at once; past it, dropped (and listed)
WEBHOOK_LOG_MAX = STORE_ENTRIES_MAX  # attempts listed; the oldest go first
WEBHOOK_ANSWER_BYTES_MAX = 500  # of each answer's body, kept in the attempt list

_NESTED_PARAM = re.compile(r"([A-Za-z_]+)\[([^\[\]]+)\]")
_BOOLEAN = {"true": True, "false": False}
_AMOUNT = re.compile(r"[0-9]+")
_CURRENCY = re.compile(r"[A-Za-z]{3}")
# The one Search API query we support: metadata['name']:'value' (either quote; \ escapes).
_METADATA_QUERY = re.compile(
    r"""\s* metadata \[ (['"]) (?P<name>[^'"\\]+) \1 \] \s* : \s*
        (?P<q>['"]) (?P<value> (?: \\. | (?!(?P=q)) [^\\] )* ) (?P=q) \s*""",
    re.VERBOSE,
)


# --- webhooks ------------------------------------------------------------------------------------


class WebhookSettings(BaseModel):
    """How deliveries behave (the JSON body of POST /_sim/webhooks; fields left out keep their
    current values)."""

    model_config = ConfigDict(extra="forbid")

    paused: bool = False  # deliveries wait (before their next attempt) until unpaused
    duplicate_p: float = Field(default=0.0, ge=0.0, le=1.0)  # chance of a second delivery
    delay_s_max: float = Field(default=0.0, ge=0.0, le=DELAY_S_MAX)  # random delay before each
    seed: int | None = None  # seeds the duplicate and delay draws, so runs repeat


class WebhookSender:
    """Where webhooks go and how they are signed: one per process, kept across resets."""

    def __init__(self, url: str, secret: str) -> None:
        self.url = url
        self.secret = secret
        self._session: aiohttp.ClientSession | None = None

    async def post(self, body: bytes, signature: str) -> tuple[int | None, str | None,
                                                                 str | None]:
        """One attempt: (status, the start of the answer, error) with status None when no
        answer came (refused, reset, timed out)."""
        if self._session is None:  # made here, on the running loop, at first use
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=WEBHOOK_TIMEOUT_S))
        try:
            async with self._session.post(self.url, data=body, headers={
                    "Content-Type": "application/json; charset=utf-8",
                    "Stripe-Signature": signature,
                    "User-Agent": "paysim (Stripe-like webhooks)"}) as response:
                answer = await response.content.read(WEBHOOK_ANSWER_BYTES_MAX)
                return response.status, answer.decode("utf-8", "replace"), None
        except (aiohttp.ClientError, TimeoutError) as exc:
            return None, None, f"{type(exc).__name__}: {exc}"[:WEBHOOK_ANSWER_BYTES_MAX]

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


@dataclass(slots=True)
class _Outgoing:
    """One event to deliver, shared by its deliveries (the first and a duplicate)."""

    event: dict[str, Any]
    body: bytes
    last_signed_s: int = 0

    def next_timestamp(self) -> int:
        """A timestamp for the next signature of this event, later than every earlier one.

        Two signatures of one body in the same second would be the same header, which a
        receiver rightly refuses as a replay; a provider's retry is always a new header.
        Wall time, not the simulator's clock: moving that forward to expire keys must not make
        every webhook stale."""
        self.last_signed_s = max(int(time.time()), self.last_signed_s + 1)
        return self.last_signed_s


@dataclass
class WebhookDeliveries:
    """The deliveries of one SimState. `sender` None: no --webhook-url, nothing is sent."""

    sender: WebhookSender | None
    settings: WebhookSettings = field(default_factory=WebhookSettings)
    rng: random.Random = field(default_factory=random.Random)
    released: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)  # strong references
    held: int = 0  # deliveries waiting for an unpause
    attempts: deque[dict[str, Any]] = field(
        default_factory=lambda: deque(maxlen=WEBHOOK_LOG_MAX))
    attempts_dropped: int = 0  # listed attempts pushed out by newer ones

    def __post_init__(self) -> None:
        self.released.set()

    def configure(self, update: WebhookSettings) -> None:
        given = update.model_fields_set
        self.settings = self.settings.model_copy(
            update={name: getattr(update, name) for name in given})
        if "seed" in given:
            self.rng = random.Random(update.seed)
        if self.settings.paused:
            self.released.clear()
        else:
            self.released.set()

    def send(self, event: dict[str, Any]) -> None:
        """Schedule the deliveries of an event (called as its object commits)."""
        if self.sender is None:
            return
        outgoing = _Outgoing(event, json.dumps(event).encode())
        # Drawn at commit, in commit order, so a seed gives the same draws for the same charges.
        copies = 2 if self.rng.random() < self.settings.duplicate_p else 1
        delays_s = [self.rng.uniform(0.0, self.settings.delay_s_max) for _ in range(copies)]
        for copy, delay_s in enumerate(delays_s, start=1):
            if len(self.tasks) >= WEBHOOK_DELIVERIES_MAX:
                self._log(outgoing, copy, 0, None, None, "dropped: too many deliveries pending",
                          final=True)
                continue
            task = asyncio.create_task(self._deliver(self.sender, outgoing, copy, delay_s))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    async def _deliver(self, sender: WebhookSender, outgoing: _Outgoing, copy: int,
                       delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        for attempt in range(1, WEBHOOK_ATTEMPTS_MAX + 1):
            if not self.released.is_set():
                self.held += 1
                try:
                    await self.released.wait()
                finally:
                    self.held -= 1
            signed_at_s = outgoing.next_timestamp()
            # Never sign a time that has not come yet: wait for it (under a second).
            await asyncio.sleep(max(0.0, signed_at_s - time.time()))
            status, answer, error = await sender.post(
                outgoing.body, sign(outgoing.body, sender.secret, signed_at_s))
            # 409: the receiver already accepted this very signature; sending it on is useless.
            delivered = status is not None and (200 <= status < 300 or status == 409)
            self._log(outgoing, copy, attempt, status, answer, error, signed_at_s,
                      final=delivered or attempt == WEBHOOK_ATTEMPTS_MAX)
            if delivered:
                return
            if attempt < WEBHOOK_ATTEMPTS_MAX:
                await asyncio.sleep(WEBHOOK_BACKOFF_S[min(attempt, len(WEBHOOK_BACKOFF_S)) - 1])

    def _log(self, outgoing: _Outgoing, copy: int, attempt: int, status: int | None,
             answer: str | None, error: str | None, signed_at_s: int | None = None, *,
             final: bool) -> None:
        if len(self.attempts) == self.attempts.maxlen:
            self.attempts_dropped += 1
        event = outgoing.event
        obj = event["data"]["object"]
        # The charge the event is about: the object itself, an intent's latest, a refund's.
        charge_id = obj["id"] if obj.get("object") == "charge" else (
            obj.get("latest_charge") or obj.get("charge"))
        self.attempts.append({
            "at": time.time(), "event_id": event["id"], "type": event["type"],
            "object_id": obj["id"], "charge_id": charge_id,
            "key": event["request"]["idempotency_key"], "delivery": copy, "attempt": attempt,
            "signed_at": signed_at_s, "status": status, "answer": answer, "error": error,
            "final": final,  # the last attempt of this delivery: delivered or given up
        })

    def cancel(self) -> list[asyncio.Task[None]]:
        tasks = list(self.tasks)
        for task in tasks:
            task.cancel()
        return tasks

    def describe(self, *, attempts: bool = True) -> dict[str, Any]:
        described: dict[str, Any] = {
            "url": None if self.sender is None else self.sender.url,
            "settings": self.settings.model_dump(), "pending": len(self.tasks),
            "held": self.held, "attempts_dropped": self.attempts_dropped}
        if attempts:
            described["attempts"] = list(self.attempts)
        return described

# --- state ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class _Ledgered:
    charge: dict[str, Any]  # the public charge object; never changed once made
    idempotency_key: str | None
    request_id: str
    at_s: float = 0.0  # when it was made, on the simulator's clock (search lag)


@dataclass(slots=True)
class _Intent:
    intent: dict[str, Any]  # the public PaymentIntent, current; answers carry snapshots
    idempotency_key: str | None  # of the request that created it
    request_id: str
    at_s: float = 0.0


@dataclass(slots=True)
class _Refund:
    refund: dict[str, Any]  # the public refund object; never changed once made
    idempotency_key: str | None
    request_id: str


@dataclass
class SimState(keyed.State):
    """Everything the simulator knows: the shared keys, rules and request log, and the charges,
    payment intents and refunds. `POST /_sim/reset` swaps in a new one, so a request still
    executing from before the reset writes into the old state, never into the new ledger."""

    charges: dict[str, _Ledgered] = field(default_factory=dict)  # insertion order = ledger order
    charge_ids_by_metadata: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    intents: dict[str, _Intent] = field(default_factory=dict)
    intent_ids_by_metadata: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    refunds: dict[str, _Refund] = field(default_factory=dict)
    refunded_by_charge: dict[str, int] = field(default_factory=dict)  # amounts, minor units
    events: list[dict[str, Any]] = field(default_factory=list)  # oldest first
    event_index: dict[str, int] = field(default_factory=dict)  # id -> position (paging)
    search_lag_s: float = 0.0
    webhooks: WebhookDeliveries = field(default_factory=lambda: WebhookDeliveries(None))

    def record_count(self) -> int:
        return len(self.charges) + len(self.intents) + len(self.refunds)

    def commit_charge(self, charge: dict[str, Any], key: str | None, request_id: str) -> None:
        assert charge["id"] not in self.charges, "charge ids are unique"
        self.charges[charge["id"]] = _Ledgered(charge, key, request_id, self.now_s())
        for name, value in charge["metadata"].items():
            self.charge_ids_by_metadata.setdefault((name, value), []).append(charge["id"])
        self.emit("charge.succeeded" if charge["status"] == "succeeded" else "charge.failed",
                  charge, key, request_id)

    def commit_intent(self, intent: dict[str, Any], key: str | None, request_id: str) -> None:
        assert intent["id"] not in self.intents, "payment intent ids are unique"
        self.intents[intent["id"]] = _Intent(intent, key, request_id, self.now_s())
        for name, value in intent["metadata"].items():
            self.intent_ids_by_metadata.setdefault((name, value), []).append(intent["id"])

    def commit_refund(self, refund: dict[str, Any], key: str | None, request_id: str) -> None:
        assert refund["id"] not in self.refunds, "refund ids are unique"
        self.refunds[refund["id"]] = _Refund(refund, key, request_id)
        self.refunded_by_charge[refund["charge"]] = (
            self.refunded_by_charge.get(refund["charge"], 0) + refund["amount"])
        self.emit("refund.created", refund, key, request_id)

    def emit(self, kind: str, obj: dict[str, Any], key: str | None, request_id: str) -> None:
        """An event about `obj` as it is now (a snapshot), and its webhook deliveries."""
        event = {
            "id": _new_id("evt"),
            "object": "event",
            "api_version": API_VERSION,
            "type": kind,
            "data": {"object": deepcopy(obj)},
            "request": {"id": request_id, "idempotency_key": key},
            "created": int(self.now_s()),
            "livemode": False,
            "pending_webhooks": 0,
        }
        self.event_index[event["id"]] = len(self.events)
        self.events.append(event)
        self.webhooks.send(event)

    def searchable(self, at_s: float) -> bool:
        """Whether a record made at `at_s` shows in search yet (the indexing lag)."""
        return self.now_s() - at_s >= self.search_lag_s


@dataclass
class Simulator(keyed.Simulator):
    """The app's handle on its state (replaced on reset) and its webhook sender (kept)."""

    state: SimState
    webhook_sender: WebhookSender | None = None

    def new_state(self, key_ttl_s: float) -> SimState:
        return SimState(key_ttl_s=key_ttl_s, webhooks=WebhookDeliveries(self.webhook_sender))

    def reset(self) -> keyed.State:
        old = self.state
        super().reset()
        old.webhooks.cancel()  # what was not delivered yet never will be: a test starts clean
        return old


SIM = web.AppKey("sim", Simulator)


# --- parameters ----------------------------------------------------------------------------------


def _scalar(value: Any) -> str:
    """A JSON scalar as the string a form body would carry: Stripe sees strings either way."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str):
        return str(value)
    raise BadBody(f"unsupported value {value!r}: only strings, numbers and one nested object")


async def _read_params(request: web.Request) -> dict[str, Any]:
    """Parameters from a form body (like Stripe, with `metadata[name]=value`) or a JSON object."""
    params: dict[str, Any] = {}
    if request.content_type == "application/json":
        try:
            raw = await request.json()
        except ValueError as exc:
            raise BadBody(f"invalid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise BadBody("the JSON body must be an object")
        for name, value in raw.items():
            if isinstance(value, dict):
                params[name] = {str(k): _scalar(v) for k, v in value.items()}
            else:
                params[name] = _scalar(value)
        return params
    if request.content_type not in ("application/x-www-form-urlencoded", "multipart/form-data"):
        if await request.read():
            raise BadBody(f"unsupported content type {request.content_type}")
        return params
    for name, value in (await request.post()).items():
        if not isinstance(value, str):
            raise BadBody(f"parameter {name} is a file")
        nested = _NESTED_PARAM.fullmatch(name)
        if nested is None:
            params[name] = value
            continue
        outer, inner = nested.groups()
        sub = params.setdefault(outer, {})
        if not isinstance(sub, dict):
            raise BadBody(f"parameter {outer} is both a value and an object")
        sub[inner] = value
    return params


def _bad(message: str, *, param: str | None = None, code: str | None = None) -> Answer:
    return _error(400, "invalid_request_error", message, code=code, param=param)


def _unknown_param(params: Mapping[str, Any], allowed: frozenset[str]) -> Answer | None:
    for name in params:
        if name not in allowed:
            return _bad(f"Received unknown parameter: {name}", code="parameter_unknown",
                        param=name)
    return None


def _missing_param(params: Mapping[str, Any], *names: str) -> Answer | None:
    for name in names:
        if not params.get(name):
            return _bad(f"Missing required param: {name}.", code="parameter_missing",
                        param=name)
    return None


def _invalid_amount(params: Mapping[str, Any]) -> Answer | None:
    amount = params["amount"]
    if not isinstance(amount, str) or not _AMOUNT.fullmatch(amount):
        return _bad(f"Invalid integer: {amount}", code="parameter_invalid_integer",
                    param="amount")
    if int(amount) < 1:
        return _bad("Amount must be at least 1 cent.", code="amount_too_small", param="amount")
    if int(amount) > AMOUNT_MAX:
        return _bad(f"Amount must be no more than {AMOUNT_MAX}.", code="amount_too_large",
                    param="amount")
    return None


def _invalid_strings(params: Mapping[str, Any], *names: str) -> Answer | None:
    for name in names:
        if name in params and not isinstance(params[name], str):
            return _bad(f"Invalid string: {params[name]}", param=name)
    return None


def _invalid_boolean(params: Mapping[str, Any], *names: str) -> Answer | None:
    for name in names:
        if name in params and params[name] not in _BOOLEAN:
            return _bad(f"Invalid boolean: {params[name]}", param=name)
    return None


def _invalid_metadata(params: Mapping[str, Any]) -> Answer | None:
    metadata = params.get("metadata", {})
    if not isinstance(metadata, dict):
        return _bad("Invalid object", param="metadata")
    if len(metadata) > METADATA_KEYS_MAX:
        return _bad(f"Metadata can have at most {METADATA_KEYS_MAX} keys.", param="metadata")
    for name, value in metadata.items():
        if len(name) > METADATA_KEY_CHARS_MAX or len(value) > METADATA_VALUE_CHARS_MAX:
            return _bad(f"Metadata keys are at most {METADATA_KEY_CHARS_MAX} characters and "
                        f"values at most {METADATA_VALUE_CHARS_MAX}.", param=f"metadata[{name}]")
    return None


def _first(*checks: Callable[[], Answer | None]) -> Answer | None:
    """The first refusal among `checks`, run in order (each may assume the ones before)."""
    for check in checks:
        answer = check()
        if answer is not None:
            return answer
    return None


def _invalid(params: Mapping[str, Any]) -> Answer | None:
    """The 400 Stripe would answer for these charge parameters, or None when they are valid."""
    return _first(
        lambda: _unknown_param(params, CHARGE_PARAMS),
        lambda: _missing_param(params, "amount", "currency", "customer"),
        lambda: _invalid_amount(params),
        lambda: _invalid_currency(params),
        lambda: _invalid_strings(params, "customer", "description"),
        lambda: _invalid_metadata(params))


def _invalid_currency(params: Mapping[str, Any]) -> Answer | None:
    currency = params["currency"]
    if not isinstance(currency, str) or not _CURRENCY.fullmatch(currency):
        return _bad(f"Invalid currency: {currency}.", param="currency")
    return None


def _new_charge(params: Mapping[str, Any], *, declined: bool, created: int,
                payment_intent: str | None = None,
                payment_method: str | None = None) -> dict[str, Any]:
    amount = int(params["amount"])
    return {
        "id": _new_id("ch"),
        "object": "charge",
        "amount": amount,
        "amount_captured": 0 if declined else amount,
        "amount_refunded": 0,
        "captured": not declined,
        "currency": params["currency"].lower(),
        "customer": params.get("customer"),
        "description": params.get("description"),
        "status": "failed" if declined else "succeeded",
        "paid": not declined,
        "failure_code": "card_declined" if declined else None,
        "failure_message": "Your card was declined." if declined else None,
        "outcome": {"type": "issuer_declined" if declined else "authorized",
                    "reason": "generic_decline" if declined else None},
        "payment_intent": payment_intent,
        "payment_method": payment_method,
        "metadata": dict(params.get("metadata", {})),
        "created": created,
        "livemode": False,
    }


# --- the charge endpoint (layers 1 to 7 are `halfway.simulators.keyed`'s) ------------------------


def _charge(state: SimState, params: Mapping[str, Any], match: Mapping[str, str],
            key: str | None, action: FaultAction, request_id: str) -> Answer:
    """Make the charge (declined: recorded as failed and answered 402)."""
    declined = action.decline or params["customer"] == DECLINED_CUSTOMER
    charge = _new_charge(params, declined=declined, created=int(state.now_s()))
    state.commit_charge(charge, key, request_id)
    if declined:
        return _error(402, "card_error", "Your card was declined.", code="card_declined",
                      decline_code="generic_decline", charge=charge["id"])
    return 200, charge


# --- the PaymentIntent endpoints ------------------------------------------------------------------


def _invalid_intent(params: Mapping[str, Any]) -> Answer | None:
    """The 400 for these PaymentIntent create parameters, or None when they are valid."""
    return _first(
        lambda: _unknown_param(params, INTENT_PARAMS),
        lambda: _missing_param(params, "amount", "currency"),
        lambda: _invalid_amount(params),
        lambda: _invalid_currency(params),
        lambda: _invalid_strings(params, "customer", "description", "payment_method"),
        lambda: _invalid_boolean(params, "confirm", "off_session"),
        lambda: _invalid_payment_method_types(params),
        lambda: _invalid_metadata(params),
        lambda: (_without_payment_method() if _BOOLEAN.get(params.get("confirm", "false"))
                 and not params.get("payment_method") and not params.get("customer")
                 else None))


def _invalid_payment_method_types(params: Mapping[str, Any]) -> Answer | None:
    if params.get("payment_method_types") is None:
        return None
    for value in _payment_method_types(params):
        if value not in PAYMENT_METHOD_TYPES:
            return _bad(f"The payment method type {value!r} is invalid.",
                        param="payment_method_types")
    return None


def _payment_method_types(params: Mapping[str, Any]) -> list[str]:
    types = params.get("payment_method_types") or {"0": "card"}
    return sorted(set(types.values() if isinstance(types, dict) else [types]))


def _without_payment_method() -> Answer:
    return _bad("You cannot confirm this PaymentIntent because it's missing a payment method. "
                "Pass a payment_method, or a customer whose default card paysim charges.",
                code="payment_intent_unexpected_state", param="payment_method")


def _new_intent(params: Mapping[str, Any], created: int) -> dict[str, Any]:
    intent_id = _new_id("pi")
    payment_method = params.get("payment_method")
    return {
        "id": intent_id,
        "object": "payment_intent",
        "amount": int(params["amount"]),
        "amount_received": 0,
        "currency": params["currency"].lower(),
        "customer": params.get("customer"),
        "description": params.get("description"),
        "status": "requires_confirmation" if payment_method else "requires_payment_method",
        "payment_method": payment_method,
        "payment_method_types": _payment_method_types(params),
        "capture_method": "automatic",
        "confirmation_method": "automatic",
        "client_secret": f"{intent_id}_secret_{_new_id('s')[2:]}",
        "latest_charge": None,
        "last_payment_error": None,
        "canceled_at": None,
        "cancellation_reason": None,
        "metadata": dict(params.get("metadata", {})),
        "created": created,
        "livemode": False,
    }


def _pay(state: SimState, record: _Intent, payment_method: str | None, action: FaultAction,
         key: str | None, request_id: str) -> Answer:
    """One payment attempt of an intent: a charge, then the intent's new status and event."""
    intent = record.intent
    payment_method = payment_method or intent["payment_method"] or DEFAULT_PAYMENT_METHOD
    declined = (action.decline or intent["customer"] == DECLINED_CUSTOMER
                or payment_method in DECLINED_PAYMENT_METHODS)
    charge = _new_charge(
        {"amount": str(intent["amount"]), "currency": intent["currency"],
         "customer": intent["customer"], "description": intent["description"],
         # Stripe copies the intent's metadata to the charge it makes, once.
         "metadata": intent["metadata"]},
        declined=declined, created=int(state.now_s()), payment_intent=intent["id"],
        payment_method=payment_method)
    state.commit_charge(charge, key, request_id)
    intent["payment_method"] = payment_method
    intent["latest_charge"] = charge["id"]
    if declined:
        error = {"type": "card_error", "code": "card_declined",
                 "decline_code": "generic_decline", "message": "Your card was declined.",
                 "charge": charge["id"]}
        intent.update(status="requires_payment_method", last_payment_error=error)
        state.emit("payment_intent.payment_failed", intent, key, request_id)
        return _error(402, "card_error", "Your card was declined.", code="card_declined",
                      decline_code="generic_decline", charge=charge["id"],
                      payment_intent=deepcopy(intent))
    intent.update(status="succeeded", amount_received=intent["amount"], last_payment_error=None)
    state.emit("payment_intent.succeeded", intent, key, request_id)
    return 200, deepcopy(intent)


def _create_intent(state: SimState, params: Mapping[str, Any], match: Mapping[str, str],
                   key: str | None, action: FaultAction, request_id: str) -> Answer:
    intent = _new_intent(params, created=int(state.now_s()))
    state.commit_intent(intent, key, request_id)
    if _BOOLEAN.get(params.get("confirm", "false")):
        return _pay(state, state.intents[intent["id"]], None, action, key, request_id)
    return 200, deepcopy(intent)


def _invalid_confirm(state: SimState, params: Mapping[str, Any],
                     match: Mapping[str, str]) -> Answer | None:
    return _first(
        lambda: _unknown_param(params, CONFIRM_PARAMS),
        lambda: _invalid_strings(params, "payment_method"),
        lambda: _invalid_boolean(params, "off_session"),
        lambda: _unconfirmable(state, match["intent"], params.get("payment_method")))


def _unconfirmable(state: SimState, intent_id: str, payment_method: str | None
                   ) -> Answer | None:
    """Why this intent cannot be confirmed now (unknown, in another status, no way to pay)."""
    record = state.intents.get(intent_id)
    if record is None:
        return keyed.missing("payment_intent", intent_id)
    intent = record.intent
    if intent["status"] not in CONFIRMABLE:
        return _bad(f"This PaymentIntent's status is {intent['status']}, but it must be one of "
                    f"{', '.join(sorted(CONFIRMABLE))} to be confirmed.",
                    code="payment_intent_unexpected_state")
    if not (payment_method or intent["payment_method"] or intent["customer"]):
        return _without_payment_method()
    return None


def _confirm_intent(state: SimState, params: Mapping[str, Any], match: Mapping[str, str],
                    key: str | None, action: FaultAction, request_id: str) -> Answer:
    # Checked again: another confirm (another key) may have paid it during this one's delay.
    refusal = _unconfirmable(state, match["intent"], params.get("payment_method"))
    if refusal is not None:
        return refusal
    return _pay(state, state.intents[match["intent"]], params.get("payment_method"), action,
                key, request_id)


# --- the refund endpoint -------------------------------------------------------------------------


def _invalid_refund(state: SimState, params: Mapping[str, Any],
                    match: Mapping[str, str]) -> Answer | None:
    return _first(
        lambda: _unknown_param(params, REFUND_PARAMS),
        lambda: _invalid_strings(params, "payment_intent", "charge", "reason"),
        lambda: (_invalid_amount(params) if "amount" in params else None),
        lambda: (_bad(f"Invalid reason: {params['reason']}", param="reason")
                 if "reason" in params and params["reason"] not in REFUND_REASONS else None),
        lambda: _invalid_metadata(params),
        lambda: _unrefundable(state, params)[0])


def _unrefundable(state: SimState, params: Mapping[str, Any]
                  ) -> tuple[Answer | None, _Ledgered | None]:
    """(why this refund cannot be made now, or None; the charge it refunds)."""
    if ("payment_intent" in params) == ("charge" in params):
        return _bad("Pass exactly one of payment_intent and charge.",
                    code="parameter_missing", param="payment_intent"), None
    charge_id = params.get("charge")
    if "payment_intent" in params:
        record = state.intents.get(params["payment_intent"])
        if record is None:
            return _bad(f"No such payment_intent: '{params['payment_intent']}'",
                        code="resource_missing", param="payment_intent"), None
        if record.intent["status"] != "succeeded":
            return _bad("This PaymentIntent does not have a successful charge to refund.",
                        code="charge_not_refundable", param="payment_intent"), None
        charge_id = record.intent["latest_charge"]
    ledgered = state.charges.get(str(charge_id))
    if ledgered is None:
        return _bad(f"No such charge: '{charge_id}'", code="resource_missing",
                    param="charge"), None
    charge = ledgered.charge
    if charge["status"] != "succeeded":
        return _bad(f"Charge {charge['id']} has no successful payment to refund.",
                    code="charge_not_refundable", param="charge"), None
    left = charge["amount"] - state.refunded_by_charge.get(charge["id"], 0)
    if left <= 0:
        return _bad(f"Charge {charge['id']} has already been refunded.",
                    code="charge_already_refunded"), None
    if "amount" in params and int(params["amount"]) > left:
        return _bad(f"Refund amount ({params['amount']}) is greater than unrefunded amount on "
                    f"charge ({left})", code="amount_too_large", param="amount"), None
    return None, ledgered


def _refund(state: SimState, params: Mapping[str, Any], match: Mapping[str, str],
            key: str | None, action: FaultAction, request_id: str) -> Answer:
    # Checked again: another refund (another key) may have taken what was left meanwhile.
    refusal, ledgered = _unrefundable(state, params)
    if refusal is not None:
        return refusal
    assert ledgered is not None
    charge = ledgered.charge
    left = charge["amount"] - state.refunded_by_charge.get(charge["id"], 0)
    refund = {
        "id": _new_id("re"),
        "object": "refund",
        "amount": int(params["amount"]) if "amount" in params else left,
        "currency": charge["currency"],
        "charge": charge["id"],
        "payment_intent": charge["payment_intent"],
        "reason": params.get("reason"),
        "status": "succeeded",
        "metadata": dict(params.get("metadata", {})),
        "created": int(state.now_s()),
    }
    state.commit_refund(refund, key, request_id)
    return 200, refund


def _logged(request: web.Request, arrival: keyed.Arrival) -> dict[str, Any]:
    return {"endpoint": arrival.endpoint, "path": request.path, "idempotency_key": arrival.key}


PAYSIM = keyed.Provider(
    sim=SIM, rules=keyed.FaultRules, read_params=_read_params, log_fields=_logged,
    rate_limited=("Too many requests hit the API too quickly. We recommend an exponential "
                  "backoff of your requests."),
    records="ledger", not_done="nothing was charged or refunded",
    done="it was charged or refunded")
CREATE_CHARGE = keyed.Write("charges.create", lambda state, params, match: _invalid(params),
                            _charge)
CREATE_INTENT = keyed.Write("payment_intents.create",
                            lambda state, params, match: _invalid_intent(params), _create_intent)
CONFIRM_INTENT = keyed.Write("payment_intents.confirm", _invalid_confirm, _confirm_intent)
CREATE_REFUND = keyed.Write("refunds.create", _invalid_refund, _refund)


# --- lookups -------------------------------------------------------------------------------------


async def get_charge(request: web.Request) -> web.Response:
    charge_id = request.match_info["charge_id"]
    ledgered = request.app[SIM].state.charges.get(charge_id)
    if ledgered is None:
        return _reply(*keyed.missing("charge", charge_id), _new_id("req"))
    return _reply(200, ledgered.charge, _new_id("req"))


async def get_intent(request: web.Request) -> web.Response:
    intent_id = request.match_info["intent"]
    record = request.app[SIM].state.intents.get(intent_id)
    if record is None:
        return _reply(*keyed.missing("payment_intent", intent_id), _new_id("req"))
    return _reply(200, record.intent, _new_id("req"))


async def get_refund(request: web.Request) -> web.Response:
    refund_id = request.match_info["refund"]
    record = request.app[SIM].state.refunds.get(refund_id)
    if record is None:
        return _reply(*keyed.missing("refund", refund_id), _new_id("req"))
    return _reply(200, record.refund, _new_id("req"))


def _metadata_query(request: web.Request) -> tuple[str, str] | None:
    """(name, value) of the one Search API query we support: metadata['name']:'value'."""
    query = _METADATA_QUERY.fullmatch(request.query.get("query", ""))
    if query is None:
        return None
    return query["name"], re.sub(r"\\(.)", r"\1", query["value"])


def _search(request: web.Request, limit: int, path: str,
            found: Callable[[SimState, tuple[str, str]], list[tuple[dict[str, Any], float]]]
            ) -> Answer:
    """The Search API's answer: the records `found` for the query, newest first, that the
    indexing lag lets show."""
    state = request.app[SIM].state
    query = _metadata_query(request)
    if query is None:
        return _bad("This simulator supports only the query metadata['name']:'value'.",
                    param="query")
    newest_first = [obj for obj, at_s in reversed(found(state, query)) if state.searchable(at_s)]
    return 200, {"object": "search_result", "url": path, "data": newest_first[:limit],
                 "has_more": len(newest_first) > limit, "next_page": None}


def _search_charges(request: web.Request, limit: int) -> Answer:
    return _search(request, limit, "/v1/charges/search", lambda state, query: [
        (state.charges[i].charge, state.charges[i].at_s)
        for i in state.charge_ids_by_metadata.get(query, [])])


def _search_intents(request: web.Request, limit: int) -> Answer:
    return _search(request, limit, "/v1/payment_intents/search", lambda state, query: [
        (state.intents[i].intent, state.intents[i].at_s)
        for i in state.intent_ids_by_metadata.get(query, [])])


def _list_refunds(request: web.Request, limit: int) -> Answer:
    """Refunds, newest first, optionally of one payment intent or charge (not lagged)."""
    wanted = {name: request.query[name] for name in ("payment_intent", "charge")
              if name in request.query}
    data = [r.refund for r in reversed(request.app[SIM].state.refunds.values())
            if all(r.refund[name] == value for name, value in wanted.items())]
    return 200, {"object": "list", "url": "/v1/refunds", "data": data[:limit],
                 "has_more": len(data) > limit}


def _list_events(request: web.Request, limit: int) -> Answer:
    """Events, newest first, like Stripe's: `type` is a name or a group (`payment_intent.*`);
    `starting_after` an event id, the page after it."""
    state = request.app[SIM].state
    kind = request.query.get("type")
    group = kind[:-1] if kind is not None and kind.endswith(".*") else None
    start = len(state.events)
    after = request.query.get("starting_after")
    if after is not None:
        if after not in state.event_index:
            return keyed.missing("event", after)
        start = state.event_index[after]
    data: list[dict[str, Any]] = []
    has_more = False
    for position in range(start - 1, -1, -1):  # newest first
        event = state.events[position]
        if kind is not None and event["type"] != kind and not (
                group is not None and event["type"].startswith(group)):
            continue
        if len(data) == limit:
            has_more = True
            break
        data.append(event)
    return 200, {"object": "list", "url": "/v1/events", "data": data, "has_more": has_more}


# --- simulator controls (not Stripe's; the faults, requests, reset and clock are keyed's) --------


async def ledger(request: web.Request) -> web.Response:
    """The ground truth: every charge, intent and refund, with the key that made it."""
    state = request.app[SIM].state
    charges = [{**entry.charge, "idempotency_key": entry.idempotency_key,
                "request_id": entry.request_id} for entry in state.charges.values()]
    intents = [{**entry.intent, "idempotency_key": entry.idempotency_key,
                "request_id": entry.request_id} for entry in state.intents.values()]
    refunds = [{**entry.refund, "idempotency_key": entry.idempotency_key,
                "request_id": entry.request_id} for entry in state.refunds.values()]
    return web.json_response({"charges": charges, "payment_intents": intents,
                              "refunds": refunds})


async def set_search(request: web.Request) -> web.Response:
    """`{"lag_s": N}`: how long after it is made a record shows in search."""
    try:
        lag_s = float((await request.json())["lag_s"])
    except (ValueError, KeyError, TypeError):
        return keyed.bad_control('expected {"lag_s": N}')
    if not 0.0 <= lag_s <= SEARCH_LAG_S_MAX:
        return keyed.bad_control(f"lag_s must be 0 to {SEARCH_LAG_S_MAX:g}")
    request.app[SIM].state.search_lag_s = lag_s
    return web.json_response({"lag_s": lag_s})


async def get_search(request: web.Request) -> web.Response:
    return web.json_response({"lag_s": request.app[SIM].state.search_lag_s})


async def set_webhooks(request: web.Request) -> web.Response:
    try:
        update = WebhookSettings.model_validate_json(await request.read())
    except ValidationError as exc:
        return keyed.bad_control(str(exc))
    webhooks = request.app[SIM].state.webhooks
    webhooks.configure(update)
    return web.json_response(webhooks.describe(attempts=False))


async def list_webhooks(request: web.Request) -> web.Response:
    return web.json_response(request.app[SIM].state.webhooks.describe())


# --- app and process -----------------------------------------------------------------------------


def make_app(key_ttl_s: float = keyed.KEY_TTL_S_DEFAULT, *, webhook_url: str | None = None,
             webhook_secret: str = WEBHOOK_SECRET_DEFAULT,
             api_key: str | None = None) -> web.Application:
    """The simulator's app. `api_key`: when given, every `/v1/` request must carry it."""
    sender = None if webhook_url is None else WebhookSender(webhook_url, webhook_secret)
    app = keyed.new_app(PAYSIM, Simulator(
        SimState(key_ttl_s=key_ttl_s, webhooks=WebhookDeliveries(sender)), sender))
    if api_key is not None:
        app.middlewares.append(_authenticate(api_key))
    app.router.add_post("/v1/charges", keyed.write_handler(PAYSIM, CREATE_CHARGE))
    # Each search before its {id}: the first route that matches wins.
    app.router.add_get("/v1/charges/search", keyed.list_handler(_search_charges))
    app.router.add_get("/v1/charges/{charge_id}", get_charge)
    app.router.add_post("/v1/payment_intents", keyed.write_handler(PAYSIM, CREATE_INTENT))
    app.router.add_get("/v1/payment_intents/search", keyed.list_handler(_search_intents))
    app.router.add_get("/v1/payment_intents/{intent}", get_intent)
    app.router.add_post("/v1/payment_intents/{intent}/confirm",
                        keyed.write_handler(PAYSIM, CONFIRM_INTENT))
    app.router.add_post("/v1/refunds", keyed.write_handler(PAYSIM, CREATE_REFUND))
    app.router.add_get("/v1/refunds", keyed.list_handler(_list_refunds))
    app.router.add_get("/v1/refunds/{refund}", get_refund)
    app.router.add_get("/v1/events", keyed.list_handler(_list_events))
    app.router.add_get("/_sim/ledger", ledger)
    app.router.add_post("/_sim/webhooks", set_webhooks)
    app.router.add_get("/_sim/webhooks", list_webhooks)
    app.router.add_post("/_sim/search", set_search)
    app.router.add_get("/_sim/search", get_search)
    app.on_shutdown.append(_cancel_webhooks)
    app.on_cleanup.append(_close_webhook_sender)
    return app


def _authenticate(api_key: str) -> Any:
    """A middleware: a `/v1/` request without `Authorization: Bearer <api_key>` is a 401,
    before arrival numbering, fault rules and the idempotency layer (as at Stripe)."""

    @web.middleware
    async def authenticate(request: web.Request,
                           handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                           ) -> web.StreamResponse:
        if request.path.startswith("/v1/"):
            given = request.headers.get("Authorization", "")
            if not secrets.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                token = given.removeprefix("Bearer ").strip()
                # Like Stripe, never echo a key whole: its last four characters at most.
                message = (f"Invalid API Key provided: {token[:8]}****{token[-4:]}"
                           if len(token) > 12 else
                           "You did not provide a valid API key. Provide it as "
                           "'Authorization: Bearer sk_test_...'.")
                return _reply(*_error(401, "invalid_request_error", message), _new_id("req"))
        return await handler(request)

    return authenticate


async def _cancel_webhooks(app: web.Application) -> None:
    await asyncio.gather(*app[SIM].state.webhooks.cancel(), return_exceptions=True)


async def _close_webhook_sender(app: web.Application) -> None:
    sender = app[SIM].webhook_sender
    if sender is not None:
        await sender.close()


async def start_in_process(port: int = 0, key_ttl_s: float = keyed.KEY_TTL_S_DEFAULT, *,
                           host: str = keyed.HOST, webhook_url: str | None = None,
                           webhook_secret: str = WEBHOOK_SECRET_DEFAULT,
                           api_key: str | None = None,
                           ) -> tuple[str, Callable[[], Awaitable[None]]]:
    """Serve the simulator on this event loop: (base URL, a coroutine function that stops it)."""
    url, runner = await keyed.start(make_app(key_ttl_s, webhook_url=webhook_url,
                                             webhook_secret=webhook_secret, api_key=api_key),
                                    host, port)
    return url, runner.cleanup


def main(argv: Sequence[str] | None = None) -> int:
    parser = keyed.arg_parser("python -m halfway.simulators.payments",
                        "A Stripe-like payment provider simulator.")
    parser.add_argument("--webhook-url", default=None,
                        help="POST a signed event here for every charge made (none: no webhooks)")
    parser.add_argument("--webhook-secret", default=WEBHOOK_SECRET_DEFAULT,
                        help="the endpoint secret webhooks are signed with")
    parser.add_argument("--api-key", default=None,
                        help="require this API key (Authorization: Bearer KEY) on /v1/ "
                             "requests; none: keys are accepted and not checked")
    args = keyed.parse_args(parser, argv)
    if not args.webhook_secret:
        parser.error("--webhook-secret must not be empty")
    if args.api_key is not None and not args.api_key:
        parser.error("--api-key must not be empty")
    return asyncio.run(keyed.serve(lambda: make_app(args.key_ttl_s,
                                                    webhook_url=args.webhook_url,
                                                    webhook_secret=args.webhook_secret,
                                                    api_key=args.api_key),
                                   args.host, args.port))


if __name__ == "__main__":
    sys.exit(main())
