"""What the keyed provider simulators share (paysim, tripsim): not a simulator of its own.

Both model Stripe's write path, and this module is that path, layers 1 to 7 of paysim's theory
of operation (`halfway.simulators.payments`): a write is numbered and consumes the first fault
rule it hits; a 429 fault answers at once; a bad `Idempotency-Key` or body is a 400 and a full
store a 503; a key younger than the key lifetime answers a reuse with other parameters (or on
another endpoint) with 400 `idempotency_error`, a reuse while the first request executes with
409 `idempotency_key_in_use`, and otherwise replays the saved answer with
`Idempotent-Replayed: true`; the provider validates; then the key is reserved and the
execution (a fault's delay, a 5xx before commit, the provider's act, a 5xx after a 2xx) runs
shielded from the client hanging up, its answer saved under the key whatever it is; a
`lose_reply` fault closes the connection instead of answering. Nothing before execution is
saved under the key.

A simulator gives the path what differs (a `Provider`: where its state is, how it reads a body,
what its request log adds, its words in the shared answers) and one `Write` per endpoint (its
validation and its act). Also here: the fault rules, the key store on the simulator's clock
(wall time plus an offset that `POST /_sim/clock` moves forward), the error and reply helpers,
the controls both serve (`/_sim/faults`, `/_sim/requests`, `/_sim/reset`, `/_sim/clock`), and
starting and serving the process.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import secrets
import signal
import sys
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from halfway.listening import CannotListen, authority, bound_socket

HOST = "127.0.0.1"
KEY_TTL_S_DEFAULT = 86_400.0  # Stripe API v1 keeps keys at least 24 h (Resend: 24 h)
KEY_CHARS_MAX = 255  # Stripe's limit on an Idempotency-Key
STORE_ENTRIES_MAX = 100_000  # keys, records and logged writes, each
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
SHUTDOWN_TIMEOUT_S = 2.0  # a stopping simulator does not wait for slow (delayed) requests
BACKLOG = 1024  # hundreds of clients connect at once in tests; the default 128 would drop SYNs

Answer = tuple[int, dict[str, Any]]  # a status and a JSON body


# --- fault rules (the JSON body of POST /_sim/faults) --------------------------------------------


@dataclass(frozen=True, slots=True)
class Arrival:
    """A write as the fault rules see it: numbered from 1 since the rules were last set."""

    endpoint: str
    number: int  # among all writes
    endpoint_number: int  # among this endpoint's writes
    key: str | None


class FaultMatch(BaseModel):
    """Which writes a rule hits. Every condition given must hold; none means all."""

    model_config = ConfigDict(extra="forbid")

    nth: int | None = Field(default=None, ge=1)  # the n-th write since rules were set
    key: str | None = None
    key_prefix: str | None = None
    every: int | None = Field(default=None, ge=1)  # writes n, 2n, 3n, ...
    probability: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = None  # seeds this rule's own generator, so runs repeat

    def hits(self, arrival: Arrival, rng: random.Random) -> bool:
        return self.hits_number(arrival.number, arrival.key, rng)

    def hits_number(self, number: int, key: str | None, rng: random.Random) -> bool:
        if self.nth is not None and number != self.nth:
            return False
        if self.every is not None and number % self.every != 0:
            return False
        if self.key is not None and key != self.key:
            return False
        if self.key_prefix is not None and not (key or "").startswith(self.key_prefix):
            return False
        # Drawn last, and only for writes that pass the rest, so a seed gives the same hits
        # for the same write sequence.
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


# --- state ---------------------------------------------------------------------------------------


@dataclass(slots=True)
class KeyEntry:
    path: str
    fingerprint: str
    created_at_s: float
    status: int | None = None  # None while the first request is still executing
    body: dict[str, Any] | None = None


@dataclass
class State:
    """What every simulator's state holds; a simulator adds its records. `POST /_sim/reset`
    swaps in a new one, so a request still executing from before the reset writes into the old
    state, never into the new ledger."""

    key_ttl_s: float
    clock_offset_s: float = 0.0
    # In creation order: the clock only moves forward, so expired keys are always at the front.
    keys: OrderedDict[str, KeyEntry] = field(default_factory=OrderedDict)
    requests: list[dict[str, Any]] = field(default_factory=list)
    rules: list[_ArmedRule] = field(default_factory=list)
    writes_since_rules: int = 0
    writes_by_endpoint: dict[str, int] = field(default_factory=dict)
    in_flight: int = 0
    executions: set[asyncio.Task[Answer]] = field(default_factory=set)

    def now_s(self) -> float:
        return time.time() + self.clock_offset_s

    def record_count(self) -> int:
        """How many records the simulator keeps: with `in_flight`, bounded by the store."""
        raise NotImplementedError

    def set_rules(self, rules: Sequence[FaultRule]) -> None:
        self.rules = [_ArmedRule(r, r.times, random.Random(r.match.seed)) for r in rules]
        self.writes_since_rules = 0
        self.writes_by_endpoint = {}

    def arrive(self, endpoint: str, key: str | None) -> tuple[Arrival, FaultAction]:
        """Number a write (overall, and per endpoint) and consume the first rule it hits."""
        self.writes_since_rules += 1
        endpoint_number = self.writes_by_endpoint.get(endpoint, 0) + 1
        self.writes_by_endpoint[endpoint] = endpoint_number
        arrival = Arrival(endpoint, self.writes_since_rules, endpoint_number, key)
        for armed in self.rules:
            if armed.times_left == 0:
                continue
            if armed.rule.match.hits(arrival, armed.rng):
                if armed.times_left is not None:
                    armed.times_left -= 1
                return arrival, armed.rule.action
        return arrival, NO_FAULT

    def forget_expired_keys(self) -> None:
        now_s = self.now_s()
        while self.keys:
            key, entry = next(iter(self.keys.items()))
            if now_s - entry.created_at_s < self.key_ttl_s:
                return
            del self.keys[key]


@dataclass
class Simulator:
    """The app's handle on its state; `state` is replaced on reset (an aiohttp app is frozen)."""

    state: State

    def new_state(self, key_ttl_s: float) -> State:
        return type(self.state)(key_ttl_s=key_ttl_s)

    def reset(self) -> State:
        """Swap in a new, empty state with the same key lifetime; the old one is returned."""
        old = self.state
        self.state = self.new_state(old.key_ttl_s)
        return old


