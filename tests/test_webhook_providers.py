"""Webhook providers beyond paysim: Stripe's format checked against the official `stripe`
library, Standard Webhooks against the official `standardwebhooks` library, providers declared
as data (and refused at start with the reason, never a secret), the gateway that does not start
without a secret, and a Standard Webhooks event that settles an unknown step through the real
broker.

The equivalence tests ask the official verifier first and the gateway second, on the same
payload and headers; timestamps stay two seconds clear of the tolerance's edge, so the moment
between the two calls cannot change a verdict.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import stripe
from aiohttp.test_utils import TestServer
from hypothesis import given, settings
from hypothesis import strategies as st
from standardwebhooks.webhooks import Webhook as StandardWebhook

from halfway.contract import Outcome, SettlementSource, TaskRequested
from halfway.contract.webhooks import WebhookReceived
from halfway.core.fold import FinalState, StepStatus, fold
from halfway.core.reconcile import declared_report
from halfway.gateway import make_app
from halfway.settings import KafkaSettings
from halfway.webhooks import standard
from halfway.webhooks.providers import (
    DEV_SECRETS,
    Provider,
    ProviderDeclaration,
    ProviderError,
    load,
    paysim,
)
from halfway.webhooks.signature import SignatureError, sign, signature, verify
from tests.test_cli_hostile import halfway
from tests.test_webhooks import OFFLINE, FakeJournal, FakeWriter

pytest.register_assert_rewrite("tests.processes")

from tests.processes import CLUSTER_KEY, Cluster, cluster  # noqa: E402

pytest_plugins = ["tests.processes"]

broker = pytest.mark.broker
TOLERANCE_S = 300
EDGE_S = 2  # how far from the tolerance's edge a timestamp is kept (see the module docstring)
HTTP_TIMEOUT_S = 30.0
WAIT_S = 90.0

STRIPE_OLD, STRIPE_NEW = "whsec_stripe_old_0123456789", "whsec_stripe_new_9876543210"
# Standard Webhooks secrets: base64 after whsec_ (24 and 32 bytes).
SW_OLD = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SW_NEW = "whsec_" + "c2VjcmV0LWZvci10aGUtaG90ZWxzLXByb3ZpZGVyLTAx"
HOTELS_ENV = "HALFWAY_TEST_HOTELS_WEBHOOK_SECRET"


def _now() -> int:
    return int(time.time())


# --- Stripe's format against stripe.Webhook.construct_event ---------------------------------------


def stripe_event(key: str | None = "renewal-1:1") -> dict[str, Any]:
    return {"id": f"evt_{uuid.uuid4().hex[:24]}", "object": "event", "type": "charge.succeeded",
            "api_version": "2024-06-20", "created": _now(),
            "data": {"object": {"id": f"ch_{uuid.uuid4().hex[:24]}", "object": "charge",
                                "amount": 4900, "currency": "usd", "customer": "cus_1",
                                "status": "succeeded", "metadata": {"halfway_key": key}}}}


def stripe_accepts(body: bytes, header: str | None, secrets: tuple[str, ...]) -> bool:
    """What the official library decides, with several endpoint secrets: any one verifies."""
    for secret in secrets:
        try:
            stripe.Webhook.construct_event(body, header, secret)  # type: ignore[arg-type]
        except Exception:  # SignatureVerificationError, and whatever else it raises
            continue
        return True
    return False


def we_accept(body: bytes, header: str | None, secrets: tuple[str, ...]) -> bool:
    try:
        verify(body, header, secrets, now_s=time.time())
    except SignatureError:
        return False
    return True


@dataclass(frozen=True)
class Case:
    body: bytes
    header: str | None
    secrets: tuple[str, ...]  # the endpoint's, on our side


def stripe_cases() -> dict[str, Case]:
    body = json.dumps(stripe_event()).encode()
    now = _now()
    old, new = signature(body, STRIPE_OLD, now), signature(body, STRIPE_NEW, now)
    stale = now - TOLERANCE_S - EDGE_S
    recent = now - TOLERANCE_S + EDGE_S
    return {
        "valid": Case(body, sign(body, STRIPE_NEW, now), (STRIPE_NEW,)),
        "valid-recent": Case(body, sign(body, STRIPE_NEW, recent), (STRIPE_NEW,)),
        # The provider rolls its secret: it signs with both, and either side may be ahead.
        "rotated-provider-both-v1-old-endpoint": Case(body, f"t={now},v1={old},v1={new}",
                                                      (STRIPE_OLD,)),
        "rotated-provider-both-v1-new-endpoint": Case(body, f"t={now},v1={old},v1={new}",
                                                      (STRIPE_NEW,)),
        "rotated-endpoint-two-secrets-old-signed": Case(body, sign(body, STRIPE_OLD, now),
                                                        (STRIPE_NEW, STRIPE_OLD)),
        "rotated-endpoint-two-secrets-new-signed": Case(body, sign(body, STRIPE_NEW, now),
                                                        (STRIPE_NEW, STRIPE_OLD)),
        "rotated-out-old-secret": Case(body, sign(body, STRIPE_OLD, now), (STRIPE_NEW,)),
        "test-mode-v0-ignored": Case(body, f"t={now},v1={new},v0={'f' * 64}", (STRIPE_NEW,)),
        "stale": Case(body, sign(body, STRIPE_NEW, stale), (STRIPE_NEW,)),
        "stale-rotated": Case(body, f"t={stale},v1={old},v1={new}", (STRIPE_OLD, STRIPE_NEW)),
        "tampered-body": Case(body.replace(b"4900", b"9999"), sign(body, STRIPE_NEW, now),
                              (STRIPE_NEW,)),
        "tampered-signature": Case(body, f"t={now},v1={'0' * 64}", (STRIPE_NEW,)),
        "tampered-timestamp": Case(body, f"t={now - 1},v1={new}", (STRIPE_NEW,)),
        "wrong-secret": Case(body, sign(body, "whsec_guessed", now), (STRIPE_NEW,)),
        "missing-header": Case(body, None, (STRIPE_NEW,)),
        "empty-header": Case(body, "", (STRIPE_NEW,)),
        "no-v1": Case(body, f"t={now},v0={new}", (STRIPE_NEW,)),
        "no-timestamp": Case(body, f"v1={new}", (STRIPE_NEW,)),
        "first-t-counts": Case(body, f"t={now},t=1,v1={new}", (STRIPE_NEW,)),
        "spaces-are-not-stripped": Case(body, f"t={now}, v1={new}", (STRIPE_NEW,)),
        "junk-items-are-ignored": Case(body, f"t={now},v1={new},junk", (STRIPE_NEW,)),
        "non-ascii-guess-first": Case(body, f"t={now},v1=é{'0' * 63},v1={new}", (STRIPE_NEW,)),
        "not-utf8-body": Case(b"\xff" + body, sign(b"\xff" + body, STRIPE_NEW, now),
                              (STRIPE_NEW,)),
    }


STRIPE_EXPECTED = {  # what construct_event decides, written down so a changed library shows
    "valid": True, "valid-recent": True,
    "rotated-provider-both-v1-old-endpoint": True, "rotated-provider-both-v1-new-endpoint": True,
    "rotated-endpoint-two-secrets-old-signed": True,
    "rotated-endpoint-two-secrets-new-signed": True, "rotated-out-old-secret": False,
    "test-mode-v0-ignored": True, "stale": False, "stale-rotated": False,
    "tampered-body": False, "tampered-signature": False, "tampered-timestamp": False,
    "wrong-secret": False, "missing-header": False, "empty-header": False, "no-v1": False,
    "no-timestamp": False, "first-t-counts": True, "spaces-are-not-stripped": False,
    "junk-items-are-ignored": True, "non-ascii-guess-first": False, "not-utf8-body": False,
}


@pytest.mark.parametrize("name", sorted(STRIPE_EXPECTED))
def test_stripe_signatures_verify_exactly_as_construct_event_decides(name: str) -> None:
    case = stripe_cases()[name]
    official = stripe_accepts(case.body, case.header, case.secrets)
    assert official is STRIPE_EXPECTED[name]
    assert we_accept(case.body, case.header, case.secrets) is official


_stripe_parts = st.sampled_from(["t={now}", "t={stale}", "t={recent}", "t=", "t=x", "t=-1",
                                 "v1={good}", "v1={other}", "v1=", "v0={good}", " v1={good}",
                                 "v1={good} ", "junk", "v1=é", "t={now}={now}", "v1={good}=x"])


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(_stripe_parts, max_size=6), tamper=st.booleans(),
       secrets=st.sampled_from([(STRIPE_NEW,), (STRIPE_OLD,), (STRIPE_OLD, STRIPE_NEW)]))
def test_any_stripe_header_made_of_real_parts_is_decided_as_construct_event_decides(
        parts: list[str], tamper: bool, secrets: tuple[str, ...]) -> None:
    body = json.dumps(stripe_event()).encode()
    now = _now()
    values = {"now": now, "stale": now - TOLERANCE_S - EDGE_S,
              "recent": now - TOLERANCE_S + EDGE_S, "good": signature(body, STRIPE_NEW, now),
              "other": signature(body, STRIPE_OLD, now)}
    header = ",".join(p.format(**values) for p in parts)
    sent = body + b" " if tamper else body
    assert we_accept(sent, header, secrets) is stripe_accepts(sent, header, secrets), header


def test_a_genuine_signature_from_the_future_is_accepted_as_stripe_accepts_it() -> None:
    # Stripe's verifier has no upper bound, and neither has ours (the gateway remembers such
    # a signature against replays until its own time is past: halfway/webhooks/signature.py).
    body = json.dumps(stripe_event()).encode()
    header = sign(body, STRIPE_NEW, _now() + TOLERANCE_S + 60)
    assert stripe_accepts(body, header, (STRIPE_NEW,))
    assert verify(body, header, STRIPE_NEW, now_s=time.time()) == _now() + TOLERANCE_S + 60


# --- Standard Webhooks against standardwebhooks.Webhook.verify ----------------------------------


def hotel_event(key: str | None, booking_id: str = "bk_1",
                kind: str = "booking.confirmed") -> dict[str, Any]:
    data: dict[str, Any] = {"id": booking_id, "object": "booking"}
    if key is not None:
        data["metadata"] = {"halfway_key": key}
    return {"type": kind, "timestamp": datetime.now(UTC).isoformat(), "data": data}


def sw_headers(body: bytes, secret: str, msg_id: str, ts: int) -> dict[str, str]:
    """Signed by the library itself (not by our helper)."""
    sig = StandardWebhook(secret).sign(msg_id, datetime.fromtimestamp(ts, UTC), body.decode())
    return {"webhook-id": msg_id, "webhook-timestamp": str(ts), "webhook-signature": sig}


def sw_accepts(body: bytes, headers: dict[str, str], secrets: tuple[str, ...]) -> bool:
    for secret in secrets:
        try:
            StandardWebhook(secret).verify(body, headers)
        except Exception:  # WebhookVerificationError, ValueError, ...
            continue
        return True
    return False


def we_accept_sw(body: bytes, headers: dict[str, str], secrets: tuple[str, ...]) -> bool:
    try:
        standard.verify(body, headers, secrets)
    except SignatureError:
        return False
    return True


def sw_cases() -> dict[str, tuple[bytes, dict[str, str], tuple[str, ...]]]:
    body = json.dumps(hotel_event("trip-1:2")).encode()
    now, msg = _now(), f"msg_{uuid.uuid4().hex}"
    good = sw_headers(body, SW_NEW, msg, now)
    old = sw_headers(body, SW_OLD, msg, now)
    both = {**good, "webhook-signature": f"{old['webhook-signature']} "
                                         f"{good['webhook-signature']}"}
    without = {name: {k: v for k, v in good.items() if k != name} for name in standard.HEADERS}
    return {
        "valid": (body, good, (SW_NEW,)),
        "rotated-provider-both-old-endpoint": (body, both, (SW_OLD,)),
        "rotated-endpoint-two-secrets": (body, old, (SW_NEW, SW_OLD)),
        "rotated-out-old-secret": (body, old, (SW_NEW,)),
        "stale": (body, sw_headers(body, SW_NEW, msg, now - TOLERANCE_S - EDGE_S), (SW_NEW,)),
        "future": (body, sw_headers(body, SW_NEW, msg, now + TOLERANCE_S + EDGE_S), (SW_NEW,)),
        "tampered-body": (body + b" ", good, (SW_NEW,)),
        "tampered-id": (body, {**good, "webhook-id": "msg_other"}, (SW_NEW,)),
        "tampered-timestamp": (body, {**good, "webhook-timestamp": str(now - 1)}, (SW_NEW,)),
        "wrong-secret": (body, good, (SW_OLD,)),
        "missing-id": (body, without["webhook-id"], (SW_NEW,)),
        "missing-timestamp": (body, without["webhook-timestamp"], (SW_NEW,)),
        "missing-signature": (body, without["webhook-signature"], (SW_NEW,)),
        "v2-only": (body, {**good, "webhook-signature": "v2," +
                           good["webhook-signature"].split(",")[1]}, (SW_NEW,)),
        "garbled-entry": (body, {**good, "webhook-signature": "v1"}, (SW_NEW,)),
        "not-base64": (body, {**good, "webhook-signature": "v1,@@@"}, (SW_NEW,)),
        "timestamp-not-a-number": (body, {**good, "webhook-timestamp": "soon"}, (SW_NEW,)),
    }


SW_EXPECTED = {
    "valid": True, "rotated-provider-both-old-endpoint": True,
    "rotated-endpoint-two-secrets": True, "rotated-out-old-secret": False, "stale": False,
    "future": False, "tampered-body": False, "tampered-id": False, "tampered-timestamp": False,
    "wrong-secret": False, "missing-id": False, "missing-timestamp": False,
    "missing-signature": False, "v2-only": False, "garbled-entry": False, "not-base64": False,
    "timestamp-not-a-number": False,
}


@pytest.mark.parametrize("name", sorted(SW_EXPECTED))
def test_standard_webhooks_verify_exactly_as_the_library_decides(name: str) -> None:
    body, headers, secrets = sw_cases()[name]
    official = sw_accepts(body, headers, secrets)
    assert official is SW_EXPECTED[name]
    assert we_accept_sw(body, headers, secrets) is official


@pytest.mark.parametrize(("name", "kind"), [
    ("stale", "stale"), ("future", "future"), ("tampered-body", "mismatch"),
    ("missing-id", "missing"), ("garbled-entry", "garbled"), ("not-base64", "mismatch"),
    ("timestamp-not-a-number", "garbled"),
])
def test_a_refused_standard_webhook_says_why(name: str, kind: str) -> None:
    body, headers, secrets = sw_cases()[name]
    with pytest.raises(SignatureError) as refused:
        standard.verify(body, headers, secrets)
    assert refused.value.kind == kind
    assert all(s not in refused.value.reason for s in secrets)


def test_our_standard_webhooks_signing_helper_is_what_the_library_verifies() -> None:
    body = json.dumps(hotel_event("trip-1:2")).encode()
    headers = standard.sign(body, SW_NEW, "msg_1", _now())
    assert sw_accepts(body, headers, (SW_NEW,))
    assert standard.verify(body, headers, (SW_NEW,)).message_id == "msg_1"


# --- declared providers ---------------------------------------------------------------------------

HOTELS = {"name": "hotels", "format": "standardwebhooks", "secret_env": HOTELS_ENV,
          "mapping": {"events": {"booking.confirmed": "done", "booking.failed": "not_done"},
                      "key": "data.metadata.halfway_key", "object_id": "data.id"}}


def declare(tmp_path: Path, *providers: dict[str, Any], suffix: str = ".json") -> Path:
    path = tmp_path / f"providers{suffix}"
    path.write_text(json.dumps({"providers": list(providers)}))
    return path


def test_without_a_secret_or_dev_mode_nothing_is_served_and_the_reason_says_what_to_set() -> None:
    with pytest.raises(ProviderError) as refused:
        load({})
    reason = str(refused.value)
    assert "no webhook provider to serve" in reason
    for name in ("HALFWAY_PAYSIM_WEBHOOK_SECRET", "HALFWAY_WEBHOOK_PROVIDERS",
                 "HALFWAY_DEV_MODE=1"):
        assert name in reason


def test_dev_mode_serves_paysim_with_its_published_dev_secret() -> None:
    loaded = load({"HALFWAY_DEV_MODE": "1"})
    assert loaded.providers["paysim"].secrets == (DEV_SECRETS["paysim"],)
    for off in ("0", "", "off", "no", "false"):
        with pytest.raises(ProviderError):
            load({"HALFWAY_DEV_MODE": off})


def test_the_dev_secret_set_explicitly_is_refused_outside_dev_mode() -> None:
    env = {"HALFWAY_PAYSIM_WEBHOOK_SECRET": DEV_SECRETS["paysim"]}
    with pytest.raises(ProviderError) as refused:
        load(env)
    assert "published dev secret" in str(refused.value)
    assert DEV_SECRETS["paysim"] not in str(refused.value)
    assert load(env | {"HALFWAY_DEV_MODE": "1"}).providers["paysim"]


def test_a_secret_being_rolled_is_two_secrets_and_both_verify() -> None:
    loaded = load({"HALFWAY_PAYSIM_WEBHOOK_SECRET": f" {STRIPE_NEW} , {STRIPE_OLD} "})
    provider = loaded.providers["paysim"]
    assert provider.secrets == (STRIPE_NEW, STRIPE_OLD)
    assert STRIPE_NEW not in repr(provider)
    assert STRIPE_OLD not in repr(provider)
    body = b'{"id": "evt_1"}'
    for secret in (STRIPE_NEW, STRIPE_OLD):
        assert verify(body, sign(body, secret, _now()), provider.secrets, time.time())


def test_declared_providers_join_the_builtins_and_paysim_without_a_secret_is_left_out(
        tmp_path: Path) -> None:
    path = declare(tmp_path, HOTELS)
    loaded = load({"HALFWAY_WEBHOOK_PROVIDERS": str(path), HOTELS_ENV: SW_NEW})
    assert sorted(loaded.providers) == ["hotels"]
    assert loaded.not_served == ["paysim: HALFWAY_PAYSIM_WEBHOOK_SECRET is not set"]
    hotels = loaded.providers["hotels"]
    assert (hotels.format, hotels.secrets) == ("standardwebhooks", (SW_NEW,))
    both = load({"HALFWAY_WEBHOOK_PROVIDERS": str(path), HOTELS_ENV: SW_NEW,
                 "HALFWAY_PAYSIM_WEBHOOK_SECRET": STRIPE_NEW})
    assert sorted(both.providers) == ["hotels", "paysim"]


def test_toml_declarations_work_too(tmp_path: Path) -> None:
    path = tmp_path / "providers.toml"
    path.write_text(f"""
