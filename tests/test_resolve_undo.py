"""An operator settles a saga's undo that needs attention: by its key (`TASK:N:undo`, or a
successor's `:undo2`, `:undo3`), through `halfway resolve` and `POST /api/steps/{key}/resolve`,
as `compensation.settled` with source `operator`; and the saga goes on from the verdict.

- pure: an undo unknown with no further check holds the saga for an operator instead of
  ending it; their `done` lets the next undo run and the task end `compensated`, their
  `not_done` ends it `needs_attention`, as an undo the provider refused does;
- on the broker: the API and the command line settle an undo by its key, with the same
  refusals as for a step (not in the journal, settled already);
- through real processes: a trip whose flight release hangs past its key's lifetime is held
  for an operator, who settles the undo through the API, and the trip ends `compensated`.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from halfway.contract import (
    CompensationChecked,
    CompensationSettled,
    FinalState,
    Outcome,
    SettlementSource,
    TaskFinished,
    TaskPolicy,
)
from halfway.core.decide import Finish, Hold
from halfway.core.effects import effects_to_work
from halfway.demo.trip import FULL_HOTEL, trip_request
from halfway.journal import JournalWriter
from halfway.journal.replay import task_state
from halfway.resolve import Effect, ResolveRefused, os_user, parse_effect
from halfway.settings import KafkaSettings
from tests.factories import Stamper
from tests.test_cli_hostile import halfway, operator_env
from tests.test_operator_api import OPS, bearer, serving
from tests.test_saga import TOOLS, Trip

pytest.register_assert_rewrite("tests.processes")

from tests.processes import Cluster  # noqa: E402

pytest_plugins = ["tests.processes"]


def saga(task_id: str = "trip-7") -> Trip:
    trip = Trip()
    trip.s = Stamper(task_id)
    trip.log = [trip.s.started(allowed_tools=sorted(TOOLS), policy=TaskPolicy(saga=True))]
    return trip


def undoing(task_id: str = "trip-7") -> Trip:
    """A flight held, a hotel booked, the charge declined: both undos intended."""
    trip = saga(task_id)
    trip.run(trip.place("hold_flight"))
    trip.run(trip.place("book_hotel"))
    trip.run(trip.place("charge_customer"), Outcome.NOT_DONE)
    trip.compensate(trip.decide())
    return trip


def escalate_undo(trip: Trip, n: int) -> None:
    """Step n's undo under its latest key: sent, no reply, and no lookup left."""
    generation = trip.state().steps[n].undo_generation
    trip.log.append(trip.s.undo_attempted(n, 1, generation=generation))
    trip.log.append(trip.s.undo_settled(n, Outcome.UNKNOWN, attempt=1, generation=generation))
    trip.log.append(trip.s.undo_checked(n, None, generation=generation))


def operator_settles_undo(trip: Trip, n: int, outcome: Outcome) -> None:
    generation = trip.state().steps[n].undo_generation
    said: dict[str, Any] = ({"evidence": {"booking_id": "bk_1", "resolved_by": "os:alice"}}
                            if outcome is Outcome.DONE else
                            {"reason": "the hotel says it is still booked (resolved by os:alice)"})
    trip.log.append(trip.s.undo_settled(n, outcome, source=SettlementSource.OPERATOR,
                                        generation=generation, **said))


# --- pure: the saga waits for the operator's verdict, then goes on from it -----------------------


def test_an_undo_with_no_further_check_holds_the_saga_for_an_operator_not_its_end() -> None:
    trip = undoing()
    escalate_undo(trip, 2)
    assert trip.state().needs_attention
    move = trip.decide()
    assert isinstance(move, Hold), move  # it ended needs_attention before: nobody could move it
    assert "halfway resolve trip-7:2:undo" in move.reason
    # The flight's undo waits behind the hotel's.
    assert [e.step_id for e in effects_to_work(trip.state(), trip.s.now) if e.undo] == ["trip-7:2"]

    operator_settles_undo(trip, 2, Outcome.DONE)
    state = trip.state()
    assert state.steps[2].undo.settlement.source is SettlementSource.OPERATOR
    assert not state.needs_attention
    assert [e.step_id for e in effects_to_work(state, trip.s.now) if e.undo and
            e.state.outcome is None] == ["trip-7:1"]  # its turn has come
    assert isinstance(trip.decide(), Hold)
    trip.undo(1)
    final = trip.decide()
    assert isinstance(final, Finish)
    assert final.state is FinalState.COMPENSATED, final


