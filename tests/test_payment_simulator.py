"""paysim and the charge_customer adapter, against the simulator running as a real process.

Each test resets the simulator and uses its own keys. Waits are bounded polls of the
simulator's own records, never fixed sleeps, and nothing asserts on elapsed time.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any, TypeVar

import httpx
import pytest
from pydantic import ValidationError

from halfway.contract import EffectClass
from halfway.core.classify import ConnectionLost, NotSent, Replied, TimedOut
from halfway.simulators.payments import start_in_process
from halfway.tools.payments import ChargeArgs, PaymentsAdapter, charge_customer_spec
from halfway.tools.spec import CallContext, Found, LookupFailed, NotFound, Succeeded

SIM_START_TIMEOUT_S = 30.0  # a cold interpreter importing aiohttp and pydantic on a busy machine
SIM_STOP_TIMEOUT_S = 10.0
POLL_INTERVAL_S = 0.05
POLL_ATTEMPTS_MAX = 400  # 20 s at most, for things that land within a few seconds
HTTP_TIMEOUT_S = 30.0  # for the test's own client, which should never time out

T = TypeVar("T")


@asynccontextmanager
async def _simulator(*flags: str) -> AsyncIterator[str]:
    """Run `python -m halfway.simulators.payments --port 0` and yield its base URL."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "halfway.simulators.payments", "--port", "0", *flags,
        stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), SIM_START_TIMEOUT_S)
        text = line.decode().strip()
        assert text.startswith("listening on http://127.0.0.1:"), f"simulator said {text!r}"
        yield text.removeprefix("listening on ")
    finally:
        if proc.returncode is None:
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), SIM_STOP_TIMEOUT_S)
        except TimeoutError:
            proc.kill()
            await proc.wait()


@pytest.fixture(scope="session")
async def sim_url() -> AsyncIterator[str]:
    async with _simulator() as url:
        yield url


@pytest.fixture
async def sim(sim_url: str) -> AsyncIterator[httpx.AsyncClient]:
    """A raw client on a freshly reset simulator."""
    async with httpx.AsyncClient(base_url=sim_url, timeout=HTTP_TIMEOUT_S) as client:
        (await client.post("/_sim/reset")).raise_for_status()
        yield client


@pytest.fixture
async def adapter(sim: httpx.AsyncClient) -> AsyncIterator[PaymentsAdapter]:
    async with PaymentsAdapter(str(sim.base_url)) as a:
        yield a


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
    return CallContext(step_id=f"step-{key}", key=key, attempt=attempt, timeout_s=timeout_s)


def _form(key: str | None = None, **overrides: str) -> dict[str, str]:
    form = {"amount": "4900", "currency": "usd", "customer": "cus_1",
            "description": "invoice INV-2291", "metadata[invoice]": "INV-2291"}
    if key is not None:
        form["metadata[halfway_key]"] = key
    form.update(overrides)
    return form


async def _charge(sim: httpx.AsyncClient, key: str | None, **overrides: str) -> httpx.Response:
    headers = {"Idempotency-Key": key} if key is not None else {}
    return await sim.post("/v1/charges", data=_form(key, **overrides), headers=headers)


async def _ledger(sim: httpx.AsyncClient, key: str | None = None) -> list[dict[str, Any]]:
    response = await sim.get("/_sim/ledger")
    response.raise_for_status()
    charges = response.json()["charges"]
    return [c for c in charges if key is None or c["idempotency_key"] == key]


async def _faults(sim: httpx.AsyncClient, *rules: dict[str, Any]) -> None:
    (await sim.post("/_sim/faults", json={"rules": list(rules)})).raise_for_status()


async def _until(probe: Callable[[], Awaitable[T | None]], what: str) -> T:
    """Poll `probe` until it returns something, a bounded number of times."""
    for _ in range(POLL_ATTEMPTS_MAX):
        found = await probe()
        if found is not None:
            return found
        await asyncio.sleep(POLL_INTERVAL_S)
    raise AssertionError(f"gave up waiting for {what}")


def _error(response: httpx.Response) -> dict[str, Any]:
    return response.json()["error"]


# --- the happy path and replays -------------------------------------------------------------------


