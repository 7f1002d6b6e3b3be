"""The reconciler through real processes: lookups, webhooks, key lifetimes, operators.

Like test_core_loop, every test runs the simulator and the services as child processes on a
topic prefix of its own, and judges by the journal, the provider's ledger and request log.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from halfway import settings
from halfway.contract import DeadLetter, FinalState, Outcome, SettlementSource, StepSettled
from halfway.contract.outcomes import OutcomeChanged
from halfway.contract.topics import DEAD_LETTERS
from halfway.core.fold import StepStatus, fold
from halfway.outcomes.service import read_outcomes
from halfway.settings import KafkaSettings
from halfway.webhooks import sign

pytest.register_assert_rewrite("tests.processes")

from tests.processes import (  # noqa: E402
    CLUSTER_KEY,
    Cluster,
    charges_for,
    cluster,
    journal_now,
    kill9,
    renewal_request,
)
from tests.test_journal import raw_records  # noqa: E402

pytest_plugins = ["tests.processes"]
pytestmark = pytest.mark.broker

TIMEOUT_S = 1.0
KEY_TTL_S = 6.0
LONG_WAIT_S = 120.0


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def short_keys(kafka_settings: KafkaSettings, tmp_path: Path,
                     request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    """A provider that forgets keys after KEY_TTL_S, and services told so."""
    async with cluster(kafka_settings, tmp_path, charge_timeout_s=TIMEOUT_S,
                       sim_args=("--key-ttl-s", str(KEY_TTL_S))) as c:
        request.node.stash[CLUSTER_KEY] = c
        yield c


async def halfway_cli(c: Cluster, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "halfway", *args, env=c.env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_a_key_that_expires_while_unknown_ends_retries_and_needs_an_operator(
        short_keys: Cluster) -> None:
    c = short_keys
    ttl = {"HALFWAY_CHARGE_KEY_TTL_S": str(KEY_TTL_S)}
    # The provider fails before committing and saves the 500 under the key (as Stripe does):
    # every retry with the key replays the 500, and lookups find nothing. Nothing proves
    # either way; the key runs out.
    await c.faults({"match": {"nth": 1}, "action": {"status": 500, "when": "before_commit"}})
    for service in ("decider", "executor", "reconciler"):
        await c.start(service, **ttl)
    task_id = new_id("expiry")
    step_id = f"{task_id}:1"
    await c.publish(renewal_request(task_id))

    def needs_attention() -> bool | None:
        return True if fold(c.journal.of(task_id), task_id).needs_attention else None

    await c.journal.wait_for(needs_attention, "the task to need attention", LONG_WAIT_S)
    state = fold(c.journal.of(task_id), task_id)
    assert state.step(1).status is StepStatus.UNKNOWN  # never rounded to failure
    assert state.finished is None
    requests = [r for r in await c.sim_requests() if r["idempotency_key"] == step_id]
    assert len(requests) >= 2, "the harness should have retried while the key was alive"
    first_s = requests[0]["at"]  # the provider's clock, in seconds
    late = [r for r in requests if r["at"] > first_s + KEY_TTL_S]
    assert late == [], f"requests after the provider forgot the key: {late}"
    assert charges_for(await c.ledger(), step_id) == []

    # A person checks with the bank and resolves it; the task moves on and finishes.
    code, out, err = await halfway_cli(c, "resolve", step_id, "not_done", "--reason",
                                       "the bank shows no payment", "--by", "alice")
    assert code == 0, err
    assert f"{step_id}: not_done" in out
    await c.journal.until_finished([task_id], LONG_WAIT_S)
    state = fold(c.journal.of(task_id), task_id)
    settled = state.step(1).effect.settlement
    assert settled.source is SettlementSource.OPERATOR
    assert "alice" in settled.reason
    assert state.final_state is FinalState.FAILED
    assert not state.needs_attention


async def test_resolve_refuses_what_it_cannot_settle(short_keys: Cluster) -> None:
    c = short_keys
    for service in ("decider", "executor", "reconciler"):
        await c.start(service)
    task_id = new_id("refuse")
    await c.publish(renewal_request(task_id))
    await c.journal.until_finished([task_id], LONG_WAIT_S)
    code, _, err = await halfway_cli(c, "resolve", f"{task_id}:1", "not_done", "--reason", "x")
    assert code == 2
    assert "already done" in err
    code, _, err = await halfway_cli(c, "resolve", f"{task_id}:7", "done", "--evidence", "a=b")
    assert code == 2
    assert "not in the journal" in err
    code, _, err = await halfway_cli(c, "resolve", f"{task_id}:1", "done")
    assert code == 2
    assert "needs evidence" in err
    events = await journal_now(c.settings)
    operator = [e for e in events if isinstance(e, StepSettled) and e.task_id == task_id
                and e.source is SettlementSource.OPERATOR]
    assert operator == []
    assert fold([e for e in events if e.task_id == task_id], task_id).step(1).outcome \
        is Outcome.DONE


# --- webhooks ---------------------------------------------------------------------------------


@pytest.fixture
async def hooked(kafka_settings: KafkaSettings, tmp_path: Path,
                 request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    """The provider sends signed webhooks to our gateway (its own process)."""
    async with cluster(kafka_settings, tmp_path, charge_timeout_s=TIMEOUT_S,
                       webhooks=True) as c:
        request.node.stash[CLUSTER_KEY] = c
        yield c


def settlements_of(c: Cluster, task_id: str) -> list[StepSettled]:
    return [e for e in c.journal.of(task_id) if isinstance(e, StepSettled)]


async def test_the_essay_timeline_nothing_found_then_the_charge_lands_and_settles(
        hooked: Cluster) -> None:
    c = hooked
    # The charge lands at 2.2 s; the harness gives up waiting at 1 s and looks it up at once.
    await c.faults({"match": {"nth": 1}, "action": {"delay_s": 2.2}})
    for service in ("decider", "executor", "reconciler"):
        await c.start(service)
    task_id = new_id("essay")
    await c.publish(renewal_request(task_id))
    await c.journal.until_finished([task_id], LONG_WAIT_S)
    events = c.journal.of(task_id)
    kinds = [(e.type, getattr(e, "outcome", None)) for e in events
             if e.type in ("step.settled", "step.checked")]
    first_unknown = kinds.index(("step.settled", Outcome.UNKNOWN))
    first_check = kinds.index(("step.checked", None))
    done = kinds.index(("step.settled", Outcome.DONE))
    assert first_unknown < first_check < done, kinds  # unknown, nothing found yet, then done
    state = fold(events, task_id)
    assert state.final_state is FinalState.SUCCEEDED
    assert state.step(1).effect.settlement.evidence["charge_id"]
    assert len(charges_for(await c.ledger(), f"{task_id}:1")) == 1


async def test_with_lookups_off_webhooks_alone_settle_every_unknown_step(
        hooked: Cluster) -> None:
    c = hooked
    tasks = 100
    # Every charge lands after the caller gave up: every step becomes unknown, and with no
    # lookups nothing but the provider's webhooks can settle it. They come twice half of the
    # time, and late by up to a second, so out of order.
    await c.faults({"match": {}, "action": {"delay_s": 1.5}})
    await c.webhook_behaviour(duplicate_p=0.5, delay_s_max=1.0, seed=11)
    await c.start("decider")
    await c.start("executor")
    await c.start("reconciler", HALFWAY_RECONCILER_LOOKUPS="off")
    ids = [new_id(f"hook-{i:03d}") for i in range(tasks)]
    await c.publish(*(renewal_request(t, invoice=f"INV-{t}") for t in ids))
    await c.journal.until_finished(ids, LONG_WAIT_S)

    log = await c.webhook_log()
    duplicates = sum(1 for a in log["attempts"] if a["delivery"] == 2)
    charges = await c.ledger()
    problems = []
    for task_id in ids:
        state = fold(c.journal.of(task_id), task_id)
        step = state.step(1)
        sources = [s.source for s in settlements_of(c, task_id)]
        if state.final_state is not FinalState.SUCCEEDED:
            problems.append(f"{task_id}: {state.final_state}")
        if step.effect.settlement.source is not SettlementSource.WEBHOOK:
            problems.append(f"{task_id}: settled by {step.effect.settlement.source}")
        if SettlementSource.LOOKUP in sources:
            problems.append(f"{task_id}: a lookup ran although lookups are off")
        if len(charges_for(charges, f"{task_id}:1")) != 1:
            problems.append(f"{task_id}: {len(charges_for(charges, f'{task_id}:1'))} charges")
        if not step.effect.unknowns:
            problems.append(f"{task_id}: never unknown (the test did not test webhooks)")
    assert problems == []
    assert duplicates > 0, "no duplicate deliveries: the test did not test dedupe"


async def test_restarting_the_reconciler_loses_no_unknown_step_and_no_unmatched_webhook(
        hooked: Cluster) -> None:
    c = hooked
    await c.faults({"match": {}, "action": {"delay_s": 1.5}})
    await c.webhook_behaviour(paused=True)  # the provider holds its webhooks for now
    await c.start("decider")
    await c.start("executor")
    reconciler = await c.start("reconciler", HALFWAY_RECONCILER_LOOKUPS="off")
    ids = [new_id(f"restart-{i}") for i in range(10)]
    await c.publish(*(renewal_request(t, invoice=f"INV-{t}") for t in ids))

    def all_unknown() -> bool | None:
        return True if all(fold(c.journal.of(t), t).step(1) is not None
                           and fold(c.journal.of(t), t).step(1).status is StepStatus.UNKNOWN
                           for t in ids) else None

    await c.journal.wait_for(all_unknown, "every step unknown", LONG_WAIT_S)
    await kill9(reconciler)
    # While no reconciler runs, the webhooks arrive: the gateway publishes them, unmatched.
    await c.webhook_behaviour(paused=False)

    async def delivered() -> None:
        while True:
            attempts = (await c.webhook_log())["attempts"]
            if len({a["key"] for a in attempts if a["status"] == 200}) >= len(ids):
                return
            await asyncio.sleep(0.1)

    await asyncio.wait_for(delivered(), LONG_WAIT_S)
    assert all(fold(c.journal.of(t), t).step(1).status is StepStatus.UNKNOWN for t in ids)
    await c.start("reconciler", HALFWAY_RECONCILER_LOOKUPS="off")
    await c.journal.until_finished(ids, LONG_WAIT_S)
    for task_id in ids:
        state = fold(c.journal.of(task_id), task_id)
        assert state.final_state is FinalState.SUCCEEDED, task_id
        assert state.step(1).effect.settlement.source is SettlementSource.WEBHOOK, task_id


async def post_webhook(c: Cluster, event_id: str, kind: str, key: str, charge_id: str, *,
                       amount: int = 4900, customer: str = "cus_8812") -> None:
    """A webhook signed with the provider's real secret: only its content is ours."""
    now = int(time.time())
    body = json.dumps({"id": event_id, "type": kind, "created": now,
                       "data": {"object": {
                           "id": charge_id, "object": "charge", "amount": amount,
                           "currency": "usd", "customer": customer,
                           "status": "succeeded" if kind == "charge.succeeded" else "failed",
                           "metadata": {"halfway_key": key}}}}).encode()
    async with httpx.AsyncClient(timeout=30) as client:
        response = await client.post(c.gateway_url, content=body, headers={
            "Stripe-Signature": sign(body, settings.paysim_webhook_secret(), now),
            "Content-Type": "application/json"})
    assert response.status_code == 200, response.text


