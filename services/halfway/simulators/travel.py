"""tripsim: three providers in one process (flights, hotels, email) for sagas in demos and tests.

Run it as its own process: `python -m halfway.simulators.travel --port 0 --key-ttl-s 86400`
prints exactly one line, `listening on http://127.0.0.1:PORT`, once it accepts connections.

What it models. A trip is a saga: hold a flight and book a hotel (both can be undone), then
send the itinerary by email (it cannot be). No flight or hotel API was researched
(research/providers.md covers payments and email), so all three follow paysim's model, which is
Stripe's: the `Idempotency-Key` header dedupes our retries while the key is younger than
`key_ttl_s`, and our key also travels in the object (`metadata.halfway_key`; for an email, its
Message-ID) so a lookup finds the effect by our name for it, also after the key is forgotten.
The email provider dedupes by `Idempotency-Key` for 24 h like Resend and is searched by
Message-ID like Mailgun. Error bodies are paysim's (`{"error": {type, code, message}}`), so one
adapter reads all three; unlike Resend's 409, a key reused with other parameters is a 400
`idempotency_error`, as at Stripe.

Endpoints (JSON bodies; each write takes an `Idempotency-Key` header):

    POST /flights/holds                   {flight, passenger, metadata}    flights.hold
    POST /flights/holds/{id}/release      {}                               flights.release
    POST /hotels/bookings                 {hotel, guest, nights, metadata} hotels.book
    POST /hotels/bookings/{id}/cancel     {}                               hotels.cancel
    POST /email/messages                  {to, subject, body, message_id}  email.send
    GET  /flights/holds?key=K | ?release_key=K       GET /flights/holds/{id}
    GET  /hotels/bookings?key=K | ?cancel_key=K      GET /hotels/bookings/{id}
    GET  /email/messages?message_id=M                GET /email/messages/{id}

Lists answer `{"object": "list", "data": [...], "has_more"}`, newest first, at most `limit`.
`key` matches `metadata.halfway_key`; `release_key` / `cancel_key` match the keys of the undo
requests a hold or booking was answered 200 for (`release_keys` / `cancel_keys` on the object),
so an undo step finds its own effect by its own key.

Theory of operation. Every write (a create or an undo) passes through paysim's layers, in
paysim's order, and each layer says whether its answer is saved under the key:

1. Arrival: the write is numbered (from 1 since the fault rules were last set: overall, and
   per endpoint) and the first fault rule that matches it is consumed, once, here.
2. Rate limiter: a 429 fault answers now. Not saved.
3. Request checks: a bad `Idempotency-Key` or a body that is not a JSON object is a 400; a full
   store is a 503. Not saved.
4. Idempotency layer, for a key younger than `key_ttl_s`: another endpoint or other parameters
   → 400 `idempotency_error`; the first request still executing → 409
   `idempotency_key_in_use`; otherwise the saved status and body are replayed with
   `Idempotent-Replayed: true`. None of these answers is saved.
5. Validation: bad parameters → 400; an unknown hold or booking → 404 `resource_missing`; an
   undo of a refused attempt → 400 `not_undoable`. Not saved: the key stays free.
6. Execution: the key is reserved as processing; a fault's delay runs, then a 5xx before
   commit, or the provider acts, then a 5xx after commit (only after a 2xx). Acting is one of:
   - a create makes its effect (a hold `held`, a booking `confirmed`, an email `sent`), or is
     refused with 422 (a flight with no seats: `no_seats`, only by a `decline` fault; a hotel
     in the full set: `no_availability`; an address at `@bounce.invalid`: `invalid_recipient`).
     A refused attempt is recorded with status `refused`, so a lookup by key finds it (proof of
     not done), but it is not an effect: the ledger lists it under `refused` only;
   - an undo moves a `held` hold to `released`, a `confirmed` booking to `cancelled`, and
     records the undo's key on it. An undo of what is already undone is a 200 too (and records
     its key). A `decline` fault refuses an undo with 422 (`release_refused`,
     `cancellation_refused`) and changes nothing. Emails have no undo.
   Whatever the answer, 5xx included, it is saved under the key (a snapshot: the replay of a
   hold's creation still says `held` after it is released). Execution is shielded from the
   client hanging up: a hold whose client gave up still lands, as at Stripe.
7. Reply: a `lose_reply` fault closes the connection instead of answering (the result is
   already committed and saved, so a retry with the key replays it).

Fault rules (`POST /_sim/faults`, `{"rules": [...]}`) are paysim's `FaultAction` under a
`match` with one more condition, `endpoint`: one of `flights.hold`, `flights.release`,
`hotels.book`, `hotels.cancel`, `email.send`. With it, `nth` and `every` count that endpoint's
writes; without it, every write. Lookups are never faulted.

Simulator controls: `DELETE /_sim/faults`, `POST /_sim/reset` (a new, empty state; the full set
back to its default), `POST /_sim/clock {"advance_s": N}`, `POST /_sim/hotels/full
{"hotels": [...]}` (replaces the full set; `HTL-FULL` by default), `GET /_sim/requests` (every
write with its endpoint, key, numbers, fault and answer), `GET /_sim/ledger` (`holds`,
`bookings`, `emails`: effects only, each with its key, request id and status history;
`refused`: the refused attempts), and `POST /_sim/drain` (answers once every execution in
flight has finished, within `DRAIN_TIMEOUT_S`: tests wait for a slow commit without polling).

Time: keys expire and histories are stamped on the simulator's clock, wall time plus an offset
that `POST /_sim/clock` moves forward. Delays are real time.

Bounds: at most `STORE_ENTRIES_MAX` keys, records (of all providers together) and logged
writes, and `IN_FLIGHT_MAX` executions at once; past them a write is refused with 503
(unsaved), never silently dropped, because the ledger is the ground truth tests compare with.

Not modelled: API keys, hold time limits (a real hold lapses on its own), cancellation fees,
webhooks, search lag, Resend's 409 codes, SES replacing our Message-ID.
"""