async def test_a_charge_succeeds_and_the_ledger_has_it_with_its_key(
        sim: httpx.AsyncClient, key: str) -> None:
    response = await _charge(sim, key)

    assert response.status_code == 200
    charge = response.json()
    assert charge["id"].startswith("ch_")
    assert (charge["object"], charge["status"]) == ("charge", "succeeded")
    assert (charge["amount"], charge["currency"], charge["customer"]) == (4900, "usd", "cus_1")
    assert charge["metadata"] == {"halfway_key": key, "invoice": "INV-2291"}
    assert isinstance(charge["created"], int)
    assert "Idempotent-Replayed" not in response.headers
    [ledgered] = await _ledger(sim)
    assert ledgered["id"] == charge["id"]
    assert ledgered["idempotency_key"] == key
    fetched = await sim.get(f"/v1/charges/{charge['id']}")
    assert fetched.status_code == 200
    assert fetched.json() == charge


async def test_the_same_key_and_params_replay_without_a_second_charge(
        sim: httpx.AsyncClient, key: str) -> None:
    first = await _charge(sim, key)
    again = await _charge(sim, key)

    assert again.status_code == 200
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.json() == first.json()
    assert len(await _ledger(sim)) == 1
    logged = (await sim.get("/_sim/requests")).json()["requests"]
    assert [(r["status"], r["replayed"]) for r in logged] == [(200, False), (200, True)]


async def test_the_same_key_with_other_params_is_refused_and_not_saved(
        sim: httpx.AsyncClient, key: str) -> None:
    first = await _charge(sim, key)

    other = await _charge(sim, key, amount="5000")
    assert other.status_code == 400
    assert _error(other)["type"] == "idempotency_error"
    assert "same parameters" in _error(other)["message"]
    assert key in _error(other)["message"]
    assert "Idempotent-Replayed" not in other.headers

    original = await _charge(sim, key)  # the refusal was not saved: the original replays
    assert original.status_code == 200
    assert original.headers["Idempotent-Replayed"] == "true"
    assert original.json() == first.json()
    assert len(await _ledger(sim)) == 1


async def test_the_same_key_while_the_first_is_processing_gets_409_then_replays(
        sim: httpx.AsyncClient, adapter: PaymentsAdapter, key: str) -> None:
    await _faults(sim, {"match": {"key": key}, "times": 1, "action": {"delay_s": 3.0}})
    first = asyncio.create_task(_charge(sim, key))

    async def executing() -> bool | None:
        logged = (await sim.get("/_sim/requests")).json()["requests"]
        # params logged and no status yet: past the key check, reserved and executing
        return True if logged and logged[0]["params"] and logged[0]["status"] is None else None

    await _until(executing, "the first request to start executing")
    second = await _charge(sim, key)
    assert second.status_code == 409
    assert _error(second)["code"] == "idempotency_key_in_use"
    via_adapter = await adapter.call(ARGS, _ctx(key, attempt=2))
    assert isinstance(via_adapter, Replied)
    assert (via_adapter.status, via_adapter.code) == (409, "idempotency_key_in_use")

    first_response = await first
    assert first_response.status_code == 200
    later = await _charge(sim, key)
    assert later.status_code == 200
    assert later.headers["Idempotent-Replayed"] == "true"
    assert later.json() == first_response.json()
    assert len(await _ledger(sim)) == 1


# --- faults: 5xx, 429, lost replies, slowness, refusals -------------------------------------------


async def test_a_500_after_commit_is_saved_and_a_lookup_finds_the_charge(
        sim: httpx.AsyncClient, adapter: PaymentsAdapter, key: str) -> None:
    await _faults(sim, {"match": {"key": key}, "times": 1,
                        "action": {"status": 500, "when": "after_commit"}})

    result = await adapter.call(ARGS, _ctx(key))
    assert isinstance(result, Replied)
    assert (result.status, result.code) == (500, "api_error")
    [charge] = await _ledger(sim, key)
    assert charge["status"] == "succeeded"

    retry = await _charge(sim, key)  # like Stripe, the saved 500 replays for good
    assert retry.status_code == 500
    assert retry.headers["Idempotent-Replayed"] == "true"
    retried = await adapter.call(ARGS, _ctx(key, attempt=2))
    assert isinstance(retried, Replied)
    assert retried.status == 500
    assert len(await _ledger(sim)) == 1

    found = await adapter.lookup(ARGS, _ctx(key))  # only a lookup settles it
    assert isinstance(found, Found)
    assert found.succeeded
    assert found.evidence == {"charge_id": charge["id"], "amount_cents": 4900,
                              "currency": "usd", "provider": "paysim"}