async def dead_letters_for(c: Cluster, key: str, count: int) -> list[DeadLetter]:
    records = await raw_records(
        c.settings, DEAD_LETTERS, count,
        keep=lambda r: key in DeadLetter.model_validate_json(r.value).value)
    return [DeadLetter.model_validate_json(r.value) for r in records]


async def test_a_webhook_for_a_key_never_sent_is_quarantined_and_never_settles_the_step(
        hooked: Cluster) -> None:
    """A provider cannot know our key before we send it: a signed webhook for T:1 that
    arrives before T:1 was attempted is an orphan, whatever it says, now and later."""
    c = hooked
    task_id, other = new_id("early"), new_id("never")
    step_id = f"{task_id}:1"
    await c.start("reconciler", HALFWAY_RECONCILER_LOOKUPS="off")
    await post_webhook(c, "evt_early_1", "charge.succeeded", step_id, "ch_early_1")
    await post_webhook(c, "evt_never_1", "charge.failed", f"{other}:1", "ch_never_1")
    (early,) = await dead_letters_for(c, "evt_early_1", 1)
    assert "orphan" in early.reason
    assert step_id in early.reason
    (never,) = await dead_letters_for(c, "evt_never_1", 1)
    assert "not attempted before the webhook arrived" in never.reason
    # Then the task starts. Its own call cannot settle it (the provider is slow, the caller
    # gives up, lookups are off, the provider's own webhooks are held back): were the early
    # webhook kept, it would settle the step with a charge that never existed.
    await c.faults({"match": {}, "action": {"delay_s": 1.5}})
    await c.webhook_behaviour(paused=True)
    for service in ("decider", "executor"):
        await c.start(service)
    await c.publish(renewal_request(task_id))
    await c.journal.first(lambda e: e.task_id == task_id and e.type == "step.settled",
                          "the step's first settlement", LONG_WAIT_S)
    (charge,) = await until_charged(c, step_id)
    # The provider's real webhook, about the attempt we journaled, is evidence.
    await c.webhook_behaviour(paused=False)
    await c.journal.until_finished([task_id], LONG_WAIT_S)
    state = fold(c.journal.of(task_id), task_id)
    settlement = state.step(1).effect.settlement
    assert settlement.source is SettlementSource.WEBHOOK
    assert settlement.evidence["charge_id"] == charge["id"] != "ch_early_1"
    assert not state.step(1).effect.contradictions
    assert state.final_state is FinalState.SUCCEEDED
    # A restart weighs every webhook again from the topic: the orphan stays an orphan.
    for proc in [p for p in c.procs if p.name.startswith("reconciler")]:
        await kill9(proc)
    again = await c.start("reconciler", HALFWAY_RECONCILER_LOOKUPS="off")
    await again.until_logged("webhook quarantined", count=2, timeout_s=LONG_WAIT_S)
    events = await journal_now(c.settings)
    assert not [e for e in events if getattr(e, "evidence", None)
                and e.evidence.get("provider_event_id") in ("evt_early_1", "evt_never_1")]


