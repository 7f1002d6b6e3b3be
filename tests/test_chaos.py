"""The chaos suite (benchmarks/chaos.py): its oracle, and a small run against real processes.

The oracle's tests are pure: hand-made journals and ledgers, each with one thing wrong, must be
judged exactly (an oracle that misses a duplicate is worse than none). The run is small enough
for CI on two cores: 200 tasks through two of each service, with kill -9s, a pause past the
consumer session timeout, refused connections, a fault mix at the provider, duplicate and late
webhooks, and one kill -9 of a broker of the run's own; once with deciders and executors, once
with workers (both in one process) and a share of trips (sagas). It fails, never skips, when
something it needs is missing.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from benchmarks.chaos import ChaosConfig, run
from benchmarks.chaos_oracle import (
    Requested,
    Verdict,
    judge,
    last_outcomes,
    percentile,
    reason_group,
)
from benchmarks.chaos_report import render, settlement_counts

from halfway.contract import FinalState, Outcome, SettlementSource, SubjectHeld
from halfway.core.fold import TaskState, fold
from halfway.outcomes.derive import messages
from tests.factories import Stamper

# --- the oracle, pure ----------------------------------------------------------------------------


def charge(key: str, invoice: str, charge_id: str, status: str = "succeeded") -> dict[str, Any]:
    return {"id": charge_id, "status": status, "idempotency_key": key,
            "metadata": {"halfway_key": key, "invoice": invoice}}


def succeeded_task(task_id: str, invoice: str, charge_id: str) -> list[Any]:
    s = Stamper(task_id)
    return [s.started(), s.intended(1, subject=f"invoice:{invoice}"), s.attempted(1, 1),
            s.settled(1, Outcome.DONE, attempt=1, evidence={"charge_id": charge_id}),
            s.finished(FinalState.SUCCEEDED)]


def failed_task(task_id: str) -> list[Any]:
    s = Stamper(task_id)
    return [s.started(), s.refused(1, reason="refused: invoice:INV-1 is already charged"),
            s.finished(FinalState.FAILED)]


def judged(journals: dict[str, list[Any]], ledger: list[dict[str, Any]],
           invoices: dict[str, str], *, outcomes: bool = True,
           tamper: dict[tuple[str, str], str] | None = None) -> Verdict:
    states = {t: fold(events, t) for t, events in journals.items()}
    published = [m for t, events in journals.items() for m in messages(events, t)]
    last = last_outcomes(published)
    for about, state in (tamper or {}).items():
        last[about] = last[about].model_copy(update={"state": state})
    return judge([Requested(t, i) for t, i in invoices.items()], ledger, states,
                 last if outcomes else None)


def test_a_clean_run_has_no_findings() -> None:
    # A pair on one invoice: one charge, the other task refused and failed.
    journals = {"a": succeeded_task("a", "INV-1", "ch_a"), "b": failed_task("b")}
    verdict = judged(journals, [charge("a:1", "INV-1", "ch_a")], {"a": "INV-1", "b": "INV-1"})
    assert verdict.counts() == {"tasks": 2, "duplicates": 0, "lost": 0, "wrong": 0,
                                "stuck": 0, "needs_attention": 0}
    assert verdict.final_states == {"succeeded": 1, "failed": 1}


def test_two_succeeded_charges_on_one_invoice_are_a_duplicate() -> None:
    journals = {"a": succeeded_task("a", "INV-1", "ch_a"),
                "b": succeeded_task("b", "INV-1", "ch_b")}
    ledger = [charge("a:1", "INV-1", "ch_a"), charge("b:1", "INV-1", "ch_b")]
    verdict = judged(journals, ledger, {"a": "INV-1", "b": "INV-1"})
    assert len(verdict.duplicates) == 1
    assert "INV-1" in verdict.duplicates[0].what
    assert verdict.lost == []
    assert verdict.wrong == []


def test_one_key_charged_twice_is_a_duplicate_that_names_the_key() -> None:
    journals = {"a": succeeded_task("a", "INV-1", "ch_a")}
    ledger = [charge("a:1", "INV-1", "ch_a"), charge("a:1", "INV-1", "ch_a2")]
    verdict = judged(journals, ledger, {"a": "INV-1"})
    assert len(verdict.duplicates) == 1
    assert "a:1" in verdict.duplicates[0].what


def test_lost_a_task_never_started_a_charge_nobody_knows_and_a_done_without_a_charge() -> None:
    journals = {"a": succeeded_task("a", "INV-1", "ch_a")}
    ledger = [charge("x:1", "INV-9", "ch_x")]  # no step of the journal carries key x:1
    verdict = judged(journals, ledger, {"a": "INV-1", "never": "INV-2"}, outcomes=False)
    whats = sorted((f.task_id, f.what.split(" ")[0]) for f in verdict.lost)
    assert whats == [("a", "a:1"), ("never", "requested,"), ("x", "ledger")], verdict.lost
    # The step's `done` without a charge is lost; the task's `succeeded` on it is wrong too.
    assert verdict.wrong_tasks == 1
    assert "finished succeeded" in verdict.wrong[0].what


def test_outcomes_the_ledger_contradicts_are_wrong() -> None:
    s = Stamper("c")
    not_done_but_charged = [s.started(), s.intended(1), s.attempted(1, 1),
                            s.settled(1, Outcome.NOT_DONE, attempt=1),
                            s.finished(FinalState.FAILED)]
    journals = {"c": not_done_but_charged, "d": failed_task("d")}
    ledger = [charge("c:1", "INV-2291", "ch_c"), charge("d:1", "INV-4", "ch_d")]
    verdict = judged(journals, ledger, {"c": "INV-2291", "d": "INV-4"}, outcomes=False)
    assert {f.task_id for f in verdict.wrong} == {"c"}
    assert any("not_done in the journal" in f.what for f in verdict.wrong)
    assert any("finished failed" in f.what for f in verdict.wrong)
    # d never intended a step, so a charge under its key is one the journal does not know.
    assert [f.task_id for f in verdict.lost] == ["d"]


def test_done_with_evidence_naming_another_charge_is_wrong() -> None:
    journals = {"a": succeeded_task("a", "INV-1", "ch_other")}
    verdict = judged(journals, [charge("a:1", "INV-1", "ch_a")], {"a": "INV-1"})
    assert verdict.wrong_tasks == 1
    assert "ch_other" in verdict.wrong[0].what


def test_an_outcomes_topic_behind_the_journal_is_wrong() -> None:
    journals = {"a": succeeded_task("a", "INV-1", "ch_a")}
    verdict = judged(journals, [charge("a:1", "INV-1", "ch_a")], {"a": "INV-1"},
                     tamper={("a", "task"): "running"})
    assert verdict.wrong_tasks == 1
    assert "last says running" in verdict.wrong[0].what


def test_unknown_is_counted_never_wrong_stuck_unless_someone_must_act() -> None:
    s = Stamper("u")
    unknown = [s.started(), s.intended(1), s.attempted(1, 1),
               s.settled(1, Outcome.UNKNOWN, attempt=1)]
    escalated = Stamper("e")
    gave_up = [escalated.started(), escalated.intended(1, subject="invoice:INV-7"),
               escalated.attempted(1, 1), escalated.settled(1, Outcome.UNKNOWN, attempt=1),
               escalated.checked(1, next_in=None)]
    waiter = Stamper("w")
    held = SubjectHeld(subject="invoice:INV-7", tool="charge_customer", holder="e:1")
    waiting = [waiter.started(),
               waiter.refused(1, reason="blocked: e:1 on invoice:INV-7 is still unknown")]
    waiting[-1] = waiting[-1].model_copy(update={"blocked": held})
    journals = {"u": unknown, "e": gave_up, "w": waiting}
    verdict = judged(journals, [], {"u": "INV-2291", "e": "INV-7", "w": "INV-7"})
    assert [f.task_id for f in verdict.stuck] == ["u"]
    assert verdict.needs_attention_tasks == 2
    assert (verdict.lost, verdict.wrong, verdict.duplicates) == ([], [], [])
    assert any(r.startswith("waiting: blocked") for r in verdict.needs_attention)


def test_unknown_to_settled_runs_from_the_first_unknown_to_the_definitive_settlement() -> None:
    s = Stamper("l", tick=timedelta(seconds=1))
    events = [s.started(), s.intended(1), s.attempted(1, 1),
              s.settled(1, Outcome.UNKNOWN, attempt=1),  # t = 4 s
              s.checked(1), s.attempted(1, 2),
              s.settled(1, Outcome.UNKNOWN, attempt=2),
              s.settled(1, Outcome.DONE, source=SettlementSource.LOOKUP,
                        evidence={"charge_id": "ch_l"}),  # t = 8 s
              s.finished(FinalState.SUCCEEDED)]
    verdict = judged({"l": events}, [charge("l:1", "INV-2291", "ch_l")], {"l": "INV-2291"})
    assert verdict.unknown_to_settled_s == [4.0]
    assert verdict.counts()["wrong"] == 0


def test_percentiles_and_reason_groups() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0], 50) == 2.0
    assert percentile(range(1, 101), 99) == 99
    assert reason_group("no charge with metadata halfway_key=chaos-ab-00012:1 after 3 checks") \
        == reason_group("no charge with metadata halfway_key=chaos-ab-00977:1 after 12 checks")


def test_a_task_the_journal_never_saw_is_lost_not_stuck() -> None:
    verdict = judge([Requested("ghost", "INV-1")], [], {"ghost": TaskState("ghost")}, {})
    assert [f.task_id for f in verdict.lost] == ["ghost"]
    assert verdict.stuck == []


def trip_journal(task_id: str, *, hotel_full: bool = False) -> list[Any]:
    """A trip's journal: hold, book, charge, email; or hold, a full hotel, the hold released."""
    s = Stamper(task_id)
    hold = s.intended(1, tool="hold_flight", args={"flight": "LH-454"}, subject=None)
    events: list[Any] = [s.started(), hold, s.attempted(1, 1),
                         s.settled(1, Outcome.DONE, attempt=1, evidence={"hold_id": "h_1"}),
                         s.intended(2, tool="book_hotel", args={"hotel": "H"}, subject=None),
                         s.attempted(2, 1)]
    if hotel_full:
        return [*events, s.settled(2, Outcome.NOT_DONE, attempt=1),
                s.undo_intended(1, tool="release_flight", args={"hold_id": "h_1"}),
                s.undo_attempted(1, 1), s.undo_settled(1, Outcome.DONE, attempt=1),
                s.finished(FinalState.COMPENSATED)]
    return [*events, s.settled(2, Outcome.DONE, attempt=1, evidence={"booking_id": "b_1"}),
            s.intended(3, args={"invoice": f"INV-{task_id}"}, subject=f"invoice:INV-{task_id}"),
            s.attempted(3, 1), s.settled(3, Outcome.DONE, attempt=1,
                                         evidence={"charge_id": f"ch_{task_id}"}),
            s.intended(4, tool="send_email", args={"to": "a@example.com"}, subject=None),
            s.attempted(4, 1), s.settled(4, Outcome.DONE, attempt=1, evidence={"email": "e_1"}),
            s.finished(FinalState.SUCCEEDED)]