async def test_a_500_before_commit_is_saved_and_nothing_is_charged(
        sim: httpx.AsyncClient, adapter: PaymentsAdapter, key: str) -> None:
    await _faults(sim, {"match": {"key": key}, "times": 1,
                        "action": {"status": 500, "when": "before_commit"}})

    first = await _charge(sim, key)
    assert first.status_code == 500
    retry = await _charge(sim, key)
    assert retry.status_code == 500
    assert retry.headers["Idempotent-Replayed"] == "true"
    assert retry.json() == first.json()
    assert await _ledger(sim) == []
    assert isinstance(await adapter.lookup(ARGS, _ctx(key)), NotFound)


async def test_a_429_runs_before_the_idempotency_layer_and_is_not_saved(
        sim: httpx.AsyncClient, adapter: PaymentsAdapter, key: str) -> None:
    await _faults(sim, {"match": {"key": key}, "times": 1, "action": {"status": 429}})

    limited = await adapter.call(ARGS, _ctx(key))
    assert isinstance(limited, Replied)
    assert (limited.status, limited.code) == (429, "rate_limit")
    assert await _ledger(sim) == []

    retried = await adapter.call(ARGS, _ctx(key, attempt=2))
    assert isinstance(retried, Succeeded)
    assert not retried.replayed  # the 429 was never saved under the key
    assert len(await _ledger(sim, key)) == 1


async def test_a_lost_reply_after_commit_is_connection_lost_and_the_charge_exists(
        sim: httpx.AsyncClient, adapter: PaymentsAdapter, key: str) -> None:
    await _faults(sim, {"match": {"key": key}, "times": 1, "action": {"lose_reply": True}})

    result = await adapter.call(ARGS, _ctx(key))

    assert isinstance(result, ConnectionLost)
    [charge] = await _ledger(sim, key)
    retried = await adapter.call(ARGS, _ctx(key, attempt=2))
    assert isinstance(retried, Succeeded)
    assert retried.replayed
    assert retried.evidence["charge_id"] == charge["id"]
    assert len(await _ledger(sim)) == 1


async def test_slower_than_the_client_timeout_is_timed_out_and_the_charge_lands_later(
        sim: httpx.AsyncClient, adapter: PaymentsAdapter, key: str) -> None:
    await _faults(sim, {"match": {"nth": 1}, "action": {"delay_s": 2.5}})
    # The adapter's client made and a connection pooled first (a lookup is not a write): the
    # 0.5 s below is the reply's, not a connect's on a loaded machine (NotSent, rightly: it
    # happened once in CI).
    assert isinstance(await adapter.lookup(ARGS, _ctx(key)), NotFound)

    result = await adapter.call(ARGS, _ctx(key, timeout_s=0.5))
    assert result == TimedOut(0.5)

    async def landed() -> dict[str, Any] | None:
        charges = await _ledger(sim, key)
        return charges[0] if charges else None

    charge = await _until(landed, "the slow charge to land")
    found = await adapter.lookup(ARGS, _ctx(key))
    assert isinstance(found, Found)
    assert found.succeeded
    assert found.evidence["charge_id"] == charge["id"]
    retried = await adapter.call(ARGS, _ctx(key, attempt=2))
    assert isinstance(retried, Succeeded)
    assert retried.replayed
    assert len(await _ledger(sim)) == 1


async def test_a_refused_connection_is_not_sent_and_a_lookup_fails(free_port: int) -> None:
    async with PaymentsAdapter(f"http://127.0.0.1:{free_port}") as refused:
        result = await refused.call(ARGS, _ctx("renewal-1:1"))
        looked = await refused.lookup(ARGS, _ctx("renewal-1:1"))

    assert isinstance(result, NotSent)
    assert "ConnectError" in result.why
    assert isinstance(looked, LookupFailed)


