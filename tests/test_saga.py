"""Sagas, pure: the order rules (with the reason the model reads), undo planning and order,
and how a failing saga ends. The broker-backed trip runs are in test_trip.py."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict

from halfway.contract import (
    CompensationPlan,
    EffectClass,
    FinalState,
    OnUnknown,
    Outcome,
    SagaRole,
    SettlementSource,
    TaskPolicy,
)
from halfway.contract.ids import UNDO_KEYS_MAX
from halfway.core import saga
from halfway.core.decide import (
    Abort,
    Ask,
    Compensate,
    Finish,
    Hold,
    Refused,
    ToolFacts,
    accept_call,
    decide,
    finish_for,
)
from halfway.core.effects import effects_to_work
from halfway.core.fold import fold
from tests.factories import Stamper

TOOLS = {"hold_flight", "book_hotel", "charge_customer", "send_email", "lookup_fare",
         "read_fare"}


class AnyArgs(BaseModel):
    model_config = ConfigDict(extra="allow")


def facts(name: str, role: SagaRole | None, undo: str | None = None) -> ToolFacts:
    plan = None if undo is None else CompensationPlan(tool=undo, args={"ref": "$result.ref"})
    return ToolFacts(name, AnyArgs, EffectClass.KEYED, lambda _a: None, saga_role=role,
                     undo=plan)


HOLD = facts("hold_flight", SagaRole.COMPENSABLE, "release_flight_hold")
HOTEL = facts("book_hotel", SagaRole.COMPENSABLE, "cancel_hotel_booking")
CHARGE = facts("charge_customer", SagaRole.PIVOT)
EMAIL = facts("send_email", SagaRole.RETRIABLE)
FARE = facts("lookup_fare", None)
READ = ToolFacts("read_fare", AnyArgs, EffectClass.READ, lambda _a: None)  # no role: a read
BY_NAME = {f.name: f for f in (HOLD, HOTEL, CHARGE, EMAIL, FARE, READ)}


class Trip:
    """A saga's journal, written step by step like the services would."""

    def __init__(self, policy: TaskPolicy | None = None) -> None:
        self.s = Stamper("trip-7")
        self.log: list[Any] = [self.s.started(allowed_tools=sorted(TOOLS),
                                              policy=policy or TaskPolicy(saga=True))]

    def state(self):
        return fold(self.log)

    def place(self, tool: str) -> int:
        """Place the next step through accept_call, as the decider would."""
        state = self.state()
        n = state.next_step_n
        fields = accept_call(state, n, BY_NAME[tool], tool, {"ref": f"r{n}"})
        assert not isinstance(fields, Refused), fields
        fields.pop("step_id"), fields.pop("key")
        self.log.append(self.s.intended(**fields))
        return n

    def settle(self, n: int, outcome: Outcome, **kw: Any) -> None:
        if outcome is Outcome.DONE:
            kw.setdefault("evidence", {"ref": f"ref-{n}"})
        self.log.append(self.s.settled(n, outcome, **kw))

    def run(self, n: int, outcome: Outcome = Outcome.DONE) -> None:
        self.log.append(self.s.attempted(n, 1))
        self.settle(n, outcome, attempt=1)

    def decide(self, now_plus: timedelta = timedelta(0)):
        """The decider's next move; a call-off is journaled as the decider would."""
        move = decide(self.state(), known_tools=TOOLS, requested=True,
                      now=self.s.now + now_plus)
        if isinstance(move, Abort):
            self.log.append(self.s.aborted(move.reason, by=saga.HARNESS))
            return self.decide(now_plus)
        return move

    def compensate(self, move: Compensate) -> None:
        for n, tool, args, generation in move.undos:
            self.log.append(self.s.undo_intended(n, tool=tool, args=args,
                                                 generation=generation))

    def undo(self, n: int, outcome: Outcome = Outcome.DONE, **kw: Any) -> None:
        """Attempt step n's undo under its latest key, and settle it."""
        generation = self.state().steps[n].undo_generation
        self.log.append(self.s.undo_attempted(n, 1, generation=generation))
        self.log.append(self.s.undo_settled(n, outcome, attempt=1, generation=generation,
                                            **kw))

    def undo_proven_absent(self, n: int) -> None:
        """Step n's undo under its latest key: a saved 5xx replayed, then a lookup that found
        nothing past the provider's bound (`not_done`, source lookup, no effect named)."""
        generation = self.state().steps[n].undo_generation
        self.log.append(self.s.undo_attempted(n, 1, generation=generation))
        self.log.append(self.s.undo_settled(n, Outcome.UNKNOWN, attempt=1,
                                            generation=generation, replayed=True,
                                            reason="the provider replayed a saved 500"))
        self.log.append(self.s.undo_settled(n, Outcome.NOT_DONE, attempt=1,
                                            generation=generation,
                                            source=SettlementSource.LOOKUP,
                                            reason="nothing found past the provider's bound"))


