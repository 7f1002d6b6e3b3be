"""The Stripe tools (`halfway.tools.stripe_payments`) through the official `stripe` client,
against paysim running as a real process; and paysim's PaymentIntents, refunds and events.

Each test resets the simulator and uses its own keys. Waits are bounded polls of the
simulator's own records, never fixed sleeps, and nothing asserts on elapsed time. Every test
that makes a call also counts paysim's request log: one journaled attempt is exactly one HTTP
request (the library's own retries are off).
"""

from __future__ import annotations

import asyncio
import json
import socket
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from datetime import UTC, datetime
from typing import Any, TypeVar

import httpx
import pytest
import stripe
from aiohttp import web

from halfway import App
from halfway.contract import EffectClass, Outcome, SagaRole
from halfway.contract.webhooks import WebhookReceived
from halfway.core.classify import (
    ConnectionLost,
    NotSent,
    Replied,
    TimedOut,
    ToolRefused,
    Unexpected,
    classify,
)
from halfway.simulators.payments import WEBHOOK_SECRET_DEFAULT, start_in_process
from halfway.tools.payments import ChargeArgs
from halfway.tools.spec import CallContext, Found, LookupFailed, NotFound, Succeeded
from halfway.tools.stripe_payments import (
    ChargeAdapter,
    RefundAdapter,
    RefundArgs,
    StripeConnection,
    intent_result,
    stripe_app,
    stripe_failure,
    stripe_tools,
)
from tests.test_payment_simulator import _simulator

POLL_INTERVAL_S = 0.05
POLL_ATTEMPTS_MAX = 400  # 20 s at most, for things that land within a few seconds
HTTP_TIMEOUT_S = 30.0
API_KEY = "sk_test_halfway_0123456789"

T = TypeVar("T")


@pytest.fixture(scope="session")
async def stripe_sim_url() -> AsyncIterator[str]:
    async with _simulator() as url:
        yield url