async def test_with_lookups_off_a_failed_webhook_is_not_proof_and_an_operator_is_asked(
        hooked: Cluster) -> None:
    """A negative report is corroborated by a lookup; with lookups off nothing can, so it
    proves nothing: the charge that did land must not read "not done, safe to try again"."""
    c = hooked
    task_id = new_id("failed-word")
    step_id = f"{task_id}:1"
    await c.faults({"match": {}, "action": {"delay_s": 1.5}})  # the caller gives up first
    await c.webhook_behaviour(paused=True)  # the provider's own webhooks are held back
    for service in ("decider", "executor"):
        await c.start(service)
    await c.start("reconciler", HALFWAY_RECONCILER_LOOKUPS="off")
    await c.publish(renewal_request(task_id))
    await c.journal.first(lambda e: e.task_id == task_id and e.type == "step.settled",
                          "the step's first settlement (unknown)", LONG_WAIT_S)
    (charge,) = await until_charged(c, step_id)  # it landed
    await post_webhook(c, f"evt_{task_id}_failed", "charge.failed", step_id, "ch_made_up")
    checked = await c.journal.first(
        lambda e: e.task_id == task_id and e.type == "step.checked"
        and "lookups are off" in e.found, "an operator asked", LONG_WAIT_S)
    assert "says it failed" in checked.found
    assert checked.next_check_at is None
    step = fold(c.journal.of(task_id), task_id).step(1)
    assert step.status is StepStatus.UNKNOWN
    assert step.effect.needs_attention
    # The provider's real webhook then settles it: done, the charge that landed.
    await c.webhook_behaviour(paused=False)
    await c.journal.until_finished([task_id], LONG_WAIT_S)
    state = fold(c.journal.of(task_id), task_id)
    settlements = [s.outcome for s in settlements_of(c, task_id)]
    assert Outcome.NOT_DONE not in settlements, settlements
    assert state.step(1).effect.settlement.evidence["charge_id"] == charge["id"]
    assert state.final_state is FinalState.SUCCEEDED


