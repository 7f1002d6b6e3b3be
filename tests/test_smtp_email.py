"""send_email over SMTP: the real aiosmtplib client against smtpsim (aiosmtpd), no broker.

- the Message-ID is RFC 5322-valid (Python's `email` parses it without defects) and gives our
  key back, for every key the harness mints;
- every reply and failure, at every phase, proves what RFC 5321 says it proves: before the
  content left, never done; a 2yz to the end of data, done; a 4yz or 5yz, not done; silence or
  a lost connection after the content, unknown, and the lookup settles it;
- the unkeyed tool sends one transaction per attempt, and the executor's rules never retry it;
- the simulator's own rules (faults, bounds, dedupe) and its process entry point.
"""

from __future__ import annotations

import asyncio
import email
import email.policy
import email.utils
import re
import socket
import sys
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

import httpx
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from pydantic import ValidationError

from halfway.app import App
from halfway.contract import EffectClass, Outcome, SagaRole
from halfway.contract.ids import KEY_PATTERN
from halfway.core import fold
from halfway.core.classify import (
    ConnectionLost,
    NotSent,
    TimedOut,
    ToolRefused,
    classify,
)
from halfway.core.next_action import (
    Escalate,
    Lookup,
    Nothing,
    SettleNotDone,
    Wait,
    next_action,
    on_nothing_found,
)
from halfway.simulators.smtpsim import SmtpSim, running
from halfway.tools.email_smtp import (
    SEND_EMAIL,
    SmtpEmailAdapter,
    SmtpEmailArgs,
    SmtpRelay,
    key_from_message_id,
    message_id_for,
    smtp_email_spec,
    smtp_tools,
)
from halfway.tools.spec import CallContext, Found, LookupFailed, NotFound, Succeeded
from tests.factories import Stamper