def undoing(*done: str) -> Trip:
    """A trip whose `done` steps were done and whose charge was declined: being undone, its
    undos journaled."""
    trip = Trip()
    for tool in done:
        trip.run(trip.place(tool))
    trip.run(trip.place("charge_customer"), Outcome.NOT_DONE)
    trip.compensate(trip.decide())
    return trip


def refusal(trip: Trip, tool: str) -> str:
    state = trip.state()
    out = accept_call(state, state.next_step_n, BY_NAME[tool], tool, {"ref": "x"})
    assert isinstance(out, Refused), out
    return out.reason


# -- the order rules --------------------------------------------------------------------------


def test_a_step_with_no_undo_that_is_not_the_pivot_is_refused() -> None:
    trip = Trip()
    assert refusal(trip, "lookup_fare") == (
        "refused: lookup_fare declares no undo and is not the pivot, so this saga could not "
        "take it back; a saga places undoable steps, then one pivot, then retriable steps")
    assert refusal(trip, "send_email") == (
        "refused: send_email cannot be undone and is not the pivot; place it after the pivot")


def test_a_second_pivot_is_refused() -> None:
    trip = Trip()
    trip.run(trip.place("hold_flight"))
    trip.run(trip.place("charge_customer"))
    assert refusal(trip, "charge_customer") == (
        "refused: this saga already has its pivot, trip-7:2 (charge_customer); a second step "
        "that cannot be undone is not allowed")


def test_a_compensable_step_after_the_pivot_is_refused() -> None:
    trip = Trip()
    trip.run(trip.place("charge_customer"))
    assert refusal(trip, "book_hotel") == (
        "refused: book_hotel would come after the pivot trip-7:1 (charge_customer); nothing "
        "that may need undoing can follow the point of no return")


def test_the_right_order_is_accepted_and_each_undo_is_declared_with_its_step() -> None:
    trip = Trip()
    for tool in ("hold_flight", "book_hotel", "charge_customer", "send_email"):
        trip.run(trip.place(tool))
    steps = trip.state().steps
    assert steps[1].intent.compensation == HOLD.undo
    assert steps[2].intent.saga_role is SagaRole.COMPENSABLE
    assert steps[3].intent.compensation is None
    assert isinstance(trip.decide(), Ask)


def test_a_task_that_is_not_a_saga_has_no_order_rules() -> None:
    trip = Trip(TaskPolicy(saga=False))
    trip.run(trip.place("send_email"))
    trip.run(trip.place("lookup_fare"))


# -- undoing a failing saga -------------------------------------------------------------------


