"""The fold refuses what no honest writer journals: the audit's forgeries, seen from inside the
journal's trust boundary (a writer the broker lets write the journal, buggy or compromised).

`tests/test_kafka_security.py` shows the broker refusing them from everyone else.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from halfway.contract import Event, Outcome, SettlementSource, StepIntended, StepSettled
from halfway.core import StepStatus, TaskStatus, apply, fold
from tests.factories import Stamper
from tests.test_fold import histories

TASK = "renewal-8812"


def test_a_decision_for_a_task_nobody_started_is_never_a_step() -> None:
    s = Stamper("forged-1")
    forged = s.intended(1, args={"invoice": "INV-X", "customer": "cus_1",
                                 "amount_cents": 99_999, "currency": "usd"})
    state = fold([forged])
    assert state.steps == {}
    (refused,) = state.not_accepted
    assert refused.event == forged
    assert "never started" in refused.reason
    # A request alone starts nothing either: only the decider's task.started does.
    assert fold([s.requested(), forged]).steps == {}


def test_a_done_planted_before_the_task_existed_never_settles_its_step() -> None:
    s = Stamper(TASK)
    planted = s.settled(1, Outcome.DONE, source=SettlementSource.WEBHOOK,
                        evidence={"charge_id": "ch_forged"})
    state = fold([planted, s.requested(), s.started(), s.intended(1)])
    assert state.step(1).status is StepStatus.INTENDED  # the executor still charges
    assert state.step(1).effect.settlement is None
    (refused,) = state.not_accepted
    assert refused.event == planted
    assert "before the step was decided" in refused.reason
    # The real settlement is the outcome, and the forgery is not a contradiction of it.
    state = apply(apply(state, s.attempted(1, 1)),
                  s.settled(1, Outcome.DONE, attempt=1, evidence={"charge_id": "ch_real"}))
    assert state.step(1).effect.settlement.evidence == {"charge_id": "ch_real"}
    assert state.step(1).effect.contradictions == ()
    assert state.status is TaskStatus.RUNNING


def _without_start(log: list[Event]) -> list[Event]:
    return [e for e in log if e.type != "task.started"]


@given(histories())
@settings(max_examples=200, deadline=None)
def test_no_step_of_a_task_that_never_started_is_accepted(log: list[Event]) -> None:
    state = fold(_without_start(log), log[0].task_id)
    assert state.steps == {}
    intents = {e.event_id for e in log if isinstance(e, StepIntended)}
    refused = {n.event.event_id for n in state.not_accepted if isinstance(n.event, StepIntended)}
    assert refused == intents


@given(histories(), st.data())
@settings(max_examples=200, deadline=None)
def test_settlements_planted_before_their_step_change_no_step(log: list[Event],
                                                              data: st.DataObject) -> None:
    """Plant a forged settlement of each decided step anywhere before its decision: every step
    folds exactly as in the honest log, and each forgery is kept as not accepted."""
    s = Stamper(log[0].task_id)
    planted = list(log)
    forged: list[StepSettled] = []
    for intent in [e for e in log if isinstance(e, StepIntended)]:
        outcome = data.draw(st.sampled_from(list(Outcome)))
        fake = s.settled(intent.n, outcome, source=SettlementSource.WEBHOOK,
                         evidence={"charge_id": f"ch_forged_{intent.n}"}
                         if outcome is Outcome.DONE else None)
        at = data.draw(st.integers(0, planted.index(intent)))
        planted.insert(at, fake)
        forged.append(fake)
    honest, attacked = fold(log), fold(planted)
    assert attacked.steps == honest.steps
    assert attacked.status == honest.status
    assert {n.event.event_id for n in attacked.not_accepted} >= {f.event_id for f in forged}