def tripsim_ledger(task_id: str, *, hotel_full: bool = False) -> dict[str, list[Any]]:
    if hotel_full:
        return {"holds": [{"id": "h_1", "status": "released", "idempotency_key": f"{task_id}:1",
                           "release_keys": [f"{task_id}:1:undo"]}], "bookings": [], "emails": []}
    return {"holds": [{"id": "h_1", "status": "held", "idempotency_key": f"{task_id}:1",
                       "release_keys": []}],
            "bookings": [{"id": "b_1", "status": "confirmed", "idempotency_key": f"{task_id}:2",
                          "cancel_keys": []}],
            "emails": [{"id": "e_1", "status": "sent", "idempotency_key": f"{task_id}:4"}]}


def judged_trips(journals: dict[str, list[Any]], travel: dict[str, list[Any]],
                 charges: list[dict[str, Any]]) -> Verdict:
    states = {t: fold(events, t) for t, events in journals.items()}
    return judge([Requested(t, f"INV-{t}", trip=True) for t in journals], charges, states, None,
                 travel)


def test_trips_that_went_right_have_no_findings() -> None:
    travel = {store: [*tripsim_ledger("t-ok")[store], *tripsim_ledger("t-full", hotel_full=True)[
        store]] for store in ("holds", "bookings", "emails")}
    verdict = judged_trips({"t-ok": trip_journal("t-ok"),
                            "t-full": trip_journal("t-full", hotel_full=True)}, travel,
                           [charge("t-ok:3", "INV-t-ok", "ch_t-ok")])
    assert verdict.counts() == {"tasks": 2, "duplicates": 0, "lost": 0, "wrong": 0, "stuck": 0,
                                "needs_attention": 0}, verdict.to_json()
    assert verdict.final_states == {"succeeded": 1, "compensated": 1}