# --- declines, events, lookups --------------------------------------------------------------------


async def test_a_declined_card_is_402_saved_and_found_as_failed(
        sim: httpx.AsyncClient, adapter: PaymentsAdapter, key: str) -> None:
    declined_args = ChargeArgs(invoice="INV-2291", customer="cus_declined", amount_cents=4900)

    result = await adapter.call(declined_args, _ctx(key))
    assert isinstance(result, Replied)
    assert (result.status, result.code) == (402, "card_declined")

    [charge] = await _ledger(sim, key)
    assert charge["status"] == "failed"
    replay = await _charge(sim, key, customer="cus_declined")
    assert replay.status_code == 402
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert _error(replay)["type"] == "card_error"
    assert _error(replay)["charge"] == charge["id"]

    found = await adapter.lookup(declined_args, _ctx(key))
    assert isinstance(found, Found)
    assert not found.succeeded
    assert found.reason.startswith("card_declined")
    assert found.evidence["charge_id"] == charge["id"]


async def test_an_injected_decline_is_a_failed_charge(
        sim: httpx.AsyncClient, adapter: PaymentsAdapter, key: str) -> None:
    await _faults(sim, {"match": {"key_prefix": key[:12]}, "action": {"decline": True}})

    result = await adapter.call(ARGS, _ctx(key))

    assert isinstance(result, Replied)
    assert result.code == "card_declined"
    found = await adapter.lookup(ARGS, _ctx(key))
    assert isinstance(found, Found)
    assert not found.succeeded


async def test_events_carry_the_idempotency_key_newest_first(
        sim: httpx.AsyncClient, key: str) -> None:
    other_key = f"{key}-other"
    first = (await _charge(sim, key)).json()
    second = (await _charge(sim, other_key)).json()
    await _charge(sim, f"{key}-declined", customer="cus_declined")

    response = await sim.get("/v1/events", params={"type": "charge.succeeded"})

    assert response.status_code == 200
    events = response.json()["data"]
    assert [e["data"]["object"]["id"] for e in events] == [second["id"], first["id"]]
    assert [e["request"]["idempotency_key"] for e in events] == [other_key, key]
    assert all(e["id"].startswith("evt_") and e["type"] == "charge.succeeded" for e in events)
    assert all(e["request"]["id"].startswith("req_") for e in events)
    failed = (await sim.get("/v1/events", params={"type": "charge.failed"})).json()["data"]
    assert [e["request"]["idempotency_key"] for e in failed] == [f"{key}-declined"]


async def test_search_finds_charges_by_our_metadata_key_only(
        sim: httpx.AsyncClient, adapter: PaymentsAdapter, key: str) -> None:
    mine = (await _charge(sim, key)).json()
    await _charge(sim, f"{key}-other")

    response = await sim.get("/v1/charges/search",
                             params={"query": f"metadata['halfway_key']:'{key}'"})

    assert response.status_code == 200
    body = response.json()
    assert body["object"] == "search_result"
    assert [c["id"] for c in body["data"]] == [mine["id"]]
    assert isinstance(await adapter.lookup(ARGS, _ctx(f"{key}-nobody")), NotFound)
    unsupported = await sim.get("/v1/charges/search", params={"query": "status:'succeeded'"})
    assert unsupported.status_code == 400
    missing = await sim.get("/v1/charges/ch_nope")
    assert missing.status_code == 404
    assert _error(missing)["code"] == "resource_missing"


async def test_a_lookup_refuses_a_charge_under_our_key_with_other_amounts(
        sim: httpx.AsyncClient, adapter: PaymentsAdapter, key: str) -> None:
    await _charge(sim, key, amount="5000")

    looked = await adapter.lookup(ARGS, _ctx(key))

    assert isinstance(looked, LookupFailed)
    assert "5000" in looked.detail


# --- key lifetime and validation ------------------------------------------------------------------