[[providers]]
name = "hotels"
format = "standardwebhooks"
secret_env = "{HOTELS_ENV}"
[providers.mapping]
key = "data.metadata.halfway_key"
object_id = "data.id"
[providers.mapping.events]
"booking.confirmed" = "done"
""")
    loaded = load({"HALFWAY_WEBHOOK_PROVIDERS": str(path), HOTELS_ENV: SW_NEW})
    assert loaded.providers["hotels"].mapping.events == {"booking.confirmed": "done"}


LEAKED = "whsec_c2hvdWxkLW5ldmVyLWJlLXNob3du"


@pytest.mark.parametrize(("change", "words"), [
    ({"format": "svix"}, "format"),
    ({"secret": LEAKED}, "secret"),  # a secret in the file: refused, and never repeated
    ({"name": "Hotels/../x"}, "name"),
    ({"secret_env": "NOT-A-NAME"}, "secret_env"),
    ({"mapping": {**HOTELS["mapping"], "events": {}}}, "events"),
    ({"mapping": {**HOTELS["mapping"], "events": {"booking.confirmed": "maybe"}}}, "events"),
    ({"mapping": {**HOTELS["mapping"], "key": "data..key"}}, "key"),
    ({"mapping": {**HOTELS["mapping"], "object_id": None}}, "object_id"),
    ({"format": "stripe"}, "event_id"),  # Stripe's deliveries carry no id header
])
def test_a_bad_declaration_stops_the_start_with_the_reason(
        tmp_path: Path, change: dict[str, Any], words: str) -> None:
    path = declare(tmp_path, HOTELS | change)
    with pytest.raises(ProviderError) as refused:
        load({"HALFWAY_WEBHOOK_PROVIDERS": str(path), HOTELS_ENV: SW_NEW})
    reason = str(refused.value)
    assert str(path) in reason
    assert words in reason
    assert LEAKED not in reason
    assert SW_NEW not in reason


@pytest.mark.parametrize(("text", "words"), [
    ("{not json", "not JSON"),
    (json.dumps({"providers": [HOTELS, HOTELS]}), "more than once: hotels"),
    (json.dumps({"providers": [HOTELS], "extra": 1}), "extra"),
])
def test_a_declarations_file_that_does_not_parse_stops_the_start(
        tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "providers.json"
    path.write_text(text)
    with pytest.raises(ProviderError) as refused:
        load({"HALFWAY_WEBHOOK_PROVIDERS": str(path), HOTELS_ENV: SW_NEW})
    assert words in str(refused.value)


def test_a_missing_declarations_file_stops_the_start(tmp_path: Path) -> None:
    with pytest.raises(ProviderError) as refused:
        load({"HALFWAY_WEBHOOK_PROVIDERS": str(tmp_path / "nowhere.json")})
    assert "cannot read it" in str(refused.value)


@pytest.mark.parametrize(("secret", "words"), [
    ("", "no secret"),
    ("whsec_not base64!", "whitespace"),
    ("whsec_@@not-base64@@", "not base64"),
    ("whsec_", "empty"),
    (",".join([SW_NEW] * 5), "at most 4"),
])
def test_a_declared_provider_without_a_usable_secret_stops_the_start(
        tmp_path: Path, secret: str, words: str) -> None:
    path = declare(tmp_path, HOTELS)
    with pytest.raises(ProviderError) as refused:
        load({"HALFWAY_WEBHOOK_PROVIDERS": str(path), HOTELS_ENV: secret})
    reason = str(refused.value)
    assert HOTELS_ENV in reason
    assert words in reason
    if len(secret) > len("whsec_"):
        assert secret not in reason


# --- the gateway with a Standard Webhooks provider, offline ---------------------------------------


def hotels_provider(*secrets: str) -> Provider:
    return Provider(ProviderDeclaration.model_validate(HOTELS), secrets)


@dataclass
class OfflineGateway:
    client: httpx.AsyncClient
    writer: FakeWriter
    journal: FakeJournal


@pytest.fixture
async def offline() -> AsyncIterator[OfflineGateway]:
    writer, journal = FakeWriter(), FakeJournal()
    app = make_app(OFFLINE, writer,  # type: ignore[arg-type]
                   [paysim(STRIPE_NEW, STRIPE_OLD), hotels_provider(SW_NEW, SW_OLD)],
                   journal=journal)
    server = TestServer(app)
    await server.start_server()
    try:
        async with httpx.AsyncClient(base_url=str(server.make_url("")),
                                     timeout=HTTP_TIMEOUT_S) as client:
            yield OfflineGateway(client, writer, journal)
    finally:
        await server.close()


async def post_sw(client: httpx.AsyncClient, body: bytes, headers: dict[str, str],
                  ) -> httpx.Response:
    return await client.post("/webhooks/hotels", content=body,
                             headers=headers | {"Content-Type": "application/json"})


@pytest.mark.parametrize("name", sorted(STRIPE_EXPECTED))
async def test_the_gateway_answers_200_exactly_when_construct_event_accepts(
        offline: OfflineGateway, name: str) -> None:
    case = stripe_cases()[name]
    secrets = (STRIPE_NEW, STRIPE_OLD)  # our endpoint's: the library is asked with the same
    official = stripe_accepts(case.body, case.header, secrets)
    headers = {"Content-Type": b"application/json"}
    if case.header is not None:
        headers["Stripe-Signature"] = case.header.encode()  # as sent: UTF-8 where not ASCII

    response = await offline.client.post("/webhooks/paysim", content=case.body,
                                         headers=headers)

    assert response.status_code == (200 if official else 400), response.text
    assert len(offline.writer.records) == (1 if official else 0)


async def test_a_standard_webhook_is_published_with_the_mapped_outcome_and_its_delivery_id(
        offline: OfflineGateway) -> None:
    body = json.dumps(hotel_event("trip-1:2", "bk_42")).encode()
    msg = f"msg_{uuid.uuid4().hex}"
    response = await post_sw(offline.client, body, sw_headers(body, SW_OLD, msg, _now()))

    assert response.status_code == 200, response.text
    assert response.json() == {"received": True, "duplicate": False, "event_id": msg}
    [hook] = offline.writer.published()
    assert (hook.provider, hook.provider_event_id, hook.provider_event_type, hook.object_id,
            hook.key, hook.task_id, hook.outcome) == (
        "hotels", msg, "booking.confirmed", "bk_42", "trip-1:2", "trip-1", Outcome.DONE)
    assert hook.journal_offset == offline.journal.offset


async def test_a_standard_webhook_retry_is_a_duplicate_and_a_resent_copy_a_replay(
        offline: OfflineGateway) -> None:
    body = json.dumps(hotel_event("trip-2:1")).encode()
    msg, now = f"msg_{uuid.uuid4().hex}", _now()
    first = sw_headers(body, SW_NEW, msg, now - 1)
    assert (await post_sw(offline.client, body, first)).status_code == 200
    # A captured copy, even with a bogus signature entry added, is the same signed request.
    padded = {**first, "webhook-signature": first["webhook-signature"] + " v1,AAAA"}
    replayed = await post_sw(offline.client, body, padded)
    assert replayed.status_code == 409, replayed.text
    # The provider's retry: the same webhook-id, signed afresh.
    retry = await post_sw(offline.client, body, sw_headers(body, SW_NEW, msg, now))
    assert retry.json() == {"received": True, "duplicate": True, "event_id": msg}
    assert len(offline.writer.records) == 1


@pytest.mark.parametrize(("kind", "outcome"), [
    ("booking.confirmed", Outcome.DONE),
    ("booking.failed", Outcome.NOT_DONE),
    ("booking.viewed", None),  # not in the mapping: published, saying nothing
])
async def test_the_mapping_decides_the_outcome_on_the_record(
        offline: OfflineGateway, kind: str, outcome: Outcome | None) -> None:
    body = json.dumps(hotel_event("trip-3:1", kind=kind)).encode()
    response = await post_sw(offline.client, body,
                             sw_headers(body, SW_NEW, f"msg_{uuid.uuid4().hex}", _now()))
    assert response.status_code == 200, response.text
    [hook] = offline.writer.published()
    assert hook.outcome == outcome


async def test_an_event_without_what_the_mapping_names_is_400(offline: OfflineGateway) -> None:
    event = hotel_event("trip-4:1")
    del event["data"]["id"]
    body = json.dumps(event).encode()
    response = await post_sw(offline.client, body,
                             sw_headers(body, SW_NEW, f"msg_{uuid.uuid4().hex}", _now()))
    assert response.status_code == 400
    assert "no data.id" in response.json()["error"]
    assert offline.writer.records == []


async def test_a_refused_standard_webhook_is_400_with_the_reason_and_no_secret(
        offline: OfflineGateway) -> None:
    body = json.dumps(hotel_event("trip-5:1")).encode()
    stale = sw_headers(body, SW_NEW, "msg_5", _now() - TOLERANCE_S - EDGE_S)
    forged = sw_headers(body, "whsec_" + "QUFBQUFBQUFBQUFBQUFBQUFBQUFBQUFB", "msg_6", _now())
    for headers, words in ((stale, "too old"), (forged, "no v1 signature matches")):
        response = await post_sw(offline.client, body, headers)
        assert response.status_code == 400
        assert words in response.json()["error"]
        assert SW_NEW not in response.text
        assert SW_OLD not in response.text
    assert offline.writer.records == []


# --- the reconciler's side: a declared outcome for a tool that reads no webhooks ------------------


def _hook(outcome: Outcome | None) -> WebhookReceived:
    now = datetime.now(UTC)
    return WebhookReceived(provider="hotels", provider_event_id="msg_1",
                           provider_event_type="booking.confirmed", object_id="bk_1",
                           key="trip-1:2", task_id="trip-1", payload={}, outcome=outcome,
                           signed_at=now, received_at=now, journal_partition=0,
                           journal_offset=5)


def test_a_declared_done_is_evidence_under_the_tools_evidence_id() -> None:
    report = declared_report(_hook(Outcome.DONE), "booking_id")
    assert report is not None
    assert (report.outcome, report.effect_id) == (Outcome.DONE, "bk_1")
    assert report.evidence == {"booking_id": "bk_1", "provider": "hotels",
                               "event_type": "booking.confirmed"}
    not_done = declared_report(_hook(Outcome.NOT_DONE), "booking_id")
    assert not_done is not None
    assert not_done.outcome is Outcome.NOT_DONE
    assert declared_report(_hook(None), "booking_id") is None


# --- the gateway does not start without a secret ------------------------------------------------


async def run_gateway(environ: dict[str, str]) -> tuple[int, str]:
    """`halfway run gateway` with exactly this configuration: (exit code, stderr). The broker
    address is one nothing listens on: a gateway that got as far as Kafka would hang there."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("HALFWAY_") or k in ("HALFWAY_HOME",)}
    env = base | {"HALFWAY_KAFKA_BOOTSTRAP": "127.0.0.1:9", "HALFWAY_GATEWAY_PORT": "0",
                  "HALFWAY_LOG_FORMAT": "json"} | environ
    return await halfway("run", "gateway", environ=env)  # fails if it went on


