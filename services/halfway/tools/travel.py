"""The trip tools: hold a flight, book a hotel, email the itinerary, and the two undos.

Five tools for a saga, spoken to tripsim (`halfway.simulators.travel`):

    hold_flight           compensable, undone by release_flight_hold {"hold_id": $result.hold_id}
    book_hotel            compensable, undone by cancel_hotel_booking {"booking_id": ...}
    send_email            retriable (an email cannot be taken back): after the pivot
    release_flight_hold   the undo of hold_flight
    cancel_hotel_booking  the undo of book_hotel

Every tool is keyed: our key goes in the `Idempotency-Key` header, so the provider dedupes our
retries while it remembers the key, and also where a lookup can find it after the provider
forgot the key: a hold's or booking's `metadata.halfway_key`; an email's Message-ID,
`<KEY@halfway.local>` (the provider dedupes by the header, as Resend does, and is searched by
Message-ID, as Mailgun is). An undo is a step of its own with its own key (`trip-1:1:undo`);
the provider records the key of every undo request it answered on the hold or booking, so the
undo's lookup asks for its own key (`?release_key=`, `?cancel_key=`) and finds its own effect.

One `TravelAdapter` serves all five tools (one shared `httpx.AsyncClient`, made on first use;
`aclose()` closes it). It reports what it saw and never raises for a provider or network
failure; the pure core (`halfway.core.classify`) decides what that means. Failures map as
charge_customer's do, as `halfway.tools.http` lists: a non-2xx answer is Replied with the
provider's error code (or type) and message (a refused booking is 422 `no_availability`: proof
of not done).

A lookup answers Found (evidence of the same shape as the call's), Found(succeeded=False) for
a refused attempt under our key (tripsim keeps those: a hotel with no room, a bounced
address), NotFound, or LookupFailed (the lookup itself failed, or what it found is not what this
step asked for).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, ConfigDict, Field

from halfway.contract import CompensationPlan, EffectClass, SagaRole
from halfway.tools.http import HttpAdapter, call_result, error_text
from halfway.tools.spec import (
    CallContext,
    CallResult,
    Found,
    LookupFailed,
    LookupResult,
    NotFound,
    ToolSpec,
)

HOLD_FLIGHT = "hold_flight"
RELEASE_FLIGHT_HOLD = "release_flight_hold"
BOOK_HOTEL = "book_hotel"
CANCEL_HOTEL_BOOKING = "cancel_hotel_booking"
SEND_EMAIL = "send_email"
PROVIDER = "tripsim"
METADATA_KEY = "halfway_key"  # the metadata entry that carries our idempotency key
MESSAGE_ID_DOMAIN = "halfway.local"
KEY_TTL_S_DEFAULT = 86_400.0  # what tripsim keeps by default (Stripe v1 and Resend: 24 h)
SEARCH_LIMIT = 10  # one key names one effect; more than a few records under it is a finding
NIGHTS_MAX = 60
REFUSED = "refused"  # tripsim's status for a refused attempt (not an effect)

_ID = r"^[A-Za-z0-9_-]{1,100}$"  # provider ids, safe in a URL path
_ADDRESS = r"^[^@\s<>]+@[^@\s<>]+\.[^@\s<>]+$"

A = TypeVar("A", bound=BaseModel)


# --- arguments -----------------------------------------------------------------------------------


class HoldFlightArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    flight: str = Field(min_length=1, max_length=100,
                        description="the flight and date, e.g. LH454-2025-07-01")
    passenger: str = Field(min_length=1, max_length=200, description="the passenger's full name")


class ReleaseFlightHoldArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    hold_id: str = Field(pattern=_ID, description="the hold to release, e.g. hold_9f2c…")


class BookHotelArgs(BaseModel):
    """`nights` is strict: "3" is refused, never coerced."""

    model_config = ConfigDict(extra="forbid")

    hotel: str = Field(min_length=1, max_length=100, description="the hotel id, e.g. HTL-1042")
    guest: str = Field(min_length=1, max_length=200, description="the guest's full name")
    nights: int = Field(ge=1, le=NIGHTS_MAX, strict=True,
                        description=f"the number of nights, an integer from 1 to {NIGHTS_MAX}")


class CancelHotelBookingArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    booking_id: str = Field(pattern=_ID, description="the booking to cancel, e.g. bk_41d0…")


class SendEmailArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    to: str = Field(pattern=_ADDRESS, max_length=254, description="one e-mail address")
    subject: str = Field(min_length=1, max_length=300)
    body: str = Field(max_length=20_000, description="plain text")


def _as(args: BaseModel, kind: type[A], tool: str) -> A:
    if not isinstance(args, kind):
        raise TypeError(f"{tool} takes {kind.__name__}, got {type(args).__name__}")
    return args


def flight_subject(args: BaseModel) -> str:
    hold = _as(args, HoldFlightArgs, HOLD_FLIGHT)
    return f"flight:{hold.flight}:{hold.passenger}"


def hotel_subject(args: BaseModel) -> str:
    booking = _as(args, BookHotelArgs, BOOK_HOTEL)
    return f"hotel:{booking.hotel}:{booking.guest}"


def email_subject(args: BaseModel) -> str:
    email = _as(args, SendEmailArgs, SEND_EMAIL)
    return f"email:{email.to}:{email.subject}"


def message_id(key: str) -> str:
    """The Message-ID the adapter gives an email: our key, so a lookup finds it by our name."""
    return f"<{key}@{MESSAGE_ID_DOMAIN}>"


# --- specs ---------------------------------------------------------------------------------------


def travel_specs(timeout_s: float = 5.0, key_ttl_s: float = KEY_TTL_S_DEFAULT,
                 completes_within_s: float | None = None) -> list[ToolSpec]:
    """The five specs; `key_ttl_s` must not exceed what the provider keeps (tripsim's
    `--key-ttl-s`); `completes_within_s` only for a provider that finishes every request
    within it and whose lookups show every effect at once (then nothing found past it proves
    not done: a booking stuck behind a saved 500 fails its saga, which is undone)."""
    keyed: dict[str, Any] = {"effect_class": EffectClass.KEYED, "timeout_s": timeout_s,
                             "key_ttl_s": key_ttl_s, "has_lookup": True,
                             "completes_within_s": completes_within_s}
    return [
        ToolSpec(
            name=HOLD_FLIGHT, evidence_id="hold_id", args_model=HoldFlightArgs,
            subject=flight_subject, **keyed,
            description=("Hold a seat on a flight for a passenger (not yet paid; released if "
                         "the trip falls through). Returns the hold_id."),
            saga_role=SagaRole.COMPENSABLE,
            undo=CompensationPlan(tool=RELEASE_FLIGHT_HOLD,
                                  args={"hold_id": "$result.hold_id"})),
        ToolSpec(
            name=RELEASE_FLIGHT_HOLD, evidence_id="hold_id", args_model=ReleaseFlightHoldArgs,
            **keyed,
            description="Release a flight hold made by hold_flight (the undo of hold_flight)."),
        ToolSpec(
            name=BOOK_HOTEL, evidence_id="booking_id", args_model=BookHotelArgs,
            subject=hotel_subject, **keyed,
            description=("Book a hotel room for a guest for a number of nights (an integer). "
                         "Returns the booking_id; a full hotel refuses."),
            saga_role=SagaRole.COMPENSABLE,
            undo=CompensationPlan(tool=CANCEL_HOTEL_BOOKING,
                                  args={"booking_id": "$result.booking_id"})),
        ToolSpec(
            name=CANCEL_HOTEL_BOOKING, evidence_id="booking_id", args_model=CancelHotelBookingArgs,
            **keyed,
            description="Cancel a hotel booking made by book_hotel (the undo of book_hotel)."),
        ToolSpec(
            name=SEND_EMAIL, evidence_id="email_id", args_model=SendEmailArgs,
            subject=email_subject, **keyed,
            description=("Send a plain-text e-mail to one address. It cannot be taken back: "
                         "in a trip, send it only once everything is booked."),
            saga_role=SagaRole.RETRIABLE),
    ]


def travel_tools(base_url: str, *, timeout_s: float = 5.0,
                 key_ttl_s: float = KEY_TTL_S_DEFAULT, completes_within_s: float | None = None,
                 ) -> list[tuple[ToolSpec, TravelAdapter]]:
    """Every trip tool with its adapter: one `TravelAdapter` serves all five (close it once;
    closing it again is harmless)."""
    adapter = TravelAdapter(base_url)
    return [(spec, adapter) for spec in travel_specs(timeout_s, key_ttl_s, completes_within_s)]


# --- evidence ------------------------------------------------------------------------------------


def _hold_evidence(hold: dict[str, Any]) -> dict[str, Any]:
    return {"hold_id": hold["id"], "flight": hold["flight"], "status": hold["status"],
            "provider": PROVIDER}


def _release_evidence(hold: dict[str, Any]) -> dict[str, Any]:
    return {"hold_id": hold["id"], "status": hold["status"], "provider": PROVIDER}


def _booking_evidence(booking: dict[str, Any]) -> dict[str, Any]:
    return {"booking_id": booking["id"], "hotel": booking["hotel"],
            "status": booking["status"], "provider": PROVIDER}


def _cancel_evidence(booking: dict[str, Any]) -> dict[str, Any]:
    return {"booking_id": booking["id"], "status": booking["status"], "provider": PROVIDER}


def _email_evidence(email: dict[str, Any]) -> dict[str, Any]:
    return {"message_id": email["message_id"], "email_id": email["id"], "to": email["to"],
            "provider": PROVIDER}


Evidence = Callable[[dict[str, Any]], dict[str, Any]]


# --- the adapter ---------------------------------------------------------------------------------


class TravelAdapter(HttpAdapter):
    """Calls and lookups for the five trip tools; which tool is meant follows from the args."""

    async def call(self, args: BaseModel, ctx: CallContext) -> CallResult:
        match args:
            case HoldFlightArgs(flight=flight, passenger=passenger):
                return await self._write(
                    "/flights/holds", {"flight": flight, "passenger": passenger,
                                       "metadata": {METADATA_KEY: ctx.key}},
                    ctx, "held", _hold_evidence)
            case ReleaseFlightHoldArgs(hold_id=hold_id):
                return await self._write(f"/flights/holds/{_segment(hold_id)}/release", {},
                                         ctx, "released", _release_evidence)
            case BookHotelArgs(hotel=hotel, guest=guest, nights=nights):
                return await self._write(
                    "/hotels/bookings", {"hotel": hotel, "guest": guest, "nights": nights,
                                         "metadata": {METADATA_KEY: ctx.key}},
                    ctx, "confirmed", _booking_evidence)
            case CancelHotelBookingArgs(booking_id=booking_id):
                return await self._write(f"/hotels/bookings/{_segment(booking_id)}/cancel", {},
                                         ctx, "cancelled", _cancel_evidence)
            case SendEmailArgs(to=to, subject=subject, body=body):
                return await self._write(
                    "/email/messages", {"to": to, "subject": subject, "body": body,
                                        "message_id": message_id(ctx.key)},
                    ctx, "sent", _email_evidence)
        raise TypeError(f"TravelAdapter serves no tool that takes {type(args).__name__}")

    async def lookup(self, args: BaseModel, ctx: CallContext) -> LookupResult:
        """Find the effect named by our key (tripsim has no search lag, but NotFound is never
        proof on its own: the core decides what it means)."""
        key = ctx.key
        match args:
            case HoldFlightArgs(flight=flight, passenger=passenger):
                found = await self._list("/flights/holds", {"key": key}, ctx)
                return found if isinstance(found, LookupFailed) else _settle_created(
                    found, key, "hold", _hold_evidence, frozenset({"held", "released"}),
                    ours=lambda o: (o.get("metadata") or {}).get(METADATA_KEY) == key,
                    same=lambda o: (o.get("flight"), o.get("passenger")) == (flight, passenger))
            case ReleaseFlightHoldArgs(hold_id=hold_id):
                found = await self._list("/flights/holds", {"release_key": key}, ctx)
                return found if isinstance(found, LookupFailed) else _settle_undo(
                    found, key, hold_id, "hold", "release_keys", "released", _release_evidence)
            case BookHotelArgs(hotel=hotel, guest=guest, nights=nights):
                found = await self._list("/hotels/bookings", {"key": key}, ctx)
                return found if isinstance(found, LookupFailed) else _settle_created(
                    found, key, "booking", _booking_evidence,
                    frozenset({"confirmed", "cancelled"}),
                    ours=lambda o: (o.get("metadata") or {}).get(METADATA_KEY) == key,
                    same=lambda o: (o.get("hotel"), o.get("guest"), o.get("nights")) ==
                    (hotel, guest, nights))
            case CancelHotelBookingArgs(booking_id=booking_id):
                found = await self._list("/hotels/bookings", {"cancel_key": key}, ctx)
                return found if isinstance(found, LookupFailed) else _settle_undo(
                    found, key, booking_id, "booking", "cancel_keys", "cancelled",
                    _cancel_evidence)
            case SendEmailArgs(to=to, subject=subject):
                mid = message_id(key)
                found = await self._list("/email/messages", {"message_id": mid}, ctx)
                return found if isinstance(found, LookupFailed) else _settle_created(
                    found, key, "email", _email_evidence, frozenset({"sent"}),
                    ours=lambda o: o.get("message_id") == mid,
                    same=lambda o: (o.get("to"), o.get("subject")) == (to, subject))
        raise TypeError(f"TravelAdapter serves no tool that takes {type(args).__name__}")

    async def _write(self, path: str, body: dict[str, Any], ctx: CallContext, done: str,
                     evidence: Evidence) -> CallResult:
        response = await self._request("POST", path, ctx.timeout_s, json=body,
                                       headers={"Idempotency-Key": ctx.key})
        if not isinstance(response, httpx.Response):
            return response
        return call_result(response, done, evidence)

    async def _list(self, path: str, params: dict[str, Any],
                    ctx: CallContext) -> list[Any] | LookupFailed:
        response = await self._request("GET", path, ctx.timeout_s,
                                       params={**params, "limit": SEARCH_LIMIT})
        if not isinstance(response, httpx.Response):
            return LookupFailed(f"lookup {path} failed: {response!r}")
        if response.status_code != 200:
            return LookupFailed(f"lookup {path} answered HTTP {response.status_code}: "
                                f"{error_text(response)}")
        try:
            found = response.json()["data"]
            if not isinstance(found, list):
                raise TypeError("data is not a list")
        except Exception as exc:
            return LookupFailed(f"lookup {path} failed: {type(exc).__name__}: {exc}")
        return found


# --- HTTP and what an answer says ----------------------------------------------------------------


def _segment(provider_id: str) -> str:
    """A provider id as one URL path segment (the args pattern already allows no other)."""
    return quote(provider_id, safe="")


def _settle_created(found: list[Any], key: str, noun: str, evidence_of: Evidence,
                    effects: Collection[str], *, ours: Callable[[dict[str, Any]], bool],
                    same: Callable[[dict[str, Any]], bool]) -> LookupResult:
    """What the records found under our key say about a create (hold, booking, email)."""
    try:
        mine = [o for o in reversed(found) if isinstance(o, dict) and ours(o)]  # oldest first
        if not mine:
            return NotFound(f"no {noun} under key {key}")
        for made in mine:
            if not same(made):
                # Our key on something else: claiming done or not done would both be guesses.
                return LookupFailed(f"{noun} {made.get('id')} carries key {key} but is not "
                                    "what this step asked for")
        done = [o for o in mine if o.get("status") in effects]
        if done:
            evidence = evidence_of(done[0])
            if len(done) > 1:
                # A key reused after the provider forgot it: the effect was made twice.
                evidence[f"duplicate_{noun}_ids"] = [o["id"] for o in done[1:]]
            return Found(evidence=evidence, succeeded=True)
        refused = [o for o in mine if o.get("status") == REFUSED]
        if refused:
            reason = " ".join(str(p) for p in (refused[0].get("failure_code"),
                                               refused[0].get("failure_message")) if p)
            return Found(evidence=evidence_of(refused[0]), succeeded=False,
                         reason=reason or f"the {noun} was refused")
        statuses = sorted({str(o.get("status")) for o in mine})
        return LookupFailed(f"{noun} {mine[0].get('id')} is not final ({', '.join(statuses)})")
    except Exception as exc:
        return LookupFailed(f"unreadable {noun}: {type(exc).__name__}: {exc}")


def _settle_undo(found: list[Any], key: str, target_id: str, noun: str, keys_field: str,
                 done: str, evidence_of: Evidence) -> LookupResult:
    """What the records carrying the undo's own key say: Found only for the target, undone."""
    try:
        mine = [o for o in found if isinstance(o, dict) and key in (o.get(keys_field) or [])]
        if not mine:
            return NotFound(f"no {noun} undone under key {key}")
        for undone in mine:
            if undone.get("id") != target_id:
                return LookupFailed(f"undo key {key} is recorded on {noun} {undone.get('id')}, "
                                    f"not on {target_id}")
        if mine[0].get("status") != done:
            return LookupFailed(f"{noun} {target_id} carries undo key {key} but is "
                                f"{mine[0].get('status')!r}")
        return Found(evidence=evidence_of(mine[0]), succeeded=True)
    except Exception as exc:
        return LookupFailed(f"unreadable {noun}: {type(exc).__name__}: {exc}")