async def until_charged(c: Cluster, key: str) -> list[dict]:
    async def charged() -> list[dict]:
        while True:  # the provider's ledger has no notification: polled, bounded
            if found := charges_for(await c.ledger(), key):
                return found
            await asyncio.sleep(0.05)

    return await asyncio.wait_for(charged(), LONG_WAIT_S)


async def test_a_webhook_that_contradicts_the_step_needs_an_operator_not_a_settlement(
        hooked: Cluster) -> None:
    """A second charge reported under a done key, and an unknown step's webhook charging
    another amount: both are kept as contradictions, and the task needs an operator."""
    c = hooked
    for service in ("decider", "executor", "reconciler", "outcomes"):
        await c.start(service)
    done_task = new_id("twice")
    await c.publish(renewal_request(done_task))
    await c.journal.until_finished([done_task], LONG_WAIT_S)
    state = fold(c.journal.of(done_task), done_task)
    charge_id = state.step(1).effect.settlement.evidence["charge_id"]
    await post_webhook(c, "evt_second", "charge.succeeded", f"{done_task}:1", "ch_second")
    contradiction = await c.journal.first(
        lambda e: e.task_id == done_task and getattr(e, "contradiction", None) is not None,
        "the contradiction journaled", LONG_WAIT_S)
    assert "names another effect than " + charge_id in contradiction.contradiction
    state = fold(c.journal.of(done_task), done_task)
    assert state.step(1).effect.settlement.evidence["charge_id"] == charge_id  # still done
    assert state.needs_attention
    # The outcomes topic says so too: the task needs attention, though it had succeeded.
    outcome = await last_outcome(c, done_task, "needs_attention")
    assert "ch_second" in outcome.words

    # An unknown step, and a webhook whose charge is for another amount: not a settlement.
    await c.faults({"match": {}, "action": {"delay_s": 1.5}})
    await c.webhook_behaviour(paused=True)
    odd = new_id("odd")
    for proc in [p for p in c.procs if p.name.startswith("reconciler")]:
        await kill9(proc)  # lookups would settle it first: this test is about the webhook
    await c.start("reconciler", HALFWAY_RECONCILER_LOOKUPS="off")
    await c.publish(renewal_request(odd))
    await c.journal.first(lambda e: e.task_id == odd and getattr(e, "outcome", None)
                          is Outcome.UNKNOWN, "the step unknown", LONG_WAIT_S)
    await post_webhook(c, "evt_odd", "charge.succeeded", f"{odd}:1", "ch_odd", amount=9900)
    await c.journal.first(
        lambda e: e.task_id == odd and getattr(e, "contradiction", None) is not None,
        "the mismatch journaled as a contradiction", LONG_WAIT_S)
    state = fold(c.journal.of(odd), odd)
    assert state.step(1).status is StepStatus.UNKNOWN  # never settled by it
    assert state.needs_attention
    assert "9900 usd" in state.step(1).effect.attention_why


