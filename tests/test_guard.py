"""The subject guard, pure: verdicts from log order, releases, once per subject, stale claims."""

from __future__ import annotations

import itertools
import uuid
from datetime import UTC, datetime

from hypothesis import given, settings
from hypothesis import strategies as st

from halfway.contract import Outcome
from halfway.contract.guards import Release, SubjectClaimed, SubjectReleased
from halfway.core.fold import fold
from halfway.core.guard import Blocked, Granted, GuardBook, stale_claims
from tests.factories import Stamper

AT = datetime(2026, 12, 2, tzinfo=UTC)
SUBJECT = "invoice:INV-2291"


def claim(step: str, *, tool: str = "charge_customer", subject: str = SUBJECT,
          once: bool = False) -> SubjectClaimed:
    return SubjectClaimed(event_id=uuid.uuid4().hex, at=AT, subject=subject, tool=tool,
                          step_id=step, task_id=step.rsplit(":", 1)[0], once_per_subject=once)


def release(c: SubjectClaimed, how: Release) -> SubjectReleased:
    return SubjectReleased(event_id=uuid.uuid4().hex, at=AT, subject=c.subject, tool=c.tool,
                           step_id=c.step_id, task_id=c.task_id, release=how)


def test_the_first_claim_in_the_log_holds_the_subject_and_the_model_reads_why() -> None:
    book = GuardBook()
    first, second = claim("renewal-8812:3"), claim("renewal-9000:1")
    assert book.apply(first) == Granted()
    assert book.apply(second) == Blocked(
        "blocked: renewal-8812:3 on invoice:INV-2291 is still unknown (not settled yet); "
        "charge_customer waits until it is")
    assert book.apply(claim("renewal-8812:3")) == Granted()  # the holder asking again
    assert book.apply(claim("renewal-9000:1", tool="send_email")) == Granted()  # another tool
    assert book.apply(claim("renewal-9000:1", subject="invoice:INV-1")) == Granted()


def test_a_release_frees_the_subject_unless_it_was_done_once_per_subject() -> None:
    book = GuardBook()
    a = claim("a:1")
    book.apply(a)
    book.apply(release(claim("b:1"), Release.NOT_DONE))  # not the holder: nothing changes
    assert isinstance(book.apply(claim("c:1")), Blocked)
    book.apply(release(a, Release.DONE))
    assert book.apply(claim("c:1")) == Granted()  # not once-per-subject: free again

    once = GuardBook()
    x = claim("x:1", once=True)
    once.apply(x)
    once.apply(release(x, Release.DONE))
    assert once.apply(claim("y:1", once=True)) == Blocked(
        "blocked: x:1 already did charge_customer on invoice:INV-2291; charge_customer "
        "happens once per subject")
    y = claim("y:2", once=True)
    other = GuardBook()
    other.apply(y)
    other.apply(release(y, Release.NOT_DONE))  # it never happened: free
    assert other.apply(claim("z:1", once=True)) == Granted()


def test_held_by_lists_a_tasks_live_claims() -> None:
    book = GuardBook()
    a = claim("a:1")
    book.apply(a)
    assert list(book.held_by("a")) == ["a:1"]
    book.apply(release(a, Release.ABANDONED))
    assert book.held_by("a") == {}


def test_stale_claims_follow_the_tasks_journal() -> None:
    s = Stamper("a")
    c1, c2, c3 = claim("a:1"), claim("a:2"), claim("a:3")
    state = fold([s.started(), s.intended(1), s.attempted(1, 1),
                  s.settled(1, Outcome.DONE, attempt=1),
                  s.intended(2, subject="invoice:OTHER")])
    # Step 1 is done; step 2 became a step on another subject; step 3 is being placed.
    assert stale_claims([c1, c2, c3], state, placing={3}) == [
        (c1, Release.DONE), (c2, Release.ABANDONED)]
    # Not being placed any more (a crash between claim and decision): abandoned.
    assert (c3, Release.ABANDONED) in stale_claims([c3], state, placing=set())
    unknown = fold([s.started(), s.intended(1), s.attempted(1, 1),
                    s.settled(1, Outcome.UNKNOWN, attempt=1)])
    assert stale_claims([c1], unknown, placing=set()) == []  # unknown keeps its claim


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["claim", "done", "not_done", "abandon"]),
                          st.integers(0, 4), st.booleans()), max_size=40))
def test_never_two_holders_and_a_once_done_subject_is_never_granted_again(
        script: list[tuple[str, int, bool]]) -> None:
    """Claims and releases of five tasks, interleaved in any order, with redeliveries."""
    book = GuardBook()
    holder: str | None = None
    done_once = False
    seq = itertools.count(1)
    claims: dict[int, SubjectClaimed] = {}
    for what, task, redeliver in script:
        if what == "claim":
            c = claim(f"t{task}:{next(seq)}", once=True)
            verdict = book.apply(c)
            if redeliver:
                assert book.apply(c) == verdict  # a redelivered claim gets the same answer
            if verdict == Granted():
                assert holder is None
                assert not done_once
                holder, claims[task] = c.step_id, c
        elif task in claims:
            c = claims.pop(task)
            how = {"done": Release.DONE, "not_done": Release.NOT_DONE,
                   "abandon": Release.ABANDONED}[what]
            book.apply(release(c, how))
            if redeliver:
                book.apply(release(c, how))
            if holder == c.step_id:
                holder = None
                done_once = done_once or how is Release.DONE
