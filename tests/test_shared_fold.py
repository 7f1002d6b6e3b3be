"""The followers of one process fold each journal record once (`SharedFolds`), and get exactly
what folding it themselves would give."""

from __future__ import annotations

from halfway.contract import Event, Outcome
from halfway.core.fold import fold
from halfway.journal.shared_fold import SharedFolds
from tests.factories import Stamper


def task_events(s: Stamper) -> list[Event]:
    return [s.started(), s.intended(1), s.attempted(1, 1), s.settled(1, Outcome.DONE),
            s.finished()]


def test_a_second_follower_takes_the_first_ones_states_and_they_equal_its_own_fold() -> None:
    s = Stamper("t-shared")
    events = task_events(s)
    shared = SharedFolds()
    first = second = None
    for event in events:
        before_second = second
        first = shared.apply(first, event)
        second = shared.apply(second, event.model_copy())  # its own decoded copy
        assert second is first, f"{event.type} folded twice"
        assert before_second is not second
    assert first == fold(events)


def test_a_different_record_with_the_same_event_id_folds_for_itself() -> None:
    s = Stamper("t-forged")
    started, intended = s.started(), s.intended(1)
    shared = SharedFolds()
    state = shared.apply(None, started)
    genuine = shared.apply(state, intended)
    forged = intended.model_copy(update={"tool": "refund_charge"})
    theirs = shared.apply(state, forged)
    assert theirs is not genuine
    assert theirs == fold([started, forged])
    assert theirs.steps[1].intent.tool == "refund_charge"


def test_a_state_the_other_follower_never_held_folds_for_itself() -> None:
    s = Stamper("t-restored")
    started, intended = s.started(), s.intended(1)
    shared = SharedFolds()
    mine = shared.apply(None, started)
    restored = fold([started])  # equal, but another object (a snapshot's, say)
    assert restored == mine
    assert restored is not mine
    assert shared.apply(restored, intended) is not shared.apply(mine, intended)
    assert shared.apply(restored, intended) == fold([started, intended])


def test_only_the_newest_results_are_kept() -> None:
    shared = SharedFolds(kept=3)
    s = Stamper("t-bounded")
    events = task_events(s)
    state = None
    for event in events:
        state = shared.apply(state, event)
    assert len(shared._results) == 3