def test_a_trip_compensated_with_its_hold_still_held_is_wrong() -> None:
    travel = tripsim_ledger("t-full", hotel_full=True)
    travel["holds"][0] |= {"status": "held", "release_keys": []}
    verdict = judged_trips({"t-full": trip_journal("t-full", hotel_full=True)}, travel, [])
    assert [f.what for f in verdict.wrong] == [
        "t-full:1: its undo is done in the journal, but hold h_1 still stands",
        "finished compensated, but ['hold h_1 (t-full:1)'] still stand(s) at tripsim"]


def test_trip_effects_twice_under_a_key_unknown_to_the_journal_or_missing_are_found() -> None:
    travel = tripsim_ledger("t-ok")
    travel["emails"].append({"id": "e_2", "status": "sent", "idempotency_key": "t-ok:4"})
    travel["bookings"] = []
    travel["holds"].append({"id": "h_9", "status": "held", "idempotency_key": "ghost:1"})
    verdict = judged_trips({"t-ok": trip_journal("t-ok")}, travel,
                           [charge("t-ok:3", "INV-t-ok", "ch_t-ok")])
    assert [f.what for f in verdict.duplicates] == [
        "t-ok:4: 2 effects under one key: ['email e_1', 'email e_2']"]
    assert sorted(f.what for f in verdict.lost) == [
        "t-ok:2 is done in the journal, but tripsim has no booking under its key",
        "tripsim hold h_9 (held, key ghost:1) is not the effect of any step"]