SENDER = "trips@halfway.example"
DOMAIN = "halfway.example"
KEY = "trip-ok-1a2b3c:4"
TIMEOUT_S = 1.0
ATOM = re.compile(r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(?:\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*")
MAIL = SmtpEmailArgs(to="ada@example.com", subject="Your trip trip-ok-1a2b3c",
                     body="Flight LH-454, 3 nights in Rome.\n.\nA line that was a lone dot.")


@pytest.fixture
async def sim() -> AsyncIterator[SmtpSim]:
    async with running() as s:
        yield s


def relay_of(sim: SmtpSim, **kw: Any) -> SmtpRelay:
    options: dict[str, Any] = {"lookup_url": sim.lookup_url, "timeout_s": TIMEOUT_S,
                               "completes_within_s": 1.0} | kw
    return SmtpRelay(host=sim.host, port=sim.smtp_port, sender=SENDER, **options)


@pytest.fixture
async def adapter(sim: SmtpSim) -> AsyncIterator[SmtpEmailAdapter]:
    adapter = SmtpEmailAdapter(relay_of(sim))
    yield adapter
    await adapter.aclose()


def ctx(key: str = KEY, attempt: int = 1, timeout_s: float = TIMEOUT_S) -> CallContext:
    return CallContext(step_id=key.removesuffix(":undo"), key=key, attempt=attempt,
                       timeout_s=timeout_s)


async def http(sim: SmtpSim, method: str, path: str, body: Any = None) -> httpx.Response:
    async with httpx.AsyncClient(base_url=sim.http_url, timeout=5) as client:
        return await client.request(method, path, json=body)


async def faults(sim: SmtpSim, *rules: dict[str, Any]) -> None:
    response = await http(sim, "POST", "/faults", {"rules": list(rules)})
    assert response.status_code == 200, response.text


async def ledger(sim: SmtpSim) -> list[dict[str, Any]]:
    return (await http(sim, "GET", "/messages")).json()["data"]


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- the Message-ID ------------------------------------------------------------------------------


def parsed_message_id(adapter: SmtpEmailAdapter, key: str) -> Any:
    """The Message-ID header of the message the adapter writes, as Python's `email` reads it."""
    wire = adapter.message(MAIL, message_id_for(key, DOMAIN), key)
    assert wire.endswith(b"\r\n.\r\n")
    parsed = email.message_from_bytes(wire[:-3], policy=email.policy.default)
    return parsed["Message-ID"]


OFFLINE = SmtpEmailAdapter(SmtpRelay(host="127.0.0.1", port=25, sender=SENDER))


LONGEST_KEY = "a" + "." * 47 + ":9999:undo"  # every "." and ":" escaped: folded on its own line


@given(st.from_regex(KEY_PATTERN, fullmatch=True))
@example(LONGEST_KEY)
def test_the_message_id_is_rfc5322_valid_and_gives_our_key_back(key: str) -> None:
    header = parsed_message_id(OFFLINE, key)
    assert header.defects == ()
    # A long one is folded onto its own line (CFWS before "<" is allowed), so strip it.
    value = str(header).strip()
    assert value == message_id_for(key, DOMAIN)
    left, _, right = email.utils.unquote(value).rpartition("@")
    assert ATOM.fullmatch(left)  # id-left is dot-atom-text
    assert right == DOMAIN
    assert key_from_message_id(str(header)) == key
    assert key_from_message_id(value, DOMAIN) == key


@given(st.text(min_size=1, max_size=80))
def test_any_key_round_trips(key: str) -> None:
    message_id = message_id_for(key, DOMAIN)
    assert key_from_message_id(message_id) == key


def test_the_travel_tools_message_id_is_not_valid_and_ours_is() -> None:
    """`<trip-1:4@halfway.local>` (tripsim's) reads back as `<trip-1`, with defects."""
    raw = b"Message-ID: <trip-1:4@halfway.local>\r\n\r\n"
    header = email.message_from_bytes(raw, policy=email.policy.default)["Message-ID"]
    assert header.defects
    assert str(header) == "<trip-1"
    assert message_id_for("trip-1:4", "halfway.local") == "<trip-1=3A4@halfway.local>"
    assert message_id_for("renewal-1:2:undo", DOMAIN) == f"<renewal-1=3A2=3Aundo@{DOMAIN}>"
    assert message_id_for("a.b:1", DOMAIN) == f"<a=2Eb=3A1@{DOMAIN}>"


@pytest.mark.parametrize("message_id", [
    "<trip-1:4@halfway.local>",  # not escaped
    "<trip-1=3a4@halfway.local>",  # lowercase hex
    "<trip=2D1=3A4@halfway.local>",  # "-" is kept as it is, never escaped
    "<trip-1=3@halfway.local>",  # a stray "="
    "<=FF@halfway.local>",  # not UTF-8
    "trip-1=3A4@halfway.local",  # no angle brackets
    "<@halfway.local>",
    "<a@b@halfway.local>",
])
def test_only_what_message_id_for_makes_gives_a_key(message_id: str) -> None:
    with pytest.raises(ValueError, match="Message-ID"):
        key_from_message_id(message_id)


def test_a_message_id_of_another_domain_is_not_ours() -> None:
    with pytest.raises(ValueError, match="domain"):
        key_from_message_id("<trip-1=3A4@elsewhere.example>", DOMAIN)
    for bad in ("", "a b", "a..b", ".a"):
        with pytest.raises(ValueError, match="not a valid Message-ID domain"):
            message_id_for("trip-1:4", bad)
    with pytest.raises(ValueError, match="empty"):
        message_id_for("", DOMAIN)
    with pytest.raises(ValueError, match="too long"):
        message_id_for(":" * 400, DOMAIN)


# --- the arguments and the spec ------------------------------------------------------------------


@pytest.mark.parametrize("to", ["ada", "ada@example", "Ada <ada@example.com>", "a b@example.com",
                                "ada@example.com\r\nBcc: eve@example.com", "adá@example.com",
                                "ada@-example.com", "a" * 65 + "@example.com", ".ada@example.com"])
def test_to_is_one_plain_address(to: str) -> None:
    with pytest.raises(ValidationError):
        SmtpEmailArgs(to=to, subject="s", body="b")


def test_the_subject_is_one_line_and_bounded() -> None:
    for subject in ("", "a\r\nBcc: eve@example.com", "a\nb", "x" * 301):
        with pytest.raises(ValidationError):
            SmtpEmailArgs(to="ada@example.com", subject=subject, body="b")
    SmtpEmailArgs(to="o'neil+trips@mail.example.co.uk", subject="Grüße, ✈ " * 30, body="")


def test_the_spec_is_unkeyed_unless_the_relay_dedupes_by_message_id() -> None:
    plain = SmtpRelay(host="127.0.0.1", port=25, sender=SENDER)
    spec = smtp_email_spec(plain)
    assert (spec.name, spec.effect_class, spec.key_ttl_s, spec.has_lookup) == (
        SEND_EMAIL, EffectClass.UNKEYED, None, False)
    deduping = SmtpRelay(host="127.0.0.1", port=25, sender=SENDER, lookup_url="http://x/m",
                         dedupes_by_message_id=True, dedupe_window_s=3600)
    spec = smtp_email_spec(deduping)
    assert (spec.effect_class, spec.key_ttl_s, spec.has_lookup) == (EffectClass.KEYED, 3600, True)
    with pytest.raises(ValueError, match="dedupe_window_s"):
        SmtpRelay(host="h", port=25, sender=SENDER, dedupes_by_message_id=True)
    with pytest.raises(ValueError, match="lookup_url"):
        SmtpRelay(host="h", port=25, sender=SENDER, completes_within_s=5)
    with pytest.raises(ValueError, match="sender"):
        SmtpRelay(host="h", port=25, sender="trips")
    with pytest.raises(ValueError, match="choose one"):
        SmtpRelay(host="h", port=25, sender=SENDER, starttls=True, use_tls=True)


async def test_smtp_tools_adds_send_email_to_an_app(sim: SmtpSim) -> None:
    app = App(name="mailer", instructions="You send itineraries.")
    adapter = smtp_tools(app, relay_of(sim), saga_role=SagaRole.RETRIABLE)
    tool = app.registry().get(SEND_EMAIL)
    assert tool is not None
    assert tool.adapter is adapter
    assert tool.spec.saga_role is SagaRole.RETRIABLE
    assert tool.spec.has_lookup
    assert tool.spec.subject(MAIL) == "email:ada@example.com:Your trip trip-ok-1a2b3c"
    assert isinstance(await tool.adapter.call(MAIL, ctx()), Succeeded)
    await app.registry().aclose()


# --- sending: every reply and failure ------------------------------------------------------------


async def test_a_send_is_done_with_the_message_id_and_the_relays_queue_id(
        sim: SmtpSim, adapter: SmtpEmailAdapter) -> None:
    result = await adapter.call(MAIL, ctx())

    assert isinstance(result, Succeeded), result
    message_id = f"<trip-ok-1a2b3c=3A4@{DOMAIN}>"
    assert result.evidence["message_id"] == message_id
    assert result.evidence["accepted"] == ["ada@example.com"]
    [record] = await ledger(sim)
    assert result.evidence["queue_id"] == record["queue_id"]
    assert smtp_email_spec(adapter.relay).effect_id(result.evidence) == record["queue_id"]
    assert (record["message_id"], record["mail_from"], record["rcpt_tos"], record["subject"]) == (
        message_id, SENDER, ["ada@example.com"], MAIL.subject)
    assert key_from_message_id(record["message_id"], DOMAIN) == KEY
    found = await adapter.lookup(MAIL, ctx())
    assert isinstance(found, Found)
    assert found.evidence["queue_id"] == record["queue_id"]


async def test_the_longest_key_is_sent_and_found(sim: SmtpSim,
                                                 adapter: SmtpEmailAdapter) -> None:
    result = await adapter.call(MAIL, ctx(LONGEST_KEY))
    assert isinstance(result, Succeeded), result
    [record] = await ledger(sim)
    assert key_from_message_id(record["message_id"], DOMAIN) == LONGEST_KEY
    assert isinstance(await adapter.lookup(MAIL, ctx(LONGEST_KEY)), Found)


async def test_accept_then_drop_is_unknown_and_the_lookup_finds_it_done(
        sim: SmtpSim, adapter: SmtpEmailAdapter) -> None:
    await faults(sim, {"action": "accept_then_drop"})
    result = await adapter.call(MAIL, ctx())

    assert isinstance(result, ConnectionLost), result
    assert classify(result).outcome is Outcome.UNKNOWN
    [record] = await ledger(sim)
    found = await adapter.lookup(MAIL, ctx())
    assert isinstance(found, Found)
    assert found.succeeded
    assert found.evidence["queue_id"] == record["queue_id"]
    assert found.others == ()


async def test_slow_past_the_timeout_is_unknown_and_the_lookup_finds_it_done(
        sim: SmtpSim, adapter: SmtpEmailAdapter) -> None:
    await faults(sim, {"action": "slow", "delay_s": 3 * TIMEOUT_S})
    started = asyncio.get_running_loop().time()
    result = await adapter.call(MAIL, ctx())

    assert asyncio.get_running_loop().time() - started < TIMEOUT_S + 1.0  # bounded
    assert isinstance(result, TimedOut), result
    assert classify(result).outcome is Outcome.UNKNOWN
    found = await adapter.lookup(MAIL, ctx())
    assert isinstance(found, Found)
    assert found.evidence["message_id"] == message_id_for(KEY, DOMAIN)


async def test_dropped_after_the_content_and_never_queued_is_unknown_and_found_nowhere(
        sim: SmtpSim, adapter: SmtpEmailAdapter) -> None:
    """Unknown at the call; the lookup finds nothing, which proves not_done only because the
    relay declares it records acceptance within completes_within_s."""
    await faults(sim, {"action": "drop", "phase": "data"})
    result = await adapter.call(MAIL, ctx())

    assert isinstance(result, ConnectionLost), result
    assert classify(result).outcome is Outcome.UNKNOWN
    assert isinstance(await adapter.lookup(MAIL, ctx()), NotFound)
    assert await ledger(sim) == []


@pytest.mark.parametrize(("phase", "code"), [("mail", 421), ("mail", 451), ("rcpt", 450),
                                             ("rcpt", 451), ("rcpt", 452)])
async def test_a_transient_refusal_before_data_is_not_done_and_nothing_is_recorded(
        sim: SmtpSim, adapter: SmtpEmailAdapter, phase: str, code: int) -> None:
    await faults(sim, {"action": "transient", "phase": phase, "code": code})
    result = await adapter.call(MAIL, ctx())

    assert isinstance(result, ToolRefused), result
    assert f" {code} " in result.reason
    assert "not sent" in result.reason
    assert classify(result).outcome is Outcome.NOT_DONE
    assert await ledger(sim) == []
    assert isinstance(await adapter.lookup(MAIL, ctx()), NotFound)


@pytest.mark.parametrize(("action", "phase", "code"), [
    ("transient", "data", 451),  # RFC 5321 §4.2.5: after a 4yz the relay must not deliver it
    ("transient", "data", 452),
    ("refuse", "mail", 553),
    ("refuse", "rcpt", 550),
    ("refuse", "data", 552),
    ("refuse", "data", 554),
])
async def test_a_refusal_is_not_done(sim: SmtpSim, adapter: SmtpEmailAdapter, action: str,
                                     phase: str, code: int) -> None:
    await faults(sim, {"action": action, "phase": phase, "code": code})
    result = await adapter.call(MAIL, ctx())

    assert isinstance(result, ToolRefused), result
    assert str(code) in result.reason
    verdict = classify(result)
    assert verdict.outcome is Outcome.NOT_DONE, verdict
    assert await ledger(sim) == []


async def test_a_refusal_on_a_later_attempt_is_unknown(sim: SmtpSim,
                                                       adapter: SmtpEmailAdapter) -> None:
    """Only a keyed tool has attempt 2; its attempt 1 may have been accepted."""
    await faults(sim, {"action": "refuse", "phase": "rcpt"})
    result = await adapter.call(MAIL, ctx(attempt=2))

    assert isinstance(result, NotSent), result
    assert classify(result, attempt=2).outcome is Outcome.UNKNOWN


@pytest.mark.parametrize("rule", [{"action": "slow", "phase": "mail", "delay_s": 3.0},
                                  {"action": "slow", "phase": "rcpt", "delay_s": 3.0},
                                  {"action": "drop", "phase": "mail"},
                                  {"action": "drop", "phase": "rcpt"}])
async def test_silence_or_a_lost_connection_before_the_content_is_not_done(
        sim: SmtpSim, adapter: SmtpEmailAdapter, rule: dict[str, Any]) -> None:
    result = await adapter.call(MAIL, ctx())

    assert isinstance(result, Succeeded)  # the relay works; now the fault
    await faults(sim, rule)
    result = await adapter.call(MAIL, ctx("trip-ok-1a2b3c:5"))
    assert isinstance(result, NotSent), result
    assert "not sent" in result.why
    assert classify(result).outcome is Outcome.NOT_DONE
    assert len(await ledger(sim)) == 1


async def test_connection_refused_never_reached_the_relay() -> None:
    adapter = SmtpEmailAdapter(SmtpRelay(host="127.0.0.1", port=closed_port(), sender=SENDER,
                                         timeout_s=TIMEOUT_S))
    result = await adapter.call(MAIL, ctx())

    assert isinstance(result, NotSent), result
    assert classify(result, attempt=1).outcome is Outcome.NOT_DONE
    assert classify(result, attempt=2).outcome is Outcome.UNKNOWN


async def test_the_relays_full_ledger_refuses_with_452() -> None:
    async with running(messages_max=1) as sim:
        adapter = SmtpEmailAdapter(relay_of(sim))
        assert isinstance(await adapter.call(MAIL, ctx()), Succeeded)
        result = await adapter.call(MAIL, ctx("trip-ok-1a2b3c:5"))
        await adapter.aclose()
    assert isinstance(result, ToolRefused), result
    assert "452 4.3.1" in result.reason


# --- one send per attempt, and the executor's rules ----------------------------------------------


@pytest.mark.parametrize("rule", [None, {"action": "accept_then_drop"},
                                  {"action": "slow", "delay_s": 3.0},
                                  {"action": "transient", "phase": "rcpt"},
                                  {"action": "drop", "phase": "data"}])
async def test_one_attempt_is_one_transaction(sim: SmtpSim, adapter: SmtpEmailAdapter,
                                              rule: dict[str, Any] | None) -> None:
    if rule is not None:
        await faults(sim, rule)
    await adapter.call(MAIL, ctx())
    transactions = (await http(sim, "GET", "/transactions")).json()["data"]
    assert len(transactions) == 1, transactions
    assert transactions[0]["mail_from"] == SENDER


def test_the_executor_never_sends_the_unkeyed_tool_twice() -> None:
    """After an unknown: a lookup, never attempt 2; nothing found past completes_within_s (and
    the send window) proves not_done; without that bound, an operator decides."""
    for completes_within_s in (None, 5.0):
        relay = SmtpRelay(host="127.0.0.1", port=25, sender=SENDER, lookup_url="http://r/m",
                          completes_within_s=completes_within_s)
        policy = smtp_email_spec(relay).policy()
        s = Stamper("trip-ok-1a2b3c")
        log = [s.started(), s.intended(1, tool=SEND_EMAIL, effect_class=EffectClass.UNKEYED,
                                       args=MAIL.model_dump(), subject=None),
               s.attempted(1, 1), s.settled(1, Outcome.UNKNOWN, attempt=1)]
        assert next_action(fold(log).step(1).effect, policy, s.now) == Lookup()
        log.append(s.checked(1, next_in=timedelta(seconds=1)))
        effect = fold(log).step(1).effect
        for later_s in (0.5, 2, 60, 86_400 * 2):
            action = next_action(effect, policy, s.now + timedelta(seconds=later_s))
            assert isinstance(action, Lookup | Wait | Escalate), action  # never Call(2)
        log.append(s.checked(1, next_in=None))  # lookups over: escalated to an operator
        assert fold(log).step(1).effect.needs_attention
        assert next_action(fold(log).step(1).effect, policy, s.now) == Nothing()
        after = on_nothing_found(effect, policy, s.now + timedelta(seconds=60))
        assert isinstance(after, SettleNotDone) is (completes_within_s is not None)


async def test_a_relay_that_dedupes_by_message_id_makes_a_retry_harmless() -> None:
    async with running(dedupe_message_id=True) as sim:
        adapter = SmtpEmailAdapter(relay_of(sim, dedupes_by_message_id=True,
                                            dedupe_window_s=86_400))
        await faults(sim, {"action": "accept_then_drop"})
        first = await adapter.call(MAIL, ctx(attempt=1))
        again = await adapter.call(MAIL, ctx(attempt=2))
        messages = await ledger(sim)
        await adapter.aclose()
    assert isinstance(first, ConnectionLost), first
    assert isinstance(again, Succeeded), again
    assert len(messages) == 1
    assert again.evidence["queue_id"] == messages[0]["queue_id"]


# --- the lookup ----------------------------------------------------------------------------------


async def test_without_a_lookup_url_there_is_no_lookup(sim: SmtpSim) -> None:
    relay = relay_of(sim, lookup_url=None, completes_within_s=None)
    assert smtp_email_spec(relay).has_lookup is False
    adapter = SmtpEmailAdapter(relay)
    assert isinstance(await adapter.lookup(MAIL, ctx()), LookupFailed)


async def test_a_failed_lookup_says_nothing(sim: SmtpSim) -> None:
    adapter = SmtpEmailAdapter(relay_of(sim, lookup_url=f"http://127.0.0.1:{closed_port()}/m"))
    assert isinstance(await adapter.lookup(MAIL, ctx()), LookupFailed)
    await adapter.aclose()
    adapter = SmtpEmailAdapter(relay_of(sim, lookup_url=f"{sim.http_url}/nowhere"))
    assert isinstance(await adapter.lookup(MAIL, ctx()), LookupFailed)
    await adapter.aclose()


async def test_our_message_id_on_another_message_is_not_proof(
        sim: SmtpSim, adapter: SmtpEmailAdapter) -> None:
    assert isinstance(await adapter.call(MAIL, ctx()), Succeeded)
    other = MAIL.model_copy(update={"subject": "Something else"})
    found = await adapter.lookup(other, ctx())
    assert isinstance(found, LookupFailed)
    assert "not what this step asked for" in found.detail


# --- the simulator -------------------------------------------------------------------------------


@pytest.mark.parametrize("rule", [
    {"action": "refuse", "code": 451},
    {"action": "transient", "code": 550},
    {"action": "accept_then_drop", "phase": "rcpt"},
    {"action": "transient", "phase": "mail", "to": "ada@example.com"},
    {"action": "slow"},
    {"action": "slow", "delay_s": 601},
    {"action": "drop", "code": 421},
    {"action": "explode"},
])
async def test_bad_fault_rules_are_refused(sim: SmtpSim, rule: dict[str, Any]) -> None:
    response = await http(sim, "POST", "/faults", {"rules": [rule]})
    assert response.status_code == 400, response.text


async def test_rules_are_consumed_in_order_and_may_name_a_recipient(
        sim: SmtpSim, adapter: SmtpEmailAdapter) -> None:
    await faults(sim, {"action": "refuse", "phase": "rcpt", "to": "grace@example.com"},
                 {"action": "transient", "phase": "rcpt", "times": 2})
    grace = MAIL.model_copy(update={"to": "grace@example.com"})
    results = [await adapter.call(MAIL, ctx("t:1")), await adapter.call(grace, ctx("t:2")),
               await adapter.call(grace, ctx("t:3")), await adapter.call(grace, ctx("t:4"))]
    assert [r.reason.split(": ")[1][:3] if isinstance(r, ToolRefused) else "ok"
            for r in results] == ["451", "550", "451", "ok"], results
    assert (await http(sim, "GET", "/faults")).json() == {"rules": []}
    await faults(sim, {"action": "refuse", "times": 5})
    assert (await http(sim, "DELETE", "/faults")).json() == {"rules": []}
    assert isinstance(await adapter.call(MAIL, ctx("t:5")), Succeeded)


async def test_the_simulator_runs_as_its_own_process() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "halfway.simulators.smtpsim", "--port", "0", "--http-port", "0",
        stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(30):
            line = (await proc.stdout.readline()).decode().strip()
        match = re.fullmatch(r"listening on smtp://([\d.]+):(\d+) (http://[\d.]+:\d+)", line)
        assert match, line
        host, port, http_url = match.group(1), int(match.group(2)), match.group(3)
        adapter = SmtpEmailAdapter(SmtpRelay(host=host, port=port, sender=SENDER,
                                             lookup_url=f"{http_url}/messages",
                                             timeout_s=5.0))
        assert isinstance(await adapter.call(MAIL, ctx(timeout_s=5.0)), Succeeded)
        assert isinstance(await adapter.lookup(MAIL, ctx(timeout_s=5.0)), Found)
        await adapter.aclose()
    finally:
        proc.terminate()
        assert await proc.wait() == 0
