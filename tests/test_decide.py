"""decide and accept_call: the decider's pure rules, and the scripted model."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict, Field

from halfway.contract import (
    EffectClass,
    FinalState,
    Outcome,
    StepRefused,
    SubjectHeld,
    TaskPolicy,
    TaskRequested,
)
from halfway.core import fold
from halfway.core.decide import (
    ARGS_BYTES_MAX,
    BLOCKED_WAIT_S_MAX,
    MODEL_BACKOFF_S_BASE,
    MODEL_BACKOFF_S_MAX,
    MODEL_FAILURES_MAX,
    Abort,
    Ask,
    Finish,
    Hold,
    Idle,
    Refused,
    Reject,
    RetryAt,
    Start,
    ToolFacts,
    WaitFor,
    accept_call,
    decide,
    finish_for,
)
from halfway.models import ModelUnavailable, RefusalView, ScriptedModel, StepView, history_of
from tests.factories import Stamper

KNOWN = {"charge_customer"}


class Charge(BaseModel):
    model_config = ConfigDict(extra="forbid")
    invoice: str
    amount_cents: int = Field(gt=0, strict=True)


CHARGE = ToolFacts("charge_customer", Charge, EffectClass.KEYED,
                   lambda a: f"invoice:{a.invoice}")


@pytest.fixture
def s() -> Stamper:
    return Stamper("renewal-8812")


def test_a_request_is_started_or_rejected_once(s: Stamper) -> None:
    state = fold([s.requested()])
    assert decide(state, known_tools=KNOWN, requested=True, now=s.now) == Start()
    assert decide(state, known_tools=set(), requested=True, now=s.now) == Reject(
        "unknown tools: charge_customer")
    started = fold([s.requested(), s.started(), s.requested()])  # requested twice
    assert decide(started, known_tools=KNOWN, requested=True, now=s.now) == Ask(1)
    assert decide(fold([s.requested(), s.rejected()]), known_tools=KNOWN, requested=True,
                  now=s.now) == Idle()
    assert decide(fold([s.requested()]), known_tools=KNOWN, requested=False, now=s.now) == Idle()


def test_a_task_called_off_ends_failed_only_if_nothing_it_did_stands(s: Stamper) -> None:
    """Called off while its charge was in flight, and the charge landed: not "failed" (read
    as "nothing happened, safe to try again"), but a task a person must see."""
    landed = [s.started(), s.intended(1), s.attempted(1, 1), s.aborted("wrong customer"),
              s.settled(1, Outcome.DONE, attempt=1, evidence={"charge_id": "ch_1"})]
    move = decide(fold(landed), known_tools=KNOWN, requested=False, now=s.now)
    assert move == Finish(FinalState.NEEDS_ATTENTION,
                          "aborted by operator: wrong customer; done before it stopped, and not "
                          "undone (this task is not a saga): renewal-8812:1 (charge_customer)")
    refused = [*landed[:4], s.settled(1, Outcome.NOT_DONE, attempt=1)]
    assert decide(fold(refused), known_tools=KNOWN, requested=False, now=s.now) == Finish(
        FinalState.FAILED, "aborted by operator: wrong customer")

def test_a_task_called_off_before_it_started_is_rejected_never_started(s: Stamper) -> None:
    move = decide(fold([s.requested(), s.aborted("wrong customer")]), known_tools=KNOWN,
                  requested=True, now=s.now)
    assert move == Reject("called off before it started, by operator: wrong customer")

def test_a_rejection_names_at_most_a_few_unknown_tools_each_cut(s: Stamper) -> None:
    """A request listing thousands of long unknown names is rejected in a bounded reason (it
    is journaled for good): ten names at most, each cut."""
    names = [f"tool_{n:04}_" + "x" * 300 for n in range(2000)]
    request = TaskRequested(**s.stamp(), input={}, allowed_tools=names)
    move = decide(fold([request]), known_tools=KNOWN, requested=True, now=s.now)
    assert isinstance(move, Reject)
    assert move.reason.endswith(" and 1990 more")
    assert move.reason.startswith("unknown tools: tool_0000_xxx")
    assert len(move.reason) < 1000


@pytest.mark.parametrize("tail", ["intended", "in_flight", "unknown", "escalated"])
def test_an_unsettled_step_holds_the_task(s: Stamper, tail: str) -> None:
    log = [s.started(), s.intended(1)]
    if tail != "intended":
        log.append(s.attempted(1, 1))
    if tail in ("unknown", "escalated"):
        log.append(s.settled(1, Outcome.UNKNOWN, attempt=1))
    if tail == "escalated":
        log.append(s.checked(1, next_in=None))
    move = decide(fold(log), known_tools=KNOWN, requested=False, now=s.now)
    assert isinstance(move, Hold)
    assert "renewal-8812:1" in move.reason
    assert ("operator" in move.reason) == (tail == "escalated")


def test_settled_steps_let_the_model_decide_the_next_one(s: Stamper) -> None:
    for outcome in (Outcome.DONE, Outcome.NOT_DONE):
        log = [s.started(), s.intended(1), s.attempted(1, 1), s.settled(1, outcome, attempt=1)]
        assert decide(fold(log), known_tools=KNOWN, requested=False, now=s.now) == Ask(2)


def test_limits_finish_the_task(s: Stamper) -> None:
    one_step = [s.started(policy=TaskPolicy(max_steps=1)), s.intended(1), s.attempted(1, 1),
                s.settled(1, Outcome.DONE, attempt=1)]
    move = decide(fold(one_step), known_tools=KNOWN, requested=False, now=s.now)
    assert move == Finish(FinalState.FAILED, "reached the limit of 1 steps")
    late = [s.started(policy=TaskPolicy(deadline=s.now + timedelta(seconds=1)))]
    move = decide(fold(late), known_tools=KNOWN, requested=False, now=s.now + timedelta(hours=1))
    assert isinstance(move, Finish)
    assert "deadline" in move.summary


def test_final_state_follows_the_last_step(s: Stamper) -> None:
    base = [s.started(), s.intended(1), s.attempted(1, 1)]
    assert finish_for(fold([*base, s.settled(1, Outcome.DONE, attempt=1)]), "paid") \
        == Finish(FinalState.SUCCEEDED, "paid")
    assert finish_for(fold([*base, s.settled(1, Outcome.NOT_DONE, attempt=1)]), "declined") \
        == Finish(FinalState.FAILED, "declined")


def test_accept_call_mints_the_key_and_freezes_validated_args(s: Stamper) -> None:
    state = fold([s.started()])
    fields = accept_call(state, 1, CHARGE, "charge_customer",
                         {"invoice": "INV-2291", "amount_cents": 4900})
    assert not isinstance(fields, Refused)
    assert fields["key"] == "renewal-8812:1" == fields["step_id"]
    assert fields["subject"] == "invoice:INV-2291"
    assert fields["args"] == {"invoice": "INV-2291", "amount_cents": 4900}


@pytest.mark.parametrize(
    ("tool", "name", "args", "why"),
    [
        (CHARGE, "charge_customer", {"invoice": "INV-2291", "amount_cents": "49.00"},
         "amount_cents"),
        (CHARGE, "charge_customer", {"invoice": "INV-2291", "amount_cents": 4900, "key": "x"},
         "key"),
        (None, "wire_money", {}, "not allowed"),
        (None, "", {}, "'' (no name) is not allowed"),  # said so, not "refused:  is not"
    ],
)
def test_accept_call_refuses_with_a_reason_the_model_can_read(
    s: Stamper, tool: ToolFacts | None, name: str, args: dict, why: str,
) -> None:
    refused = accept_call(fold([s.started()]), 1, tool, name, args)
    assert isinstance(refused, Refused)
    assert refused.reason.startswith("refused:")
    assert why in refused.reason


def _boom(_args: Charge) -> str:
    raise KeyError("acct")


@pytest.mark.parametrize(("subject_of", "why"), [
    (lambda a: "invoice:" + "9" * 600, "608 characters; a subject has 1 to 500"),
    (lambda a: "", "0 characters"),
    (_boom, "no subject for charge_customer from these arguments (KeyError: 'acct')"),
])
def test_a_subject_the_arguments_cannot_make_is_refused_in_words(
        s: Stamper, subject_of: Any, why: str) -> None:
    """The subject is made from the model's arguments: one too long, empty or failing is the
    model's to mend (a refusal it reads), not a decision that can never be placed."""
    tool = ToolFacts("charge_customer", Charge, EffectClass.KEYED, subject_of)
    refused = accept_call(fold([s.started()]), 1, tool, "charge_customer",
                          {"invoice": "INV-2291", "amount_cents": 4900})
    assert isinstance(refused, Refused)
    assert why in refused.reason