@pytest.fixture
async def sim(stripe_sim_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """A raw client on a freshly reset simulator."""
    async with httpx.AsyncClient(base_url=stripe_sim_url, timeout=HTTP_TIMEOUT_S) as client:
        (await client.post("/_sim/reset")).raise_for_status()
        yield client


@pytest.fixture
async def tools(sim: httpx.AsyncClient) -> AsyncIterator[tuple[ChargeAdapter, RefundAdapter]]:
    """The two adapters as `stripe_tools` adds them to an app."""
    app = App(name="stripe-test")
    connection = stripe_tools(app, api_key=API_KEY, api_base=str(sim.base_url), timeout_s=5.0)
    registry = app.registry()
    charge, refund = registry.get("charge_customer"), registry.get("refund_payment")
    assert charge is not None
    assert refund is not None
    assert isinstance(charge.adapter, ChargeAdapter)
    assert isinstance(refund.adapter, RefundAdapter)
    yield charge.adapter, refund.adapter
    await registry.aclose()
    await connection.aclose()  # closing again is harmless


@pytest.fixture
def charger(tools: tuple[ChargeAdapter, RefundAdapter]) -> ChargeAdapter:
    return tools[0]


@pytest.fixture
def key() -> str:
    return f"renewal-{uuid.uuid4().hex[:12]}:1"


@pytest.fixture
def free_port() -> Iterator[int]:
    """A port that refuses connections: bound, never listening, held for the whole test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


ARGS = ChargeArgs(invoice="INV-2291", customer="cus_1", amount_cents=4900)


def _ctx(key: str, *, timeout_s: float = 5.0, attempt: int = 1) -> CallContext:
    return CallContext(step_id=key, key=key, attempt=attempt, timeout_s=timeout_s)


async def _ledger(sim: httpx.AsyncClient) -> dict[str, list[dict[str, Any]]]:
    response = await sim.get("/_sim/ledger")
    response.raise_for_status()
    return response.json()


async def _intents(sim: httpx.AsyncClient, key: str) -> list[dict[str, Any]]:
    return [i for i in (await _ledger(sim))["payment_intents"] if i["idempotency_key"] == key]


async def _writes(sim: httpx.AsyncClient, key: str) -> list[dict[str, Any]]:
    """The write requests paysim received with this key (every HTTP request, retries too)."""
    logged = (await sim.get("/_sim/requests")).json()["requests"]
    return [r for r in logged if r["idempotency_key"] == key]


async def _faults(sim: httpx.AsyncClient, *rules: dict[str, Any]) -> None:
    (await sim.post("/_sim/faults", json={"rules": list(rules)})).raise_for_status()


async def _until(probe: Callable[[], Awaitable[T | None]], what: str) -> T:
    for _ in range(POLL_ATTEMPTS_MAX):
        found = await probe()
        if found is not None:
            return found
        await asyncio.sleep(POLL_INTERVAL_S)
    raise AssertionError(f"gave up waiting for {what}")


def _outcome(result: Any, attempt: int = 1) -> Outcome:
    return Outcome.DONE if isinstance(result, Succeeded) else classify(result,
                                                                       attempt=attempt).outcome


# --- the call: done, replayed, refused ------------------------------------------------------------


async def test_create_and_confirm_succeeds_with_evidence_and_our_key_everywhere(
        sim: httpx.AsyncClient, charger: ChargeAdapter, key: str) -> None:
    result = await charger.call(ARGS, _ctx(key))

    assert isinstance(result, Succeeded), result
    assert not result.replayed
    (intent,) = await _intents(sim, key)
    assert result.evidence == {"payment_intent_id": intent["id"],
                               "charge_id": intent["latest_charge"], "amount_cents": 4900,
                               "currency": "usd", "status": "succeeded", "provider": "stripe"}
    assert intent["metadata"] == {"halfway_key": key, "halfway_step": key, "invoice": "INV-2291"}
    assert (intent["status"], intent["customer"], intent["amount_received"]) == \
        ("succeeded", "cus_1", 4900)
    # The intent's payment is a charge in the ledger, carrying the intent and its metadata.
    (charge,) = [c for c in (await _ledger(sim))["charges"] if c["id"] == intent["latest_charge"]]
    assert (charge["payment_intent"], charge["metadata"]) == (intent["id"], intent["metadata"])
    (write,) = await _writes(sim, key)
    assert (write["endpoint"], write["status"]) == ("payment_intents.create", 200)
    assert write["params"]["confirm"] == "true"


async def test_the_same_key_twice_is_one_intent_and_the_second_answer_is_replayed(
        sim: httpx.AsyncClient, charger: ChargeAdapter, key: str) -> None:
    first = await charger.call(ARGS, _ctx(key))
    again = await charger.call(ARGS, _ctx(key, attempt=2))

    assert isinstance(first, Succeeded)
    assert isinstance(again, Succeeded)
    assert (first.replayed, again.replayed) == (False, True)
    assert again.evidence == first.evidence
    assert len(await _intents(sim, key)) == 1
    assert [(w["status"], w["replayed"]) for w in await _writes(sim, key)] == \
        [(200, False), (200, True)]


async def test_a_decline_is_a_402_card_error_not_done_and_found_failed(
        sim: httpx.AsyncClient, charger: ChargeAdapter, key: str) -> None:
    declined = ARGS.model_copy(update={"customer": "cus_declined"})
    result = await charger.call(declined, _ctx(key))

    assert isinstance(result, Replied), result
    assert (result.status, result.code) == (402, "card_declined")
    assert "generic_decline" in result.message
    assert _outcome(result) is Outcome.NOT_DONE
    again = await charger.call(declined, _ctx(key, attempt=2))  # saved, so replayed
    assert isinstance(again, Replied)
    assert (again.status, again.replayed) == (402, True)
    assert _outcome(again, attempt=2) is Outcome.NOT_DONE

    found = await charger.lookup(declined, _ctx(key))
    assert isinstance(found, Found), found
    assert not found.succeeded
    assert "card_declined" in found.reason
    (intent,) = await _intents(sim, key)
    assert intent["status"] == "requires_payment_method"
    assert len(await _writes(sim, key)) == 2


async def test_an_injected_decline_fault_is_a_decline(
        sim: httpx.AsyncClient, charger: ChargeAdapter, key: str) -> None:
    await _faults(sim, {"match": {"key": key}, "action": {"decline": True}})
    result = await charger.call(ARGS, _ctx(key))
    assert isinstance(result, Replied)
    assert result.status == 402


async def test_a_500_after_commit_is_saved_replayed_unknown_and_the_lookup_finds_it(
        sim: httpx.AsyncClient, charger: ChargeAdapter, key: str) -> None:
    await _faults(sim, {"match": {"key": key}, "times": 1,
                        "action": {"status": 500, "when": "after_commit"}})
    first = await charger.call(ARGS, _ctx(key))
    assert isinstance(first, Replied)
    assert (first.status, first.replayed) == (500, False)
    assert _outcome(first) is Outcome.UNKNOWN

    # A retry with the key can never resolve it: Stripe replays the saved 500.
    again = await charger.call(ARGS, _ctx(key, attempt=2))
    assert isinstance(again, Replied)
    assert (again.status, again.replayed) == (500, True)
    assert _outcome(again, attempt=2) is Outcome.UNKNOWN
    assert "replayed" in classify(again, attempt=2).reason

    found = await charger.lookup(ARGS, _ctx(key))
    (intent,) = await _intents(sim, key)
    assert isinstance(found, Found), found
    assert found.succeeded
    assert found.evidence["payment_intent_id"] == intent["id"]
    assert len(await _writes(sim, key)) == 2  # one request per attempt: no hidden retries


async def test_a_500_before_commit_is_unknown_and_nothing_is_found(
        sim: httpx.AsyncClient, charger: ChargeAdapter, key: str) -> None:
    await _faults(sim, {"match": {"key": key}, "times": 1,
                        "action": {"status": 503, "when": "before_commit"}})
    result = await charger.call(ARGS, _ctx(key))
    assert isinstance(result, Replied)
    assert result.status == 503
    assert _outcome(result) is Outcome.UNKNOWN
    assert isinstance(await charger.lookup(ARGS, _ctx(key)), NotFound)
    assert await _intents(sim, key) == []
    assert len(await _writes(sim, key)) == 1


async def test_slower_than_the_timeout_is_unknown_then_the_lookup_finds_one_intent(
        sim: httpx.AsyncClient, charger: ChargeAdapter, key: str) -> None:
    await _faults(sim, {"match": {"key": key}, "times": 1, "action": {"delay_s": 1.5}})
    result = await charger.call(ARGS, _ctx(key, timeout_s=0.5))

    assert isinstance(result, TimedOut), result
    assert _outcome(result) is Outcome.UNKNOWN

    async def found() -> Found | None:
        looked = await charger.lookup(ARGS, _ctx(key))
        return looked if isinstance(looked, Found) else None

    settled = await _until(found, "the slow payment to land")
    assert settled.succeeded
    (intent,) = await _intents(sim, key)
    assert settled.evidence["payment_intent_id"] == intent["id"]
    retried = await charger.call(ARGS, _ctx(key, attempt=2))
    assert isinstance(retried, Succeeded)
    assert retried.replayed
    assert len(await _intents(sim, key)) == 1
    assert len(await _writes(sim, key)) == 2


async def test_the_same_key_while_the_first_is_in_flight_is_409_unknown(
        sim: httpx.AsyncClient, charger: ChargeAdapter, key: str) -> None:
    await _faults(sim, {"match": {"key": key}, "times": 1, "action": {"delay_s": 3.0}})
    first = asyncio.create_task(charger.call(ARGS, _ctx(key, timeout_s=20.0)))

    async def executing() -> bool | None:
        logged = await _writes(sim, key)
        return True if logged and logged[0]["params"] and logged[0]["status"] is None else None

    await _until(executing, "the first request to start executing")
    second = await charger.call(ARGS, _ctx(key, attempt=2))
    assert isinstance(second, Replied), second
    assert (second.status, second.code) == (409, "idempotency_key_in_use")
    assert _outcome(second, attempt=2) is Outcome.UNKNOWN

    done = await first
    assert isinstance(done, Succeeded)
    assert len(await _intents(sim, key)) == 1
    # The library retries 409s by default; with its retries off, the 409 was one request.
    assert [w["status"] for w in await _writes(sim, key)] == [200, 409]


async def test_a_429_is_unknown_and_not_saved(
        sim: httpx.AsyncClient, charger: ChargeAdapter, key: str) -> None:
    await _faults(sim, {"match": {"key": key}, "times": 1, "action": {"status": 429}})
    limited = await charger.call(ARGS, _ctx(key))

    assert isinstance(limited, Replied)
    assert (limited.status, limited.code) == (429, "rate_limit")
    assert _outcome(limited) is Outcome.UNKNOWN
    retried = await charger.call(ARGS, _ctx(key, attempt=2))
    assert isinstance(retried, Succeeded)
    assert not retried.replayed
    assert len(await _writes(sim, key)) == 2


async def test_a_refused_connection_is_never_reached_on_attempt_one_only(
        free_port: int, key: str) -> None:
    app = App(name="refused")
    connection = stripe_tools(app, api_key=API_KEY, api_base=f"http://127.0.0.1:{free_port}",
                              timeout_s=2.0, refunds=False)
    tool = app.registry().get("charge_customer")
    assert tool is not None
    try:
        result = await tool.adapter.call(ARGS, _ctx(key))
        assert isinstance(result, NotSent), result
        assert _outcome(result, attempt=1) is Outcome.NOT_DONE
        assert _outcome(result, attempt=2) is Outcome.UNKNOWN
        assert isinstance(await tool.adapter.lookup(ARGS, _ctx(key)), LookupFailed)
    finally:
        await connection.aclose()


async def test_a_lost_reply_is_unknown_the_lookup_finds_it_and_a_retry_replays(
        sim: httpx.AsyncClient, charger: ChargeAdapter, key: str) -> None:
    await _faults(sim, {"match": {"key": key}, "times": 1, "action": {"lose_reply": True}})
    lost = await charger.call(ARGS, _ctx(key))

    assert isinstance(lost, ConnectionLost), lost
    assert _outcome(lost) is Outcome.UNKNOWN
    (intent,) = await _intents(sim, key)
    found = await charger.lookup(ARGS, _ctx(key))
    assert isinstance(found, Found)
    assert found.evidence["payment_intent_id"] == intent["id"]
    retried = await charger.call(ARGS, _ctx(key, attempt=2))
    assert isinstance(retried, Succeeded)
    assert retried.replayed
    assert retried.evidence["payment_intent_id"] == intent["id"]
    assert [w["reply_lost"] for w in await _writes(sim, key)] == [True, False]


async def test_the_count_would_show_hidden_retries(
        sim: httpx.AsyncClient, key: str) -> None:
    """The request log sees every request: the library left at its retries sends three for a
    saved 500 (and would for a 409, a reset or a timeout), all inside one call."""
    await _faults(sim, {"match": {"key": key}, "action": {"status": 500, "when": "after_commit"}})
    client = stripe.StripeClient(API_KEY, base_addresses={"api": str(sim.base_url)},
                                 max_network_retries=2)
    with pytest.raises(stripe.APIError):
        await asyncio.to_thread(client.v1.payment_intents.create,
                                {"amount": 4900, "currency": "usd", "customer": "cus_1"},
                                {"idempotency_key": key})
    assert [(w["status"], w["replayed"]) for w in await _writes(sim, key)] == \
        [(500, False), (500, True), (500, True)]


@pytest.mark.parametrize("action", [
    {"status": 500, "when": "after_commit"},
    {"status": 502, "when": "before_commit"},
    {"lose_reply": True},
])
async def test_one_http_request_per_attempt_whatever_the_failure(
        sim: httpx.AsyncClient, charger: ChargeAdapter, key: str,
        action: dict[str, Any]) -> None:
    await _faults(sim, {"match": {"key": key}, "action": action})
    for attempt in (1, 2, 3):
        result = await charger.call(ARGS, _ctx(key, attempt=attempt))
        assert _outcome(result, attempt=attempt) is Outcome.UNKNOWN, result
        assert len(await _writes(sim, key)) == attempt


async def test_the_key_with_other_parameters_is_an_idempotency_error_and_unknown(
        sim: httpx.AsyncClient, charger: ChargeAdapter, key: str) -> None:
    assert isinstance(await charger.call(ARGS, _ctx(key)), Succeeded)
    other = ARGS.model_copy(update={"amount_cents": 5000})
    result = await charger.call(other, _ctx(key, attempt=2))

    # This request was refused, but the key's first request did happen: never proof.
    assert isinstance(result, Unexpected), result
    assert "idempotency" in result.what.lower()
    assert _outcome(result, attempt=2) is Outcome.UNKNOWN
    assert len(await _intents(sim, key)) == 1


async def test_a_configured_payment_method_is_sent_and_invalid_parameters_refused(
        sim: httpx.AsyncClient, stripe_sim_url: str, key: str) -> None:
    app = App(name="with-pm")
    connection = stripe_tools(app, api_key=API_KEY, api_base=stripe_sim_url, timeout_s=5.0,
                              payment_method="pm_card_visa", off_session=True, refunds=False)
    tool = app.registry().get("charge_customer")
    assert tool is not None
    assert isinstance(tool.adapter, ChargeAdapter)
    try:
        paid = await tool.adapter.call(ARGS, _ctx(key))
        # A currency the arguments' model would refuse, sent anyway: paysim refuses it as
        # Stripe would, 400 before the endpoint runs, and saves nothing under the key.
        bad = await tool.adapter.call(ARGS.model_copy(update={"currency": "us1"}),
                                      _ctx(f"{key}-bad"))
    finally:
        await connection.aclose()
    assert isinstance(paid, Succeeded), paid
    (write,) = await _writes(sim, key)
    assert (write["params"]["payment_method"], write["params"]["off_session"]) == \
        ("pm_card_visa", "true")
    assert isinstance(bad, Replied), bad
    assert (bad.status, bad.replayed) == (400, False)
    assert _outcome(bad, attempt=3) is Outcome.NOT_DONE
    assert await _intents(sim, f"{key}-bad") == []


async def test_a_wrong_api_key_is_never_reached_on_attempt_one_only(key: str) -> None:
    url, stop = await start_in_process(api_key=API_KEY)
    app = App(name="keys")
    wrong = stripe_tools(app, api_key="sk_test_wrong_key_0000", api_base=url, timeout_s=5.0,
                         refunds=False)
    right_app = App(name="keys-right")
    right = stripe_tools(right_app, api_key=API_KEY, api_base=url, timeout_s=5.0, refunds=False)
    try:
        tool = app.registry().get("charge_customer")
        assert tool is not None
        result = await tool.adapter.call(ARGS, _ctx(key))
        assert isinstance(result, NotSent), result
        assert "401" in result.why
        assert API_KEY not in result.why
        assert "sk_test_wrong_key_0000" not in result.why  # Stripe masks keys; so does paysim
        assert _outcome(result, attempt=1) is Outcome.NOT_DONE
        assert _outcome(result, attempt=2) is Outcome.UNKNOWN
        good = right_app.registry().get("charge_customer")
        assert good is not None
        assert isinstance(await good.adapter.call(ARGS, _ctx(key, attempt=2)), Succeeded)
    finally:
        await wrong.aclose()
        await right.aclose()
        await stop()


# --- the lookup -----------------------------------------------------------------------------------


async def test_with_search_lagging_the_events_fallback_finds_the_intent(
        sim: httpx.AsyncClient, charger: ChargeAdapter, key: str) -> None:
    (await sim.post("/_sim/search", json={"lag_s": 600})).raise_for_status()
    made = await charger.call(ARGS, _ctx(key))
    assert isinstance(made, Succeeded)
    searched = (await sim.get("/v1/payment_intents/search",
                              params={"query": f"metadata['halfway_key']:'{key}'"})).json()
    assert (searched["object"], searched["data"]) == ("search_result", [])

    found = await charger.lookup(ARGS, _ctx(key))
    assert isinstance(found, Found), found
    assert found.succeeded
    assert found.evidence == made.evidence
    assert isinstance(await charger.lookup(ARGS, _ctx(f"{key}-other")), NotFound)

    (await sim.post("/_sim/clock", json={"advance_s": 601})).raise_for_status()
    searched = (await sim.get("/v1/payment_intents/search",
                              params={"query": f"metadata['halfway_key']:'{key}'"})).json()
    assert [i["id"] for i in searched["data"]] == [made.evidence["payment_intent_id"]]


async def test_an_intent_under_our_key_with_other_amounts_is_for_an_operator(
        sim: httpx.AsyncClient, charger: ChargeAdapter, key: str) -> None:
    assert isinstance(await charger.call(ARGS, _ctx(key)), Succeeded)
    found = await charger.lookup(ARGS.model_copy(update={"amount_cents": 5000}), _ctx(key))
    assert isinstance(found, LookupFailed), found
    assert "4900" in found.detail
    assert "5000" in found.detail


async def test_two_succeeded_intents_under_one_key_are_found_with_the_other_named(
        sim: httpx.AsyncClient, charger: ChargeAdapter, key: str) -> None:
    first = await charger.call(ARGS, _ctx(key))
    (await sim.post("/_sim/clock", json={"advance_s": 86_401})).raise_for_status()
    second = await charger.call(ARGS, _ctx(key, attempt=2))  # the key was forgotten
    assert isinstance(first, Succeeded)
    assert isinstance(second, Succeeded)
    assert not second.replayed

    found = await charger.lookup(ARGS, _ctx(key))
    assert isinstance(found, Found)
    assert found.succeeded
    assert found.evidence["payment_intent_id"] == first.evidence["payment_intent_id"]
    assert found.others == (second.evidence["payment_intent_id"],)


def test_what_a_2xx_intent_says() -> None:
    base = {"id": "pi_1", "amount": 4900, "currency": "usd", "customer": "cus_1"}
    assert isinstance(intent_result({**base, "status": "succeeded"}, replayed=True), Succeeded)
    for pending in ("processing", "requires_action", "requires_confirmation"):
        result = intent_result({**base, "status": pending}, replayed=False)
        assert isinstance(result, Unexpected)
        assert _outcome(result) is Outcome.UNKNOWN
    canceled = intent_result({**base, "status": "canceled"}, replayed=False)
    assert isinstance(canceled, ToolRefused)
    assert _outcome(canceled) is Outcome.NOT_DONE
    failed = intent_result({**base, "status": "requires_payment_method",
                            "last_payment_error": {"code": "card_declined"}}, replayed=False)
    assert isinstance(failed, ToolRefused)
    assert "card_declined" in failed.reason


# --- the exception table --------------------------------------------------------------------------


def _error_body(kind: str, code: str | None = None) -> dict[str, Any]:
    return {"error": {"type": kind, "message": "words", **({"code": code} if code else {})}}


@pytest.mark.parametrize(("exc", "expected", "outcome_1", "outcome_2"), [
    (stripe.CardError("declined", None, "card_declined", http_status=402,
                      json_body=_error_body("card_error", "card_declined")),
     Replied, Outcome.NOT_DONE, Outcome.NOT_DONE),
    (stripe.InvalidRequestError("no such", "id", "resource_missing", http_status=404,
                                json_body=_error_body("invalid_request_error")),
     Replied, Outcome.NOT_DONE, Outcome.NOT_DONE),
    (stripe.IdempotencyError("other params", http_status=400,
                             json_body=_error_body("idempotency_error")),
     Unexpected, Outcome.UNKNOWN, Outcome.UNKNOWN),
    (stripe.RateLimitError("slow down", http_status=400,
                           json_body=_error_body("invalid_request_error", "rate_limit")),
     Replied, Outcome.UNKNOWN, Outcome.UNKNOWN),
    (stripe.AuthenticationError("bad key", http_status=401,
                                json_body=_error_body("invalid_request_error")),
     NotSent, Outcome.NOT_DONE, Outcome.UNKNOWN),
    (stripe.PermissionError("restricted", http_status=403,
                            json_body=_error_body("invalid_request_error")),
     NotSent, Outcome.NOT_DONE, Outcome.UNKNOWN),
    (stripe.PermissionError("restricted", http_status=403, headers={"Idempotent-Replayed": "true"},
                            json_body=_error_body("invalid_request_error")),
     Replied, Outcome.NOT_DONE, Outcome.NOT_DONE),
    (stripe.APIError("conflict", http_status=409, json_body=_error_body("api_error")),
     Replied, Outcome.UNKNOWN, Outcome.UNKNOWN),
    (stripe.APIError("dependency", http_status=424, json_body=_error_body("api_error")),
     Unexpected, Outcome.UNKNOWN, Outcome.UNKNOWN),
    (stripe.APIError("oops", http_status=500, json_body=_error_body("api_error")),
     Replied, Outcome.UNKNOWN, Outcome.UNKNOWN),
    (stripe.APIError("Invalid response body from API", http_status=200),
     Unexpected, Outcome.UNKNOWN, Outcome.UNKNOWN),
    (stripe.APIConnectionError("no cause"), Unexpected, Outcome.UNKNOWN, Outcome.UNKNOWN),
])
def test_each_library_exception_reports_what_it_proves(
        exc: stripe.StripeError, expected: type, outcome_1: Outcome,
        outcome_2: Outcome) -> None:
    failure = stripe_failure(exc, 5.0)
    assert isinstance(failure, expected), failure
    assert (_outcome(failure, 1), _outcome(failure, 2)) == (outcome_1, outcome_2)


def _connection_error(cause: BaseException) -> stripe.APIConnectionError:
    try:
        try:
            raise cause
        except BaseException as inner:
            raise stripe.APIConnectionError("network", should_retry=True) from inner
    except stripe.APIConnectionError as exc:
        return exc


@pytest.mark.parametrize(("cause", "expected"), [
    (httpx.ConnectError("refused"), NotSent),
    (httpx.ConnectTimeout("slow connect"), NotSent),
    (httpx.ReadTimeout("slow reply"), TimedOut),
    (httpx.RemoteProtocolError("server disconnected"), ConnectionLost),
    (httpx.ReadError("reset"), ConnectionLost),
    (ValueError("who knows"), Unexpected),
])
def test_a_connection_error_is_read_from_its_cause(cause: BaseException,
                                                   expected: type) -> None:
    assert isinstance(stripe_failure(_connection_error(cause), 5.0), expected)


# --- refunds --------------------------------------------------------------------------------------


async def test_a_refund_is_keyed_replayed_and_found(
        sim: httpx.AsyncClient, tools: tuple[ChargeAdapter, RefundAdapter], key: str) -> None:
    charger, refunder = tools
    paid = await charger.call(ARGS, _ctx(key))
    assert isinstance(paid, Succeeded)
    undo_key = f"{key}:undo"
    args = RefundArgs(payment_intent_id=paid.evidence["payment_intent_id"])

    assert isinstance(await refunder.lookup(args, _ctx(undo_key)), NotFound)
    refunded = await refunder.call(args, _ctx(undo_key))
    again = await refunder.call(args, _ctx(undo_key, attempt=2))
    assert isinstance(refunded, Succeeded), refunded
    assert isinstance(again, Succeeded), again
    assert again.replayed
    assert again.evidence == refunded.evidence
    assert refunded.evidence["amount_cents"] == 4900
    found = await refunder.lookup(args, _ctx(undo_key))
    assert isinstance(found, Found)
    assert found.evidence == refunded.evidence
    assert len((await _ledger(sim))["refunds"]) == 1

    # Another key, nothing left to refund: refused, not done.
    more = await refunder.call(args, _ctx(f"{key}:other"))
    assert isinstance(more, Replied), more
    assert more.code == "charge_already_refunded"
    assert _outcome(more) is Outcome.NOT_DONE


async def test_a_partial_refund_under_our_key_with_another_amount_is_for_an_operator(
        sim: httpx.AsyncClient, tools: tuple[ChargeAdapter, RefundAdapter], key: str) -> None:
    charger, refunder = tools
    paid = await charger.call(ARGS, _ctx(key))
    assert isinstance(paid, Succeeded)
    intent_id = paid.evidence["payment_intent_id"]
    part = await refunder.call(RefundArgs(payment_intent_id=intent_id, amount_cents=900,
                                          reason="requested_by_customer"), _ctx(f"{key}:r"))
    assert isinstance(part, Succeeded)
    assert part.evidence["amount_cents"] == 900
    looked = await refunder.lookup(RefundArgs(payment_intent_id=intent_id, amount_cents=1000),
                                   _ctx(f"{key}:r"))
    assert isinstance(looked, LookupFailed), looked


# --- webhooks -------------------------------------------------------------------------------------


def _received(event: dict[str, Any]) -> WebhookReceived:
    now = datetime.now(UTC)
    obj = event["data"]["object"]
    return WebhookReceived(provider="paysim", provider_event_id=event["id"],
                           provider_event_type=event["type"], object_id=obj["id"],
                           key=obj["metadata"].get("halfway_key"), payload=event,
                           signed_at=now, received_at=now)


async def test_payment_intent_events_are_read_as_reports(
        sim: httpx.AsyncClient, charger: ChargeAdapter, key: str) -> None:
    paid = await charger.call(ARGS, _ctx(key))
    declined_args = ARGS.model_copy(update={"customer": "cus_declined"})
    await charger.call(declined_args, _ctx(f"{key}-d"))
    events = (await sim.get("/v1/events", params={"type": "payment_intent.*"})).json()["data"]
    by_type = {e["type"]: e for e in events}
    assert set(by_type) == {"payment_intent.succeeded", "payment_intent.payment_failed"}
    assert isinstance(paid, Succeeded)

    done = charger.read_webhook(ARGS, _received(by_type["payment_intent.succeeded"]))
    assert done is not None
    assert done.outcome is Outcome.DONE
    assert done.mismatch is None
    assert done.evidence == paid.evidence
    other = charger.read_webhook(ARGS.model_copy(update={"amount_cents": 1}),
                                 _received(by_type["payment_intent.succeeded"]))
    assert other is not None
    assert other.mismatch is not None
    failed = charger.read_webhook(declined_args,
                                  _received(by_type["payment_intent.payment_failed"]))
    assert failed is not None
    assert failed.outcome is Outcome.NOT_DONE
    assert failed.reason is not None
    assert "card_declined" in failed.reason
    charge_events = (await sim.get("/v1/events", params={"type": "charge.succeeded"})).json()
    assert charger.read_webhook(ARGS, _received(charge_events["data"][0])) is None


async def test_payment_intent_webhooks_are_signed_for_the_official_client(key: str) -> None:
    bodies: list[tuple[bytes, str]] = []

    async def receive(request: web.Request) -> web.Response:
        bodies.append((await request.read(), request.headers["Stripe-Signature"]))
        return web.json_response({"ok": True})

    receiver = web.Application()
    receiver.router.add_post("/hooks", receive)
    runner = web.AppRunner(receiver)
    await runner.setup()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    await web.SockSite(runner, sock).start()
    url, stop = await start_in_process(webhook_url=f"http://127.0.0.1:{port}/hooks")
    app = App(name="hooks")
    connection = stripe_tools(app, api_key=API_KEY, api_base=url, timeout_s=5.0)
    try:
        tool = app.registry().get("charge_customer")
        assert tool is not None
        assert isinstance(await tool.adapter.call(ARGS, _ctx(key)), Succeeded)

        async def both() -> bool | None:
            return True if len(bodies) >= 2 else None

        await _until(both, "the charge and payment intent webhooks")
        types = set()
        for body, signature in bodies:
            event = stripe.Webhook.construct_event(body, signature, WEBHOOK_SECRET_DEFAULT)
            types.add(event.type)
            assert json.loads(body)["request"]["idempotency_key"] == key
        assert types == {"charge.succeeded", "payment_intent.succeeded"}
    finally:
        await connection.aclose()
        await stop()
        await runner.cleanup()


# --- paysim's PaymentIntent endpoints, as the client sees them ------------------------------------


async def test_create_then_confirm_and_the_states_between(sim: httpx.AsyncClient) -> None:
    connection = StripeConnection(api_key=API_KEY, api_base=str(sim.base_url), timeout_s=5.0)
    intents = connection.client().v1.payment_intents
    made = await intents.create_async({"amount": 1000, "currency": "eur", "customer": "cus_2"})
    assert (made.status, made.amount, made.currency) == ("requires_payment_method", 1000, "eur")
    assert (await intents.retrieve_async(made.id)).status == "requires_payment_method"
    confirmed = await intents.confirm_async(made.id, {"payment_method": "pm_card_visa"})
    assert (confirmed.status, confirmed.payment_method) == ("succeeded", "pm_card_visa")
    with pytest.raises(stripe.InvalidRequestError) as again:
        await intents.confirm_async(made.id)
    assert again.value.code == "payment_intent_unexpected_state"
    with pytest.raises(stripe.InvalidRequestError) as missing:
        await intents.retrieve_async("pi_nope")
    assert (missing.value.http_status, missing.value.code) == (404, "resource_missing")
    fresh = await intents.create_async({"amount": 1000, "currency": "eur", "customer": "cus_2"})
    with pytest.raises(stripe.CardError) as declined:
        await intents.confirm_async(fresh.id, {"payment_method": "pm_card_chargeDeclined"})
    assert declined.value.http_status == 402
    assert (await intents.retrieve_async(fresh.id)).status == "requires_payment_method"
    with pytest.raises(stripe.InvalidRequestError) as unknown:
        await intents.create_async({"amount": 1000, "currency": "eur",
                                    "capture_method": "manual"})
    assert unknown.value.code == "parameter_unknown"
    await connection.aclose()


async def test_events_list_filters_by_group_and_pages(
        sim: httpx.AsyncClient, charger: ChargeAdapter, key: str) -> None:
    for n in range(3):
        assert isinstance(await charger.call(ARGS, _ctx(f"{key}-{n}")), Succeeded)
    every = (await sim.get("/v1/events", params={"limit": 100})).json()["data"]
    assert [e["type"] for e in every] == ["payment_intent.succeeded", "charge.succeeded"] * 3
    first = (await sim.get("/v1/events", params={"type": "payment_intent.*",
                                                  "limit": 2})).json()
    assert first["has_more"]
    assert len(first["data"]) == 2
    rest = (await sim.get("/v1/events", params={"type": "payment_intent.*", "limit": 2,
                                                 "starting_after": first["data"][-1]["id"]})
            ).json()
    assert not rest["has_more"]
    assert len(rest["data"]) == 1
    keys = [e["request"]["idempotency_key"] for e in first["data"] + rest["data"]]
    assert keys == [f"{key}-2", f"{key}-1", f"{key}-0"]


# --- configuration --------------------------------------------------------------------------------


def test_the_specs_and_the_factory() -> None:
    app = stripe_app(env={"STRIPE_API_KEY": API_KEY, "STRIPE_API_BASE": "http://127.0.0.1:9"})
    assert app.tool_names == ["charge_customer", "refund_payment"]
    charge = app.registry().get("charge_customer")
    assert charge is not None
    spec = charge.spec
    assert (spec.effect_class, spec.key_ttl_s, spec.saga_role, spec.once_per_subject,
            spec.evidence_id, spec.completes_within_s) == (
        EffectClass.KEYED, 86_400.0, SagaRole.PIVOT, True, "payment_intent_id", None)
    assert spec.subject(ARGS) == "invoice:INV-2291"
    assert isinstance(charge.adapter, ChargeAdapter)
    assert API_KEY not in repr(charge.adapter.connection)
    assert charge.adapter.connection.api_base == "http://127.0.0.1:9"
    refund = app.registry().get("refund_payment")
    assert refund is not None
    assert refund.spec.subject(
        RefundArgs(payment_intent_id="pi_1")) == "payment_intent:pi_1"

    default = stripe_app(env={"STRIPE_API_KEY": API_KEY})
    tool = default.registry().get("charge_customer")
    assert tool is not None
    assert isinstance(tool.adapter, ChargeAdapter)
    assert tool.adapter.connection.api_base == "https://api.stripe.com"
    with pytest.raises(ValueError, match="STRIPE_API_KEY"):
        stripe_app(env={})
    with pytest.raises(ValueError, match="24 h"):
        stripe_tools(App(name="long"), api_key=API_KEY, key_ttl_s=30 * 86_400)
    with pytest.raises(ValueError, match="API key is required"):
        StripeConnection(api_key="", api_base="http://x", timeout_s=1.0)