# --- helpers -------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def error(status: int, kind: str, message: str, *, code: str | None = None,
          param: str | None = None, **extra: Any) -> Answer:
    """A Stripe error body: stripe-python maps it by `type` and status (providers.md §2.3)."""
    body: dict[str, Any] = {"type": kind, "message": message}
    if code is not None:
        body["code"] = code
    if param is not None:
        body["param"] = param
    body.update(extra)
    return status, {"error": body}


def reply(status: int, body: Mapping[str, Any], request_id: str, *, key: str | None = None,
          replayed: bool = False) -> web.Response:
    headers = {"Request-Id": request_id}
    if key is not None:
        headers["Idempotency-Key"] = key
    if replayed:
        headers["Idempotent-Replayed"] = "true"
    return web.json_response(body, status=status, headers=headers)


class BadBody(Exception):
    """The body cannot be read as parameters (answered 400, unsaved)."""


def fingerprint(method: str, path: str, params: Mapping[str, Any]) -> str:
    canonical = json.dumps([method, path, params], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def missing(noun: str, object_id: str) -> Answer:
    """The 404 for an id the provider does not know."""
    return error(404, "invalid_request_error", f"No such {noun}: '{object_id}'",
                 code="resource_missing", param="id")


def list_handler(answer: Callable[[web.Request, int], Answer]
                 ) -> Callable[[web.Request], Awaitable[web.Response]]:
    """A GET of a list or a search: a 400 for a bad `limit`, else `answer` for the limit."""

    async def handle(request: web.Request) -> web.Response:
        request_id = new_id("req")
        raw = request.query.get("limit", str(LIST_LIMIT_DEFAULT))
        if not raw.isdigit() or not 1 <= int(raw) <= LIST_LIMIT_MAX:
            return reply(*error(400, "invalid_request_error",
                                f"limit must be an integer from 1 to {LIST_LIMIT_MAX}",
                                param="limit"), request_id)
        return reply(*answer(request, int(raw)), request_id)

    return handle


def bad_control(message: str) -> web.Response:
    """The 400 of a simulator control (not a provider's endpoint)."""
    return web.json_response({"error": {"type": "invalid_request_error", "message": message}},
                             status=400)


# --- the write path ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Provider:
    """What differs between simulators on the shared write path and controls."""

    sim: web.AppKey[Any]  # where the app keeps its Simulator
    rules: type[FaultRules]  # the body of POST /_sim/faults
    read_params: Callable[[web.Request], Awaitable[dict[str, Any]]]  # raises BadBody
    # The request log's own fields for a write, between its request id and its params.
    log_fields: Callable[[web.Request, Arrival], dict[str, Any]]
    rate_limited: str  # the message of a 429
    records: str  # what is full, with executions, in a 503: "ledger", "records"
    not_done: str  # what an injected 5xx before commit says: "nothing was done"
    done: str  # what an injected 5xx after commit says: "it was done"


@dataclass(frozen=True, slots=True)
class Write:
    """One write endpoint: its name (for fault rules and the request log), validation (layer
    5: None when valid) and act (layer 6, once the fault's delay ran and no 5xx came before)."""

    name: str
    validate: Callable[[Any, Mapping[str, Any], Mapping[str, str]], Answer | None]
    act: Callable[[Any, Mapping[str, Any], Mapping[str, str], str | None, FaultAction, str],
                  Answer]


def write_handler(provider: Provider,
                  write: Write) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        return await _handle_write(request, provider, write)

    return handle


async def _handle_write(request: web.Request, provider: Provider,
                        write: Write) -> web.StreamResponse:
    state = request.app[provider.sim].state  # held for the whole request: a reset swaps it
    request_id = new_id("req")
    key = request.headers.get("Idempotency-Key")
    if key is not None and len(key) >= 2 and key[0] == key[-1] == '"':
        key = key[1:-1]  # the IETF draft sends an sf-string; most clients send a bare token
    if len(state.requests) >= STORE_ENTRIES_MAX:
        return reply(*error(503, "api_error", "simulator request log is full; reset it"),
                     request_id)

    arrival, action = state.arrive(write.name, key)
    logged: dict[str, Any] = {"at": state.now_s(), "request_id": request_id,
                              **provider.log_fields(request, arrival),
                              "params": None, "status": None, "replayed": False,
                              "reply_lost": False,
                              "fault": action.model_dump(exclude_defaults=True) or None}
    state.requests.append(logged)

    status, body, replayed = await _answer(request, provider, write, state, key, action,
                                           request_id, logged)
    logged["status"], logged["replayed"] = status, replayed
    if action.lose_reply and request.transport is not None:
        # Hang up without a byte of response. aiohttp then fails to write the response below
        # and drops it as a premature disconnection; the client sees the server disconnect.
        logged["reply_lost"] = True
        request.transport.close()
    return reply(status, body, request_id, key=key, replayed=replayed)


async def _answer(request: web.Request, provider: Provider, write: Write, state: State,
                  key: str | None, action: FaultAction, request_id: str,
                  logged: dict[str, Any]) -> tuple[int, dict[str, Any], bool]:
    """Layers 2 to 6: (status, body, replayed)."""
    if action.status == 429:
        await asyncio.sleep(action.delay_s)
        return (*error(429, "invalid_request_error", provider.rate_limited, code="rate_limit"),
                False)
    if key is not None and not 1 <= len(key) <= KEY_CHARS_MAX:
        return (*error(400, "invalid_request_error", "Idempotency keys are 1 to "
                       f"{KEY_CHARS_MAX} characters long.", param="Idempotency-Key"), False)
    try:
        params = await provider.read_params(request)
    except BadBody as exc:
        return (*error(400, "invalid_request_error", str(exc)), False)
    logged["params"] = params
    # From here to the reservation below nothing awaits, so no other request can slip between
    # the key check and the reservation.
    path = request.path
    printed = fingerprint(request.method, path, params)
    entry: KeyEntry | None = None
    if key is not None:
        state.forget_expired_keys()
        known = state.keys.get(key)
        if known is not None:
            return _reused(known, key, path, printed)
        if len(state.keys) >= STORE_ENTRIES_MAX:
            return (*error(503, "api_error", f"simulator key store is full "
                           f"({STORE_ENTRIES_MAX} keys); retry later or reset"), False)
    invalid = write.validate(state, params, request.match_info)
    if invalid is not None:
        return (*invalid, False)
    if state.record_count() + state.in_flight >= STORE_ENTRIES_MAX or \
            state.in_flight >= IN_FLIGHT_MAX:
        return (*error(503, "api_error", f"simulator {provider.records} or executions are "
                       "full; retry later or reset"), False)
    if key is not None:
        entry = KeyEntry(path, printed, state.now_s())
        state.keys[key] = entry
    state.in_flight += 1
    match = dict(request.match_info)
    execution = asyncio.create_task(
        _execute(provider, write, state, params, match, key, entry, action, request_id))
    state.executions.add(execution)  # a strong reference: the loop keeps only weak ones
    execution.add_done_callback(lambda done: _executed(state, key, entry, done))
    # Shielded: a client that hangs up or times out does not stop a write that began.
    status, body = await asyncio.shield(execution)
    return status, body, False


def _reused(known: KeyEntry, key: str, path: str,
            printed: str) -> tuple[int, dict[str, Any], bool]:
    """The idempotency layer's answer to a key it still remembers: (status, body, replayed)."""
    if known.status is not None and (known.path, known.fingerprint) == (path, printed):
        assert known.body is not None
        return known.status, known.body, True
    if known.path != path:
        status, body = error(
            400, "idempotency_error", "Keys for idempotent requests can only be used for the "
            f"same endpoint they were first used for ('{path}' vs '{known.path}'). Try using a "
            f"key other than '{key}' if you meant to execute a different request.")
    elif known.fingerprint != printed:
        status, body = error(
            400, "idempotency_error", "Keys for idempotent requests can only be used with the "
            "same parameters they were first used with. Try using a key other than "
            f"'{key}' if you meant to execute a different request.")
    else:
        status, body = error(
            409, "api_error", "There is currently another in-progress request using this "
            "Idempotency-Key. Please try again later.", code="idempotency_key_in_use")
    return status, body, False


async def _execute(provider: Provider, write: Write, state: State,
                   params: Mapping[str, Any], match: Mapping[str, str], key: str | None,
                   entry: KeyEntry | None, action: FaultAction, request_id: str) -> Answer:
    """Layer 6: act and save the answer under the key, whatever it is."""
    await asyncio.sleep(action.delay_s)
    result = _act(provider, write, state, params, match, key, action, request_id)
    if entry is not None:
        entry.status, entry.body = result
    return result


def _executed(state: State, key: str | None, entry: KeyEntry | None,
              execution: asyncio.Task[Answer]) -> None:
    """A done callback, so it runs even for an execution cancelled before it started."""
    state.in_flight -= 1
    state.executions.discard(execution)
    assert state.in_flight >= 0
    if entry is not None and entry.status is None and key is not None and \
            state.keys.get(key) is entry:
        # A bug or a shutdown ended it unsaved: free the key rather than answer 409 forever.
        del state.keys[key]


def _act(provider: Provider, write: Write, state: State, params: Mapping[str, Any],
         match: Mapping[str, str], key: str | None, action: FaultAction,
         request_id: str) -> Answer:
    if action.status is not None and action.when == "before_commit":
        return error(action.status, "api_error", "An unexpected error occurred (injected "
                     f"before commit: {provider.not_done}).")
    status, body = write.act(state, params, match, key, action, request_id)
    if action.status is not None and 200 <= status < 300:
        return error(action.status, "api_error", "An unexpected error occurred (injected "
                     f"after commit: {provider.done}).")
    return status, body


# --- simulator controls (not a provider's) -------------------------------------------------------


def new_app(provider: Provider, simulator: Simulator) -> web.Application:
    """An app holding `simulator`, with the controls every simulator has; the caller adds the
    provider's own routes."""
    key_ttl_s = simulator.state.key_ttl_s
    if key_ttl_s <= 0:
        raise ValueError(f"key_ttl_s must be positive, got {key_ttl_s}")
    app = web.Application(client_max_size=BODY_BYTES_MAX)
    app[provider.sim] = simulator

    async def set_faults(request: web.Request) -> web.Response:
        try:
            rules = provider.rules.model_validate_json(await request.read())
        except ValidationError as exc:
            return bad_control(str(exc))
        request.app[provider.sim].state.set_rules(rules.rules)
        return web.json_response({"rules": len(rules.rules)})

    async def clear_faults(request: web.Request) -> web.Response:
        request.app[provider.sim].state.set_rules([])
        return web.json_response({"rules": 0})

    async def requests_log(request: web.Request) -> web.Response:
        return web.json_response({"requests": request.app[provider.sim].state.requests})

    async def reset(request: web.Request) -> web.Response:
        request.app[provider.sim].reset()
        return web.json_response({"reset": True})

    async def advance_clock(request: web.Request) -> web.Response:
        """Move the simulator's clock forward (never back: key expiry relies on it)."""
        try:
            raw = await request.json()
            advance_s = float(raw["advance_s"])
        except (ValueError, KeyError, TypeError):
            return bad_control('expected {"advance_s": N}')
        if not 0.0 <= advance_s <= CLOCK_ADVANCE_S_MAX:
            return bad_control(f"advance_s must be 0 to {CLOCK_ADVANCE_S_MAX:g}")
        state = request.app[provider.sim].state
        state.clock_offset_s += advance_s
        return web.json_response({"now": state.now_s(), "offset_s": state.clock_offset_s})

    async def cancel_executions(app: web.Application) -> None:
        executions = list(app[provider.sim].state.executions)
        for execution in executions:
            execution.cancel()
        await asyncio.gather(*executions, return_exceptions=True)

    app.router.add_post("/_sim/faults", set_faults)
    app.router.add_delete("/_sim/faults", clear_faults)
    app.router.add_get("/_sim/requests", requests_log)
    app.router.add_post("/_sim/reset", reset)
    app.router.add_post("/_sim/clock", advance_clock)
    app.on_shutdown.append(cancel_executions)
    return app


# --- process -------------------------------------------------------------------------------------


async def start(app: web.Application, host: str, port: int) -> tuple[str, web.AppRunner]:
    """Serve `app` on this event loop: (base URL, its runner; `runner.cleanup()` stops it).
    CannotListen, naming `--host` or `--port`, when the address cannot be listened on."""
    sock = await bound_socket(host, port, host_setting="--host", port_setting="--port")
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    await web.SockSite(runner, sock, backlog=BACKLOG).start()
    return f"http://{authority(host, sock.getsockname()[1])}", runner


async def serve(make_app: Callable[[], web.Application], host: str, port: int) -> int:
    """Serve the app `make_app` makes (on the running loop) until SIGTERM or SIGINT; the exit
    code (2, said in one line, when the address cannot be listened on)."""
    try:
        url, runner = await start(make_app(), host, port)
    except CannotListen as exc:
        print(exc, file=sys.stderr, flush=True)
        return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    print(f"listening on {url}", flush=True)  # the one line a parent process reads
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
    return 0


def arg_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The options every simulator takes: --host, --port, --key-ttl-s."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--host", default=HOST)
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--key-ttl-s", type=float, default=KEY_TTL_S_DEFAULT,
                        help="how long an idempotency key is remembered after its first request")
    return parser


def parse_args(parser: argparse.ArgumentParser,
               argv: Sequence[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.key_ttl_s <= 0:
        parser.error("--key-ttl-s must be positive")
    return args
