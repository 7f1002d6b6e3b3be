"""paysim: a Stripe-like payment provider (API v1 charges) for demos and tests.

Run it as its own process: `python -m halfway.simulators.payments --port 0 --key-ttl-s 86400`
prints exactly one line, `listening on http://127.0.0.1:PORT`, once it accepts connections.

Theory of operation. `POST /v1/charges` passes through Stripe's layers in Stripe's order
(research/providers.md §2.1), and each layer says whether its answer is saved under the key:

1. Arrival: the request is numbered (from 1 since the fault rules were last set) and the first
   fault rule that matches it is consumed, once, here.
2. Rate limiter: a 429 fault answers now. Not saved: it runs before the idempotency layer.
3. Request checks: a bad `Idempotency-Key` or body is a 400; a full store is a 503. Not saved.
4. Idempotency layer, for a key younger than `key_ttl_s` (an older one is forgotten, so its
   reuse is a new request): other parameters → 400 `idempotency_error`; the first request still
   executing → 409 `idempotency_key_in_use`; otherwise the saved status and body are replayed
   with `Idempotent-Replayed: true`. None of these answers is saved.
5. Validation: invalid parameters → 400 `invalid_request_error`. Not saved (Stripe saves only
   once the endpoint began executing), so the key stays free for a corrected request.
6. Execution: the key is reserved as processing; a fault's delay runs, then a 5xx before commit,
   or a charge (a declined one is recorded as `failed` and answered 402), then a 5xx after
   commit. Whatever the answer, 500s included, it is saved under the key. Execution is shielded
   from the client hanging up: a charge whose client gave up still lands, like at Stripe.
7. Reply: a `lose_reply` fault closes the connection instead of answering (the result is
   already committed and saved, so a retry with the key replays it).

A fault action's delay, 5xx and decline shape an execution; 429 and `lose_reply` apply to any
create request the rule matched (a replay's reply can be lost too).

Time: keys expire on the simulator's clock, wall time plus an offset that `POST /_sim/clock`
moves forward, so tests can expire keys without waiting. Delays are real time.

Bounds: at most `STORE_ENTRIES_MAX` keys, charges and logged create requests, and
`IN_FLIGHT_MAX` executions at once; past them a create request is refused with 503 (unsaved),
never silently dropped, because the ledger is the ground truth tests compare with.

Webhooks (with `--webhook-url`): every committed charge, succeeded or failed, is delivered as a
`charge.succeeded` or `charge.failed` event (the charge as `data.object`, our key in
`request.idempotency_key`), POSTed with a `Stripe-Signature` header signed with
`--webhook-secret`. Like Stripe's: at least once, retried with backoff on a non-2xx answer or a
connection error (a bounded number of attempts, Stripe's days compressed into about a minute),
re-signed at every attempt with a fresh timestamp, and ended by a 2xx or by a 409 (the receiver
says it already accepted this exact signature). `POST /_sim/webhooks` makes it worse on purpose:
a second delivery of some events (`duplicate_p`, a provider retry), a random delay before each
delivery (`delay_s_max`, so events arrive out of order), and `paused` (deliveries wait until
unpaused, so a test decides when a webhook arrives). `GET /_sim/webhooks` lists every attempt.
A reset cancels the deliveries not yet made and restores the defaults.

Not modelled: API keys (401), search indexing lag, list paging cursors, thin (v2) events.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import re
import secrets
import signal
import socket
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from halfway.webhooks.signature import sign

HOST = "127.0.0.1"
KEY_TTL_S_DEFAULT = 86_400.0  # Stripe API v1 keeps keys at least 24 h
KEY_CHARS_MAX = 255  # Stripe's limit on an Idempotency-Key
STORE_ENTRIES_MAX = 100_000  # keys, charges and logged create requests, each
IN_FLIGHT_MAX = 10_000  # executions at once
RULES_MAX = 100
DELAY_S_MAX = 600.0
CLOCK_ADVANCE_S_MAX = 10 * 365 * 86_400.0
BODY_BYTES_MAX = 64 * 1024
LIST_LIMIT_DEFAULT = 10  # Stripe's list and search defaults and maximum
LIST_LIMIT_MAX = 100
METADATA_KEYS_MAX = 50  # Stripe's metadata limits
METADATA_KEY_CHARS_MAX = 40
METADATA_VALUE_CHARS_MAX = 500
AMOUNT_MAX = 99_999_999  # Stripe's largest amount, in the currency's minor unit
DECLINED_CUSTOMER = "cus_declined"  # charging this customer is always declined
SHUTDOWN_TIMEOUT_S = 2.0  # a stopping simulator does not wait for slow (delayed) requests
BACKLOG = 1024  # hundreds of clients connect at once in tests; the default 128 would drop SYNs
API_VERSION = "2024-06-20"
CHARGE_PARAMS = frozenset({"amount", "currency", "customer", "description", "metadata"})
WEBHOOK_SECRET_DEFAULT = "whsec_halfway_dev"
WEBHOOK_ATTEMPTS_MAX = 12  # per delivery; then it is given up (and listed as such)
WEBHOOK_BACKOFF_S = (0.2, 0.5, 1.0, 2.0, 4.0)  # after attempt 1, 2, ...; then the last, again
WEBHOOK_TIMEOUT_S = 10.0  # one POST, connect to last byte
WEBHOOK_DELIVERIES_MAX = 2 * STORE_ENTRIES_MAX  # each charge gives at most two deliveries
WEBHOOK_LOG_MAX = STORE_ENTRIES_MAX  # attempts listed; the oldest go first
WEBHOOK_ANSWER_BYTES_MAX = 500  # of each answer's body, kept in the attempt list

_NESTED_PARAM = re.compile(r"([A-Za-z_]+)\[([^\[\]]+)\]")
_AMOUNT = re.compile(r"[0-9]+")
_CURRENCY = re.compile(r"[A-Za-z]{3}")
# The one Search API query we support: metadata['name']:'value' (either quote; \ escapes).
_METADATA_QUERY = re.compile(
    r"""\s* metadata \[ (['"]) (?P<name>[^'"\\]+) \1 \] \s* : \s*
        (?P<q>['"]) (?P<value> (?: \\. | (?!(?P=q)) [^\\] )* ) (?P=q) \s*""",
    re.VERBOSE,
)

# --- fault rules (the JSON body of POST /_sim/faults) -------------------------------------------


class FaultMatch(BaseModel):
    """Which create requests a rule hits. Every condition given must hold; none means all."""

    model_config = ConfigDict(extra="forbid")

    nth: int | None = Field(default=None, ge=1)  # the n-th create request since rules were set
    key: str | None = None
    key_prefix: str | None = None
    every: int | None = Field(default=None, ge=1)  # requests n, 2n, 3n, ...
    probability: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None  # seeds this rule's own generator, so runs repeat

    def hits(self, number: int, key: str | None, rng: random.Random) -> bool:
        if self.nth is not None and number != self.nth:
            return False
        if self.every is not None and number % self.every != 0:
            return False
        if self.key is not None and key != self.key:
            return False
        if self.key_prefix is not None and not (key or "").startswith(self.key_prefix):
            return False
        # Drawn last, and only for requests that pass the rest, so a seed gives the same hits
        # for the same request sequence.
        return self.probability is None or rng.random() < self.probability


class FaultAction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    delay_s: float = Field(default=0.0, ge=0.0, le=DELAY_S_MAX)
    lose_reply: bool = False
    status: int | None = None  # 429, or a 5xx with `when`
    when: Literal["before_commit", "after_commit"] | None = None
    decline: bool = False

    @model_validator(mode="after")
    def _consistent(self) -> FaultAction:
        if self.status is not None and not (self.status == 429 or 500 <= self.status < 600):
            raise ValueError("status must be 429 or a 5xx")
        if self.status is not None and self.status >= 500 and self.when is None:
            raise ValueError("a 5xx needs `when`: before_commit or after_commit")
        if self.when is not None and (self.status is None or self.status < 500):
            raise ValueError("`when` goes with a 5xx status only")
        if self.status is not None and (self.decline or self.lose_reply):
            raise ValueError("a status cannot combine with decline or lose_reply")
        return self


class FaultRule(BaseModel):
    model_config = ConfigDict(extra="forbid")

    match: FaultMatch = Field(default_factory=FaultMatch)
    times: int | None = Field(default=None, ge=1)  # None: for as long as the rules stand
    action: FaultAction


class FaultRules(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rules: list[FaultRule] = Field(max_length=RULES_MAX)


@dataclass(slots=True)
class _ArmedRule:
    rule: FaultRule
    times_left: int | None
    rng: random.Random


NO_FAULT = FaultAction()


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
        """Schedule the deliveries of a committed charge's event (called as it commits)."""
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
        self.attempts.append({
            "at": time.time(), "event_id": event["id"], "type": event["type"],
            "charge_id": event["data"]["object"]["id"],
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
class _KeyEntry:
    path: str
    fingerprint: str
    created_at_s: float
    status: int | None = None  # None while the first request is still executing
    body: dict[str, Any] | None = None


@dataclass(slots=True)
class _Ledgered:
    charge: dict[str, Any]  # the public charge object; never changed once made
    idempotency_key: str | None
    request_id: str


@dataclass
class SimState:
    """Everything the simulator knows. `POST /_sim/reset` swaps in a new one, so a request still
    executing from before the reset writes into the old state, never into the new ledger."""

    key_ttl_s: float
    clock_offset_s: float = 0.0
    # In creation order: the clock only moves forward, so expired keys are always at the front.
    keys: OrderedDict[str, _KeyEntry] = field(default_factory=OrderedDict)
    charges: dict[str, _Ledgered] = field(default_factory=dict)  # insertion order = ledger order
    charge_ids_by_metadata: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)  # one per charge, oldest first
    requests: list[dict[str, Any]] = field(default_factory=list)
    rules: list[_ArmedRule] = field(default_factory=list)
    creates_since_rules: int = 0
    in_flight: int = 0
    executions: set[asyncio.Task[tuple[int, dict[str, Any]]]] = field(default_factory=set)
    webhooks: WebhookDeliveries = field(default_factory=lambda: WebhookDeliveries(None))

    def now_s(self) -> float:
        return time.time() + self.clock_offset_s

    def set_rules(self, rules: Sequence[FaultRule]) -> None:
        self.rules = [_ArmedRule(r, r.times, random.Random(r.match.seed)) for r in rules]
        self.creates_since_rules = 0

    def arrive(self, key: str | None) -> tuple[int, FaultAction]:
        """Number a create request and consume the first rule that matches it."""
        self.creates_since_rules += 1
        number = self.creates_since_rules
        for armed in self.rules:
            if armed.times_left == 0:
                continue
            if armed.rule.match.hits(number, key, armed.rng):
                if armed.times_left is not None:
                    armed.times_left -= 1
                return number, armed.rule.action
        return number, NO_FAULT

    def forget_expired_keys(self) -> None:
        now_s = self.now_s()
        while self.keys:
            key, entry = next(iter(self.keys.items()))
            if now_s - entry.created_at_s < self.key_ttl_s:
                return
            del self.keys[key]

    def commit_charge(self, charge: dict[str, Any], key: str | None, request_id: str) -> None:
        assert charge["id"] not in self.charges, "charge ids are unique"
        self.charges[charge["id"]] = _Ledgered(charge, key, request_id)
        for name, value in charge["metadata"].items():
            self.charge_ids_by_metadata.setdefault((name, value), []).append(charge["id"])
        self.events.append({
            "id": _new_id("evt"),
            "object": "event",
            "api_version": API_VERSION,
            "type": "charge.succeeded" if charge["status"] == "succeeded" else "charge.failed",
            "data": {"object": charge},
            "request": {"id": request_id, "idempotency_key": key},
            "created": charge["created"],
            "livemode": False,
            "pending_webhooks": 0,
        })
        self.webhooks.send(self.events[-1])


@dataclass
class Simulator:
    """The app's handle on its state; `state` is replaced on reset (an aiohttp app is frozen)."""

    state: SimState
    webhook_sender: WebhookSender | None = None

    def new_state(self, key_ttl_s: float) -> SimState:
        return SimState(key_ttl_s=key_ttl_s, webhooks=WebhookDeliveries(self.webhook_sender))


SIM = web.AppKey("sim", Simulator)


# --- helpers -------------------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _error(status: int, kind: str, message: str, *, code: str | None = None,
           param: str | None = None, **extra: Any) -> tuple[int, dict[str, Any]]:
    """A Stripe error body: stripe-python maps it by `type` and status (providers.md §2.3)."""
    error: dict[str, Any] = {"type": kind, "message": message}
    if code is not None:
        error["code"] = code
    if param is not None:
        error["param"] = param
    error.update(extra)
    return status, {"error": error}


def _reply(status: int, body: Mapping[str, Any], request_id: str, *, key: str | None = None,
           replayed: bool = False) -> web.Response:
    headers = {"Request-Id": request_id}
    if key is not None:
        headers["Idempotency-Key"] = key
    if replayed:
        headers["Idempotent-Replayed"] = "true"
    return web.json_response(body, status=status, headers=headers)


class _BadBody(Exception):
    """The body cannot be read as parameters (answered 400, unsaved)."""


def _scalar(value: Any) -> str:
    """A JSON scalar as the string a form body would carry: Stripe sees strings either way."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float | str):
        return str(value)
    raise _BadBody(f"unsupported value {value!r}: only strings, numbers and one nested object")


async def _read_params(request: web.Request) -> dict[str, Any]:
    """Parameters from a form body (like Stripe, with `metadata[name]=value`) or a JSON object."""
    params: dict[str, Any] = {}
    if request.content_type == "application/json":
        try:
            raw = await request.json()
        except ValueError as exc:
            raise _BadBody(f"invalid JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise _BadBody("the JSON body must be an object")
        for name, value in raw.items():
            if isinstance(value, dict):
                params[name] = {str(k): _scalar(v) for k, v in value.items()}
            else:
                params[name] = _scalar(value)
        return params
    if request.content_type not in ("application/x-www-form-urlencoded", "multipart/form-data"):
        if await request.read():
            raise _BadBody(f"unsupported content type {request.content_type}")
        return params
    for name, value in (await request.post()).items():
        if not isinstance(value, str):
            raise _BadBody(f"parameter {name} is a file")
        nested = _NESTED_PARAM.fullmatch(name)
        if nested is None:
            params[name] = value
            continue
        outer, inner = nested.groups()
        sub = params.setdefault(outer, {})
        if not isinstance(sub, dict):
            raise _BadBody(f"parameter {outer} is both a value and an object")
        sub[inner] = value
    return params


def _fingerprint(method: str, path: str, params: Mapping[str, Any]) -> str:
    canonical = json.dumps([method, path, params], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def _invalid(params: Mapping[str, Any]) -> tuple[int, dict[str, Any]] | None:
    """The 400 Stripe would answer for these charge parameters, or None when they are valid."""
    for name in params:
        if name not in CHARGE_PARAMS:
            return _error(400, "invalid_request_error", f"Received unknown parameter: {name}",
                          code="parameter_unknown", param=name)
    for name in ("amount", "currency", "customer"):
        if not params.get(name):
            return _error(400, "invalid_request_error", f"Missing required param: {name}.",
                          code="parameter_missing", param=name)
    amount = params["amount"]
    if not isinstance(amount, str) or not _AMOUNT.fullmatch(amount):
        return _error(400, "invalid_request_error", f"Invalid integer: {amount}",
                      code="parameter_invalid_integer", param="amount")
    if int(amount) < 1:
        return _error(400, "invalid_request_error", "Amount must be at least 1 cent.",
                      code="amount_too_small", param="amount")
    if int(amount) > AMOUNT_MAX:
        return _error(400, "invalid_request_error", f"Amount must be no more than {AMOUNT_MAX}.",
                      code="amount_too_large", param="amount")
    currency = params["currency"]
    if not isinstance(currency, str) or not _CURRENCY.fullmatch(currency):
        return _error(400, "invalid_request_error", f"Invalid currency: {currency}.",
                      param="currency")
    for name in ("customer", "description"):
        if name in params and not isinstance(params[name], str):
            return _error(400, "invalid_request_error", f"Invalid string: {params[name]}",
                          param=name)
    metadata = params.get("metadata", {})
    if not isinstance(metadata, dict):
        return _error(400, "invalid_request_error", "Invalid object", param="metadata")
    if len(metadata) > METADATA_KEYS_MAX:
        return _error(400, "invalid_request_error",
                      f"Metadata can have at most {METADATA_KEYS_MAX} keys.", param="metadata")
    for name, value in metadata.items():
        if len(name) > METADATA_KEY_CHARS_MAX or len(value) > METADATA_VALUE_CHARS_MAX:
            return _error(400, "invalid_request_error",
                          f"Metadata keys are at most {METADATA_KEY_CHARS_MAX} characters and "
                          f"values at most {METADATA_VALUE_CHARS_MAX}.",
                          param=f"metadata[{name}]")
    return None


def _new_charge(params: Mapping[str, Any], *, declined: bool, created: int) -> dict[str, Any]:
    amount = int(params["amount"])
    return {
        "id": _new_id("ch"),
        "object": "charge",
        "amount": amount,
        "amount_captured": 0 if declined else amount,
        "amount_refunded": 0,
        "captured": not declined,
        "currency": params["currency"].lower(),
        "customer": params["customer"],
        "description": params.get("description"),
        "status": "failed" if declined else "succeeded",
        "paid": not declined,
        "failure_code": "card_declined" if declined else None,
        "failure_message": "Your card was declined." if declined else None,
        "metadata": dict(params.get("metadata", {})),
        "created": created,
        "livemode": False,
    }


def _limit(request: web.Request) -> int | tuple[int, dict[str, Any]]:
    raw = request.query.get("limit", str(LIST_LIMIT_DEFAULT))
    if not raw.isdigit() or not 1 <= int(raw) <= LIST_LIMIT_MAX:
        return _error(400, "invalid_request_error",
                      f"limit must be an integer from 1 to {LIST_LIMIT_MAX}", param="limit")
    return int(raw)


# --- the charge endpoint -------------------------------------------------------------------------


async def create_charge(request: web.Request) -> web.StreamResponse:
    state = request.app[SIM].state  # held for the whole request: a reset swaps in a new one
    request_id = _new_id("req")
    key = request.headers.get("Idempotency-Key")
    if key is not None and len(key) >= 2 and key[0] == key[-1] == '"':
        key = key[1:-1]  # the IETF draft sends an sf-string; Stripe clients send a bare token
    if len(state.requests) >= STORE_ENTRIES_MAX:
        status, body = _error(503, "api_error", "simulator request log is full; reset it")
        return _reply(status, body, request_id)

    _, action = state.arrive(key)
    logged: dict[str, Any] = {"at": state.now_s(), "request_id": request_id,
                              "idempotency_key": key, "params": None, "status": None,
                              "replayed": False, "reply_lost": False,
                              "fault": action.model_dump(exclude_defaults=True) or None}
    state.requests.append(logged)

    status, body, replayed = await _answer(request, state, key, action, request_id, logged)
    logged["status"], logged["replayed"] = status, replayed
    if action.lose_reply and request.transport is not None:
        # Hang up without a byte of response. aiohttp then fails to write the response below
        # and drops it as a premature disconnection; the client sees the server disconnect.
        logged["reply_lost"] = True
        request.transport.close()
    return _reply(status, body, request_id, key=key, replayed=replayed)


async def _answer(request: web.Request, state: SimState, key: str | None, action: FaultAction,
                  request_id: str, logged: dict[str, Any]) -> tuple[int, dict[str, Any], bool]:
    """Layers 2 to 6 of the theory of operation: (status, body, replayed)."""
    if action.status == 429:
        await asyncio.sleep(action.delay_s)
        return (*_error(429, "invalid_request_error", "Too many requests hit the API too "
                        "quickly. We recommend an exponential backoff of your requests.",
                        code="rate_limit"), False)
    if key is not None and not 1 <= len(key) <= KEY_CHARS_MAX:
        return (*_error(400, "invalid_request_error", "Idempotency keys are 1 to "
                        f"{KEY_CHARS_MAX} characters long.", param="Idempotency-Key"), False)
    try:
        params = await _read_params(request)
    except _BadBody as exc:
        return (*_error(400, "invalid_request_error", str(exc)), False)
    logged["params"] = params
    # From here to the reservation below nothing awaits, so no other request can slip between
    # the key check and the reservation.
    path = request.path
    fingerprint = _fingerprint(request.method, path, params)
    entry: _KeyEntry | None = None
    if key is not None:
        state.forget_expired_keys()
        known = state.keys.get(key)
        if known is not None:
            return _reused(known, key, path, fingerprint)
        if len(state.keys) >= STORE_ENTRIES_MAX:
            return (*_error(503, "api_error", f"simulator key store is full "
                            f"({STORE_ENTRIES_MAX} keys); retry later or reset"), False)
    invalid = _invalid(params)
    if invalid is not None:
        return (*invalid, False)
    if len(state.charges) + state.in_flight >= STORE_ENTRIES_MAX or \
            state.in_flight >= IN_FLIGHT_MAX:
        return (*_error(503, "api_error", "simulator ledger or executions are full; "
                        "retry later or reset"), False)
    if key is not None:
        entry = _KeyEntry(path, fingerprint, state.now_s())
        state.keys[key] = entry
    state.in_flight += 1
    execution = asyncio.create_task(_execute(state, params, key, entry, action, request_id))
    state.executions.add(execution)  # a strong reference: the loop keeps only weak ones
    execution.add_done_callback(lambda done: _executed(state, key, entry, done))
    # Shielded: a client that hangs up or times out does not stop a charge that began.
    status, body = await asyncio.shield(execution)
    return status, body, False


def _reused(known: _KeyEntry, key: str, path: str,
            fingerprint: str) -> tuple[int, dict[str, Any], bool]:
    """The idempotency layer's answer to a key it still remembers: (status, body, replayed)."""
    if known.status is not None and (known.path, known.fingerprint) == (path, fingerprint):
        assert known.body is not None
        return known.status, known.body, True
    if known.path != path:
        status, body = _error(
            400, "idempotency_error", "Keys for idempotent requests can only be used for the "
            f"same endpoint they were first used for ('{path}' vs '{known.path}'). Try using a "
            f"key other than '{key}' if you meant to execute a different request.")
    elif known.fingerprint != fingerprint:
        status, body = _error(
            400, "idempotency_error", "Keys for idempotent requests can only be used with the "
            "same parameters they were first used with. Try using a key other than "
            f"'{key}' if you meant to execute a different request.")
    else:
        status, body = _error(
            409, "api_error", "There is currently another in-progress request using this "
            "Idempotency-Key. Please try again later.", code="idempotency_key_in_use")
    return status, body, False


async def _execute(state: SimState, params: Mapping[str, Any], key: str | None,
                   entry: _KeyEntry | None, action: FaultAction,
                   request_id: str) -> tuple[int, dict[str, Any]]:
    """Layer 6: run the charge and save its answer under the key, whatever it is."""
    await asyncio.sleep(action.delay_s)
    result = _charge(state, params, key, action, request_id)
    if entry is not None:
        entry.status, entry.body = result
    return result


def _executed(state: SimState, key: str | None, entry: _KeyEntry | None,
              execution: asyncio.Task[tuple[int, dict[str, Any]]]) -> None:
    """A done callback, so it runs even for an execution cancelled before it started."""
    state.in_flight -= 1
    state.executions.discard(execution)
    assert state.in_flight >= 0
    if entry is not None and entry.status is None and key is not None and \
            state.keys.get(key) is entry:
        # A bug or a shutdown ended it unsaved: free the key rather than answer 409 forever.
        del state.keys[key]


def _charge(state: SimState, params: Mapping[str, Any], key: str | None, action: FaultAction,
            request_id: str) -> tuple[int, dict[str, Any]]:
    if action.status is not None and action.when == "before_commit":
        return _error(action.status, "api_error", "An unexpected error occurred (injected "
                      "before commit: no charge was made).")
    declined = action.decline or params["customer"] == DECLINED_CUSTOMER
    charge = _new_charge(params, declined=declined, created=int(state.now_s()))
    state.commit_charge(charge, key, request_id)
    if declined:
        return _error(402, "card_error", "Your card was declined.", code="card_declined",
                      decline_code="generic_decline", charge=charge["id"])
    if action.status is not None:
        return _error(action.status, "api_error", "An unexpected error occurred (injected "
                      "after commit: the charge was made).")
    return 200, charge


# --- lookups -------------------------------------------------------------------------------------


async def get_charge(request: web.Request) -> web.Response:
    state = request.app[SIM].state
    charge_id = request.match_info["charge_id"]
    ledgered = state.charges.get(charge_id)
    if ledgered is None:
        status, body = _error(404, "invalid_request_error", f"No such charge: '{charge_id}'",
                              code="resource_missing", param="id")
        return _reply(status, body, _new_id("req"))
    return _reply(200, ledgered.charge, _new_id("req"))


async def search_charges(request: web.Request) -> web.Response:
    """The Search API, for the one query the harness needs: metadata['name']:'value'."""
    state = request.app[SIM].state
    request_id = _new_id("req")
    limit = _limit(request)
    if isinstance(limit, tuple):
        return _reply(*limit, request_id)
    query = _METADATA_QUERY.fullmatch(request.query.get("query", ""))
    if query is None:
        status, body = _error(400, "invalid_request_error", "This simulator supports only the "
                              "query metadata['name']:'value'.", param="query")
        return _reply(status, body, request_id)
    value = re.sub(r"\\(.)", r"\1", query["value"])
    ids = state.charge_ids_by_metadata.get((query["name"], value), [])
    newest_first = [state.charges[i].charge for i in reversed(ids)]
    return _reply(200, {"object": "search_result", "url": "/v1/charges/search",
                        "data": newest_first[:limit], "has_more": len(newest_first) > limit,
                        "next_page": None}, request_id)


async def list_events(request: web.Request) -> web.Response:
    state = request.app[SIM].state
    request_id = _new_id("req")
    limit = _limit(request)
    if isinstance(limit, tuple):
        return _reply(*limit, request_id)
    kind = request.query.get("type")
    data: list[dict[str, Any]] = []
    has_more = False
    for event in reversed(state.events):  # newest first, like Stripe
        if kind is not None and event["type"] != kind:
            continue
        if len(data) == limit:
            has_more = True
            break
        data.append(event)
    return _reply(200, {"object": "list", "url": "/v1/events", "data": data,
                        "has_more": has_more}, request_id)


# --- simulator controls (not Stripe's) -----------------------------------------------------------


async def set_faults(request: web.Request) -> web.Response:
    try:
        rules = FaultRules.model_validate_json(await request.read())
    except ValidationError as exc:
        return web.json_response({"error": {"type": "invalid_request_error",
                                            "message": str(exc)}}, status=400)
    request.app[SIM].state.set_rules(rules.rules)
    return web.json_response({"rules": len(rules.rules)})


async def clear_faults(request: web.Request) -> web.Response:
    request.app[SIM].state.set_rules([])
    return web.json_response({"rules": 0})


async def ledger(request: web.Request) -> web.Response:
    charges = [{**entry.charge, "idempotency_key": entry.idempotency_key,
                "request_id": entry.request_id}
               for entry in request.app[SIM].state.charges.values()]
    return web.json_response({"charges": charges})


async def requests_log(request: web.Request) -> web.Response:
    return web.json_response({"requests": request.app[SIM].state.requests})


async def reset(request: web.Request) -> web.Response:
    sim = request.app[SIM]
    old = sim.state
    sim.state = sim.new_state(old.key_ttl_s)
    old.webhooks.cancel()  # what was not delivered yet never will be: a test starts clean
    return web.json_response({"reset": True})


async def set_webhooks(request: web.Request) -> web.Response:
    try:
        update = WebhookSettings.model_validate_json(await request.read())
    except ValidationError as exc:
        return web.json_response({"error": {"type": "invalid_request_error",
                                            "message": str(exc)}}, status=400)
    webhooks = request.app[SIM].state.webhooks
    webhooks.configure(update)
    return web.json_response(webhooks.describe(attempts=False))


async def list_webhooks(request: web.Request) -> web.Response:
    return web.json_response(request.app[SIM].state.webhooks.describe())


async def advance_clock(request: web.Request) -> web.Response:
    """Move the simulator's clock forward (never back: key expiry relies on it)."""
    try:
        raw = await request.json()
        advance_s = float(raw["advance_s"])
    except (ValueError, KeyError, TypeError):
        return web.json_response({"error": {"type": "invalid_request_error",
                                            "message": 'expected {"advance_s": N}'}}, status=400)
    if not 0.0 <= advance_s <= CLOCK_ADVANCE_S_MAX:
        return web.json_response({"error": {"type": "invalid_request_error", "message":
                                            f"advance_s must be 0 to {CLOCK_ADVANCE_S_MAX:g}"}},
                                 status=400)
    state = request.app[SIM].state
    state.clock_offset_s += advance_s
    return web.json_response({"now": state.now_s(), "offset_s": state.clock_offset_s})


# --- app and process -----------------------------------------------------------------------------


def make_app(key_ttl_s: float = KEY_TTL_S_DEFAULT, *, webhook_url: str | None = None,
             webhook_secret: str = WEBHOOK_SECRET_DEFAULT) -> web.Application:
    if key_ttl_s <= 0:
        raise ValueError(f"key_ttl_s must be positive, got {key_ttl_s}")
    app = web.Application(client_max_size=BODY_BYTES_MAX)
    sender = None if webhook_url is None else WebhookSender(webhook_url, webhook_secret)
    app[SIM] = Simulator(SimState(key_ttl_s=key_ttl_s, webhooks=WebhookDeliveries(sender)),
                         sender)
    app.router.add_post("/v1/charges", create_charge)
    app.router.add_get("/v1/charges/search", search_charges)  # before {charge_id}: first wins
    app.router.add_get("/v1/charges/{charge_id}", get_charge)
    app.router.add_get("/v1/events", list_events)
    app.router.add_post("/_sim/faults", set_faults)
    app.router.add_delete("/_sim/faults", clear_faults)
    app.router.add_get("/_sim/ledger", ledger)
    app.router.add_get("/_sim/requests", requests_log)
    app.router.add_post("/_sim/reset", reset)
    app.router.add_post("/_sim/clock", advance_clock)
    app.router.add_post("/_sim/webhooks", set_webhooks)
    app.router.add_get("/_sim/webhooks", list_webhooks)
    app.on_shutdown.append(_cancel_executions)
    app.on_shutdown.append(_cancel_webhooks)
    app.on_cleanup.append(_close_webhook_sender)
    return app


async def _cancel_executions(app: web.Application) -> None:
    executions = list(app[SIM].state.executions)
    for execution in executions:
        execution.cancel()
    await asyncio.gather(*executions, return_exceptions=True)


async def _cancel_webhooks(app: web.Application) -> None:
    await asyncio.gather(*app[SIM].state.webhooks.cancel(), return_exceptions=True)


async def _close_webhook_sender(app: web.Application) -> None:
    sender = app[SIM].webhook_sender
    if sender is not None:
        await sender.close()


async def _start(host: str, port: int, key_ttl_s: float, webhook_url: str | None = None,
                 webhook_secret: str = WEBHOOK_SECRET_DEFAULT) -> tuple[str, web.AppRunner]:
    # Our own socket, so that with port 0 we can read back the port the kernel chose.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    runner = web.AppRunner(make_app(key_ttl_s, webhook_url=webhook_url,
                                    webhook_secret=webhook_secret), access_log=None,
                           shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    await web.SockSite(runner, sock, backlog=BACKLOG).start()
    return f"http://{host}:{sock.getsockname()[1]}", runner


async def start_in_process(port: int = 0, key_ttl_s: float = KEY_TTL_S_DEFAULT, *,
                           host: str = HOST, webhook_url: str | None = None,
                           webhook_secret: str = WEBHOOK_SECRET_DEFAULT,
                           ) -> tuple[str, Callable[[], Awaitable[None]]]:
    """Serve the simulator on this event loop: (base URL, a coroutine function that stops it)."""
    url, runner = await _start(host, port, key_ttl_s, webhook_url, webhook_secret)
    return url, runner.cleanup


async def _serve(host: str, port: int, key_ttl_s: float, webhook_url: str | None,
                 webhook_secret: str) -> None:
    url, runner = await _start(host, port, key_ttl_s, webhook_url, webhook_secret)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(f"listening on {url}", flush=True)  # the one line a parent process reads
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m halfway.simulators.payments",
                                     description="A Stripe-like payment provider simulator.")
    parser.add_argument("--host", default=HOST)
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--key-ttl-s", type=float, default=KEY_TTL_S_DEFAULT,
                        help="how long an idempotency key is remembered after its first request")
    parser.add_argument("--webhook-url", default=None,
                        help="POST a signed event here for every charge made (none: no webhooks)")
    parser.add_argument("--webhook-secret", default=WEBHOOK_SECRET_DEFAULT,
                        help="the endpoint secret webhooks are signed with")
    args = parser.parse_args(argv)
    if args.key_ttl_s <= 0:
        parser.error("--key-ttl-s must be positive")
    if not args.webhook_secret:
        parser.error("--webhook-secret must not be empty")
    asyncio.run(_serve(args.host, args.port, args.key_ttl_s, args.webhook_url,
                       args.webhook_secret))
    return 0


if __name__ == "__main__":
    sys.exit(main())
