"""reconcile and on_nothing_found: what webhooks and empty lookups prove, and what they never do."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from halfway.contract import EffectClass, Outcome, SettlementSource, StepSettled
from halfway.contract.webhooks import WebhookReceived
from halfway.core import fold
from halfway.core.fold import EffectState
from halfway.core.next_action import (
    Call,
    SettleNotDone,
    StepPolicy,
    next_action,
    on_lookup_failed,
    on_nothing_found,
    plan_check,
)
from halfway.core.reconcile import (
    CONTRADICTION_CHARS_MAX,
    Corroborate,
    Ignore,
    Quarantine,
    Settle,
    WebhookReport,
    weigh_webhook,
)
from halfway.tools.payments import ChargeArgs, PaymentsAdapter
from tests.factories import Stamper

ATTEMPT_OFFSET = 3  # where the step's first attempt sits in its journal partition
ARRIVED_AT = 10  # the journal's end offset when the webhook arrived


def hook(kind: str = "charge.succeeded", event_id: str = "evt_1", *, object_id: str = "ch_1",
         journal_offset: int | None = ARRIVED_AT, amount: int = 4900) -> WebhookReceived:
    now = datetime.now(UTC)
    charge = {"id": object_id, "amount": amount, "currency": "usd", "customer": "cus_1",
              "status": "succeeded" if kind == "charge.succeeded" else "failed",
              "metadata": {"halfway_key": "renewal-8812:1"}}
    return WebhookReceived(provider="paysim", provider_event_id=event_id,
                           provider_event_type=kind, object_id=object_id, key="renewal-8812:1",
                           task_id="renewal-8812", payload={"id": event_id, "type": kind,
                                                            "data": {"object": charge}},
                           signed_at=now, received_at=now, journal_partition=0,
                           journal_offset=journal_offset)


ARGS = ChargeArgs(invoice="INV-2291", customer="cus_1", amount_cents=4900)


def report(h: WebhookReceived) -> WebhookReport | None:
    """What the charge tool reads from the webhook (its own adapter, as the reconciler asks)."""
    return PaymentsAdapter("http://127.0.0.1:1").read_webhook(ARGS, h)


def weigh(effect: EffectState | None, h: WebhookReceived, *, attempted_at: int | None =
          ATTEMPT_OFFSET, has_lookup: bool = True) -> Any:
    return weigh_webhook(effect, report(h), h, first_attempt_offset=attempted_at,
                         has_lookup=has_lookup)


@pytest.fixture
def s() -> Stamper:
    return Stamper("renewal-8812")


def unknown_effect(s: Stamper) -> EffectState:
    return fold([s.started(), s.intended(1), s.attempted(1, 1),
                 s.settled(1, Outcome.UNKNOWN, attempt=1)]).step(1).effect


def done_effect(s: Stamper, charge_id: str = "ch_1") -> tuple[list[Any], EffectState]:
    log = [s.started(), s.intended(1), s.attempted(1, 1),
           s.settled(1, Outcome.DONE, attempt=1, evidence={"charge_id": charge_id})]
    log[-1] = log[-1].model_copy(update={"effect_id": charge_id})
    return log, fold(log).step(1).effect


def test_a_succeeded_webhook_settles_an_unknown_step_done_with_evidence(s: Stamper) -> None:
    move = weigh(unknown_effect(s), hook())
    assert move == Settle(Outcome.DONE, "ch_1", evidence={
        "charge_id": "ch_1", "amount_cents": 4900, "currency": "usd", "provider": "paysim",
        "provider_event_id": "evt_1"})


def test_a_failed_webhook_is_corroborated_by_a_lookup_before_it_proves_anything(
        s: Stamper) -> None:
    move = weigh(unknown_effect(s), hook("charge.failed"))
    assert isinstance(move, Corroborate)
    assert "says it failed" in move.told
    assert "evt_1" in move.told
    # A tool with no lookup can only take the provider's event at its word.
    move = weigh(unknown_effect(s), hook("charge.failed"), has_lookup=False)
    assert isinstance(move, Settle)
    assert move.outcome is Outcome.NOT_DONE
    assert move.contradiction is None
    assert "evt_1" in (move.reason or "")


def test_webhooks_that_agree_or_say_nothing_write_nothing(s: Stamper) -> None:
    _, done = done_effect(s)
    assert isinstance(weigh(done, hook()), Ignore)  # a duplicate delivery, or agreeing news
    assert isinstance(weigh(unknown_effect(s), hook("charge.updated")), Ignore)


@pytest.mark.parametrize(("attempted_at", "journal_offset"), [
    (None, ARRIVED_AT),  # never attempted at all: a key nobody sent
    (ARRIVED_AT, ARRIVED_AT),  # attempted only after the webhook arrived
    (ARRIVED_AT + 5, ARRIVED_AT),
    (ATTEMPT_OFFSET, None),  # cannot be ordered against the journal
])
def test_a_webhook_for_a_key_not_attempted_before_it_arrived_is_quarantined(
        s: Stamper, attempted_at: int | None, journal_offset: int | None) -> None:
    for kind in ("charge.succeeded", "charge.failed"):
        move = weigh(unknown_effect(s), hook(kind, journal_offset=journal_offset),
                     attempted_at=attempted_at)
        assert isinstance(move, Quarantine)
    orphan = weigh(None, hook(), attempted_at=None)  # the task is not even in the journal
    assert isinstance(orphan, Quarantine)
    assert "not attempted before the webhook arrived" in orphan.reason


def test_an_object_that_does_not_match_the_step_is_a_contradiction_not_a_settlement(
        s: Stamper) -> None:
    move = weigh(unknown_effect(s), hook(amount=9900))
    assert isinstance(move, Settle)
    assert move.contradiction is not None
    assert "9900 usd to cus_1, the step asked for 4900 usd to cus_1" in move.contradiction
    log = [s.started(), s.intended(1), s.attempted(1, 1),
           s.settled(1, Outcome.UNKNOWN, attempt=1), contradiction_event(s, move)]
    effect = fold(log).step(1).effect
    assert effect.outcome is Outcome.UNKNOWN  # never taken as the outcome
    assert effect.needs_attention  # an operator must look
    assert "does not match the step" in effect.attention_why


def test_another_charge_under_a_done_key_is_a_contradiction_that_needs_an_operator(
        s: Stamper) -> None:
    log, done = done_effect(s, "ch_1")
    move = weigh(done, hook(object_id="ch_2", event_id="evt_2"))
    assert isinstance(move, Settle)
    assert move.contradiction is not None
    assert "names another effect than ch_1" in move.contradiction
    log.append(contradiction_event(s, move))
    state = fold(log)
    assert state.step(1).outcome is Outcome.DONE
    assert state.needs_attention
    # Recorded once: the same provider event again adds nothing.
    assert isinstance(weigh(state.step(1).effect, hook(object_id="ch_2", event_id="evt_2")),
                      Ignore)
    # An operator who looked and agrees with the outcome clears it.
    log.append(s.settled(1, Outcome.DONE, source=SettlementSource.OPERATOR,
                         evidence={"charge_id": "ch_1", "resolved_by": "alice"}))
    assert not fold(log).needs_attention


def test_reports_against_a_definitive_outcome_are_contradictions(s: Stamper) -> None:
    _, done = done_effect(s)
    failed = weigh(done, hook("charge.failed", event_id="evt_3"))
    assert isinstance(failed, Settle)
    assert failed.contradiction is not None
    not_done = fold([s.started(), s.intended(1), s.attempted(1, 1),
                     s.settled(1, Outcome.NOT_DONE, attempt=1)]).step(1).effect
    succeeded = weigh(not_done, hook(event_id="evt_4"))
    assert isinstance(succeeded, Settle)
    assert succeeded.contradiction is not None
    assert "settled not done" in succeeded.contradiction


def test_two_done_settlements_naming_different_effects_contradict(s: Stamper) -> None:
    log, _ = done_effect(s, "ch_1")
    second = s.settled(1, Outcome.DONE, source=SettlementSource.LOOKUP,
                       evidence={"charge_id": "ch_2"}).model_copy(update={"effect_id": "ch_2"})
    state = fold([*log, second])
    assert state.step(1).effect.contradictions == (second,)
    assert state.needs_attention
    same = s.settled(1, Outcome.DONE, source=SettlementSource.LOOKUP,
                     evidence={"charge_id": "ch_1"}).model_copy(update={"effect_id": "ch_1"})
    assert not fold([*log, same]).needs_attention  # the same charge again: agreement


def contradiction_event(s: Stamper, move: Settle) -> Any:
    return s.settled(1, move.outcome, source=SettlementSource.WEBHOOK,
                     evidence=move.evidence, reason=move.reason).model_copy(
        update={"contradiction": move.contradiction, "effect_id": move.effect_id})


def test_nothing_found_proves_not_done_only_past_a_declared_completion_bound(s: Stamper) -> None:
    effect = unknown_effect(s)
    sent = effect.attempts[0].started_at
    bounded = StepPolicy(EffectClass.KEYED, timeout_s=5, key_ttl_s=3600, completes_within_s=30)
    assert isinstance(on_nothing_found(effect, bounded, sent + timedelta(seconds=10)), datetime)
    # The bound counts the send window and the tool's timeout too: an attempt may leave up to
    # that long after it was journaled (a paused executor does not send later than the window,
    # and a tool's code may send at any point before its timeout).
    window = bounded.send_window_s + bounded.timeout_s
    assert isinstance(on_nothing_found(effect, bounded, sent + timedelta(seconds=29 + window)),
                      datetime)
    proof = on_nothing_found(effect, bounded, sent + timedelta(seconds=31 + window))
    assert isinstance(proof, SettleNotDone)
    assert "within 30 s" in proof.reason
    unbounded = StepPolicy(EffectClass.KEYED, timeout_s=5, key_ttl_s=3600)
    assert isinstance(on_nothing_found(effect, unbounded, sent + timedelta(seconds=10)),
                      datetime)
    assert on_nothing_found(effect, unbounded, sent + timedelta(days=1)) is None  # window over


def test_nothing_found_proves_nothing_before_the_provider_finished_a_late_call(
        s: Stamper) -> None:
    """A call whose code ran on past its timeout (an app's thread, a tool that would not stop)
    may send its request until it ends, and it is settled unknown only then: an outside probe
    saw a charge land after an empty lookup had "proven" it not done. The bound counts from
    the latest unknown settlement too."""
    log = [s.started(), s.intended(1), s.attempted(1, 1)]
    sent = log[-1].started_at
    late = s.settled(1, Outcome.UNKNOWN, attempt=1).model_copy(
        update={"at": sent + timedelta(seconds=600)})  # the thread ended 10 minutes on
    effect = fold([*log, late]).step(1).effect
    bounded = StepPolicy(EffectClass.KEYED, timeout_s=1, key_ttl_s=3600, completes_within_s=2)
    assert not isinstance(on_nothing_found(effect, bounded, sent + timedelta(seconds=601)),
                          SettleNotDone)
    assert isinstance(on_nothing_found(effect, bounded, sent + timedelta(seconds=603)),
                      SettleNotDone)


def test_lookups_go_on_until_the_moment_nothing_found_proves_not_done(s: Stamper) -> None:
    """With a declared bound, no check is scheduled past the moment an empty lookup proves
    not_done, and the checks do not stop before it while it lies within the lookup window
    (the schedule's next delay overshooting the window would have left it to an operator).
    Past the window (the provider may have forgotten the key), nothing changes."""
    effect = unknown_effect(s)
    sent = effect.attempts[0].started_at
    policy = StepPolicy(EffectClass.KEYED, timeout_s=5, key_ttl_s=3600, completes_within_s=30,
                        lookup_window_s=40, check_delays_s=(30.0,))
    proves_at = sent + timedelta(seconds=30 + policy.send_window_s + policy.timeout_s)
    assert plan_check(effect, policy, sent + timedelta(seconds=15)) is None  # 45 s: past 40
    assert on_nothing_found(effect, policy, sent + timedelta(seconds=15)) == proves_at
    assert on_lookup_failed(effect, policy, sent + timedelta(seconds=15)) == proves_at
    slow = replace(policy, lookup_window_s=100, check_delays_s=(60.0,))
    assert on_nothing_found(effect, slow, sent + timedelta(seconds=1)) == proves_at  # not 61
    assert isinstance(on_nothing_found(effect, policy, proves_at), SettleNotDone)
    assert on_lookup_failed(effect, policy, proves_at) is None  # saw nothing: over, as before
    narrow = replace(policy, lookup_window_s=20)  # the proof would come past the window
    assert on_nothing_found(effect, narrow, sent + timedelta(seconds=15)) is None


def test_nothing_found_for_an_effect_that_must_happen_sends_it_again(s: Stamper) -> None:
    """An undo (or a saga's step past its pivot) that timed out and provably never landed is
    sent again with its key, not proven not_done and left to a person; once no retry is
    safe, the proof is written as before (and the saga needs attention)."""
    undo = fold([s.started(), s.intended(1), s.attempted(1, 1),
                 s.settled(1, Outcome.DONE, attempt=1), s.undo_intended(1),
                 s.undo_attempted(1, 1), s.undo_settled(1, Outcome.UNKNOWN, attempt=1)]
                ).step(1).undo
    sent = undo.attempts[0].started_at
    bounded = StepPolicy(EffectClass.KEYED, timeout_s=5, key_ttl_s=3600, completes_within_s=30)
    past = sent + timedelta(seconds=31 + bounded.send_window_s + bounded.timeout_s)
    assert on_nothing_found(undo, bounded, past, must_happen=True) == past
    check = s.undo_checked(1).model_copy(update={"at": past, "next_check_at": past})
    checked = replace(undo, last_check=check, checks=1)
    assert next_action(checked, bounded, past) == Call(2)
    assert isinstance(on_nothing_found(undo, bounded, past), SettleNotDone)  # a plain step
    spent = replace(bounded, attempts_max=1)
    assert isinstance(on_nothing_found(undo, spent, past, must_happen=True), SettleNotDone)
    forgotten = sent + timedelta(seconds=3600)  # the key is about to be forgotten
    assert isinstance(on_nothing_found(undo, bounded, forgotten, must_happen=True),
                      SettleNotDone)


def test_a_lookup_that_failed_never_proves_not_done(s: Stamper) -> None:
    """The chaos suite (2000 tasks, seed 10): lookups refused during a window of refused
    connections were taken as "nothing found", and 30 s after the last attempt, as proof of
    not_done, for four charges that had landed. A failed lookup saw nothing: look again."""
    effect = unknown_effect(s)
    sent = effect.attempts[0].started_at
    bounded = StepPolicy(EffectClass.KEYED, timeout_s=5, key_ttl_s=3600, completes_within_s=30)
    for later_s in (10, 31 + bounded.send_window_s, 3600):
        assert isinstance(on_lookup_failed(effect, bounded, sent + timedelta(seconds=later_s)),
                          datetime)
    assert on_lookup_failed(effect, bounded, sent + timedelta(days=1)) is None  # window over


@pytest.mark.parametrize("task_id", ["renewal-9999", None])
def test_a_record_whose_key_names_another_task_is_quarantined(s: Stamper,
                                                              task_id: str | None) -> None:
    """The gateway derives the record's task from our key: a record that disagrees (another
    writer's) would settle a step of the task it names, not of the key's."""
    forged = hook().model_copy(update={"task_id": task_id})
    move = weigh(unknown_effect(s), forged)
    assert isinstance(move, Quarantine)
    assert move.reason == (f"the webhook's key renewal-8812:1 names task renewal-8812, but the "
                           f"record is for task {task_id}")


def test_a_contradiction_quoting_a_huge_value_still_fits_a_settlement(s: Stamper) -> None:
    """A mismatch quotes the provider's values (a 3000-digit amount): cut, it can be journaled;
    whole, the settlement was refused and the step stayed unknown for good."""
    move = weigh(unknown_effect(s), hook(amount=int("9" * 3000)))
    assert isinstance(move, Settle)
    assert move.contradiction is not None
    assert len(move.contradiction) == CONTRADICTION_CHARS_MAX
    StepSettled.model_validate({**s.settled(1, move.outcome, evidence=move.evidence)
                                .model_dump(), "contradiction": move.contradiction,
                                "effect_id": move.effect_id})