def test_a_step_not_done_undoes_the_done_steps_last_first_then_compensated() -> None:
    trip = Trip()
    trip.run(trip.place("hold_flight"))
    trip.run(trip.place("book_hotel"))
    trip.run(trip.place("charge_customer"), Outcome.NOT_DONE)  # the card is declined
    move = trip.decide()
    assert move == Compensate(
        ((2, "cancel_hotel_booking", {"ref": "ref-2"}, 1),
         (1, "release_flight_hold", {"ref": "ref-1"}, 1)),
        "step trip-7:3 (charge_customer) was not done: refused: card declined")
    trip.compensate(move)
    state = trip.state()
    # Only the last undo may run: reverse order.
    undos = [e.step_id for e in effects_to_work(state, trip.s.now) if e.undo]
    assert undos == ["trip-7:2"]
    assert isinstance(trip.decide(), Hold)
    trip.undo(2)
    undos = [e.step_id for e in effects_to_work(trip.state(), trip.s.now) if e.undo]
    assert undos == ["trip-7:1", "trip-7:2"]
    trip.undo(1)
    move = trip.decide()
    assert isinstance(move, Finish)
    assert move.state is FinalState.COMPENSATED
    assert "trip-7:2 book_hotel by cancel_hotel_booking, trip-7:1 hold_flight" in move.summary


def test_a_read_goes_anywhere_in_a_saga_and_is_never_undone() -> None:
    """A read has nothing to take back: placed before, between and after the undoable steps,
    it is skipped when the saga is undone, and holds no undo back."""
    trip = Trip()
    trip.run(trip.place("read_fare"))
    trip.run(trip.place("hold_flight"))
    trip.run(trip.place("read_fare"))
    trip.run(trip.place("charge_customer"), Outcome.NOT_DONE)
    move = trip.decide()
    assert isinstance(move, Compensate)
    assert [u[:2] for u in move.undos] == [(2, "release_flight_hold")]
    trip.compensate(move)
    assert [e.step_id for e in effects_to_work(trip.state(), trip.s.now) if e.undo] == \
        ["trip-7:2"]  # not held behind the read after it
    trip.undo(2)
    move = trip.decide()
    assert isinstance(move, Finish)
    assert move.state is FinalState.COMPENSATED

def test_a_first_step_not_done_leaves_nothing_to_undo() -> None:
    trip = Trip()
    trip.run(trip.place("hold_flight"), Outcome.NOT_DONE)
    move = trip.decide()
    assert isinstance(move, Finish)
    assert move.state is FinalState.FAILED
    assert "nothing was done" in move.summary


@pytest.mark.parametrize("proven", [Outcome.DONE, Outcome.NOT_DONE])
def test_an_unknown_step_is_undone_only_once_proven_done(proven: Outcome) -> None:
    trip = Trip(TaskPolicy(saga=True, on_unknown=OnUnknown.COMPENSATE))
    trip.run(trip.place("hold_flight"))
    hotel = trip.place("book_hotel")
    trip.run(hotel, Outcome.UNKNOWN)
    move = trip.decide()
    # The saga gives up on the unknown step: the hold is undone-to-be, the hotel waits.
    assert move == Compensate(((1, "release_flight_hold", {"ref": "ref-1"}, 1),),
                              "step trip-7:2 (book_hotel) is unknown, and the policy gives "
                              "up on unknowns")
    trip.compensate(move)
    # The hold's undo waits for the later step: it may still turn out done.
    assert [e for e in effects_to_work(trip.state(), trip.s.now) if e.undo] == []
    assert isinstance(trip.decide(), Hold)
    trip.settle(hotel, proven, source=SettlementSource.LOOKUP)
    move = trip.decide()
    if proven is Outcome.DONE:
        assert move == Compensate(((2, "cancel_hotel_booking", {"ref": "ref-2"}, 1),), move.why)
        trip.compensate(move)
        trip.undo(2)
    else:
        assert isinstance(move, Hold)  # no undo for a step that never happened
    trip.undo(1)
    final = trip.decide()
    assert isinstance(final, Finish)
    assert final.state is FinalState.COMPENSATED
    assert ("book_hotel by cancel_hotel_booking" in final.summary) is (proven is Outcome.DONE)


