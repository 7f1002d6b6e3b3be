"""What the MCP proxy answers a call the subject guard blocked (`halfway.mcp.answers`), pure.

The agent reads "not done" as "safe to try again": a call blocked by another session's step on
the same subject must never read so while that step may have, or did, do it.
"""

from __future__ import annotations

import pytest

from halfway.contract import Outcome, StepRefused, SubjectHeld
from halfway.core.fold import StepState, fold
from halfway.mcp.answers import DONE, NOT_DONE, UNKNOWN, Holder, refusal_answer
from tests.factories import Stamper

SUBJECT = "invoice:INV-7"


def blocked_refusal() -> StepRefused:
    held = SubjectHeld(subject=SUBJECT, tool="charge_customer", holder="pay-a:1")
    return Stamper("pay-b").refused(1, reason=f"blocked: pay-a:1 on {SUBJECT} is still "
                                              "unknown (not settled yet)") \
        .model_copy(update={"blocked": held})


def holder_step(outcome: Outcome | None) -> StepState | None:
    a = Stamper("pay-a")
    log = [a.started(), a.intended(1)]
    if outcome is not None:
        log.append(a.settled(1, outcome, attempt=1, evidence={"charge_id": "ch_1"}
                             if outcome is Outcome.DONE else None,
                             reason=None if outcome is Outcome.DONE else "card declined"))
    return fold(log).step(1)


def test_while_the_holder_holds_the_subject_it_is_unknown_and_the_call_waits() -> None:
    answer = refusal_answer(blocked_refusal(), SUBJECT, holder=Holder(holds=True))
    assert (answer.status, answer.final, answer.is_error) == (UNKNOWN, False, False)
    assert "do not start another charge_customer for invoice:INV-7" in answer.text


def test_a_holder_that_did_it_makes_the_answer_done_by_another_call_never_not_done() -> None:
    answer = refusal_answer(blocked_refusal(), SUBJECT,
                            holder=Holder(False, holder_step(Outcome.DONE), seen=True))
    assert (answer.status, answer.is_error) == (DONE, False)
    assert answer.text.startswith("status: done by another call: pay-a:1 did charge_customer")
    assert "ch_1" in answer.text
    assert "this call was not run" in answer.text
    assert answer.facts["this_call_ran"] is False
    assert answer.facts["done_by"] == "pay-a:1"


@pytest.mark.parametrize("holder", [
    Holder(False, None, seen=False),  # another process follows the holder's task
    Holder(False, holder_step(Outcome.UNKNOWN), seen=True),
])
def test_a_holder_whose_end_is_not_known_here_leaves_the_subject_unknown(holder: Holder
                                                                         ) -> None:
    answer = refusal_answer(blocked_refusal(), SUBJECT, holder=holder)
    assert (answer.status, answer.is_error, answer.final) == (UNKNOWN, False, True)
    assert "do not start another charge_customer for invoice:INV-7" in answer.text


@pytest.mark.parametrize(("holder", "words"), [
    (Holder(False, holder_step(Outcome.NOT_DONE), seen=True), "pay-a:1 was not done"),
    (Holder(False, None, seen=True), "pay-a:1 was given up before it ran"),  # abandoned claim
])
def test_a_holder_proven_not_done_or_never_run_leaves_nothing_done(holder: Holder,
                                                                   words: str) -> None:
    answer = refusal_answer(blocked_refusal(), SUBJECT, holder=holder)
    assert (answer.status, answer.is_error) == (NOT_DONE, True)
    assert words in answer.text