def test_an_operators_not_done_on_an_undo_ends_the_saga_needing_attention() -> None:
    trip = undoing()
    escalate_undo(trip, 2)
    assert isinstance(trip.decide(), Hold)  # the operator's verdict decides how it ends
    operator_settles_undo(trip, 2, Outcome.NOT_DONE)
    move = trip.decide()
    assert isinstance(move, Finish)
    assert move.state is FinalState.NEEDS_ATTENTION
    assert "the hotel says it is still booked (resolved by os:alice)" in move.summary
    assert "waiting behind it: trip-7:1" in move.summary
    assert trip.state().steps[2].undo_keys == ("trip-7:2:undo",)  # a person's word: no new key


def test_an_undo_under_a_successor_key_is_settled_under_that_key() -> None:
    trip = undoing()
    trip.undo(2)
    trip.undo_proven_absent(1)  # :undo did nothing, proven: sent again under :undo2
    trip.compensate(trip.decide())
    escalate_undo(trip, 1)
    move = trip.decide()
    assert isinstance(move, Hold), move
    assert "halfway resolve trip-7:1:undo2" in move.reason
    operator_settles_undo(trip, 1, Outcome.DONE)
    step = trip.state().steps[1]
    assert step.undo.settlement.source is SettlementSource.OPERATOR
    assert step.past_undos[0].state.outcome is Outcome.NOT_DONE  # the proof stands
    final = trip.decide()
    assert isinstance(final, Finish)
    assert final.state is FinalState.COMPENSATED, final


def test_a_step_id_or_any_of_its_undo_keys_names_what_is_resolved() -> None:
    assert parse_effect("trip-7:2") == Effect("trip-7", "trip-7:2", 2, None)
    assert parse_effect("trip-7:2:undo") == Effect("trip-7", "trip-7:2", 2, 1)
    assert parse_effect("trip-7:2:undo3") == Effect("trip-7", "trip-7:2", 2, 3)
    for bad in ("trip-7", "trip-7:2:undo1", "trip-7:2:undo4", "trip-7:undo", "trip-7:2:redo"):
        with pytest.raises(ResolveRefused, match="invalid step id"):
            parse_effect(bad)


# --- on the broker: the API and the command line settle an undo by its key ---------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def journaled(writer: JournalWriter, trip: Trip) -> None:
    for event in trip.log:
        await writer.append(event)


def operator_undos(state: Any, n: int) -> list[CompensationSettled]:
    return [u for u in (*state.steps[n].undo.unknowns, state.steps[n].undo.settlement)
            if u is not None and u.source is SettlementSource.OPERATOR]


