"""classify: not_done needs proof; everything else that failed is unknown."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from halfway.contract import Outcome
from halfway.core.classify import (
    AMBIGUOUS_4XX,
    CallFailure,
    ConnectionLost,
    Crashed,
    NotSent,
    Replied,
    TimedOut,
    Unexpected,
    classify,
)


@pytest.mark.parametrize(
    ("failure", "attempt", "outcome", "words"),
    [
        (Replied(402, "card_declined", "Your card was declined."), 1, Outcome.NOT_DONE,
         "refused by the provider: HTTP 402 card_declined Your card was declined."),
        (Replied(400, "idempotency_error"), 2, Outcome.NOT_DONE, "HTTP 400"),
        (Replied(404), 1, Outcome.NOT_DONE, "HTTP 404"),
        (Replied(408), 1, Outcome.UNKNOWN, "request timeout"),
        (Replied(409), 1, Outcome.UNKNOWN, "still be in flight"),
        (Replied(425), 1, Outcome.UNKNOWN, "too early"),
        (Replied(429), 1, Outcome.UNKNOWN, "rate limited"),
        (Replied(500), 1, Outcome.UNKNOWN, "server error"),
        (Replied(503), 1, Outcome.UNKNOWN, "may have happened"),
        (Replied(302), 1, Outcome.UNKNOWN, "redirect"),
        (NotSent("connection refused"), 1, Outcome.NOT_DONE, "never reached the provider"),
        (NotSent("connection refused"), 2, Outcome.UNKNOWN, "an earlier attempt may have"),
        (TimedOut(5.0), 1, Outcome.UNKNOWN, "no reply within 5 s"),
        (ConnectionLost("reset by peer"), 1, Outcome.UNKNOWN, "after sending"),
        (Crashed(), 1, Outcome.UNKNOWN, "harness stopped"),
        (Unexpected("KeyError"), 1, Outcome.UNKNOWN, "KeyError"),
    ],
)
def test_classify(failure: CallFailure, attempt: int, outcome: Outcome, words: str) -> None:
    verdict = classify(failure, attempt=attempt)
    assert verdict.outcome is outcome
    assert words in verdict.reason


def test_a_2xx_is_not_a_failure() -> None:
    with pytest.raises(ValueError, match="not a failure"):
        classify(Replied(201))


failures = st.one_of(
    st.builds(Replied, st.integers(100, 599).filter(lambda s: not 200 <= s < 300),
              st.one_of(st.none(), st.text(max_size=10)), st.text(max_size=20)),
    st.builds(NotSent, st.text(max_size=20)),
    st.builds(TimedOut, st.floats(0.001, 600)),
    st.builds(ConnectionLost, st.text(max_size=20)),
    st.builds(Crashed, st.text(max_size=20)),
    st.builds(Unexpected, st.text(max_size=20)),
)


def has_proof_of_refusal(failure: CallFailure, attempt: int) -> bool:
    if isinstance(failure, Replied):
        return 400 <= failure.status < 500 and failure.status not in AMBIGUOUS_4XX
    return isinstance(failure, NotSent) and attempt == 1


@given(failures, st.integers(1, 10))
@settings(max_examples=1000)
def test_nothing_without_proof_of_refusal_is_ever_not_done(
    failure: CallFailure, attempt: int,
) -> None:
    verdict = classify(failure, attempt=attempt)
    assert verdict.outcome is not Outcome.DONE
    assert (verdict.outcome is Outcome.NOT_DONE) == has_proof_of_refusal(failure, attempt)
    assert verdict.reason


@given(failures, st.integers(1, 10))
@settings(max_examples=500)
def test_what_must_happen_ends_not_done_only_when_the_provider_refused(
    failure: CallFailure, attempt: int,
) -> None:
    # An undo, or a saga's step past its pivot: a request that never left is tried again.
    verdict = classify(failure, attempt=attempt, must_happen=True)
    refused = isinstance(failure, Replied) and has_proof_of_refusal(failure, attempt)
    assert (verdict.outcome is Outcome.NOT_DONE) == refused
    if isinstance(failure, NotSent) and attempt == 1:
        assert verdict.reason.endswith("it must happen, so it is tried again with its key")