from __future__ import annotations

import asyncio
import copy
import json
import random
import re
import secrets
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from halfway.simulators import keyed
from halfway.simulators.keyed import (
    METADATA_KEY_CHARS_MAX,
    METADATA_KEYS_MAX,
    METADATA_VALUE_CHARS_MAX,
    RULES_MAX,
    Answer,
    BadBody,
    FaultAction,
)
from halfway.simulators.keyed import error as _error
from halfway.simulators.keyed import new_id as _new_id
from halfway.simulators.keyed import reply as _reply

PROVIDER = "tripsim"
TEXT_CHARS_MAX = 500  # flight, passenger, hotel, guest, e-mail subject
EMAIL_BODY_CHARS_MAX = 32 * 1024
NIGHTS_MAX = 365
METADATA_KEY = "halfway_key"  # the metadata entry that carries the creator's key
FULL_HOTELS_DEFAULT = frozenset({"HTL-FULL"})
FULL_HOTELS_MAX = 1_000
BOUNCE_DOMAIN = "@bounce.invalid"  # mail to an address here is refused
DRAIN_TIMEOUT_S = 60.0  # POST /_sim/drain waits at most this long, then says what is in flight

EndpointName = Literal["flights.hold", "flights.release", "hotels.book", "hotels.cancel",
                       "email.send"]
_ADDRESS = re.compile(r"[^@\s<>]+@[^@\s<>]+\.[^@\s<>]+")

# --- fault rules (the JSON body of POST /_sim/faults) --------------------------------------------


class TripFaultMatch(keyed.FaultMatch):
    """paysim's conditions plus `endpoint`. With `endpoint`, `nth` and `every` count the writes
    to that endpoint; without it, all writes."""

    endpoint: EndpointName | None = None

    def hits(self, arrival: keyed.Arrival, rng: random.Random) -> bool:
        number = arrival.number
        if self.endpoint is not None:
            if arrival.endpoint != self.endpoint:
                return False
            number = arrival.endpoint_number
        return self.hits_number(number, arrival.key, rng)


class TripFaultRule(keyed.FaultRule):
    match: TripFaultMatch = Field(default_factory=TripFaultMatch)


class TripFaultRules(keyed.FaultRules):
    rules: list[TripFaultRule] = Field(max_length=RULES_MAX)


