"""Operators who settle one effect at once: log order decides, and every answer says what the log
holds.

A resolution reads the task's journal, then appends; two operators can both read the effect
open and both append. The fold takes the first verdict in the log and keeps a later one given
without `force` in `not_accepted` (never as a contradiction nobody asked for); the resolution
reads the journal back up to its own record and is refused (409, exit 2) unless its verdict is
the one the log took, naming the verdict that came first. The same for call-offs.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

import halfway.resolve
from halfway.contract import Outcome, SettlementSource, TaskAborted
from halfway.core.fold import fold
from halfway.journal import JournalWriter
from halfway.journal.replay import read_topic, task_state
from halfway.resolve import AlreadyDecided, abort_task, resolve
from halfway.settings import KafkaSettings
from tests.factories import Stamper
from tests.test_operator_api import OPS, bearer, serving

RACERS = 12


def unknown_step(task_id: str) -> tuple[Stamper, list[Any]]:
    s = Stamper(task_id)
    return s, [s.started(), s.intended(1), s.attempted(1, 1),
               s.settled(1, Outcome.UNKNOWN, attempt=1), s.checked(1, None)]


def operator(s: Stamper, outcome: Outcome, *, undo: bool = False, **kw: Any) -> Any:
    said = ({"evidence": {"charge_id": "ch_seen_at_the_bank", "resolved_by": "api:bob"}}
            if outcome is Outcome.DONE else {"reason": "the bank shows none (resolved by api:ann)"})
    settle = s.undo_settled if undo else s.settled
    return settle(1, outcome, source=SettlementSource.OPERATOR, **said, **kw)


# --- pure: the fold keeps the first verdict, and a late one is not accepted ---------------------


@pytest.mark.parametrize("first_source", [SettlementSource.OPERATOR, SettlementSource.LOOKUP])
def test_a_verdict_that_lost_the_race_is_not_accepted_never_a_contradiction(
        first_source: SettlementSource) -> None:
    s, log = unknown_step("race-7")
    first = s.settled(1, Outcome.DONE, source=first_source)
    late = operator(s, Outcome.NOT_DONE)
    state = fold([*log, first, late])
    step = state.step(1)
    assert step.effect.settlement == first
    assert step.effect.contradictions == ()
    assert not state.needs_attention
    [refused] = state.not_accepted
    assert refused.event == late
    assert "the first verdict stands" in refused.reason
    # One that agrees changes nothing, and is no refusal either.
    assert fold([*log, first, operator(s, Outcome.DONE)]).step(1).effect.settlement == first
    # One given knowing the effect was settled (forced) says so, and is a contradiction.
    forced = late.model_copy(update={
        "event_id": uuid.uuid4().hex,
        "contradiction": "api:ann says not_done, knowing it was settled done (a second "
                         "verdict, forced)"})
    state = fold([*log, first, late, forced])
    assert state.step(1).effect.contradictions == (forced,)
    assert state.needs_attention
    assert [n.event for n in state.not_accepted] == [late]


def test_an_undos_late_verdict_is_not_accepted_either() -> None:
    s, log = unknown_step("race-7")
    log = [*log[:3], s.settled(1, Outcome.DONE, attempt=1), s.aborted(),
           s.undo_intended(1), s.undo_attempted(1, 1),
           s.undo_settled(1, Outcome.UNKNOWN, attempt=1), s.undo_checked(1, None)]
    first, late = operator(s, Outcome.NOT_DONE, undo=True), operator(s, Outcome.DONE, undo=True)
    state = fold([*log, first, late])
    undo = state.step(1).undo
    assert (undo.settlement, undo.contradictions) == (first, ())
    assert [n.event for n in state.not_accepted] == [late]


# --- on the broker: one verdict is answered 202, the others 409 naming it -----------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def warm_up(c: Any) -> None:
    """Start the API's journal writer (a call-off of a task never started: 404), so the racers
    are not lined up behind its start."""
    response = await c.post(f"/api/tasks/{new_id('never')}/abort", headers=bearer(OPS),
                            json={"reason": "warming up"})
    assert response.status == 404, await response.text()


async def journaled(writer: JournalWriter, events: list[Any]) -> None:
    for event in events:
        await writer.append(event)


@pytest.mark.broker
async def test_a_verdict_that_reaches_the_journal_second_is_refused_naming_the_first(
        topics: KafkaSettings, writer: JournalWriter, monkeypatch: pytest.MonkeyPatch) -> None:
    """The race made certain: the second resolution read the journal before the first one's
    verdict was in it."""
    s, log = unknown_step(new_id("race"))
    await journaled(writer, log)
    settings = topics.as_kind("operator")
    stale = await task_state(settings, s.task_id)
    first = await resolve(settings, f"{s.task_id}:1", Outcome.DONE,
                          evidence={"charge_id": "ch_1"}, reason=None, by="api:bob")

    async def as_read_before(_settings: KafkaSettings, _task_id: str) -> Any:
        return stale

    monkeypatch.setattr(halfway.resolve, "task_state", as_read_before)
    with pytest.raises(AlreadyDecided) as refused:
        await resolve(settings, f"{s.task_id}:1", Outcome.NOT_DONE, evidence=None,
                      reason="the bank shows none", by="api:ann")
    words = str(refused.value)
    assert f"step {s.task_id}:1 was settled done (operator: charge_id=ch_1" in words
    assert "yours is kept as not accepted" in words
    monkeypatch.undo()

    state = await task_state(settings, s.task_id)
    assert state.step(1).effect.settlement.event_id == first.event_id
    assert state.step(1).effect.contradictions == ()
    assert [n.event.reason for n in state.not_accepted] == [
        "the bank shows none (resolved by api:ann)"]

    # Knowing it is settled, a person may still record a second verdict: a contradiction.
    forced = await resolve(settings, f"{s.task_id}:1", Outcome.NOT_DONE, evidence=None,
                           reason="the bank shows none", by="api:ann", force=True)
    assert forced.contradiction == ("api:ann says not_done, knowing it was settled done (a "
                                    "second verdict, forced)")
    state = await task_state(settings, s.task_id)
    assert state.step(1).effect.contradictions == (forced,)
    assert state.needs_attention


@pytest.mark.broker
async def test_concurrent_resolutions_through_the_api_get_one_202_and_409s_naming_it(
        topics: KafkaSettings, writer: JournalWriter) -> None:
    s, log = unknown_step(new_id("race-api"))
    await journaled(writer, log)
    bodies = [{"outcome": "done", "evidence": {"charge_id": f"ch_race_{i}"}} if i % 2 == 0
              else {"outcome": "not_done", "reason": f"the bank says no ({i})"}
              for i in range(RACERS)]
    async with serving(kafka=topics.as_kind("api")) as c:
        await warm_up(c)

        async def one(body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            response = await c.post(f"/api/steps/{s.task_id}:1/resolve", json=body,
                                    headers=bearer(OPS))
            return response.status, await response.json()

        answers = await asyncio.gather(*(one(b) for b in bodies))

    accepted = [a for status, a in answers if status == 202]
    assert len(accepted) == 1, answers
    [winner] = accepted
    assert sorted(status for status, _ in answers) == [202] + [409] * (RACERS - 1), answers
    state = await task_state(topics, s.task_id)
    effect = state.step(1).effect
    assert effect.settlement.event_id == winner["event_id"]
    assert effect.outcome.value == winner["outcome"]
    assert effect.contradictions == ()
    assert not state.needs_attention
    # Each 409 names the first verdict: one that read the journal after it is refused before
    # appending; one that appended too is refused once its read back shows the first.
    first_words = (f"step {s.task_id}:1 is already {winner['outcome']}",
                   f"step {s.task_id}:1 was settled {winner['outcome']} (operator: ")
    assert all(any(w in a["error"] for w in first_words)
               for status, a in answers if status == 409), answers
    # Those that disagree and reached the journal are kept, not accepted.
    losers = [n.event for n in state.not_accepted]
    assert len(losers) <= RACERS // 2
    assert all(e.outcome is not effect.outcome for e in losers)


@pytest.mark.broker
async def test_concurrent_call_offs_get_one_202_and_409s_naming_it(
        topics: KafkaSettings, writer: JournalWriter) -> None:
    s, log = unknown_step(new_id("race-abort"))
    await journaled(writer, log)
    async with serving(kafka=topics.as_kind("api")) as c:
        await warm_up(c)

        async def one(i: int) -> tuple[int, dict[str, Any]]:
            response = await c.post(f"/api/tasks/{s.task_id}/abort", headers=bearer(OPS),
                                    json={"reason": f"call-off {i}"})
            return response.status, await response.json()

        answers = await asyncio.gather(*(one(i) for i in range(RACERS)))

    accepted = [a for status, a in answers if status == 202]
    assert len(accepted) == 1, answers
    assert sorted(status for status, _ in answers) == [202] + [409] * (RACERS - 1), answers
    aborts = [d.event async for d in read_topic(topics, only_key=s.task_id.encode())
              if isinstance(d.event, TaskAborted) and d.event.task_id == s.task_id]
    assert aborts[0].event_id == accepted[0]["event_id"]  # the first in the log is the 202
    words = f"was already called off by api:ops: {accepted[0]['reason']}"
    assert all(words in a["error"] for status, a in answers if status == 409), answers


async def test_a_call_off_that_lost_the_race_is_refused_naming_the_winner(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without a broker: the journal read back holds another call-off before ours."""
    s = Stamper("race-7")
    winner = s.aborted("the customer cancelled", by="api:bob")
    read = iter([fold([s.started()]), fold([s.started(), winner])])

    async def state(*_: Any) -> Any:
        return next(read)

    class Journal:
        async def append(self, event: Any) -> Any:
            return None

    monkeypatch.setattr(halfway.resolve, "task_state", state)
    monkeypatch.setattr(halfway.resolve, "state_through", state)
    with pytest.raises(AlreadyDecided, match="already called off by api:bob: the customer"):
        await abort_task(KafkaSettings("127.0.0.1:1", "nowhere.", 1), "race-7",
                         reason="twice", by="api:ann", writer=Journal())  # type: ignore[arg-type]
