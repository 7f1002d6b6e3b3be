"""Sagas and the subject guard through real processes: the broker, the services, tripsim and
paysim as child processes, judged by the journal and the providers' own ledgers.

- the trip that succeeds and the trip whose hotel is full (the hold and its release, nothing
  else);
- an executor killed -9 in the middle of compensating: every undo happens once;
- a step unknown and later proven done is undone; one proven not done is not;
- the order rules: the plans a saga refuses, with the reason the model was shown;
- two tasks racing to charge one invoice from two decider instances: one charge, and the
  other task refused by the guard; a third task a simulated week later is refused too.
"""

from __future__ import annotations

import asyncio
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from halfway.client import HalfwayClient
from halfway.contract import (
    CompensationAttempted,
    CompensationSettled,
    FinalState,
    OnUnknown,
    Outcome,
    StepIntended,
    TaskAborted,
    TaskPolicy,
    TaskRequested,
)
from halfway.contract.topics import JOURNAL
from halfway.demo.trip import FULL_HOTEL, trip_request
from halfway.journal import JournalWriter
from halfway.journal.records import partition_of
from halfway.resolve import ResolveRefused, os_user
from halfway.settings import KafkaSettings
from tests.factories import Stamper

pytest.register_assert_rewrite("tests.processes")

from tests.processes import CLUSTER_KEY, Cluster, Proc, cluster, journal_now, kill9  # noqa: E402

pytest_plugins = ["tests.processes"]
pytestmark = pytest.mark.broker

