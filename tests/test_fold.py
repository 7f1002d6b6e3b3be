"""fold: first in log wins, three outcomes, redeliveries and duplicates change nothing."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from halfway.contract import Event, FinalState, Outcome, SettlementSource, StepIntended
from halfway.core import StepStatus, TaskStatus, apply, fold, fold_all
from tests.factories import Stamper

TASK = "renewal-8812"


def test_a_task_runs_from_request_to_finish() -> None:
    s = Stamper(TASK)
    state = fold([s.requested()])
    assert state.status is TaskStatus.REQUESTED
    state = fold([s.requested(), s.started(), s.intended(1)])
    assert state.status is TaskStatus.RUNNING
    assert state.step(1).status is StepStatus.INTENDED
    state = fold([*_events(state), s.finished()])
    assert state.status is TaskStatus.FINISHED
    assert state.final_state is FinalState.SUCCEEDED


def _events(state) -> list[Event]:
    # Rebuild a log from a state's own events (only what these tests need).
    out: list[Event] = [e for e in (state.request, state.started) if e is not None]
    out += [st.intent for st in state.steps.values()]
    return out


def test_the_essay_timeline_unknown_then_done_by_lookup() -> None:
    s = Stamper(TASK)
    log = [s.started(), s.intended(3), s.attempted(3, 1)]
    assert fold(log).step(3).status is StepStatus.IN_FLIGHT  # a crash here: look it up first
    log.append(s.settled(3, Outcome.UNKNOWN, attempt=1, reason="no reply within 5 s"))
    assert fold(log).step(3).status is StepStatus.UNKNOWN
    log.append(s.checked(3, next_in=timedelta(seconds=2)))
    step = fold(log).step(3)
    assert step.status is StepStatus.UNKNOWN
    assert step.effect.last_check.next_check_at == log[-1].at + timedelta(seconds=2)
    log.append(s.settled(3, Outcome.DONE, source=SettlementSource.LOOKUP,
                         evidence={"charge_id": "ch_42"}))
    step = fold(log).step(3)
    assert step.status is StepStatus.DONE
    assert step.effect.settlement.evidence == {"charge_id": "ch_42"}
    assert [u.reason for u in step.effect.unknowns] == ["no reply within 5 s"]


def test_a_retry_after_unknown_is_in_flight_again() -> None:
    s = Stamper(TASK)
    log = [s.started(), s.intended(1), s.attempted(1, 1),
           s.settled(1, Outcome.UNKNOWN, attempt=1), s.attempted(1, 2)]
    step = fold(log).step(1)
    assert step.status is StepStatus.IN_FLIGHT
    assert step.outcome is Outcome.UNKNOWN  # still may have happened
    assert [a.attempt for a in step.effect.attempts] == [1, 2]


def test_the_first_decision_is_the_decision() -> None:
    s = Stamper(TASK)
    first = s.intended(1, args={"amount": 4900})
    zombie = s.intended(1, args={"amount": "49.00"})  # the model, asked again, says otherwise
    state = fold([s.started(), first, zombie])
    assert state.step(1).intent == first
    assert state.next_step_n == 2


def test_a_definitive_outcome_is_never_replaced_and_a_contradiction_is_surfaced() -> None:
    s = Stamper(TASK)
    done = s.settled(1, Outcome.DONE, attempt=1)
    late_unknown = s.settled(1, Outcome.UNKNOWN, attempt=1)
    contradiction = s.settled(1, Outcome.NOT_DONE, source=SettlementSource.WEBHOOK)
    step = fold([s.started(), s.intended(1), s.attempted(1, 1), done, late_unknown,
                 contradiction, contradiction.model_copy(update={"event_id": "zombie"})]).step(1)
    assert step.effect.settlement == done
    assert step.status is StepStatus.DONE
    assert step.effect.contradictions == (contradiction,)


def test_not_done_then_done_keeps_not_done_and_shows_the_done() -> None:
    s = Stamper(TASK)
    refused = s.settled(1, Outcome.NOT_DONE, attempt=1)
    done = s.settled(1, Outcome.DONE, source=SettlementSource.WEBHOOK)
    step = fold([s.started(), s.intended(1), s.attempted(1, 1), refused, done]).step(1)
    assert step.outcome is Outcome.NOT_DONE
    assert step.effect.contradictions == (done,)


def test_events_of_a_step_never_intended_are_kept_and_applied_when_it_appears() -> None:
    s = Stamper(TASK)
    attempt = s.attempted(1, 1)
    intent = s.intended(1)
    state = fold([s.started(), attempt])
    assert state.orphans == (attempt,)
    assert any("never intended" in a for a in state.anomalies)
    state = apply(state, intent)
    assert state.orphans == ()
    assert state.step(1).status is StepStatus.IN_FLIGHT


def test_an_attempt_counts_only_for_the_decision_it_names() -> None:
    """A worker journals its decision with the first attempt (`intent_id`). When the log did
    not take that decision, the attempt is nobody's: not the step's another decider placed
    first, not kept as an orphan for a later decision of the step."""
    s = Stamper(TASK)
    first = s.intended(1)
    late = s.intended(1, args={"invoice": "INV-2291", "amount_cents": 1})
    late_attempt = s.attempted(1, 1).model_copy(update={"intent_id": late.event_id})
    state = fold([s.started(), first, late, late_attempt])
    assert state.step(1).intent == first
    assert state.step(1).effect.attempts == ()  # the first decision is still to be attempted
    assert any("never counted" in a for a in state.anomalies)
    own = s.attempted(1, 1).model_copy(update={"intent_id": first.event_id})
    assert apply(state, own).step(1).effect.attempts == (own,)

    # Written after the task finished: the decision is refused, its attempt not kept.
    state = fold([s.started(), s.finished(), late, late_attempt])
    assert state.step(1) is None
    assert state.orphans == ()
    assert any("never counted" in a for a in state.anomalies)

    # An orphan that names its decision is adopted by that decision only.
    state = fold([s.started(), late_attempt])
    assert state.orphans == (late_attempt,)
    assert apply(state, first).step(1).effect.attempts == ()
    assert apply(state, late).step(1).effect.attempts == (late_attempt,)


def test_start_after_reject_is_an_anomaly_not_a_start() -> None:
    s = Stamper(TASK)
    state = fold([s.requested(), s.rejected("tool not allowed"), s.started()])
    assert state.status is TaskStatus.REJECTED
    assert state.started is None
    assert len(state.anomalies) == 1


def test_events_of_another_task_are_a_bug() -> None:
    with pytest.raises(ValueError, match="folded into task"):
        fold([Stamper("a").started(), Stamper("b").started()])


def test_fold_all_separates_interleaved_tasks() -> None:
    a, b = Stamper("a"), Stamper("b")
    states = fold_all([a.started(), b.started(), a.intended(1), b.intended(1), b.intended(2)])
    assert sorted(states) == ["a", "b"]
    assert len(states["a"].steps) == 1
    assert len(states["b"].steps) == 2


def test_compensation_folds_like_a_step() -> None:
    s = Stamper(TASK)
    state = fold([s.started(), s.intended(1), s.attempted(1, 1),
                  s.settled(1, Outcome.DONE, attempt=1), s.undo_intended(1),
                  s.undo_attempted(1, 1), s.undo_settled(1, Outcome.UNKNOWN, attempt=1),
                  s.undo_settled(1, Outcome.DONE, source=SettlementSource.LOOKUP)])
    step = state.step(1)
    assert step.compensation is not None
    assert step.compensation.key == f"{TASK}:1:undo"
    assert step.undo.status is StepStatus.DONE


# ---------------------------------------------------------------------------------------------
# Property tests. A strategy draws an honest history (what correct writers would journal, with
# crashes between any two writes: a history may simply stop anywhere), then a messy log made of
# it by at-least-once delivery and zombie writers.


@st.composite
def histories(draw: st.DrawFn) -> list[Event]:
    s = Stamper(draw(st.sampled_from(["renewal-8812", "trip-7", "t"])))
    log: list[Event] = [s.requested(), s.started()]
    for n in range(1, draw(st.integers(0, 4)) + 1):
        log.append(s.intended(n))
        definitive = False
        for attempt in range(1, draw(st.integers(0, 3)) + 1):
            log.append(s.attempted(n, attempt))
            reply = draw(st.sampled_from(["lost", "unknown", "done", "not_done"]))
            if reply == "lost":  # crash or lost reply: nothing journaled for this attempt
                continue
            log.append(s.settled(n, Outcome(reply), attempt=attempt))
            if reply != "unknown":
                definitive = True
                break
        for _ in range(draw(st.integers(0, 2))):
            log.append(s.checked(n))
        if not definitive and draw(st.booleans()):
            source = draw(st.sampled_from([SettlementSource.LOOKUP, SettlementSource.WEBHOOK,
                                           SettlementSource.OPERATOR]))
            log.append(s.settled(n, draw(st.sampled_from([Outcome.DONE, Outcome.NOT_DONE])),
                                 source=source))
        done = fold(log).step(n)
        if done is not None and done.outcome is Outcome.DONE and draw(st.booleans()):
            # Only a done step has an undo (the decider journals one for nothing else).
            log += [s.undo_intended(n), s.undo_attempted(n, 1)]
            log.append(s.undo_settled(n, draw(st.sampled_from(list(Outcome))), attempt=1))
    if draw(st.booleans()):
        log.append(s.finished(draw(st.sampled_from(list(FinalState)))))
    return log


def _zombie_copy(event: Event, draw: st.DrawFn) -> Event:
    """What a second writer would journal for the same fact: a new id, maybe other content."""
    update: dict = {"event_id": uuid.uuid4().hex}
    if event.type == "step.intended" and draw(st.booleans()):
        update["args"] = {"amount": "49.00"}  # the model asked again answers differently
    return event.model_copy(update=update)


@st.composite
def messy(draw: st.DrawFn, *, zombies: bool) -> tuple[list[Event], list[Event]]:
    clean = draw(histories())
    log = list(clean)
    for _ in range(draw(st.integers(0, 12))):
        if not log:
            break
        i = draw(st.integers(0, len(log) - 1))
        copy = log[i] if not zombies or draw(st.booleans()) else _zombie_copy(log[i], draw)
        j = draw(st.integers(i + 1, len(log)))  # a copy is always a later write
        log.insert(j, copy)
    return clean, log


@given(messy(zombies=False))
@settings(max_examples=300)
def test_redelivered_events_change_nothing(case: tuple[list[Event], list[Event]]) -> None:
    clean, log = case
    assert fold(log) == fold(clean)
    assert fold(log).applied == fold(clean).applied


@given(messy(zombies=True))
@settings(max_examples=300)
def test_duplicates_from_zombie_writers_change_nothing(
    case: tuple[list[Event], list[Event]],
) -> None:
    clean, log = case
    assert fold(log) == fold(clean)


@given(histories(), st.data())
@settings(max_examples=300)
def test_a_paused_workers_late_pair_changes_no_step(log: list[Event],
                                                    data: st.DataObject) -> None:
    """A worker paused between deciding step n and its append journals the decision with the
    step's first attempt after the log moved on: another decided step n first (rule 2), or the
    task finished. Wherever the pair lands after that, no step's decision or effect changes
    and nothing waits to be adopted."""
    spots = [i for i, e in enumerate(log) if e.type in ("step.intended", "task.finished")]
    assume(spots)
    i = data.draw(st.sampled_from(spots))
    anchor = log[i]
    n = anchor.n if isinstance(anchor, StepIntended) else data.draw(st.integers(1, 5))
    s = Stamper(anchor.task_id)
    late = s.intended(n, args={"invoice": "INV-2291", "amount_cents": 1})
    pair = [late, s.attempted(n, 1).model_copy(update={"intent_id": late.event_id})]
    j = data.draw(st.integers(i + 1, len(log)))
    clean, messy = fold(log), fold([*log[:j], *pair, *log[j:]])
    assert {k: (v.intent, v.effect) for k, v in messy.steps.items()} == \
        {k: (v.intent, v.effect) for k, v in clean.steps.items()}
    assert messy.orphans == clean.orphans
    assert messy.final_state == clean.final_state


@given(histories(), st.data())
@settings(max_examples=200)
def test_a_consumer_restarting_from_an_old_offset_rebuilds_the_same_state(
    log: list[Event], data: st.DataObject,
) -> None:
    # At-least-once: after a crash the consumer resumes from its last committed offset, which
    # may be well before what it had already applied.
    crash_at = data.draw(st.integers(0, len(log)))
    resume_from = data.draw(st.integers(0, crash_at))
    state = fold(log[:crash_at], task_id=log[0].task_id)
    for event in log[resume_from:]:
        state = apply(state, event)
    assert state == fold(log)


settlement_outcomes = st.lists(
    st.tuples(st.sampled_from(list(Outcome)), st.sampled_from(list(SettlementSource)),
              st.one_of(st.none(), st.integers(1, 3))),
    max_size=10,
)


@given(settlement_outcomes)
@settings(max_examples=300)
def test_outcome_is_the_first_definitive_settlement_whatever_follows(
    settlements: list[tuple[Outcome, SettlementSource, int | None]],
) -> None:
    s = Stamper(TASK)
    log: list[Event] = [s.started(), s.intended(1)]
    history = []
    for outcome, source, attempt in settlements:
        log.append(s.settled(1, outcome, attempt=attempt, source=source))
        step = fold(log).step(1)
        history.append(step)
    definitive = [e for e in log[2:] if e.outcome is not Outcome.UNKNOWN]
    final = fold(log).step(1)
    if definitive:
        assert final.effect.settlement == definitive[0]
        # An operator's later verdict (not forced) raced the first one: not accepted.
        contradicting = [e for e in definitive if e.outcome is not definitive[0].outcome
                         and e.source is not SettlementSource.OPERATOR]
        shown = {c.outcome for c in final.effect.contradictions}
        assert shown == {c.outcome for c in contradicting}
        assert all(c.outcome is not final.outcome for c in final.effect.contradictions)
    elif settlements:
        assert final.outcome is Outcome.UNKNOWN
    # Monotone: once definitive, the outcome never changes as the log grows.
    seen = None
    for step in history:
        if seen is not None:
            assert step.outcome is seen
        elif step.outcome in (Outcome.DONE, Outcome.NOT_DONE):
            seen = step.outcome


def test_a_redelivered_orphan_is_kept_once() -> None:
    s = Stamper(TASK)
    attempt = s.attempted(1, 1)
    state = fold([s.started(), attempt, attempt])
    assert state.orphans == (attempt,)


def test_a_refusal_repeated_word_for_word_still_counts() -> None:
    # A model that proposes the same thing again is refused again; the count must grow, or
    # the decider would ask forever.
    s = Stamper("renewal-8812")
    state = fold([s.started(), s.refused(1), s.refused(1), s.refused(1)])
    assert len(state.refused(1)) == 3