async def test_the_scripted_model_answers_differently_when_asked_twice(tmp_path) -> None:
    s = Stamper("renewal-8812")
    started = s.started()
    started = started.model_copy(update={"input": {
        "script": [{"tool": "charge_customer", "args": {"amount_cents": 4900},
                    "reask_args": {"amount_cents": "49.00"}}], "summary": "renewed"}})
    state = fold([started])
    model = ScriptedModel(call_log=tmp_path / "calls.jsonl")
    first = await model.decide(history_of(state, 1, []))
    again = await ScriptedModel(call_log=tmp_path / "calls.jsonl").decide(history_of(state, 1, []))
    assert first.args == {"amount_cents": 4900}
    assert again.args == {"amount_cents": "49.00"}  # another process, same shared count
    finish = await model.decide(history_of(state, 2, []))
    assert finish.summary == "renewed"
    assert model.times_asked("renewal-8812", 1) == 2


async def test_the_scripted_model_remembers_the_newest_questions_only(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A long-running workflow asks about every step of every task: the count of questions
    is bounded (it held one entry per step ever asked)."""
    from halfway.models import scripted

    monkeypatch.setattr(scripted, "ASKED_KEPT", 50)
    model = ScriptedModel()
    script = {"script": [{"tool": "charge_customer", "args": {"amount_cents": 4900},
                          "reask_args": {"amount_cents": "49.00"}}]}
    for i in range(200):
        started = Stamper(f"t-{i}").started().model_copy(update={"input": script})
        answer = await model.decide(history_of(fold([started]), 1, []))
        assert answer.args == {"amount_cents": 4900}
    assert len(model._asked) == 50
    assert model.times_asked("t-199", 1) == 1
    assert model.times_asked("t-0", 1) == 0
    newest = Stamper("t-199").started().model_copy(update={"input": script})
    again = await model.decide(history_of(fold([newest]), 1, []))
    assert again.args == {"amount_cents": "49.00"}  # a re-ask is still told apart
    assert len(model._asked) == 50


def test_refused_proposals_are_shown_and_bounded(s: Stamper) -> None:
    log = [s.started(), s.refused(1, "refused: bad amount")]
    state = fold(log)
    assert decide(state, known_tools=KNOWN, requested=False, now=s.now) == Ask(1)
    assert history_of(state, 1, []).refusals == ["refused: bad amount"]
    log += [s.refused(1), s.refused(1, "refused: third time")]
    move = decide(fold(log), known_tools=KNOWN, requested=False, now=s.now)
    assert isinstance(move, Finish)
    assert move.state is FinalState.FAILED
    assert "refused 3 times" in move.summary
    assert "third time" in move.summary


def test_a_refusal_after_the_step_is_decided_changes_nothing(s: Stamper) -> None:
    log = [s.started(), s.intended(1)]
    assert fold([*log, s.refused(1)]) == fold(log)


async def test_told_of_a_refusal_the_scripted_model_corrects_itself(tmp_path) -> None:
    s = Stamper("renewal-8812")
    started = s.started().model_copy(update={"input": {
        "script": [{"tool": "charge_customer", "args": {"amount_cents": 4900},
                    "reask_args": {"amount_cents": "49.00"}}]}})
    model = ScriptedModel(call_log=tmp_path / "calls.jsonl")
    await model.decide(history_of(fold([started]), 1, []))  # the first answer, lost in a crash
    again = await model.decide(history_of(fold([started]), 1, []))
    assert again.args == {"amount_cents": "49.00"}
    corrected = await model.decide(history_of(fold([started, s.refused(1)]), 1, []))
    assert corrected.args == {"amount_cents": 4900}


def blocked_by(s: Stamper, holder: str = "other-1:1") -> StepRefused:
    return s.refused(1, reason=f"blocked: {holder} on invoice:INV-2291 is still unknown (not "
                     "settled yet); charge_customer waits until it is").model_copy(
        update={"blocked": SubjectHeld(subject="invoice:INV-2291", tool="charge_customer",
                                       holder=holder)})


def test_a_task_blocked_by_a_held_subject_waits_without_using_up_its_refusals(
        s: Stamper) -> None:
    log = [s.started(policy=TaskPolicy(deadline=s.now + timedelta(hours=1))),
           *[blocked_by(s) for _ in range(5)]]
    state = fold(log)
    held = log[-1].blocked
    waiting = decide(state, known_tools=KNOWN, requested=True, now=s.now,
                     still_held=lambda h: h == held)
    assert state.started is not None
    assert waiting == WaitFor(held, state.started.policy.deadline)
    # Released: the model is asked again, and reads that the harness waited.
    assert decide(state, known_tools=KNOWN, requested=True, now=s.now,
                  still_held=lambda h: False) == Ask(1)
    history = history_of(state, 1, [])
    assert "waited until other-1:1 released invoice:INV-2291" in history.refusals[-1]
    # The deadline bounds the wait.
    late = decide(state, known_tools=KNOWN, requested=True, now=s.now + timedelta(hours=2),
                  still_held=lambda h: True)
    assert isinstance(late, Finish)
    assert "while waiting for invoice:INV-2291, which other-1:1 still holds" in late.summary


def test_without_a_deadline_a_wait_is_bounded_too(s: Stamper) -> None:
    state = fold([s.started(), blocked_by(s)])
    wait = decide(state, known_tools=KNOWN, requested=True, now=s.now,
                  still_held=lambda h: True)
    assert isinstance(wait, WaitFor)
    assert wait.until == state.refusals[-1].at + timedelta(seconds=BLOCKED_WAIT_S_MAX)
    after = decide(state, known_tools=KNOWN, requested=True,
                   now=wait.until + timedelta(seconds=1), still_held=lambda h: True)
    assert isinstance(after, Finish)
    assert after.state is FinalState.FAILED


def test_a_once_per_subject_block_is_a_refusal_that_counts(s: Stamper) -> None:
    done = ("blocked: other-1:1 already did charge_customer on invoice:INV-2291; "
            "charge_customer happens once per subject")
    state = fold([s.started(), *[s.refused(1, reason=done) for _ in range(3)]])
    move = decide(state, known_tools=KNOWN, requested=True, now=s.now,
                  still_held=lambda h: True)
    assert isinstance(move, Finish)
    assert "refused 3 times" in move.summary


def test_oversized_arguments_are_refused_with_their_size(s: Stamper) -> None:
    state = fold([s.requested(), s.started()])
    refusal = accept_call(state, 1, CHARGE, "charge_customer",
                          {"invoice": "x" * (ARGS_BYTES_MAX + 1), "amount_cents": 4900})
    assert isinstance(refusal, Refused)
    assert f"at most {ARGS_BYTES_MAX} are accepted" in refusal.reason


# --- the model's failures --------------------------------------------------------------------


def test_a_transient_model_failure_is_asked_again_after_a_backoff(s: Stamper) -> None:
    failed = s.model_failed(1, retry_after_s=None)
    state = fold([s.started(), failed])
    move = decide(state, known_tools=KNOWN, requested=False, now=failed.at)
    assert isinstance(move, RetryAt)
    assert failed.at < move.at <= failed.at + timedelta(seconds=MODEL_BACKOFF_S_BASE)
    assert "429" in move.why
    assert decide(state, known_tools=KNOWN, requested=False, now=move.at) == Ask(1)


def test_the_backoff_grows_is_capped_and_honours_retry_after(s: Stamper) -> None:
    log = [s.started()]
    delays = []
    for _ in range(MODEL_FAILURES_MAX - 1):
        log.append(s.model_failed(1))
        move = decide(fold(log), known_tools=KNOWN, requested=False, now=log[-1].at)
        assert isinstance(move, RetryAt)
        delays.append((move.at - log[-1].at).total_seconds())
    assert delays == sorted(delays)
    assert max(delays) <= MODEL_BACKOFF_S_MAX
    slow = s.model_failed(2, retry_after_s=30.0)
    move = decide(fold([s.started(), s.intended(1), s.settled(1, Outcome.DONE), slow]),
                  known_tools=KNOWN, requested=False, now=slow.at)
    assert isinstance(move, RetryAt)
    assert move.at >= slow.at + timedelta(seconds=30)


def test_model_failures_are_bounded_then_need_attention(s: Stamper) -> None:
    log = [s.started(), *(s.model_failed(1) for _ in range(MODEL_FAILURES_MAX))]
    move = decide(fold(log), known_tools=KNOWN, requested=False, now=s.now)
    assert isinstance(move, Finish)
    assert move.state is FinalState.NEEDS_ATTENTION
    assert f"{MODEL_FAILURES_MAX} questions for step 1 failed" in move.summary


def test_a_permanent_model_failure_ends_the_task_at_once(s: Stamper) -> None:
    failed = s.model_failed(1, "HTTP 401 invalid_api_key: Incorrect API key", status=401,
                            transient=False)
    move = decide(fold([s.started(), failed]), known_tools=KNOWN, requested=False, now=s.now)
    assert isinstance(move, Finish)
    assert move.state is FinalState.FAILED
    assert "the model is unavailable: HTTP 401" in move.summary
    # In a saga before its pivot, the same reason calls the saga off (and undoes it).
    saga = s.started(policy=TaskPolicy(saga=True))
    move = decide(fold([saga, failed.model_copy(update={"event_id": "x"})]),
                  known_tools=KNOWN, requested=False, now=s.now)
    assert isinstance(move, Abort)


def test_failures_of_a_decided_step_change_nothing(s: Stamper) -> None:
    log = [s.started(), s.intended(1)]
    assert fold([*log, s.model_failed(1)]).model_failures == {}


async def test_the_scripted_model_refuses_a_task_without_a_script() -> None:
    s = Stamper("noscript-1")
    state = fold([s.started()])
    with pytest.raises(ModelUnavailable, match=r"input\.script") as raised:
        await ScriptedModel().decide(history_of(state, 1, []))
    assert raised.value.transient is False


def test_the_conversation_is_the_journal_in_order(s: Stamper) -> None:
    log = [s.started(), s.refused(1, "refused: bad amount"), s.intended(1),
           s.settled(1, Outcome.DONE), s.refused(2, "refused: no such tool"),
           s.refused(2, "refused: again")]
    history = history_of(fold(log), 2, [], instructions="be careful")
    kinds = [(type(t).__name__, t.n) for t in history.turns]
    assert kinds == [("RefusalView", 1), ("StepView", 1), ("RefusalView", 2),
                     ("RefusalView", 2)]
    step = history.turns[1]
    assert isinstance(step, StepView)
    assert step.step_id == "renewal-8812:1"
    assert step.line.startswith("done:")
    assert len({t.call_id for t in history.turns if isinstance(t, RefusalView)}) == 3
    assert history.instructions == "be careful"
