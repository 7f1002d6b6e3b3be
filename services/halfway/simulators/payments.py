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

import asyncio
import json
import random
import re
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
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
class _Ledgered:
    charge: dict[str, Any]  # the public charge object; never changed once made
    idempotency_key: str | None
    request_id: str


@dataclass
class SimState(keyed.State):
    """Everything the simulator knows: the shared keys, rules and request log, and the charges.
    `POST /_sim/reset` swaps in a new one, so a request still executing from before the reset
    writes into the old state, never into the new ledger."""

    charges: dict[str, _Ledgered] = field(default_factory=dict)  # insertion order = ledger order
    charge_ids_by_metadata: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)  # one per charge, oldest first
    webhooks: WebhookDeliveries = field(default_factory=lambda: WebhookDeliveries(None))

    def record_count(self) -> int:
        return len(self.charges)

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


def _invalid(params: Mapping[str, Any]) -> Answer | None:
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


def _logged(request: web.Request, arrival: keyed.Arrival) -> dict[str, Any]:
    return {"idempotency_key": arrival.key}


PAYSIM = keyed.Provider(
    sim=SIM, rules=keyed.FaultRules, read_params=_read_params, log_fields=_logged,
    rate_limited=("Too many requests hit the API too quickly. We recommend an exponential "
                  "backoff of your requests."),
    records="ledger", not_done="no charge was made", done="the charge was made")
CREATE_CHARGE = keyed.Write("charges.create", lambda state, params, match: _invalid(params),
                            _charge)


# --- lookups -------------------------------------------------------------------------------------


async def get_charge(request: web.Request) -> web.Response:
    charge_id = request.match_info["charge_id"]
    ledgered = request.app[SIM].state.charges.get(charge_id)
    if ledgered is None:
        return _reply(*keyed.missing("charge", charge_id), _new_id("req"))
    return _reply(200, ledgered.charge, _new_id("req"))


def _search_charges(request: web.Request, limit: int) -> Answer:
    """The Search API, for the one query the harness needs: metadata['name']:'value'."""
    state = request.app[SIM].state
    query = _METADATA_QUERY.fullmatch(request.query.get("query", ""))
    if query is None:
        return _error(400, "invalid_request_error", "This simulator supports only the query "
                      "metadata['name']:'value'.", param="query")
    value = re.sub(r"\\(.)", r"\1", query["value"])
    ids = state.charge_ids_by_metadata.get((query["name"], value), [])
    newest_first = [state.charges[i].charge for i in reversed(ids)]
    return 200, {"object": "search_result", "url": "/v1/charges/search",
                 "data": newest_first[:limit], "has_more": len(newest_first) > limit,
                 "next_page": None}


def _list_events(request: web.Request, limit: int) -> Answer:
    kind = request.query.get("type")
    data: list[dict[str, Any]] = []
    has_more = False
    for event in reversed(request.app[SIM].state.events):  # newest first, like Stripe
        if kind is not None and event["type"] != kind:
            continue
        if len(data) == limit:
            has_more = True
            break
        data.append(event)
    return 200, {"object": "list", "url": "/v1/events", "data": data, "has_more": has_more}


# --- simulator controls (not Stripe's; the faults, requests, reset and clock are keyed's) --------


async def ledger(request: web.Request) -> web.Response:
    charges = [{**entry.charge, "idempotency_key": entry.idempotency_key,
                "request_id": entry.request_id}
               for entry in request.app[SIM].state.charges.values()]
    return web.json_response({"charges": charges})


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
             webhook_secret: str = WEBHOOK_SECRET_DEFAULT) -> web.Application:
    sender = None if webhook_url is None else WebhookSender(webhook_url, webhook_secret)
    app = keyed.new_app(PAYSIM, Simulator(
        SimState(key_ttl_s=key_ttl_s, webhooks=WebhookDeliveries(sender)), sender))
    app.router.add_post("/v1/charges", keyed.write_handler(PAYSIM, CREATE_CHARGE))
    # The search before {charge_id}: the first route that matches wins.
    app.router.add_get("/v1/charges/search", keyed.list_handler(_search_charges))
    app.router.add_get("/v1/charges/{charge_id}", get_charge)
    app.router.add_get("/v1/events", keyed.list_handler(_list_events))
    app.router.add_get("/_sim/ledger", ledger)
    app.router.add_post("/_sim/webhooks", set_webhooks)
    app.router.add_get("/_sim/webhooks", list_webhooks)
    app.on_shutdown.append(_cancel_webhooks)
    app.on_cleanup.append(_close_webhook_sender)
    return app


async def _cancel_webhooks(app: web.Application) -> None:
    await asyncio.gather(*app[SIM].state.webhooks.cancel(), return_exceptions=True)


async def _close_webhook_sender(app: web.Application) -> None:
    sender = app[SIM].webhook_sender
    if sender is not None:
        await sender.close()


async def start_in_process(port: int = 0, key_ttl_s: float = keyed.KEY_TTL_S_DEFAULT, *,
                           host: str = keyed.HOST, webhook_url: str | None = None,
                           webhook_secret: str = WEBHOOK_SECRET_DEFAULT,
                           ) -> tuple[str, Callable[[], Awaitable[None]]]:
    """Serve the simulator on this event loop: (base URL, a coroutine function that stops it)."""
    url, runner = await keyed.start(make_app(key_ttl_s, webhook_url=webhook_url,
                                       webhook_secret=webhook_secret), host, port)
    return url, runner.cleanup


def main(argv: Sequence[str] | None = None) -> int:
    parser = keyed.arg_parser("python -m halfway.simulators.payments",
                        "A Stripe-like payment provider simulator.")
    parser.add_argument("--webhook-url", default=None,
                        help="POST a signed event here for every charge made (none: no webhooks)")
    parser.add_argument("--webhook-secret", default=WEBHOOK_SECRET_DEFAULT,
                        help="the endpoint secret webhooks are signed with")
    args = keyed.parse_args(parser, argv)
    if not args.webhook_secret:
        parser.error("--webhook-secret must not be empty")
    asyncio.run(keyed.serve(lambda: make_app(args.key_ttl_s, webhook_url=args.webhook_url,
                                       webhook_secret=args.webhook_secret),
                      args.host, args.port))
    return 0


if __name__ == "__main__":
    sys.exit(main())
