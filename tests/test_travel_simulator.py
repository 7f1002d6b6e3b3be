"""tripsim and the trip tools' adapter, against the simulator served on the test's own loop.

Each test resets the simulator and uses its own keys. A slow commit is awaited with
`POST /_sim/drain` (it answers once every execution in flight has finished), never with a sleep,
and nothing asserts on elapsed time.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from halfway.contract import Outcome, SagaRole
from halfway.core.classify import ConnectionLost, Replied, TimedOut, classify
from halfway.simulators.travel import start_in_process
from halfway.tools.spec import CallContext, Found, NotFound, Succeeded
from halfway.tools.travel import (
    BookHotelArgs,
    CancelHotelBookingArgs,
    HoldFlightArgs,
    ReleaseFlightHoldArgs,
    SendEmailArgs,
    TravelAdapter,
    travel_tools,
)

HTTP_TIMEOUT_S = 30.0  # for the test's own client, which should never time out
SIM_START_TIMEOUT_S = 30.0  # a cold interpreter importing aiohttp and pydantic on a busy machine
SIM_STOP_TIMEOUT_S = 10.0
KEY_TTL_S = 86_400.0

HOLD = HoldFlightArgs(flight="LH454-2025-07-01", passenger="Ada Lovelace")
BOOKING = BookHotelArgs(hotel="HTL-1042", guest="Ada Lovelace", nights=3)
FULL = BookHotelArgs(hotel="HTL-FULL", guest="Ada Lovelace", nights=3)
EMAIL = SendEmailArgs(to="ada@example.com", subject="Your trip", body="LH454, HTL-1042")


@pytest.fixture(scope="session")
async def sim_url() -> AsyncIterator[str]:
    url, stop = await start_in_process(key_ttl_s=KEY_TTL_S)
    yield url
    await stop()


@pytest.fixture
async def sim(sim_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """A raw client on a freshly reset simulator."""
    async with httpx.AsyncClient(base_url=sim_url, timeout=HTTP_TIMEOUT_S) as client:
        (await client.post("/_sim/reset")).raise_for_status()
        yield client


@pytest.fixture
async def adapter(sim: httpx.AsyncClient) -> AsyncIterator[TravelAdapter]:
    async with TravelAdapter(str(sim.base_url)) as a:
        yield a


@pytest.fixture
def key() -> str:
    return f"trip-{uuid.uuid4().hex[:12]}:1"


def _ctx(key: str, *, timeout_s: float = 5.0, attempt: int = 1) -> CallContext:
    return CallContext(step_id=f"step-{key}", key=key, attempt=attempt, timeout_s=timeout_s)


async def _ledger(sim: httpx.AsyncClient) -> dict[str, list[dict[str, Any]]]:
    response = await sim.get("/_sim/ledger")
    response.raise_for_status()
    return response.json()


async def _faults(sim: httpx.AsyncClient, *rules: dict[str, Any]) -> None:
    (await sim.post("/_sim/faults", json={"rules": list(rules)})).raise_for_status()


async def _drain(sim: httpx.AsyncClient) -> None:
    response = await sim.post("/_sim/drain")
    response.raise_for_status()
    assert response.json() == {"in_flight": 0}


async def _hold(adapter: TravelAdapter, key: str) -> str:
    held = await adapter.call(HOLD, _ctx(key))
    assert isinstance(held, Succeeded), held
    return held.evidence["hold_id"]


# --- the process, the tools ----------------------------------------------------------------------


async def test_the_process_prints_one_line_and_serves() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "halfway.simulators.travel", "--port", "0", "--key-ttl-s", "60",
        stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), SIM_START_TIMEOUT_S)).decode()
        assert line.startswith("listening on http://127.0.0.1:"), line
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as client:
            ledger = await client.get(f"{line.strip().removeprefix('listening on ')}/_sim/ledger")
        assert ledger.json() == {"holds": [], "bookings": [], "emails": [], "refused": []}
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), SIM_STOP_TIMEOUT_S)


def test_the_tools_declare_their_saga_roles_and_undos() -> None:
    specs = {spec.name: (spec, adapter) for spec, adapter in travel_tools("http://tripsim")}

    assert list(specs) == ["hold_flight", "release_flight_hold", "book_hotel",
                           "cancel_hotel_booking", "send_email"]
    assert len({id(adapter) for _, adapter in specs.values()}) == 1
    hold, book, email = specs["hold_flight"][0], specs["book_hotel"][0], specs["send_email"][0]
    assert (hold.undo.tool, hold.undo.args) == ("release_flight_hold",
                                                {"hold_id": "$result.hold_id"})
    assert (book.undo.tool, book.undo.args) == ("cancel_hotel_booking",
                                                {"booking_id": "$result.booking_id"})
    assert (email.saga_role, email.undo) == (SagaRole.RETRIABLE, None)
    assert specs["release_flight_hold"][0].saga_role is None
    assert hold.subject(HOLD) == "flight:LH454-2025-07-01:Ada Lovelace"
    assert book.subject(BOOKING) == "hotel:HTL-1042:Ada Lovelace"
    assert email.subject(EMAIL) == "email:ada@example.com:Your trip"
    with pytest.raises(ValueError, match="nights"):
        BookHotelArgs.model_validate({"hotel": "HTL-1", "guest": "Ada", "nights": "3"})


def test_the_tools_carry_the_providers_bound_only_when_given() -> None:
    assert {spec.completes_within_s for spec, _ in travel_tools("http://tripsim")} == {None}
    bounded = travel_tools("http://tripsim", completes_within_s=660.0)
    assert {spec.completes_within_s for spec, _ in bounded} == {660.0}


# --- flights -------------------------------------------------------------------------------------


async def test_hold_then_release_and_the_ledger_has_the_history(
        sim: httpx.AsyncClient, adapter: TravelAdapter, key: str) -> None:
    held = await adapter.call(HOLD, _ctx(key))
    assert isinstance(held, Succeeded)
    assert not held.replayed
    hold_id = held.evidence["hold_id"]
    assert held.evidence == {"hold_id": hold_id, "flight": HOLD.flight, "status": "held",
                             "provider": "tripsim"}
    assert hold_id.startswith("hold_")

    undo_key = f"{key}:undo"
    released = await adapter.call(ReleaseFlightHoldArgs(hold_id=hold_id), _ctx(undo_key))
    assert released == Succeeded({"hold_id": hold_id, "status": "released",
                                  "provider": "tripsim"})

    [hold] = (await _ledger(sim))["holds"]
    assert (hold["id"], hold["status"], hold["idempotency_key"]) == (hold_id, "released", key)
    assert hold["metadata"] == {"halfway_key": key}
    assert [(h["status"], h["key"]) for h in hold["history"]] == [("held", key),
                                                                  ("released", undo_key)]
    assert hold["release_keys"] == [undo_key]
    found = await adapter.lookup(HOLD, _ctx(key))  # the hold happened, and was undone since
    assert found == Found({"hold_id": hold_id, "flight": HOLD.flight, "status": "released",
                           "provider": "tripsim"})


async def test_the_same_key_replays_the_same_hold(
        sim: httpx.AsyncClient, adapter: TravelAdapter, key: str) -> None:
    first = await adapter.call(HOLD, _ctx(key))
    again = await adapter.call(HOLD, _ctx(key, attempt=2))

    assert isinstance(first, Succeeded)
    assert isinstance(again, Succeeded)
    assert again.replayed
    assert again.evidence == first.evidence
    assert len((await _ledger(sim))["holds"]) == 1
    logged = (await sim.get("/_sim/requests")).json()["requests"]
    assert [(r["endpoint"], r["key"], r["number"], r["status"], r["replayed"])
            for r in logged] == [("flights.hold", key, 1, 200, False),
                                 ("flights.hold", key, 2, 200, True)]


async def test_the_same_key_with_other_params_is_refused_with_400(
        sim: httpx.AsyncClient, adapter: TravelAdapter, key: str) -> None:
    await _hold(adapter, key)

    other = await adapter.call(HoldFlightArgs(flight="LH455-2025-07-02", passenger="Ada"),
                               _ctx(key, attempt=2))

    assert isinstance(other, Replied)
    assert (other.status, other.code) == (400, "idempotency_error")
    assert len((await _ledger(sim))["holds"]) == 1


async def test_a_reply_slower_than_the_timeout_is_timed_out_and_the_hold_lands(
        sim: httpx.AsyncClient, adapter: TravelAdapter, key: str) -> None:
    await _faults(sim, {"match": {"endpoint": "flights.hold", "nth": 1},
                        "action": {"delay_s": 2.0}})
    # The adapter's client made and a connection pooled first (a lookup is not a write): the
    # 0.5 s below is the reply's, not a connect's on a loaded machine (that is NotSent).
    assert isinstance(await adapter.lookup(HOLD, _ctx(key)), NotFound)

    result = await adapter.call(HOLD, _ctx(key, timeout_s=0.5))
    assert result == TimedOut(0.5)
    await _drain(sim)  # the client gave up; the simulator still commits

    [hold] = (await _ledger(sim))["holds"]
    found = await adapter.lookup(HOLD, _ctx(key))
    assert isinstance(found, Found)
    assert found.succeeded
    assert found.evidence["hold_id"] == hold["id"]
    retried = await adapter.call(HOLD, _ctx(key, attempt=2))
    assert isinstance(retried, Succeeded)
    assert retried.replayed


async def test_a_lost_reply_is_connection_lost_and_a_lookup_finds_the_hold(
        sim: httpx.AsyncClient, adapter: TravelAdapter, key: str) -> None:
    await _faults(sim, {"match": {"key": key}, "times": 1, "action": {"lose_reply": True}})

    result = await adapter.call(HOLD, _ctx(key))

    assert isinstance(result, ConnectionLost)
    [hold] = (await _ledger(sim))["holds"]
    found = await adapter.lookup(HOLD, _ctx(key))
    assert isinstance(found, Found)
    assert found.evidence["hold_id"] == hold["id"]


async def test_a_500_before_commit_leaves_nothing_to_find(
        sim: httpx.AsyncClient, adapter: TravelAdapter, key: str) -> None:
    await _faults(sim, {"match": {"key": key}, "action": {"status": 503,
                                                          "when": "before_commit"}})

    result = await adapter.call(HOLD, _ctx(key))

    assert isinstance(result, Replied)
    assert result.status == 503
    assert classify(result).outcome is Outcome.UNKNOWN
    assert (await _ledger(sim))["holds"] == []
    assert isinstance(await adapter.lookup(HOLD, _ctx(key)), NotFound)


async def test_a_release_is_found_by_its_own_key_and_a_fault_can_target_it(
        sim: httpx.AsyncClient, adapter: TravelAdapter, key: str) -> None:
    await _faults(sim, {"match": {"endpoint": "flights.release", "nth": 1},
                        "action": {"status": 500, "when": "after_commit"}})
    hold_id = await _hold(adapter, key)  # the rule counts releases only: untouched
    release = ReleaseFlightHoldArgs(hold_id=hold_id)
    undo_key = f"{key}:undo"
    assert isinstance(await adapter.lookup(release, _ctx(undo_key)), NotFound)

    result = await adapter.call(release, _ctx(undo_key))
    assert isinstance(result, Replied)
    assert result.status == 500
    replay = await sim.post(f"/flights/holds/{hold_id}/release",
                            headers={"Idempotency-Key": undo_key})
    assert (replay.status_code, replay.headers["Idempotent-Replayed"]) == (500, "true")

    found = await adapter.lookup(release, _ctx(undo_key))
    assert found == Found({"hold_id": hold_id, "status": "released", "provider": "tripsim"})
    assert isinstance(await adapter.lookup(release, _ctx(f"{key}:other")), NotFound)
    again = await adapter.call(release, _ctx(f"{key}:undo-2"))  # already released: 200
    assert isinstance(again, Succeeded)
    unknown = await adapter.call(ReleaseFlightHoldArgs(hold_id="hold_nope"), _ctx(f"{key}:x"))
    assert isinstance(unknown, Replied)
    assert (unknown.status, unknown.code) == (404, "resource_missing")
    logged = (await sim.get("/_sim/requests")).json()["requests"]
    assert [(r["endpoint"], r["endpoint_number"], r["status"]) for r in logged] == [
        ("flights.hold", 1, 200), ("flights.release", 1, 500), ("flights.release", 2, 500),
        ("flights.release", 3, 200), ("flights.release", 4, 404)]


async def test_an_expired_key_is_a_new_request_and_the_lookup_shows_the_duplicate(
        sim: httpx.AsyncClient, adapter: TravelAdapter, key: str) -> None:
    first = await _hold(adapter, key)
    (await sim.post("/_sim/clock", json={"advance_s": KEY_TTL_S + 1})).raise_for_status()

    again = await adapter.call(HOLD, _ctx(key, attempt=2))

    assert isinstance(again, Succeeded)
    assert not again.replayed
    assert again.evidence["hold_id"] != first
    found = await adapter.lookup(HOLD, _ctx(key))
    assert isinstance(found, Found)
    assert found.evidence["hold_id"] == first
    assert found.evidence["duplicate_hold_ids"] == [again.evidence["hold_id"]]


# --- hotels --------------------------------------------------------------------------------------


async def test_a_full_hotel_refuses_with_422_a_found_refusal_and_no_booking(
        sim: httpx.AsyncClient, adapter: TravelAdapter, key: str) -> None:
    result = await adapter.call(FULL, _ctx(key))

    assert isinstance(result, Replied)
    assert (result.status, result.code) == (422, "no_availability")
    assert classify(result).outcome is Outcome.NOT_DONE
    found = await adapter.lookup(FULL, _ctx(key))
    assert isinstance(found, Found)
    assert not found.succeeded
    assert found.reason.startswith("no_availability")
    assert found.evidence["status"] == "refused"
    ledger = await _ledger(sim)
    assert ledger["bookings"] == []
    [refused] = ledger["refused"]
    assert (refused["id"], refused["hotel"]) == (found.evidence["booking_id"], "HTL-FULL")


async def test_a_booking_is_cancelled_and_the_full_set_is_configurable(
        sim: httpx.AsyncClient, adapter: TravelAdapter, key: str) -> None:
    booked = await adapter.call(BOOKING, _ctx(key))
    assert isinstance(booked, Succeeded)
    booking_id = booked.evidence["booking_id"]
    assert booked.evidence == {"booking_id": booking_id, "hotel": "HTL-1042",
                               "status": "confirmed", "provider": "tripsim"}
    cancel = CancelHotelBookingArgs(booking_id=booking_id)

    cancelled = await adapter.call(cancel, _ctx(f"{key}:undo"))

    assert cancelled == Succeeded({"booking_id": booking_id, "status": "cancelled",
                                   "provider": "tripsim"})
    assert await adapter.lookup(cancel, _ctx(f"{key}:undo")) == Found(cancelled.evidence)
    (await sim.post("/_sim/hotels/full", json={"hotels": ["HTL-1042"]})).raise_for_status()
    refused = await adapter.call(BOOKING, _ctx(f"{key}-2"))
    assert isinstance(refused, Replied)
    assert refused.code == "no_availability"
    [booking] = (await _ledger(sim))["bookings"]
    assert [h["status"] for h in booking["history"]] == ["confirmed", "cancelled"]


# --- email ---------------------------------------------------------------------------------------


async def test_an_email_is_sent_once_and_found_by_its_message_id(
        sim: httpx.AsyncClient, adapter: TravelAdapter, key: str) -> None:
    sent = await adapter.call(EMAIL, _ctx(key))
    replayed = await adapter.call(EMAIL, _ctx(key, attempt=2))

    assert isinstance(sent, Succeeded)
    assert sent.evidence == {"message_id": f"<{key}@halfway.local>",
                             "email_id": sent.evidence["email_id"], "to": "ada@example.com",
                             "provider": "tripsim"}
    assert isinstance(replayed, Succeeded)
    assert replayed.replayed
    assert await adapter.lookup(EMAIL, _ctx(key)) == Found(sent.evidence)
    [email] = (await _ledger(sim))["emails"]
    assert (email["id"], email["status"]) == (sent.evidence["email_id"], "sent")
    assert isinstance(await adapter.lookup(EMAIL, _ctx(f"{key}-nobody")), NotFound)


async def test_a_bounced_address_is_422_and_found_as_refused(
        sim: httpx.AsyncClient, adapter: TravelAdapter, key: str) -> None:
    bounce = SendEmailArgs(to="ada@bounce.invalid", subject="Your trip", body="...")

    result = await adapter.call(bounce, _ctx(key))

    assert isinstance(result, Replied)
    assert (result.status, result.code) == (422, "invalid_recipient")
    assert classify(result).outcome is Outcome.NOT_DONE
    found = await adapter.lookup(bounce, _ctx(key))
    assert isinstance(found, Found)
    assert not found.succeeded
    assert found.reason.startswith("invalid_recipient")
    ledger = await _ledger(sim)
    assert ledger["emails"] == []
    assert [r["status"] for r in ledger["refused"]] == ["refused"]