def test_with_on_unknown_wait_a_saga_holds_on_an_unknown_step() -> None:
    trip = Trip()
    trip.run(trip.place("hold_flight"))
    trip.run(trip.place("book_hotel"), Outcome.UNKNOWN)
    assert isinstance(trip.decide(), Hold)


def test_an_undo_that_cannot_be_done_needs_attention() -> None:
    trip = undoing("hold_flight", "book_hotel")
    trip.undo(2, Outcome.NOT_DONE)
    move = trip.decide()
    assert isinstance(move, Finish)
    assert move.state is FinalState.NEEDS_ATTENTION
    assert "the undo of step trip-7:2 (cancel_hotel_booking) could not be done" in move.summary
    assert "waiting behind it: trip-7:1" in move.summary


def test_an_undo_proven_to_have_done_nothing_is_sent_again_under_the_next_key() -> None:
    # The hotel's cancellation got a 500 the provider saved: every retry with its key gets the
    # same 500. A lookup past the provider's bound proves it did nothing, so the undo is
    # intended again under a successor key, and the saga unwinds instead of stopping.
    trip = undoing("hold_flight", "book_hotel")
    trip.undo_proven_absent(2)
    move = trip.decide()
    assert move == Compensate(((2, "cancel_hotel_booking", {"ref": "ref-2"}, 2),), move.why)
    trip.compensate(move)
    trip.compensate(move)  # a zombie decider's copy: the first under each key is the undo
    step = trip.state().steps[2]
    assert step.compensation is not None
    assert step.compensation.key == "trip-7:2:undo2"
    assert [p.plan.key for p in step.past_undos] == ["trip-7:2:undo"]
    [undo] = [e for e in effects_to_work(trip.state(), trip.s.now) if e.undo]
    assert (undo.key, undo.generation, undo.state.attempts) == ("trip-7:2:undo2", 2, ())
    assert isinstance(trip.decide(), Hold)
    trip.undo(2)
    trip.undo(1)
    final = trip.decide()
    assert isinstance(final, Finish)
    assert final.state is FinalState.COMPENSATED, final


def test_an_undo_gets_at_most_its_keys_then_needs_attention() -> None:
    trip = undoing("hold_flight")
    for generation in range(2, UNDO_KEYS_MAX + 1):
        trip.undo_proven_absent(1)
        move = trip.decide()
        assert isinstance(move, Compensate)
        assert move.undos[0][3] == generation
        trip.compensate(move)
    trip.undo_proven_absent(1)
    move = trip.decide()
    assert isinstance(move, Finish)
    assert move.state is FinalState.NEEDS_ATTENTION
    keys = ", ".join(["trip-7:1:undo"] + [f"trip-7:1:undo{g}" for g in range(2, UNDO_KEYS_MAX + 1)])
    assert (f"the undo of step trip-7:1 (release_flight_hold) could not be done under any of "
            f"its keys ({keys}) (nothing found past the provider's bound)") in move.summary


def test_a_successor_undo_key_is_taken_only_after_a_lookup_proved_the_last_did_nothing() -> None:
    trip = undoing("hold_flight")
    # Unknown is not proof, and neither is the provider's refusal: no second key.
    trip.log.append(trip.s.undo_attempted(1, 1))
    trip.log.append(trip.s.undo_settled(1, Outcome.UNKNOWN, attempt=1))
    early = trip.s.undo_intended(1, "release_flight_hold", generation=2)
    trip.log.append(early)
    state = trip.state()
    assert state.steps[1].undo_generation == 1
    assert [n.event for n in state.not_accepted] == [early]
    trip.log.append(trip.s.undo_settled(1, Outcome.NOT_DONE, attempt=1))  # refused (call)
    assert isinstance(trip.decide(), Finish)
    assert trip.state().steps[1].undo_generation == 1


