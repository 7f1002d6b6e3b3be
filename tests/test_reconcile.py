"""reconcile and on_nothing_found: what webhooks and empty lookups prove."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from halfway.contract import EffectClass, Outcome, SettlementSource
from halfway.contract.webhooks import WebhookReceived
from halfway.core import fold
from halfway.core.next_action import SettleNotDone, StepPolicy, on_nothing_found
from halfway.core.reconcile import webhook_verdict
from tests.factories import Stamper


def hook(kind: str = "charge.succeeded", event_id: str = "evt_1") -> WebhookReceived:
    now = datetime.now(UTC)
    return WebhookReceived(provider="paysim", provider_event_id=event_id,
                           provider_event_type=kind, object_id="ch_1", key="renewal-8812:1",
                           task_id="renewal-8812", payload={"id": event_id}, signed_at=now,
                           received_at=now)


@pytest.fixture
def s() -> Stamper:
    return Stamper("renewal-8812")


def unknown_effect(s: Stamper):
    return fold([s.started(), s.intended(1), s.attempted(1, 1),
                 s.settled(1, Outcome.UNKNOWN, attempt=1)]).step(1).effect


def test_a_succeeded_webhook_settles_an_unknown_step_done_with_evidence(s: Stamper) -> None:
    verdict = webhook_verdict(unknown_effect(s), hook())
    assert verdict is not None
    assert verdict.outcome is Outcome.DONE
    assert verdict.evidence == {"charge_id": "ch_1", "provider": "paysim",
                                "provider_event_id": "evt_1"}


def test_a_failed_webhook_is_proof_of_not_done(s: Stamper) -> None:
    verdict = webhook_verdict(unknown_effect(s), hook("charge.failed"))
    assert verdict is not None
    assert verdict.outcome is Outcome.NOT_DONE
    assert "evt_1" in verdict.reason


def test_webhooks_that_agree_or_say_nothing_write_nothing(s: Stamper) -> None:
    done = fold([s.started(), s.intended(1), s.attempted(1, 1),
                 s.settled(1, Outcome.DONE, attempt=1)]).step(1).effect
    assert webhook_verdict(done, hook()) is None  # a duplicate delivery, or agreeing news
    assert webhook_verdict(unknown_effect(s), hook("charge.updated")) is None


def test_a_contradicting_webhook_is_recorded_once(s: Stamper) -> None:
    log = [s.started(), s.intended(1), s.attempted(1, 1), s.settled(1, Outcome.DONE, attempt=1)]
    verdict = webhook_verdict(fold(log).step(1).effect, hook("charge.failed"))
    assert verdict is not None  # kept as evidence and surfaced, never dropped
    log.append(s.settled(1, verdict.outcome, reason=verdict.reason,
                         source=SettlementSource.WEBHOOK))
    effect = fold(log).step(1).effect
    assert effect.outcome is Outcome.DONE
    assert len(effect.contradictions) == 1
    assert webhook_verdict(effect, hook("charge.failed")) is None  # the same event again


def test_nothing_found_proves_not_done_only_past_a_declared_completion_bound(s: Stamper) -> None:
    effect = unknown_effect(s)
    sent = effect.attempts[0].started_at
    bounded = StepPolicy(EffectClass.KEYED, timeout_s=5, key_ttl_s=3600, completes_within_s=30)
    assert isinstance(on_nothing_found(effect, bounded, sent + timedelta(seconds=10)), datetime)
    proof = on_nothing_found(effect, bounded, sent + timedelta(seconds=31))
    assert isinstance(proof, SettleNotDone)
    assert "within 30 s" in proof.reason
    unbounded = StepPolicy(EffectClass.KEYED, timeout_s=5, key_ttl_s=3600)
    assert isinstance(on_nothing_found(effect, unbounded, sent + timedelta(days=1)),
                      datetime | None)
    assert on_nothing_found(effect, unbounded, sent + timedelta(days=1)) is None  # window over