async def test_the_gateway_refuses_to_start_without_a_secret_outside_dev_mode() -> None:
    code, err = await run_gateway({})
    assert code == 2, err
    assert "Traceback" not in err
    [line] = [json.loads(raw) for raw in err.splitlines() if raw.startswith("{")]
    assert line["event"] == "gateway not started"
    assert "HALFWAY_PAYSIM_WEBHOOK_SECRET" in line["reason"]
    assert "HALFWAY_DEV_MODE=1" in line["reason"]


async def test_the_gateway_refuses_a_bad_declaration_without_showing_a_secret(
        tmp_path: Path) -> None:
    path = declare(tmp_path, HOTELS | {"secret": LEAKED})
    code, err = await run_gateway({"HALFWAY_WEBHOOK_PROVIDERS": str(path), HOTELS_ENV: SW_NEW,
                                   "HALFWAY_PAYSIM_WEBHOOK_SECRET": STRIPE_NEW})
    assert code == 2, err
    assert "Traceback" not in err
    assert "gateway not started" in err
    assert "secret" in err
    assert LEAKED not in err
    assert SW_NEW not in err
    assert STRIPE_NEW not in err


# --- through the real broker: a Standard Webhooks event settles an unknown step -------------------


@pytest.fixture
async def hotels(kafka_settings: KafkaSettings, tmp_path: Path,
                 request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    async with cluster(kafka_settings, tmp_path, charge_timeout_s=1.0, tripsim=True) as c:
        request.node.stash[CLUSTER_KEY] = c
        yield c


def hotel_task(task_id: str) -> TaskRequested:
    args = {"hotel": "HTL-1042", "guest": "Ada Lovelace", "nights": 2}
    return TaskRequested(
        event_id=uuid.uuid4().hex, task_id=task_id, at=datetime.now(UTC),
        input={"script": [{"tool": "book_hotel", "args": args}], "summary": "booked"},
        allowed_tools=["book_hotel"])


@broker
async def test_a_standard_webhooks_event_settles_an_unknown_step(hotels: Cluster,
                                                                 tmp_path: Path) -> None:
    c = hotels
    path = declare(tmp_path, HOTELS)
    paysim_url = await c.start_gateway(HALFWAY_WEBHOOK_PROVIDERS=str(path), **{HOTELS_ENV: SW_NEW})
    url = paysim_url.removesuffix("/paysim") + "/hotels"
    # The booking lands at 2 s; the caller gives up at 1 s: unknown. With lookups off, only the
    # provider's word can settle it, and tripsim sends no webhooks: ours is the only one.
    await c.trip_faults({"match": {"endpoint": "hotels.book"}, "action": {"delay_s": 2.0}})
    for service in ("decider", "executor"):
        await c.start(service)
    await c.start("reconciler", HALFWAY_RECONCILER_LOOKUPS="off")
    task_id = f"hotel-{uuid.uuid4().hex[:8]}"
    key = f"{task_id}:1"
    await c.publish(hotel_task(task_id))

    def unknown() -> bool | None:
        step = fold(c.journal.of(task_id), task_id).step(1)
        return True if step is not None and step.status is StepStatus.UNKNOWN else None

    await c.journal.wait_for(unknown, f"{key} unknown")
    await c.trip("POST", "/_sim/drain")  # the slow booking has landed
    [booking] = [b for b in (await c.trip_ledger())["bookings"]
                 if (b.get("metadata") or {}).get("halfway_key") == key]

    body = json.dumps(hotel_event(key, booking["id"])).encode()
    msg = f"msg_{uuid.uuid4().hex}"
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as client:
        response = await client.post(url, content=body, headers=sw_headers(
            body, SW_NEW, msg, _now()) | {"Content-Type": "application/json"})
    assert response.status_code == 200, response.text

    states = await c.journal.until_finished([task_id], WAIT_S)
    state = states[task_id]
    assert state.final_state is FinalState.SUCCEEDED, state.finished
    settlement = state.step(1).effect.settlement
    assert settlement.source is SettlementSource.WEBHOOK
    assert settlement.outcome is Outcome.DONE
    assert settlement.evidence["booking_id"] == booking["id"]
    assert settlement.evidence["provider_event_id"] == msg
    assert state.step(1).effect.unknowns, "never unknown: the test did not test the webhook"
    gateway_log = "\n".join(p.log_path.read_text() for p in c.procs if "gateway" in p.name)
    assert "gateway listening" in gateway_log
    assert SW_NEW not in gateway_log
