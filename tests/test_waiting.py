"""Two tasks, one invoice, against the real broker: the second waits for the first's charge to
be settled, and charges only if the first is proven not done (issue 10, part 4)."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from halfway.contract import FinalState, Outcome, SettlementSource
from halfway.core.fold import fold
from halfway.settings import KafkaSettings

pytest.register_assert_rewrite("tests.processes")

from tests.processes import (  # noqa: E402
    CLUSTER_KEY,
    Cluster,
    charges_for,
    cluster,
    renewal_request,
)

pytest_plugins = ["tests.processes"]
pytestmark = pytest.mark.broker

WAIT_S = 120.0
# paysim finishes this one well within it: an empty lookup this long after the last attempt
# (and the send window) proves the charge did not happen.
COMPLETES_WITHIN_S = "1"


@pytest.fixture
async def c(kafka_settings: KafkaSettings, tmp_path: Path,
            request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    async with cluster(kafka_settings, tmp_path, charge_timeout_s=1.0) as out:
        request.node.stash[CLUSTER_KEY] = out
        yield out


async def start_services(c: Cluster) -> None:
    for service in ("decider", "executor", "reconciler"):
        await c.start(service, HALFWAY_CHARGE_COMPLETES_WITHIN_S=COMPLETES_WITHIN_S)


async def two_tasks_on_one_invoice(c: Cluster, first: str, second: str, invoice: str) -> None:
    await c.publish(renewal_request(first, invoice=invoice, reask=False))
    await c.journal.first(lambda e: e.task_id == first and e.type == "step.intended",
                          "the first task's charge decided", WAIT_S)
    await c.publish(renewal_request(second, invoice=invoice, reask=False))
    await c.journal.until_finished([first, second], WAIT_S)


async def test_the_second_task_waits_and_charges_once_the_first_is_proven_not_done(
        c: Cluster) -> None:
    tag = uuid.uuid4().hex[:6]
    first, second, invoice = f"first-{tag}", f"second-{tag}", f"INV-wait-{tag}"
    # The first charge fails before committing; the provider saves the 500 under the key and
    # replays it: unknown, then proven not done by lookups past the provider's bound.
    await c.faults({"match": {"key_prefix": first}, "action": {"status": 500,
                                                                "when": "before_commit"}})
    await start_services(c)
    await two_tasks_on_one_invoice(c, first, second, invoice)

    one, two = fold(c.journal.of(first), first), fold(c.journal.of(second), second)
    assert one.step(1).outcome is Outcome.NOT_DONE
    assert one.step(1).effect.settlement.source is SettlementSource.LOOKUP
    assert one.final_state is FinalState.FAILED
    waited = [r for r in two.refusals if r.blocked is not None]
    assert waited, "the second task never waited"
    assert waited[0].blocked.holder == f"{first}:1"
    assert two.step(1).outcome is Outcome.DONE
    assert two.final_state is FinalState.SUCCEEDED
    # It waited rather than asking again in a loop: one question before, one after.
    asked = [q for q in c.model_calls() if q["task_id"] == second and q["n"] == 1]
    assert len(asked) == 2, asked
    ledger = [ch for ch in await c.ledger() if ch["metadata"].get("invoice") == invoice]
    assert [ch["status"] for ch in ledger] == ["succeeded"]
    assert charges_for(ledger, f"{second}:1") == ledger


async def test_the_second_task_never_charges_once_the_first_is_proven_done(c: Cluster) -> None:
    tag = uuid.uuid4().hex[:6]
    first, second, invoice = f"slow-{tag}", f"later-{tag}", f"INV-done-{tag}"
    # The first charge lands after the caller gave up: unknown, then found done by a lookup.
    await c.faults({"match": {"key_prefix": first}, "action": {"delay_s": 2.5}})
    await start_services(c)
    await two_tasks_on_one_invoice(c, first, second, invoice)

    one, two = fold(c.journal.of(first), first), fold(c.journal.of(second), second)
    assert one.step(1).effect.unknowns, "the first charge was never unknown"
    assert one.final_state is FinalState.SUCCEEDED
    assert any(r.blocked is not None for r in two.refusals)
    assert not two.steps
    assert two.final_state is FinalState.FAILED
    assert "already did charge_customer" in two.finished.summary
    ledger = [ch for ch in await c.ledger() if ch["metadata"].get("invoice") == invoice]
    assert len(ledger) == 1
    assert charges_for(ledger, f"{first}:1") == ledger