async def last_outcome(c: Cluster, task_id: str, state: str) -> OutcomeChanged:
    async def found() -> OutcomeChanged:
        while True:
            mine = [m async for m in read_outcomes(c.settings) if m.task_id == task_id
                    and m.subject == "task"]
            if mine and mine[-1].state == state:
                return mine[-1]
            await asyncio.sleep(0.2)

    return await asyncio.wait_for(found(), LONG_WAIT_S)


async def test_a_reconciler_whose_app_lacks_a_steps_tool_says_so_once() -> None:
    """Its status says the step is checked; a reconciler run with another app than the
    executors' never checks it. It says so, as an error naming the tool, once per tool."""
    from structlog.testing import capture_logs

    from halfway.app import App
    from halfway.core.effects import effects_to_work
    from halfway.journal.writer import JournalWriter
    from halfway.reconciler.service import Reconciler
    from tests.factories import Stamper
    from tests.followers import MADE

    app = App(name="other")

    @app.tool(effect="read")
    async def look_up(query: str) -> dict:
        """Look something up."""
        return {"query": query}

    settings = KafkaSettings(bootstrap="127.0.0.1:1", topic_prefix="unserved.",
                             replication_factor=1)
    reconciler = Reconciler(settings, app.registry(), writer=None)  # type: ignore[arg-type]
    MADE.append((reconciler.follower, JournalWriter(settings)))  # closed after the test
    s = Stamper("elsewhere-1")
    state = fold([s.started(), s.intended(1), s.attempted(1, 1),
                  s.settled(1, Outcome.UNKNOWN, attempt=1)])
    [effect] = effects_to_work(state, s.now)
    with capture_logs() as logs:
        reconciler._consider(effect, s.now)
        reconciler._consider(effect, s.now)
    said = [e for e in logs if e.get("tool") == "charge_customer"]
    assert len(said) == 1
    assert said[0]["log_level"] == "error"
    assert "not looked up here" in said[0]["event"]