class FullHotels(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hotels: list[str] = Field(max_length=FULL_HOTELS_MAX)


# --- state ---------------------------------------------------------------------------------------

Store = Literal["holds", "bookings", "emails"]
STORES: tuple[Store, ...] = ("holds", "bookings", "emails")
EFFECT_STATUSES: dict[Store, frozenset[str]] = {
    "holds": frozenset({"held", "released"}),
    "bookings": frozenset({"confirmed", "cancelled"}),
    "emails": frozenset({"sent"}),
}
REFUSED = "refused"


@dataclass(slots=True)
class _Record:
    obj: dict[str, Any]  # the public object; an undo changes its status and history
    idempotency_key: str | None  # of the request that made it
    request_id: str


@dataclass
class TripState(keyed.State):
    """Everything the simulator knows: the shared keys, rules and request log, and the records.
    `POST /_sim/reset` swaps in a new one, so a request still executing from before the reset
    writes into the old state, never into the new ledger."""

    records: dict[str, dict[str, _Record]] = field(
        default_factory=lambda: {store: {} for store in STORES})  # insertion order = ledger order
    # (store, field, value) -> record ids, oldest first: key, release_key, cancel_key, message_id
    index: dict[tuple[str, str, str], list[str]] = field(default_factory=dict)
    full_hotels: set[str] = field(default_factory=lambda: set(FULL_HOTELS_DEFAULT))

    def record_count(self) -> int:
        return sum(len(records) for records in self.records.values())

    def commit(self, store: Store, obj: dict[str, Any], key: str | None, request_id: str,
               indexed: Mapping[str, str | None]) -> None:
        assert obj["id"] not in self.records[store], "ids are unique"
        self.records[store][obj["id"]] = _Record(obj, key, request_id)
        for name, value in indexed.items():
            self.add_to_index(store, name, value, obj["id"])

    def add_to_index(self, store: Store, name: str, value: str | None, record_id: str) -> None:
        if value is not None:
            self.index.setdefault((store, name, value), []).append(record_id)

    def find(self, store: Store, name: str, value: str) -> list[dict[str, Any]]:
        """The objects indexed under name=value, newest first."""
        ids = self.index.get((store, name, value), [])
        return [self.records[store][i].obj for i in reversed(ids)]


@dataclass
class Simulator(keyed.Simulator):
    """The app's handle on its state; `state` is replaced on reset (an aiohttp app is frozen)."""

    state: TripState


SIM = web.AppKey("tripsim", Simulator)


# --- helpers -------------------------------------------------------------------------------------


def _invalid(message: str, param: str | None = None, code: str | None = None) -> Answer:
    return _error(400, "invalid_request_error", message, code=code, param=param)


async def _read_params(request: web.Request) -> dict[str, Any]:
    """The JSON object in the body; an empty body is `{}` (an undo needs no parameters)."""
    raw = await request.read()
    if not raw.strip():
        return {}
    if request.content_type != "application/json":
        raise BadBody(f"unsupported content type {request.content_type}: send JSON")
    try:
        params = json.loads(raw)
    except ValueError as exc:
        raise BadBody(f"invalid JSON: {exc}") from exc
    if not isinstance(params, dict):
        raise BadBody("the JSON body must be an object")
    return params


# --- validation (layer 5) ------------------------------------------------------------------------


def _check_params(params: Mapping[str, Any], allowed: Sequence[str],
                  required: Sequence[str]) -> Answer | None:
    for name in params:
        if name not in allowed:
            return _invalid(f"Received unknown parameter: {name}", name, "parameter_unknown")
    for name in required:
        if name not in params or params[name] in (None, ""):
            return _invalid(f"Missing required param: {name}.", name, "parameter_missing")
    return None


def _check_text(params: Mapping[str, Any], name: str, chars_max: int = TEXT_CHARS_MAX
                ) -> Answer | None:
    value = params.get(name)
    if value is not None and (not isinstance(value, str) or len(value) > chars_max):
        return _invalid(f"{name} must be a string of at most {chars_max} characters.", name)
    return None


def _check_metadata(params: Mapping[str, Any]) -> Answer | None:
    metadata = params.get("metadata", {})
    if not isinstance(metadata, dict):
        return _invalid("metadata must be an object.", "metadata")
    if len(metadata) > METADATA_KEYS_MAX:
        return _invalid(f"Metadata can have at most {METADATA_KEYS_MAX} keys.", "metadata")
    for name, value in metadata.items():
        if not isinstance(value, str) or len(name) > METADATA_KEY_CHARS_MAX or \
                len(value) > METADATA_VALUE_CHARS_MAX:
            return _invalid(f"Metadata keys are at most {METADATA_KEY_CHARS_MAX} characters and "
                            f"values strings of at most {METADATA_VALUE_CHARS_MAX}.",
                            f"metadata[{name}]")
    return None


def _first(*checks: Callable[[], Answer | None]) -> Answer | None:
    for check in checks:
        answer = check()
        if answer is not None:
            return answer
    return None


def _valid_hold(state: TripState, params: Mapping[str, Any],
                match: Mapping[str, str]) -> Answer | None:
    return _first(
        lambda: _check_params(params, ("flight", "passenger", "metadata"),
                              ("flight", "passenger")),
        lambda: _check_text(params, "flight"), lambda: _check_text(params, "passenger"),
        lambda: _check_metadata(params))


def _valid_booking(state: TripState, params: Mapping[str, Any],
                   match: Mapping[str, str]) -> Answer | None:
    def nights() -> Answer | None:
        value = params["nights"]
        if isinstance(value, bool) or not isinstance(value, int) or \
                not 1 <= value <= NIGHTS_MAX:
            return _invalid(f"nights must be an integer from 1 to {NIGHTS_MAX}.", "nights")
        return None

    return _first(
        lambda: _check_params(params, ("hotel", "guest", "nights", "metadata"),
                              ("hotel", "guest", "nights")),
        lambda: _check_text(params, "hotel"), lambda: _check_text(params, "guest"), nights,
        lambda: _check_metadata(params))


def _valid_email(state: TripState, params: Mapping[str, Any],
                 match: Mapping[str, str]) -> Answer | None:
    def address() -> Answer | None:
        if not _ADDRESS.fullmatch(params["to"]):
            return _invalid(f"Invalid `to` field: {params['to']}.", "to", "invalid_parameter")
        return None

    return _first(
        lambda: _check_params(params, ("to", "subject", "body", "message_id"),
                              ("to", "subject")),
        lambda: _check_text(params, "to"), lambda: _check_text(params, "subject"),
        lambda: _check_text(params, "body", EMAIL_BODY_CHARS_MAX),
        lambda: _check_text(params, "message_id"), address)


def _valid_undo(store: Store, param: str, noun: str
                ) -> Callable[[TripState, Mapping[str, Any], Mapping[str, str]], Answer | None]:
    def valid(state: TripState, params: Mapping[str, Any],
              match: Mapping[str, str]) -> Answer | None:
        checked = _check_params(params, (), ())
        if checked is not None:
            return checked
        record = state.records[store].get(match[param])
        if record is None:
            return keyed.missing(noun, match[param])
        if record.obj["status"] == REFUSED:
            return _invalid(f"The {noun} '{match[param]}' was refused; there is nothing to undo.",
                            "id", "not_undoable")
        return None

    return valid


# --- acting (layer 6) ----------------------------------------------------------------------------


def _history(status: str, at_s: float, key: str | None = None) -> dict[str, Any]:
    return {"status": status, "at": at_s, "key": key}


def _refuse(state: TripState, store: Store, obj: dict[str, Any], key: str | None,
            request_id: str, indexed: Mapping[str, str | None], code: str, message: str,
            noun: str) -> Answer:
    """Record a refused create (found by lookups, never an effect) and answer 422."""
    now_s = state.now_s()
    obj.update(status=REFUSED, failure_code=code, failure_message=message,
               history=[_history(REFUSED, now_s, key)])
    state.commit(store, obj, key, request_id, indexed)
    return _error(422, "invalid_request_error", message, code=code, **{noun: obj["id"]})


def _make(state: TripState, store: Store, obj: dict[str, Any], status: str, key: str | None,
          request_id: str, indexed: Mapping[str, str | None]) -> Answer:
    obj.update(status=status, history=[_history(status, state.now_s(), key)])
    state.commit(store, obj, key, request_id, indexed)
    return 200, copy.deepcopy(obj)


def _hold(state: TripState, params: Mapping[str, Any], match: Mapping[str, str],
          key: str | None, action: FaultAction, request_id: str) -> Answer:
    metadata = dict(params.get("metadata", {}))
    obj: dict[str, Any] = {
        "id": _new_id("hold"), "object": "flight_hold", "flight": params["flight"],
        "passenger": params["passenger"], "metadata": metadata,
        "created": int(state.now_s()), "release_keys": []}
    indexed = {"key": metadata.get(METADATA_KEY)}
    if action.decline:
        return _refuse(state, "holds", obj, key, request_id, indexed, "no_seats",
                       f"No seats left on flight {params['flight']}.", "hold")
    return _make(state, "holds", obj, "held", key, request_id, indexed)


def _book(state: TripState, params: Mapping[str, Any], match: Mapping[str, str],
          key: str | None, action: FaultAction, request_id: str) -> Answer:
    metadata = dict(params.get("metadata", {}))
    obj: dict[str, Any] = {
        "id": _new_id("bk"), "object": "hotel_booking", "hotel": params["hotel"],
        "guest": params["guest"], "nights": params["nights"], "metadata": metadata,
        "created": int(state.now_s()), "cancel_keys": []}
    indexed = {"key": metadata.get(METADATA_KEY)}
    if action.decline or params["hotel"] in state.full_hotels:
        return _refuse(state, "bookings", obj, key, request_id, indexed, "no_availability",
                       f"Hotel {params['hotel']} has no room available for these nights.",
                       "booking")
    return _make(state, "bookings", obj, "confirmed", key, request_id, indexed)


def _send(state: TripState, params: Mapping[str, Any], match: Mapping[str, str],
          key: str | None, action: FaultAction, request_id: str) -> Answer:
    message_id = params.get("message_id") or f"<{secrets.token_hex(16)}@{PROVIDER}.local>"
    obj: dict[str, Any] = {
        "id": _new_id("msg"), "object": "email", "message_id": message_id, "to": params["to"],
        "subject": params["subject"], "body": params.get("body", ""),
        "created": int(state.now_s())}
    indexed = {"message_id": message_id}
    if action.decline or params["to"].lower().endswith(BOUNCE_DOMAIN):
        return _refuse(state, "emails", obj, key, request_id, indexed, "invalid_recipient",
                       f"The recipient {params['to']} does not accept mail.", "email")
    return _make(state, "emails", obj, "sent", key, request_id, indexed)


def _undo(store: Store, param: str, done: str, keys_field: str, index_name: str, code: str,
          noun: str) -> Callable[..., Answer]:
    """An undo: `held`/`confirmed` → `done`; already `done` is answered 200 as well. Either way
    the undo's key is recorded on the object, so a lookup by that key finds it."""

    def act(state: TripState, params: Mapping[str, Any], match: Mapping[str, str],
            key: str | None, action: FaultAction, request_id: str) -> Answer:
        obj = state.records[store][match[param]].obj
        if action.decline:
            return _error(422, "invalid_request_error", f"The provider refused to undo "
                          f"{noun} {obj['id']}.", code=code, **{noun: obj["id"]})
        if obj["status"] != done:
            obj["status"] = done
            obj["history"].append(_history(done, state.now_s(), key))
        if key is not None and key not in obj[keys_field]:
            obj[keys_field].append(key)
            state.add_to_index(store, index_name, key, obj["id"])
        return 200, copy.deepcopy(obj)

    return act


WRITES: dict[EndpointName, keyed.Write] = {w.name: w for w in (
    keyed.Write("flights.hold", _valid_hold, _hold),
    keyed.Write("flights.release", _valid_undo("holds", "hold_id", "hold"),
                _undo("holds", "hold_id", "released", "release_keys", "release_key",
                      "release_refused", "hold")),
    keyed.Write("hotels.book", _valid_booking, _book),
    keyed.Write("hotels.cancel", _valid_undo("bookings", "booking_id", "booking"),
                _undo("bookings", "booking_id", "cancelled", "cancel_keys", "cancel_key",
                      "cancellation_refused", "booking")),
    keyed.Write("email.send", _valid_email, _send),
)}


# --- the write path (layers 1 to 7 are `halfway.simulators.keyed`'s) -----------------------------


def _logged(request: web.Request, arrival: keyed.Arrival) -> dict[str, Any]:
    return {"endpoint": arrival.endpoint, "path": request.path, "key": arrival.key,
            "number": arrival.number, "endpoint_number": arrival.endpoint_number}


TRIPSIM = keyed.Provider(
    sim=SIM, rules=TripFaultRules, read_params=_read_params, log_fields=_logged,
    rate_limited="Too many requests; back off and retry.", records="records",
    not_done="nothing was done", done="it was done")


# --- lookups -------------------------------------------------------------------------------------


def _list_handler(store: Store, filters: Sequence[str]
                  ) -> Callable[[web.Request], Awaitable[web.Response]]:
    """GET a list filtered by exactly one of `filters` (each an index name and query name)."""

    def answer(request: web.Request, limit: int) -> Answer:
        given = [name for name in filters if name in request.query]
        if len(given) != 1:
            return _invalid(f"filter by exactly one of: {', '.join(filters)}")
        found = request.app[SIM].state.find(store, given[0], request.query[given[0]])
        return 200, {"object": "list", "url": request.path, "data": found[:limit],
                     "has_more": len(found) > limit}

    return keyed.list_handler(answer)


def _get_handler(store: Store, param: str,
                 noun: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handle(request: web.Request) -> web.Response:
        record = request.app[SIM].state.records[store].get(request.match_info[param])
        if record is None:
            return _reply(*keyed.missing(noun, request.match_info[param]), _new_id("req"))
        return _reply(200, record.obj, _new_id("req"))

    return handle


# --- simulator controls (the faults, requests, reset and clock are keyed's) ----------------------


async def set_full_hotels(request: web.Request) -> web.Response:
    try:
        full = FullHotels.model_validate_json(await request.read())
    except ValidationError as exc:
        return keyed.bad_control(str(exc))
    state = request.app[SIM].state
    state.full_hotels = set(full.hotels)
    return web.json_response({"hotels": sorted(state.full_hotels)})


async def ledger(request: web.Request) -> web.Response:
    """The effects, per provider, and the refused attempts apart: never mixed."""
    state = request.app[SIM].state
    described: dict[str, list[dict[str, Any]]] = {store: [] for store in STORES}
    described["refused"] = []
    for store in STORES:
        for record in state.records[store].values():
            entry = {**record.obj, "idempotency_key": record.idempotency_key,
                     "request_id": record.request_id}
            if record.obj["status"] in EFFECT_STATUSES[store]:
                described[store].append(entry)
            else:
                described["refused"].append(entry)
    return web.json_response(described)


async def drain(request: web.Request) -> web.Response:
    """Answer once every execution in flight now has finished (or DRAIN_TIMEOUT_S passed)."""
    state = request.app[SIM].state
    pending = list(state.executions)
    if pending:
        await asyncio.wait(pending, timeout=DRAIN_TIMEOUT_S)  # waits; never cancels them
    return web.json_response({"in_flight": state.in_flight})


# --- app and process -----------------------------------------------------------------------------


def make_app(key_ttl_s: float = keyed.KEY_TTL_S_DEFAULT) -> web.Application:
    app = keyed.new_app(TRIPSIM, Simulator(TripState(key_ttl_s=key_ttl_s)))
    post = app.router.add_post
    get = app.router.add_get

    def write(name: EndpointName) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
        return keyed.write_handler(TRIPSIM, WRITES[name])

    post("/flights/holds", write("flights.hold"))
    post("/flights/holds/{hold_id}/release", write("flights.release"))
    get("/flights/holds", _list_handler("holds", ("key", "release_key")))
    get("/flights/holds/{hold_id}", _get_handler("holds", "hold_id", "hold"))
    post("/hotels/bookings", write("hotels.book"))
    post("/hotels/bookings/{booking_id}/cancel", write("hotels.cancel"))
    get("/hotels/bookings", _list_handler("bookings", ("key", "cancel_key")))
    get("/hotels/bookings/{booking_id}", _get_handler("bookings", "booking_id", "booking"))
    post("/email/messages", write("email.send"))
    get("/email/messages", _list_handler("emails", ("message_id",)))
    get("/email/messages/{email_id}", _get_handler("emails", "email_id", "email"))
    post("/_sim/hotels/full", set_full_hotels)
    get("/_sim/ledger", ledger)
    post("/_sim/drain", drain)
    return app


async def start_in_process(port: int = 0, key_ttl_s: float = keyed.KEY_TTL_S_DEFAULT, *,
                           host: str = keyed.HOST) -> tuple[str, Callable[[], Awaitable[None]]]:
    """Serve the simulator on this event loop: (base URL, a coroutine function that stops it)."""
    url, runner = await keyed.start(make_app(key_ttl_s), host, port)
    return url, runner.cleanup


def main(argv: Sequence[str] | None = None) -> int:
    parser = keyed.arg_parser("python -m halfway.simulators.travel",
                        "A flights, hotels and email provider simulator (tripsim).")
    args = keyed.parse_args(parser, argv)
    return asyncio.run(keyed.serve(lambda: make_app(args.key_ttl_s), args.host, args.port))


if __name__ == "__main__":
    sys.exit(main())