def test_news_of_an_undo_key_never_intended_is_not_applied() -> None:
    # Only a forger (or a bug) writes about :undo2 before it is intended: it must not settle
    # the undo under its first key, nor let a successor in.
    trip = undoing("hold_flight")
    trip.log.append(trip.s.undo_attempted(1, 1))
    trip.log.append(trip.s.undo_settled(1, Outcome.UNKNOWN, attempt=1))
    forged = [trip.s.undo_attempted(1, 2, generation=2),
              trip.s.undo_settled(1, Outcome.NOT_DONE, attempt=1, generation=2,
                                  source=SettlementSource.LOOKUP, reason="nothing found")]
    trip.log += forged
    state = trip.state()
    step = state.steps[1]
    assert step.undo.outcome is Outcome.UNKNOWN
    assert [a.attempt for a in step.undo.attempts] == [1]
    assert not saga.successor_due(step)
    assert [a.split(":")[0] for a in state.anomalies] == [
        f"{e.type} {e.event_id}" for e in forged]


@pytest.mark.parametrize("verdict", [
    {"source": SettlementSource.CALL, "attempt": 1},  # the provider refused it
    {"source": SettlementSource.LOOKUP, "attempt": None, "effect_id": "rel_1"},  # its record
    {"source": SettlementSource.LOOKUP, "attempt": None},  # failed, an unnamed record
    {"source": SettlementSource.OPERATOR, "attempt": None},  # a person's word
])
def test_an_undo_not_done_for_any_other_reason_than_a_proof_of_absence_is_not_sent_again(
        verdict: dict[str, Any]) -> None:
    trip = undoing("hold_flight")
    trip.log.append(trip.s.undo_attempted(1, 1))
    trip.log.append(trip.s.undo_settled(1, Outcome.NOT_DONE, **verdict))
    move = trip.decide()
    assert isinstance(move, Finish)
    assert move.state is FinalState.NEEDS_ATTENTION
    assert trip.state().steps[1].undo_keys == ("trip-7:1:undo",)


def test_a_late_report_that_an_earlier_undo_key_did_happen_needs_a_person() -> None:
    # Proven absent, sent again under :undo2, and then the provider reports the first after
    # all: the undo may have happened twice. Kept on that key's undo, never on the latest.
    trip = undoing("hold_flight")
    trip.undo_proven_absent(1)
    trip.compensate(trip.decide())
    trip.undo(1)
    trip.log.append(trip.s.undo_settled(1, Outcome.DONE, source=SettlementSource.WEBHOOK,
                                        generation=1, evidence={"ref": "rel-1"}))
    state = trip.state()
    step = state.steps[1]
    assert step.undo.outcome is Outcome.DONE
    assert not step.undo.needs_attention
    assert step.past_undos[0].state.contradicted
    assert state.needs_attention
    move = trip.decide()
    assert isinstance(move, Finish)
    assert move.state is FinalState.NEEDS_ATTENTION
    assert "under trip-7:1:undo, proven not done before trip-7:1:undo2 was sent" in move.summary


def test_past_the_pivot_a_saga_only_goes_forward() -> None:
    trip = Trip()
    trip.run(trip.place("hold_flight"))
    trip.run(trip.place("charge_customer"))
    trip.run(trip.place("send_email"), Outcome.NOT_DONE)
    assert saga.failure(trip.state(), trip.s.now) is None
    assert isinstance(trip.decide(), Ask)


STRANDED = ("this saga is past its pivot (trip-7:2 charge_customer is done and cannot be "
            "undone), so what is done stands: an operator must finish it")