@pytest.mark.broker
async def test_the_api_and_the_command_line_settle_an_undo_by_its_key(
        topics: KafkaSettings, writer: JournalWriter) -> None:
    by_api, by_cli = undoing(new_id("undo-api")), undoing(new_id("undo-cli"))
    for trip in (by_api, by_cli):
        escalate_undo(trip, 2)
        await journaled(writer, trip)
    api_key, cli_key = f"{by_api.s.task_id}:2:undo", f"{by_cli.s.task_id}:2:undo"

    async with serving(kafka=topics.as_kind("api")) as c:
        body = {"outcome": "done", "evidence": {"booking_id": "bk_cancelled_by_phone"}}
        response = await c.post(f"/api/steps/{api_key}/resolve", json=body, headers=bearer(OPS))
        assert response.status == 202, await response.text()
        answer = await response.json()
        assert (answer["step_id"], answer["undo_key"]) == (f"{by_api.s.task_id}:2", api_key)

        # The refusals a step gets: settled already (409), not in the journal (404).
        again = await c.post(f"/api/steps/{api_key}/resolve", headers=bearer(OPS),
                             json={"outcome": "not_done", "reason": "changed my mind"})
        assert again.status == 409, await again.text()
        assert f"the undo {api_key} is already done" in (await again.json())["error"]
        for absent in (f"{by_api.s.task_id}:3:undo", f"{by_api.s.task_id}:2:undo2",
                       f"{new_id('never')}:1:undo"):
            response = await c.post(f"/api/steps/{absent}/resolve", headers=bearer(OPS),
                                    json={"outcome": "not_done", "reason": "x"})
            assert response.status == 404, (absent, await response.text())

    code, err = await halfway("resolve", cli_key, "not_done", "--reason",
                              "the hotel still shows the booking", env=operator_env(topics))
    assert code == 0, err
    code, err = await halfway("resolve", cli_key, "done", "--evidence", "booking_id=bk_1",
                              env=operator_env(topics))
    assert code == 2
    assert f"refused: the undo {cli_key} is already not_done" in err

    api = await task_state(topics, by_api.s.task_id)
    [settled] = operator_undos(api, 2)
    assert (settled.outcome, settled.generation) == (Outcome.DONE, 1)
    assert settled.evidence == {"booking_id": "bk_cancelled_by_phone", "resolved_by": "api:ops"}
    assert not api.needs_attention
    cli = await task_state(topics, by_cli.s.task_id)
    [settled] = operator_undos(cli, 2)
    assert settled.outcome is Outcome.NOT_DONE
    assert settled.reason == f"the hotel still shows the booking (resolved by os:{os_user()})"
    assert len(api.not_accepted) == len(cli.not_accepted) == 0


# --- through real processes: the trip waits for the operator, then ends compensated -------------


@pytest.mark.broker
async def test_a_trip_whose_undo_needs_attention_is_finished_by_an_operator_through_the_api(
        trip: Cluster) -> None:
    c = trip
    task_id = new_id("trip-undo-op")
    key = f"{task_id}:1:undo"
    # The flight's release hangs far past the 1 s timeout, and the provider keeps keys 4 s:
    # no lookup finds it within the key's lifetime and no retry is safe after it.
    await c.trip_faults({"match": {"endpoint": "flights.release"}, "action": {"delay_s": 60.0}})
    for name in ("decider", "executor", "reconciler"):
        await c.start(name, HALFWAY_TRAVEL_KEY_TTL_S="4")
    await c.publish(trip_request(task_id, hotel=FULL_HOTEL))
    await c.journal.first(lambda e: isinstance(e, CompensationChecked)
                          and e.task_id == task_id and e.next_check_at is None,
                          "the release escalated to an operator")

    async with serving(kafka=c.settings.as_kind("api")) as client:
        response = await client.post(
            f"/api/steps/{key}/resolve", headers=bearer(OPS),
            json={"outcome": "done", "evidence": {"hold_id": "released by the airline desk"}})
        assert response.status == 202, await response.text()
    state = (await c.journal.until_finished([task_id]))[task_id]

    assert state.final_state is FinalState.COMPENSATED, state.finished
    undo = state.steps[1].undo
    assert (undo.outcome, undo.settlement.source) == (Outcome.DONE, SettlementSource.OPERATOR)
    assert state.steps[2].outcome is Outcome.NOT_DONE  # the full hotel: nothing to undo
    assert not state.needs_attention
    # It waited for the operator: it ended once, after their verdict (it used to end
    # needs_attention at the escalation, and nobody could settle the undo).
    log = c.journal.of(task_id)
    [ended] = [i for i, e in enumerate(log) if isinstance(e, TaskFinished)]
    [verdict] = [i for i, e in enumerate(log) if isinstance(e, CompensationSettled)
                 and e.source is SettlementSource.OPERATOR]
    assert verdict < ended
