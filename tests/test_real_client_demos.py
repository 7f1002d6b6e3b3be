"""The demos on the real client libraries: the renewal through the official `stripe` client
against paysim's PaymentIntents, and the trip's itinerary over SMTP (aiosmtplib against
smtpsim). The same verdicts as the HTTP demos: one charge (the naive harness: two), and a trip
whose steps and undos all settle as the providers' own ledgers say."""

from __future__ import annotations

import pytest

from halfway.demo import renewal, trip
from halfway.settings import KafkaSettings

pytestmark = pytest.mark.broker


async def test_the_renewal_through_the_stripe_client(
        own_deployment: KafkaSettings, pg, schema: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HALFWAY_PG_SCHEMA", schema)
    ours, naive = await renewal.run(own_deployment, stripe=True)
    assert (ours.charges, naive.charges) == (1, 2)
    assert ours.read_model_state == "succeeded"
    assert renewal.verdict_ok(ours)
    assert ours.steps[0]["evidence"]["payment_intent_id"].startswith("pi_")


async def test_the_trip_with_its_email_over_smtp(
        own_deployment: KafkaSettings, pg, schema: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HALFWAY_PG_SCHEMA", schema)
    trips = await trip.run(own_deployment, email="smtp")
    assert trip.verdict_ok(trips), trip.as_text(trips)
    emails = trips.ledger["emails"]
    assert len(emails) == 1  # only the trip that went through sends its itinerary
