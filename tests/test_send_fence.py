"""`effects.why_not_send`, the fence every attempt passes before it leaves: property tests over
logs in which executors, some paused with a stale fold, journal attempt 1 of one step at any
point among a successor's settlements, an operator's abort and the task's end, and each reads
its record back at any later point.

Whatever the interleaving: at most one record of each attempt is ever sent, the first in the
log; none once the step was settled done, no first attempt once its task was aborted or over,
and none that the step's final `not_done` does not cover; a record settled as never sent is
the attempt's first.
"""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from halfway.contract import Event, Outcome, SettlementSource
from halfway.core.effects import effects_to_work, why_not_send
from halfway.core.fold import fold
from tests.factories import Stamper

HAPPENINGS = ("attempt", "retry", "settle_not_done", "prove_not_done", "settle_done",
              "settle_unknown", "abort", "finish")


def build(happenings: list[str]) -> list[Event]:
    s = Stamper("fence-1")
    log: list[Event] = [s.started(), s.intended(1)]
    for what in happenings:
        match what:
            case "attempt":  # an executor's record of attempt 1, stale fold or not
                log.append(s.attempted(1, 1))
            case "retry":  # attempt 2, with the same key, once there is an attempt 1
                tried = any(e.type == "step.attempted" for e in log)
                log.append(s.attempted(1, 2 if tried else 1))
            case "settle_not_done":  # attempt 1 never reached the provider
                log.append(s.settled(1, Outcome.NOT_DONE, attempt=1))
            case "prove_not_done":  # a lookup's proof, about the attempts up to 1
                log.append(s.settled(1, Outcome.NOT_DONE, attempt=1,
                                     source=SettlementSource.LOOKUP))
            case "settle_done":
                log.append(s.settled(1, Outcome.DONE, attempt=1,
                                     evidence={"charge_id": "ch_1"}))
            case "settle_unknown":
                log.append(s.settled(1, Outcome.UNKNOWN, attempt=1))
            case "abort":
                log.append(s.aborted())
            case "finish":
                log.append(s.finished())
    return log


@settings(max_examples=500)
@given(st.lists(st.sampled_from((*HAPPENINGS, "attempt", "attempt")), max_size=8), st.data())
def test_at_most_one_record_of_an_attempt_is_sent_and_never_after_the_step_was_over(
        happenings: list[str], data: st.DataObject) -> None:
    log = build(happenings)
    (effect,) = [e for e in effects_to_work(fold(log[:2]), log[1].at) if not e.undo]
    attempts = [k for k, e in enumerate(log) if e.type == "step.attempted"]
    sent: list[int] = []
    for k in attempts:
        # Read back once the fold holds the record, and perhaps what came after it.
        upto = data.draw(st.integers(min_value=k, max_value=len(log) - 1), label=f"read{k}")
        seen = log[:upto + 1]
        refusal = why_not_send(fold(seen), effect, log[k])  # type: ignore[arg-type]
        before = {e.type if e.type != "step.settled" else f"settled {e.outcome}"  # type: ignore[attr-defined]
                  for e in seen if e is not log[k]}
        number = log[k].attempt  # type: ignore[attr-defined]
        if refusal is None:
            sent.append(k)
            assert "settled done" not in before
            if number == 1:
                assert "task.aborted" not in before
                assert "task.finished" not in before
        elif refusal[1]:  # settled as never sent: this record alone could have gone
            assert number == 1
            assert k == attempts[0]  # the first record of attempt 1 is the first of all
            assert {"task.aborted", "task.finished"} & before
    event(f"records {len(attempts)}, sent {len(sent)}")
    numbers = [log[k].attempt for k in sent]  # type: ignore[attr-defined]
    assert len(numbers) == len(set(numbers))  # at most one record of each attempt goes
    for n in (1, 2):  # and only the first of its number in the log
        firsts = [k for k in attempts if log[k].attempt == n][:1]  # type: ignore[attr-defined]
        assert [k for k in sent if log[k].attempt == n] in ([], firsts)  # type: ignore[attr-defined]
    # No attempt that went out ends under a not_done that did not cover it.
    final = fold(log).step(1).effect.settlement
    if final is not None and final.outcome is Outcome.NOT_DONE and final.attempt is not None:
        assert all(log[k].attempt <= final.attempt for k in sent)  # type: ignore[attr-defined]


def test_a_not_done_about_the_attempts_up_to_j_is_void_after_a_later_attempt() -> None:
    """The reconciler proves `not_done` from the attempts its fold has (nothing found long
    after the last); an executor's retry journaled just before that proof is not covered by
    it: the proof is not applied, and the retry goes out and settles the step itself."""
    s = Stamper("fence-2")
    log = [s.started(), s.intended(1), s.attempted(1, 1),
           s.settled(1, Outcome.UNKNOWN, attempt=1), s.attempted(1, 2),
           s.settled(1, Outcome.NOT_DONE, attempt=1, source=SettlementSource.LOOKUP)]
    effect = fold(log).step(1).effect
    assert effect.outcome is Outcome.UNKNOWN
    (work,) = [e for e in effects_to_work(fold(log), log[-1].at) if not e.undo]
    assert why_not_send(fold(log), work, log[4]) is None  # type: ignore[arg-type]
    covered = [*log[:-1], s.settled(1, Outcome.NOT_DONE, attempt=2,
                                    source=SettlementSource.LOOKUP)]
    assert fold(covered).step(1).effect.outcome is Outcome.NOT_DONE


def test_a_late_attempt_under_an_undo_key_that_was_replaced_never_goes_out() -> None:
    """A paused executor journals a retry of the undo under its first key after a lookup
    proved that key did nothing and the undo was intended again under :undo2: the retry is
    kept with the first key's undo, and it never goes out (its key is not the undo's now)."""
    s = Stamper("fence-3")
    log: list[Event] = [
        s.started(), s.intended(1), s.attempted(1, 1),
        s.settled(1, Outcome.DONE, attempt=1), s.aborted(),
        s.undo_intended(1), s.undo_attempted(1, 1),
        s.undo_settled(1, Outcome.UNKNOWN, attempt=1),
        s.undo_settled(1, Outcome.NOT_DONE, attempt=1, source=SettlementSource.LOOKUP)]
    (stale,) = [e for e in effects_to_work(fold(log), log[-1].at) if e.undo]
    log += [s.undo_intended(1, generation=2), s.undo_attempted(1, 2)]
    step = fold(log).step(1)
    assert [a.attempt for a in step.past_undos[0].state.attempts] == [1, 2]
    assert step.undo.attempts == ()
    assert why_not_send(fold(log), stale, log[-1]) == (  # type: ignore[arg-type]
        "the undo is intended under another key than fence-3:1:undo now", False)
    (latest,) = [e for e in effects_to_work(fold(log), log[-1].at) if e.undo]
    assert (latest.key, latest.generation) == ("fence-3:1:undo2", 2)
    log.append(s.undo_attempted(1, 1, generation=2))
    assert why_not_send(fold(log), latest, log[-1]) is None  # type: ignore[arg-type]