def test_an_undo_not_done_whose_key_released_the_hold_is_wrong() -> None:
    s = Stamper("t-x")
    journal = [*trip_journal("t-x", hotel_full=True)[:-3], s.undo_attempted(1, 1),
               s.undo_settled(1, Outcome.NOT_DONE, attempt=1)]
    verdict = judged_trips({"t-x": journal}, tripsim_ledger("t-x", hotel_full=True), [])
    assert [f.what for f in verdict.wrong] == [
        "t-x:1: its undo under t-x:1:undo is not_done in the journal, but that key undid "
        "hold h_1"]


@pytest.mark.parametrize("first_key_undid", [False, True])
def test_an_undo_sent_again_under_its_next_key_is_judged_under_each_key(
        first_key_undid: bool) -> None:
    # The release under t-y:1:undo was proven to have done nothing, and went again under
    # t-y:1:undo2, which released the hold. Had the first key released it after all, the
    # proof was wrong: the journal says not_done for a key that undid the hold.
    s = Stamper("t-y")
    journal = [*trip_journal("t-y", hotel_full=True)[:-4],
               s.undo_intended(1, tool="release_flight", args={"hold_id": "h_1"}),
               s.undo_attempted(1, 1),
               s.undo_settled(1, Outcome.UNKNOWN, attempt=1, replayed=True),
               s.undo_settled(1, Outcome.NOT_DONE, attempt=1, source=SettlementSource.LOOKUP,
                              reason="nothing found"),
               s.undo_intended(1, tool="release_flight", args={"hold_id": "h_1"},
                               generation=2),
               s.undo_attempted(1, 1, generation=2),
               s.undo_settled(1, Outcome.DONE, attempt=1, generation=2),
               s.finished(FinalState.COMPENSATED)]
    travel = tripsim_ledger("t-y", hotel_full=True)
    travel["holds"][0]["release_keys"] = (["t-y:1:undo"] if first_key_undid else []) + [
        "t-y:1:undo2"]
    verdict = judged_trips({"t-y": journal}, travel, [])
    assert verdict.final_states == {"compensated": 1}
    assert [f.what for f in verdict.wrong] == ([
        "t-y:1: its undo under t-y:1:undo is not_done in the journal, but that key undid "
        "hold h_1"] if first_key_undid else [])