async def test_a_key_is_forgotten_after_its_lifetime_so_a_reuse_charges_again(key: str) -> None:
    async with _simulator("--key-ttl-s", "60") as url, \
            httpx.AsyncClient(base_url=url, timeout=HTTP_TIMEOUT_S) as sim, \
            PaymentsAdapter(url) as adapter:
        first = await adapter.call(ARGS, _ctx(key))
        assert isinstance(first, Succeeded)
        assert not first.replayed

        (await sim.post("/_sim/clock", json={"advance_s": 59})).raise_for_status()
        within = await adapter.call(ARGS, _ctx(key, attempt=2))
        assert isinstance(within, Succeeded)
        assert within.replayed
        assert len(await _ledger(sim)) == 1

        (await sim.post("/_sim/clock", json={"advance_s": 2})).raise_for_status()
        after = await adapter.call(ARGS, _ctx(key, attempt=3))
        assert isinstance(after, Succeeded)
        assert not after.replayed  # a new request: the provider forgot the key
        assert after.evidence["charge_id"] != first.evidence["charge_id"]
        assert [c["idempotency_key"] for c in await _ledger(sim)] == [key, key]

        found = await adapter.lookup(ARGS, _ctx(key))
        assert isinstance(found, Found)
        # The double charge shows: the other charge under the key, for a contradiction.
        assert {found.evidence["charge_id"], *found.others} == {
            first.evidence["charge_id"], after.evidence["charge_id"]}


async def test_a_validation_failure_is_not_saved_under_the_key(
        sim: httpx.AsyncClient, key: str) -> None:
    invalid = await _charge(sim, key, amount="49.00")
    assert invalid.status_code == 400
    assert _error(invalid)["type"] == "invalid_request_error"
    assert _error(invalid)["code"] == "parameter_invalid_integer"

    bad_currency = await _charge(sim, key, currency="dollars")
    assert bad_currency.status_code == 400
    assert _error(bad_currency)["param"] == "currency"

    valid = await _charge(sim, key)  # the key was never used up by the refusals
    assert valid.status_code == 200
    assert "Idempotent-Replayed" not in valid.headers
    assert len(await _ledger(sim)) == 1


@pytest.mark.parametrize(("overrides", "code"), [
    ({"amount": "0"}, "amount_too_small"),
    ({"amount": "-5"}, "parameter_invalid_integer"),
    ({"amount": ""}, "parameter_missing"),
    ({"surprise": "1"}, "parameter_unknown"),
])
async def test_invalid_params_are_refused(sim: httpx.AsyncClient, key: str,
                                          overrides: dict[str, str], code: str) -> None:
    response = await _charge(sim, key, **overrides)

    assert response.status_code == 400
    assert _error(response)["code"] == code
    assert await _ledger(sim) == []


async def test_a_json_body_is_accepted_and_a_decimal_amount_refused(
        sim: httpx.AsyncClient, key: str) -> None:
    body = {"amount": 4900, "currency": "usd", "customer": "cus_1",
            "metadata": {"halfway_key": key}}
    refused = await sim.post("/v1/charges", json={**body, "amount": "49.00"},
                             headers={"Idempotency-Key": key})
    assert refused.status_code == 400
    assert _error(refused)["code"] == "parameter_invalid_integer"

    accepted = await sim.post("/v1/charges", json=body, headers={"Idempotency-Key": key})
    assert accepted.status_code == 200
    assert accepted.json()["metadata"] == {"halfway_key": key}


async def test_an_overlong_key_is_refused(sim: httpx.AsyncClient) -> None:
    response = await _charge(sim, "k" * 256)

    assert response.status_code == 400
    assert await _ledger(sim) == []


# --- fault rules ----------------------------------------------------------------------------------


async def test_rules_match_by_arrival_order(sim: httpx.AsyncClient) -> None:
    await _faults(sim, {"match": {"nth": 1}, "action": {"status": 429}},
                  {"match": {"every": 3}, "times": 1, "action": {"status": 503,
                                                                  "when": "before_commit"}})

    statuses = [(await _charge(sim, f"order-{uuid.uuid4().hex}")).status_code for _ in range(6)]

    assert statuses == [429, 200, 503, 200, 200, 200]


