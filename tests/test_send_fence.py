"""`effects.why_not_send`, the fence every attempt passes before it leaves: property tests over
logs in which executors, some paused with a stale fold, journal attempt 1 of one step at any
point among a successor's settlements, an operator's abort and the task's end, and each reads
its record back at any later point.

Whatever the interleaving: at most one record of the attempt is ever sent; none is sent once
something before it (or read with it) settled the step for good, and no first attempt is sent
once its task was aborted or over; a record settled as never sent is the attempt's first.
"""

from __future__ import annotations

from hypothesis import event, given, settings
from hypothesis import strategies as st

from halfway.contract import Event, Outcome
from halfway.core.effects import effects_to_work, why_not_send
from halfway.core.fold import fold
from tests.factories import Stamper

HAPPENINGS = ("attempt", "settle_not_done", "settle_done", "settle_unknown", "abort", "finish")


def build(happenings: list[str]) -> list[Event]:
    s = Stamper("fence-1")
    log: list[Event] = [s.started(), s.intended(1)]
    for what in happenings:
        match what:
            case "attempt":  # an executor's record of attempt 1, stale fold or not
                log.append(s.attempted(1, 1))
            case "settle_not_done":
                log.append(s.settled(1, Outcome.NOT_DONE, attempt=1))
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
    sent = []
    for k in attempts:
        # Read back once the fold holds the record, and perhaps what came after it.
        upto = data.draw(st.integers(min_value=k, max_value=len(log) - 1), label=f"read{k}")
        seen = log[:upto + 1]
        refusal = why_not_send(fold(seen), effect, log[k])  # type: ignore[arg-type]
        before = {e.type if e.type != "step.settled" else f"settled {e.outcome}"  # type: ignore[attr-defined]
                  for e in seen if e is not log[k]}
        if refusal is None:
            sent.append(k)
            assert "settled done" not in before
            assert "settled not_done" not in before
            assert "task.aborted" not in before
            assert "task.finished" not in before
        elif refusal[1]:  # settled as never sent: this record alone could have gone
            assert k == attempts[0]
            assert {"task.aborted", "task.finished"} & before
    event(f"records {len(attempts)}, sent {len(sent)}")
    assert len(sent) <= 1
    assert not sent or sent[0] == attempts[0]  # only the first in the log may go