def test_the_report_counts_undo_settlements_and_undos_sent_again_under_a_new_key() -> None:
    s = Stamper("t-z")
    counts = settlement_counts([
        s.undo_intended(1), s.undo_settled(1, Outcome.UNKNOWN, attempt=1, replayed=True),
        s.undo_settled(1, Outcome.NOT_DONE, attempt=1, source=SettlementSource.LOOKUP,
                       reason="nothing found"),
        s.undo_intended(1, generation=2), s.undo_settled(1, Outcome.DONE, generation=2),
        s.settled(2, Outcome.DONE)])
    assert counts["undos_by_source_outcome"] == {"call/done": 1, "call/unknown": 1,
                                                 "lookup/not_done": 1}
    assert counts["undos_sent_again"] == 1
    assert counts["by_source_outcome"] == {"call/done": 1}


# --- a small run against real processes ----------------------------------------------------------

TASKS = 200
WINDOW_S = 25.0  # 8 tasks a second
DRAIN_S = 90.0  # a 500 before commit escalates about half a key lifetime after its attempt
KEY_TTL_S = 60.0  # well past any pause or the broker's outage: no key expires in one
PAUSES = 3
LONG_PAUSES = 1  # past the session timeout: partitions move
SHUTS = 1
TRIPS = 0.3  # of the single tasks, in the run with workers: sagas, some of them unwinding
RUN_TIMEOUT_S = 240.0  # a hang guard, far above the ~100 s a run takes


@pytest.mark.broker
@pytest.mark.load
@pytest.mark.timeout(RUN_TIMEOUT_S)
@pytest.mark.parametrize("workers", [False, True], ids=["services", "workers-and-trips"])
async def test_a_small_chaos_run_charges_once_and_loses_nothing(
        tmp_path: Path, workers: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    # Kinds take turns, so each kind is killed once. A decider that wakes up as a zombie is
    # the one that can place a step twice (a worker: place and send it): the long pause's.
    if workers:
        # Images every second with news: partitions taken over after a kill or a pause are
        # restored from snapshots (those of the outcomes publisher and the projector too).
        monkeypatch.setenv("HALFWAY_SNAPSHOT_EVERY_S", "1")
    config = ChaosConfig(tasks=TASKS, seed=10, window_s=WINDOW_S, drain_s=DRAIN_S,
                         pauses=PAUSES, long_pauses=LONG_PAUSES, shuts=SHUTS,
                         broker_kill=True, key_ttl_s=KEY_TTL_S, run_dir=tmp_path / "chaos",
                         workers=workers, trips=TRIPS if workers else 0.0,
                         long_pause_kinds=("worker" if workers else "decider",))
    kills = len(config.all_kinds())
    config.kills = kills
    report = await run(config)
    figures = report.to_json()
    text = render(report)
    findings = (tmp_path / "chaos" / "findings.txt").read_text()
    print(text)  # pytest shows it with -s, or when the test fails

    # The chaos the test is about happened.
    assert figures["broker_kills"] == 1, text
    assert sum(figures["kills"].values()) == kills, text
    assert figures["pauses"]["long_moved_partitions"] >= LONG_PAUSES, text
    assert figures["published"] == TASKS, text
    assert figures["faults"]["applied"], text
    verdict = report.verdict
    assert verdict is not None, text
    if config.trips:  # sagas ran, and some were undone
        assert figures["trips"]["requested"] > 0, text
        assert verdict.final_states["compensated"], text
    assert (len(verdict.duplicates), len(verdict.lost), verdict.wrong_tasks,
            len(verdict.stuck)) == (0, 0, 0, 0), f"{text}\n\n{findings}"
    if workers:
        restored = sum(log.read_text(errors="replace").count('"partition restored')
                       for log in (tmp_path / "chaos").rglob("*.log"))
        assert restored > 0, "no partition was restored from a snapshot"