async def test_probability_rules_repeat_for_a_seed(sim: httpx.AsyncClient) -> None:
    async def run() -> list[int]:
        await _faults(sim, {"match": {"probability": 0.5, "seed": 7}, "action": {"status": 429}})
        return [(await _charge(sim, None)).status_code for _ in range(20)]

    first, second = await run(), await run()

    assert first == second
    assert set(first) == {200, 429}


@pytest.mark.parametrize("rule", [
    {"match": {"nth": 0}, "action": {}},
    {"action": {"status": 500}},  # a 5xx needs `when`
    {"action": {"status": 404}},
    {"action": {"status": 500, "when": "after_commit", "lose_reply": True}},
    {"action": {"delay_s": -1}},
    {"match": {"sometimes": True}, "action": {}},
])
async def test_bad_rules_are_refused(sim: httpx.AsyncClient, rule: dict[str, Any]) -> None:
    response = await sim.post("/_sim/faults", json={"rules": [rule]})

    assert response.status_code == 400


async def test_clearing_rules_and_reset(sim: httpx.AsyncClient, key: str) -> None:
    await _faults(sim, {"action": {"status": 429}})
    (await sim.delete("/_sim/faults")).raise_for_status()
    assert (await _charge(sim, key)).status_code == 200

    (await sim.post("/_sim/reset")).raise_for_status()

    assert await _ledger(sim) == []
    assert (await sim.get("/_sim/requests")).json()["requests"] == []
    again = await _charge(sim, key)  # the key store was cleared too
    assert "Idempotent-Replayed" not in again.headers


# --- concurrency ----------------------------------------------------------------------------------


@pytest.mark.load
async def test_200_slow_charges_in_flight_at_once_all_land(
        sim: httpx.AsyncClient, sim_url: str) -> None:
    await _faults(sim, {"match": {}, "action": {"delay_s": 0.5}})
    keys = [f"bulk-{i}-{uuid.uuid4().hex[:8]}" for i in range(200)]

    async with PaymentsAdapter(sim_url, connections_max=len(keys)) as wide:
        results = await asyncio.gather(*(wide.call(ARGS, _ctx(k, timeout_s=HTTP_TIMEOUT_S))
                                         for k in keys))

    assert all(isinstance(r, Succeeded) for r in results), results
    ledger = await _ledger(sim)
    assert len(ledger) == 200
    assert sorted(c["idempotency_key"] for c in ledger) == sorted(keys)


# --- the spec, the args, and the in-process server -----------------------------------------------


def test_charge_args_refuse_a_decimal_string_amount_and_extra_fields() -> None:
    with pytest.raises(ValidationError):
        ChargeArgs.model_validate({"invoice": "INV-1", "customer": "cus_1",
                                   "amount_cents": "49.00"})
    with pytest.raises(ValidationError):
        ChargeArgs.model_validate_json('{"invoice": "INV-1", "customer": "cus_1", '
                                       '"amount_cents": "4900"}')
    with pytest.raises(ValidationError):
        ChargeArgs.model_validate({"invoice": "INV-1", "customer": "cus_1", "amount_cents": 0})
    with pytest.raises(ValidationError):
        ChargeArgs.model_validate({"invoice": "INV-1", "customer": "cus_1",
                                   "amount_cents": 4900, "tip_cents": 100})
    assert ChargeArgs.model_validate({"invoice": "INV-1", "customer": "cus_1",
                                      "amount_cents": 4900, "currency": "EUR"}).currency == "eur"


def test_the_spec() -> None:
    spec = charge_customer_spec(timeout_s=3.0, key_ttl_s=3600.0)

    assert spec.name == "charge_customer"
    assert spec.args_model is ChargeArgs
    assert spec.effect_class is EffectClass.KEYED
    assert (spec.timeout_s, spec.key_ttl_s, spec.has_lookup) == (3.0, 3600.0, True)
    assert spec.subject(ARGS) == "invoice:INV-2291"
    default = charge_customer_spec()
    assert (default.timeout_s, default.key_ttl_s) == (5.0, 86_400.0)


async def test_in_process_server_serves_and_stops(key: str) -> None:
    url, stop = await start_in_process()
    try:
        async with PaymentsAdapter(url) as adapter:
            result = await adapter.call(ARGS, _ctx(key))
        assert isinstance(result, Succeeded)
    finally:
        await stop()