def test_a_saga_that_cannot_go_forward_past_its_pivot_needs_attention_never_fails() -> None:
    # The charge is done, the itinerary was refused for good, and the model ends the task:
    # "failed" would read as "nothing happened, safe to try again", with the card charged.
    trip = Trip()
    trip.run(trip.place("hold_flight"))
    trip.run(trip.place("charge_customer"))
    trip.run(trip.place("send_email"), Outcome.NOT_DONE)
    end = finish_for(trip.state(), "trip booked")
    assert end.state is FinalState.NEEDS_ATTENTION
    assert end.summary == ("step trip-7:3 (send_email) was not done: refused: card declined; "
                           f"{STRANDED} (the model said: trip booked)")
    # Once the email goes out on a later step, the saga succeeds.
    trip.run(trip.place("send_email"))
    assert finish_for(trip.state(), "trip booked") == Finish(FinalState.SUCCEEDED, "trip booked")


def test_a_saga_called_off_or_given_up_past_its_pivot_needs_attention() -> None:
    trip = Trip(TaskPolicy(saga=True, max_steps=2))
    trip.run(trip.place("hold_flight"))
    trip.run(trip.place("charge_customer"))
    assert trip.decide() == Finish(FinalState.NEEDS_ATTENTION,
                                   f"reached the limit of 2 steps; {STRANDED}")
    trip.log.append(trip.s.aborted("the customer cancelled"))
    assert trip.decide() == Finish(FinalState.NEEDS_ATTENTION,
                                   f"aborted by operator: the customer cancelled; {STRANDED}")
    # Before the pivot nothing is stranded: a saga is undone (or had nothing to undo).
    early = Trip()
    early.run(early.place("hold_flight"), Outcome.NOT_DONE)
    assert early.decide() == Finish(FinalState.FAILED, "step trip-7:1 (hold_flight) was not "
                                    "done: refused: card declined; nothing was done, so nothing "
                                    "needed undoing")


def test_an_aborted_saga_calls_off_its_unsent_step_and_undoes_the_rest() -> None:
    trip = Trip()
    trip.run(trip.place("hold_flight"))
    hotel = trip.place("book_hotel")
    trip.log.append(trip.s.aborted("the customer cancelled"))
    effects = {e.move_id: e for e in effects_to_work(trip.state(), trip.s.now)}
    assert effects["trip-7:2"].called_off == (
        "the task was called off before this step was sent: the customer cancelled")
    trip.settle(hotel, Outcome.NOT_DONE, reason=effects["trip-7:2"].called_off)
    move = trip.decide()
    assert isinstance(move, Compensate)
    assert move.why == "aborted by operator: the customer cancelled"


def test_undos_and_steps_past_the_pivot_must_happen_the_rest_may_end_not_done() -> None:
    trip = Trip()
    trip.run(trip.place("hold_flight"))
    trip.run(trip.place("charge_customer"))
    trip.place("send_email")
    must = {e.move_id: e.must_happen for e in effects_to_work(trip.state(), trip.s.now)}
    assert must == {"trip-7:1": False, "trip-7:2": False, "trip-7:3": True}
    undoing = Trip()
    undoing.run(undoing.place("hold_flight"))
    undoing.run(undoing.place("book_hotel"), Outcome.NOT_DONE)
    move = undoing.decide()
    assert isinstance(move, Compensate)
    undoing.compensate(move)
    must = {e.move_id: e.must_happen for e in effects_to_work(undoing.state(), undoing.s.now)}
    assert must == {"trip-7:1": False, "trip-7:1:undo": True, "trip-7:2": False}
    # Outside a saga a step's role binds nothing: a first request that never left is not_done.
    plain = Stamper("plain-1")
    state = fold([plain.started(), plain.intended(1, saga_role=SagaRole.RETRIABLE)])
    assert [e.must_happen for e in effects_to_work(state, plain.now)] == [False]


def test_an_undo_whose_arguments_cannot_be_derived_needs_attention() -> None:
    trip = Trip()
    trip.run(trip.place("hold_flight"))
    trip.log[-1] = trip.s.settled(1, Outcome.DONE, attempt=1, evidence={"other": 1})
    trip.run(trip.place("charge_customer"), Outcome.NOT_DONE)
    move = trip.decide()
    assert isinstance(move, Finish)
    assert move.state is FinalState.NEEDS_ATTENTION
    assert "the step's result has no 'ref'" in move.summary