WEEK_S = 7 * 86_400


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def slow_trip(kafka_settings: KafkaSettings, tmp_path: Path,
                    request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    """Calls may take 5 s before they are unknown: an undo is in flight long enough to kill
    its executor in the middle of it."""
    async with cluster(kafka_settings, tmp_path, charge_timeout_s=5.0, tripsim=True) as c:
        request.node.stash[CLUSTER_KEY] = c
        yield c


async def start_services(c: Cluster) -> dict[str, Proc]:
    return {name: await c.start(name) for name in ("decider", "executor", "reconciler")}


def mine(records: list[dict[str, Any]], task_id: str) -> list[dict[str, Any]]:
    """The provider records our keys for this task name (metadata, key or Message-ID)."""
    def key(r: dict[str, Any]) -> str:
        return str((r.get("metadata") or {}).get("halfway_key") or r.get("idempotency_key")
                   or r.get("message_id") or "")
    return [r for r in records if key(r).startswith(f"{task_id}:")
            or key(r).startswith(f"<{task_id}:")]


async def effects(c: Cluster, task_id: str) -> dict[str, list[dict[str, Any]]]:
    ledger = await c.trip_ledger()
    out = {kind: mine(ledger[kind], task_id) for kind in ("holds", "bookings", "emails")}
    out["charges"] = mine(await c.ledger(), task_id)
    return out


def statuses(records: list[dict[str, Any]]) -> list[str]:
    return [r["status"] for r in records]


# --- the two trips -------------------------------------------------------------------------------


async def test_the_full_hotel_trip_leaves_a_hold_and_its_release_and_nothing_else(
        trip: Cluster) -> None:
    ok, full = new_id("trip-ok"), new_id("trip-full")
    await start_services(trip)
    await trip.publish(trip_request(ok),
                       trip_request(full, passenger="Grace Hopper", hotel=FULL_HOTEL))
    states = await trip.journal.until_finished([ok, full])

    assert states[ok].final_state is FinalState.SUCCEEDED, states[ok].finished
    assert [s.outcome for s in states[ok].steps.values()] == [Outcome.DONE] * 4
    good = await effects(trip, ok)
    assert [statuses(good[k]) for k in ("holds", "bookings", "charges", "emails")] == [
        ["held"], ["confirmed"], ["succeeded"], ["sent"]]

    state = states[full]
    assert state.final_state is FinalState.COMPENSATED, state.finished
    assert [s.outcome for s in state.steps.values()] == [Outcome.DONE, Outcome.NOT_DONE]
    assert state.steps[1].undo.outcome is Outcome.DONE
    assert state.steps[2].compensation is None  # proven not done: nothing to undo
    bad = await effects(trip, full)
    assert statuses(bad["holds"]) == ["released"]
    assert [h["status"] for h in bad["holds"][0]["history"]] == ["held", "released"]
    assert bad["bookings"] == bad["charges"] == bad["emails"] == []


async def test_an_executor_killed_while_compensating_leaves_every_undo_done_once(
        slow_trip: Cluster) -> None:
    c = slow_trip
    task_id = new_id("trip-kill")
    # The card is declined at the pivot: the hotel and the flight are undone, hotel first.
    # Cancelling takes 3 s at the provider, so the executor dies with the cancel in flight.
    await c.trip_faults({"match": {"endpoint": "hotels.cancel"}, "times": 1,
                         "action": {"delay_s": 3.0}})
    procs = await start_services(c)
    await c.publish(trip_request(task_id, customer="cus_declined"))
    await c.journal.first(lambda e: isinstance(e, CompensationAttempted)
                          and e.step_id == f"{task_id}:2", "the hotel's undo attempted")
    await kill9(procs["executor"])
    await c.start("executor")
    state = (await c.journal.until_finished([task_id]))[task_id]

    assert state.final_state is FinalState.COMPENSATED, state.finished
    assert [state.steps[n].undo.outcome for n in (1, 2)] == [Outcome.DONE, Outcome.DONE]
    done = await effects(c, task_id)
    assert statuses(done["bookings"]) == ["cancelled"]
    assert statuses(done["holds"]) == ["released"]
    assert [h["status"] for h in done["bookings"][0]["history"]] == ["confirmed", "cancelled"]
    assert [h["status"] for h in done["holds"][0]["history"]] == ["held", "released"]
    assert statuses(done["charges"]) == ["failed"]
    assert done["emails"] == []
    # Undos ran last first: the hotel's was settled before the flight's was first attempted.
    log = await journal_now(c.settings)
    order = [(type(e).__name__, e.step_id) for e in log if e.task_id == task_id
             and isinstance(e, CompensationAttempted | CompensationSettled)
             and (not isinstance(e, CompensationSettled) or e.outcome is Outcome.DONE)]
    assert order.index(("CompensationSettled", f"{task_id}:2")) < order.index(
        ("CompensationAttempted", f"{task_id}:1"))


async def test_an_undo_whose_key_holds_a_saved_500_is_sent_again_under_its_next_key(
        trip: Cluster) -> None:
    c = trip
    task_id = new_id("trip-saved")
    # The card is declined at the pivot: the hotel and the flight are undone. The hotel's
    # cancellation meets a 500 the provider saves under the key before doing anything, and
    # replays to every retry with it. Past the provider's bound (1 s here) a lookup that
    # finds nothing proves the cancellation did nothing, so it goes again under :undo2.
    await c.trip_faults({"match": {"endpoint": "hotels.cancel"}, "times": 1,
                         "action": {"status": 500, "when": "before_commit"}})
    for name in ("decider", "executor", "reconciler"):
        await c.start(name, HALFWAY_TRAVEL_COMPLETES_WITHIN_S="1")
    await c.publish(trip_request(task_id, customer="cus_declined"))
    state = (await c.journal.until_finished([task_id]))[task_id]

    assert state.final_state is FinalState.COMPENSATED, state.finished
    hotel = state.steps[2]
    assert hotel.undo_keys == (f"{task_id}:2:undo", f"{task_id}:2:undo2")
    [first] = hotel.past_undos
    assert first.state.outcome is Outcome.NOT_DONE, first.state.settlement
    assert first.state.unknowns[-1].replayed  # the retry with the key got the saved 500
    assert hotel.undo.outcome is Outcome.DONE
    assert state.steps[1].undo_keys == (f"{task_id}:1:undo",)
    assert state.steps[1].undo.outcome is Outcome.DONE
    done = await effects(c, task_id)
    assert [h["status"] for h in done["bookings"][0]["history"]] == ["confirmed", "cancelled"]
    assert statuses(done["holds"]) == ["released"]
    assert statuses(done["charges"]) == ["failed"]
    assert done["emails"] == []


async def test_an_unknown_step_is_undone_once_proven_done_and_not_if_proven_not_done(
        trip: Cluster) -> None:
    # Both bookings take 2 s at the provider, past the 1 s timeout: unknown. The saga gives up
    # on unknowns (on_unknown=compensate) and waits for the lookups to say what happened.
    happened, refused = new_id("trip-late"), new_id("trip-late-full")
    await trip.trip_faults({"match": {"endpoint": "hotels.book"}, "action": {"delay_s": 2.0}})
    await start_services(trip)
    await trip.publish(
        trip_request(happened, on_unknown=OnUnknown.COMPENSATE),
        trip_request(refused, passenger="Grace Hopper", hotel=FULL_HOTEL,
                     on_unknown=OnUnknown.COMPENSATE))
    states = await trip.journal.until_finished([happened, refused])

    for task_id in (happened, refused):
        state = states[task_id]
        assert state.final_state is FinalState.COMPENSATED, state.finished
        hotel = state.steps[2]
        assert [u.outcome for u in hotel.effect.unknowns][:1] == [Outcome.UNKNOWN]
        assert isinstance(state.aborted, TaskAborted)
        assert "is unknown, and the policy gives up on unknowns" in state.aborted.reason
    assert states[happened].steps[2].outcome is Outcome.DONE
    assert states[happened].steps[2].undo.outcome is Outcome.DONE
    assert states[refused].steps[2].outcome is Outcome.NOT_DONE
    assert states[refused].steps[2].compensation is None
    late, late_full = await effects(trip, happened), await effects(trip, refused)
    assert statuses(late["bookings"]) == ["cancelled"]
    assert statuses(late["holds"]) == ["released"]
    assert late_full["bookings"] == []
    assert statuses(late_full["holds"]) == ["released"]
    assert late["charges"] == late_full["charges"] == []


# --- the order rules -----------------------------------------------------------------------------


def saga(task_id: str, script: list[dict[str, Any]]) -> TaskRequested:
    return trip_request(task_id).model_copy(update={
        "input": {"script": script, "summary": "planned"},
        "policy": TaskPolicy(saga=True)})


async def test_a_saga_refuses_plans_out_of_order_and_the_model_reads_why(trip: Cluster) -> None:
    email = {"tool": "send_email", "args": {"to": "a@example.com", "subject": "s", "body": "b"}}
    hold = {"tool": "hold_flight", "args": {"flight": "LH-1", "passenger": "P"}}
    hotel = {"tool": "book_hotel", "args": {"hotel": "HTL-1", "guest": "P", "nights": 1}}

    def charge(invoice: str) -> dict[str, Any]:
        return {"tool": "charge_customer", "args": {"invoice": invoice, "customer": "cus_1",
                                                    "amount_cents": 100}}

    plans = {
        new_id("email-first"): ([email], 1, "refused: send_email cannot be undone and is not "
                                "the pivot; place it after the pivot"),
        new_id("two-pivots"): ([hold, charge(new_id("INV")), charge(new_id("INV"))], 3,
                               "refused: this saga already has its pivot, {t}:2 "
                               "(charge_customer); a second step that cannot be undone is "
                               "not allowed"),
        new_id("undo-after-pivot"): ([charge(new_id("INV")), hotel], 2,
                                     "refused: book_hotel would come after the pivot {t}:1 "
                                     "(charge_customer); nothing that may need undoing can "
                                     "follow the point of no return"),
    }
    await start_services(trip)
    await trip.publish(*(saga(t, script) for t, (script, _, _) in plans.items()))
    states = await trip.journal.until_finished(plans)
    stranded = {t for t, (script, _, _) in plans.items() if "charge_customer" in str(script)}
    for task_id, (_, n, reason) in plans.items():
        state = states[task_id]
        wanted = reason.format(t=task_id)
        refusals = state.refused(n)
        assert [r.reason for r in refusals] == [wanted] * 3, refusals
        assert n not in state.steps  # nothing was placed
        # Past its pivot (the card charged) a saga that cannot go on needs a person.
        assert state.final_state is (FinalState.NEEDS_ATTENTION if task_id in stranded
                                     else FinalState.FAILED), state.finished
        assert wanted in state.finished.summary
    # The scripted model was asked again after each refusal, with the refusal in its history.
    asked = [c for c in trip.model_calls() if c["task_id"] in plans]
    assert len(asked) >= 3 * len(plans)


# --- the subject guard ---------------------------------------------------------------------------


def charge_task(task_id: str, invoice: str) -> TaskRequested:
    return TaskRequested(
        event_id=uuid.uuid4().hex, task_id=task_id, at=datetime.now(UTC),
        input={"script": [{"tool": "charge_customer", "args": {
            "invoice": invoice, "customer": "cus_8812", "amount_cents": 4900}}],
            "summary": f"charged {invoice}"},
        allowed_tools=["charge_customer"])


def owned(proc: Proc) -> set[int]:
    """The journal partitions a service owns now, by its own log (eager rebalances: the last
    assignment is the whole of it)."""
    assigned = proc.logged("partitions assigned")
    return set(assigned[-1]["partitions"]) if assigned else set()


async def test_two_tasks_racing_for_one_invoice_on_two_deciders_charge_it_once(
        trip: Cluster) -> None:
    invoice = new_id("INV-RACE")
    # Each charge takes 0.8 s at the provider (within the 1 s timeout): the winner's charge is
    # in flight while the other task asks.
    await trip.faults({"match": {}, "action": {"delay_s": 0.8}})
    d1 = await trip.start("decider")
    await d1.until_logged("partitions assigned")
    d2 = await trip.start("decider")
    await d1.until_logged("partitions assigned", count=2)
    await d2.until_logged("partitions assigned")
    await trip.start("executor")
    await trip.start("reconciler")
    one, two = owned(d1), owned(d2)
    assert one, two
    assert two, one
    assert not one & two, (one, two)

    def task_on(partitions: set[int], prefix: str) -> str:
        return next(t for t in (new_id(prefix) for _ in range(1000))
                    if partition_of(t.encode(), JOURNAL.partitions) in partitions)

    a, b = task_on(one, "race-a"), task_on(two, "race-b")
    await trip.publish(charge_task(a, invoice), charge_task(b, invoice))
    states = await trip.journal.until_finished([a, b])

    charges = [c for c in await trip.ledger() if (c.get("metadata") or {}).get("invoice")
               == invoice]
    assert len(charges) == 1, charges
    winner = next(t for t in (a, b) if states[t].final_state is FinalState.SUCCEEDED)
    loser = b if winner == a else a
    assert charges[0]["metadata"]["halfway_key"] == f"{winner}:1"
    refusals = states[loser].refused(1)
    assert refusals
    assert all(r.reason.startswith(f"blocked: {winner}:1 ") for r in refusals)
    assert states[loser].final_state is FinalState.FAILED
    assert not states[loser].steps  # the loser never placed a charge

    # A simulated week later, with fresh deciders (the guard comes from Kafka alone) and a
    # provider that has long forgotten every key: the invoice is still charged once.
    await trip._sim("POST", "/_sim/clock", {"advance_s": WEEK_S})
    await kill9(d1)
    await kill9(d2)
    d3 = await trip.start("decider")
    await d3.until_logged("partitions assigned")
    later = new_id("race-later")
    await trip.publish(charge_task(later, invoice))
    state = (await trip.journal.until_finished([later]))[later]
    assert state.final_state is FinalState.FAILED
    assert state.refused(1)[0].reason == (
        f"blocked: {winner}:1 already did charge_customer on invoice:{invoice}; "
        f"charge_customer happens once per subject")
    log = await journal_now(trip.settings)
    assert not [e for e in log if isinstance(e, StepIntended) and e.task_id == later]
    assert len([c for c in await trip.ledger()
                if (c.get("metadata") or {}).get("invoice") == invoice]) == 1


async def test_an_aborted_trip_settles_its_step_in_flight_then_undoes_what_was_done(
        slow_trip: Cluster) -> None:
    c = slow_trip
    task_id = new_id("trip-abort")
    # The booking takes 4 s (the attempt's timeout is 5): the operator calls the trip off while
    # it is in flight, with `halfway abort`, a process that must start and reach the broker in
    # that window on a busy machine too.
    await c.trip_faults({"match": {"endpoint": "hotels.book"}, "action": {"delay_s": 4.0}})
    await start_services(c)
    await c.publish(trip_request(task_id))
    await c.journal.first(lambda e: getattr(e, "step_id", None) == f"{task_id}:2"
                          and e.type == "step.attempted", "the booking attempted")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "halfway", "abort", task_id, "--reason",
        "the customer cancelled", "--by", "alice", env=c.env(),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    # The journal keeps the OS user beside the name --by gives.
    alice = f"alice (os:{os_user()})"
    assert out.decode().strip() == f"{task_id}: called off by {alice}: the customer cancelled"
    state = (await c.journal.until_finished([task_id]))[task_id]

    assert state.final_state is FinalState.COMPENSATED, state.finished
    assert state.finished.summary.startswith(f"aborted by {alice}: the customer cancelled")
    assert 3 not in state.steps  # nothing decided after the call-off
    assert [state.steps[n].undo.outcome for n in (1, 2)] == [Outcome.DONE, Outcome.DONE]
    done = await effects(c, task_id)
    assert statuses(done["bookings"]) == ["cancelled"]
    assert statuses(done["holds"]) == ["released"]
    assert done["charges"] == done["emails"] == []


async def test_the_client_calls_off_only_a_task_that_was_requested(
        topics: KafkaSettings) -> None:
    async with HalfwayClient(topics) as client:
        with pytest.raises(ResolveRefused, match="was never requested"):
            await client.abort_task(new_id("never-started"), "because")


async def test_a_caller_calling_a_task_off_is_told_it_is_an_operators_act(
        topics: KafkaSettings, writer: JournalWriter) -> None:
    """Callers may only request tasks (their ACLs): the call-off is refused by the broker,
    and the caller is told who may, not handed the broker's bare authorization error. A
    request the API would refuse is refused by the client too, before it is sent."""
    task_id = new_id("running")
    await writer.append(Stamper(task_id).started())
    async with HalfwayClient(topics.as_kind("caller")) as client:
        with pytest.raises(PermissionError, match="an operator's act"):
            await client.abort_task(task_id, "the customer cancelled")
        with pytest.raises(ValueError, match="is not a task id"):
            await client.task_state("../" + task_id)
        # The API's check: the journal would keep NaN as null, a value the caller never sent.
        with pytest.raises(ValueError, match=r"not JSON numbers \(at cart\[1\]\.cents\)"):
            await client.start_task(new_id("nan"), {"cart": [{}, {"cents": float("nan")}]},
                                    ["charge_customer"])
    async with HalfwayClient(topics.as_kind("operator")) as operator:
        aborted = await operator.abort_task(task_id, "the customer cancelled")
    assert aborted.reason == "the customer cancelled"