def test_undo_args_fill_in_args_and_result() -> None:
    plan = CompensationPlan(tool="t", args={"a": "$args.invoice", "b": "$result.id", "c": 3})
    assert saga.undo_args(plan, {"invoice": "I-1"}, {"id": "x"}) == {"a": "I-1", "b": "x", "c": 3}
    assert "names no known source" in str(saga.undo_args(
        CompensationPlan(tool="t", args={"a": "$nope.x"}), {}, {}))


# -- a property: whatever happens, undos run last first, once, and only for done steps ---------


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from([Outcome.DONE, Outcome.NOT_DONE, Outcome.UNKNOWN]),
                min_size=1, max_size=4),
       st.lists(st.sampled_from([Outcome.DONE, Outcome.NOT_DONE]), min_size=4, max_size=4),
       st.randoms(use_true_random=False))
def test_undos_happen_last_first_once_and_only_for_done_steps(
        outcomes: list[Outcome], proofs: list[Outcome], rng: Any) -> None:
    """Whatever is proven in whatever order, with redelivered records, a zombie decider
    writing undos twice, and undos whose key a provider poisoned with a saved 5xx (proven
    absent, then sent again under the next key): each done step is undone once, last first,
    and nothing else; or, once a step's keys are used up, the saga needs a person."""
    trip = Trip(TaskPolicy(saga=True, on_unknown=OnUnknown.COMPENSATE))
    for i, outcome in enumerate(outcomes):
        n = trip.place("hold_flight" if i % 2 == 0 else "book_hotel")
        trip.run(n, outcome)
        if outcome is not Outcome.DONE:
            break
    else:
        trip.log.append(trip.s.aborted())  # all went well: a caller calls it off
    undone: list[int] = []
    for _ in range(50):  # every loop moves something; a bound all the same
        move = trip.decide()
        if isinstance(move, Finish):
            break
        if isinstance(move, Compensate):
            trip.compensate(move)
            if rng.random() < 0.3:
                trip.compensate(move)  # a zombie decider writes the same undos again
            continue
        if trip.log and rng.random() < 0.3:
            trip.log.append(rng.choice(trip.log))  # a redelivered record
        state = trip.state()
        unknown = [s for s in state.steps.values() if s.outcome is Outcome.UNKNOWN]
        ready = [e for e in effects_to_work(state, trip.s.now)
                 if e.undo and e.state.outcome is None]
        choices = [("prove", s.n) for s in unknown]
        choices += [("undo", int(e.step_id.split(":")[1])) for e in ready]
        assert choices, f"stuck: {move}"
        what, n = rng.choice(choices)
        if what == "prove":
            trip.settle(n, proofs[n - 1], source=SettlementSource.LOOKUP)
        elif rng.random() < 0.25:
            trip.undo_proven_absent(n)  # did nothing; its next key, if one is left
        else:
            trip.undo(n)
            undone.append(n)
    else:
        pytest.fail("the saga never finished")
    state = trip.state()
    done = sorted((s.n for s in state.steps.values() if s.outcome is Outcome.DONE), reverse=True)
    if move.state is FinalState.NEEDS_ATTENTION:  # a step's keys were all proven absent
        stuck = [s for s in state.steps.values()
                 if s.undo_generation == UNDO_KEYS_MAX and s.undo.outcome is Outcome.NOT_DONE]
        assert len(stuck) == 1, move
        assert "under any of its keys" in move.summary, move
        assert undone == [n for n in done if n > stuck[0].n]
        return
    assert undone == done  # every done step undone once, last first, and nothing else
    for step in state.steps.values():  # under one key each, the undos before it did nothing
        assert all(p.state.outcome is Outcome.NOT_DONE for p in step.past_undos)
    assert move.state is (FinalState.COMPENSATED if done else FinalState.FAILED)
