"""The subject guard, pure: verdicts from log order, releases, once per subject, stale claims."""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from halfway.contract import ClaimWithdrawn, Outcome
from halfway.contract.guards import Release, SubjectClaimed, SubjectReleased
from halfway.core.fold import TaskState, fold
from halfway.core.guard import Blocked, Granted, GuardBook, Withdraw, guard_moves
from halfway.core.guard import Release as GuardRelease
from tests.factories import Stamper

AT = datetime(2026, 12, 2, tzinfo=UTC)
SUBJECT = "invoice:INV-2291"


def claim(step: str, *, tool: str = "charge_customer", subject: str = SUBJECT,
          once: bool = False) -> SubjectClaimed:
    return SubjectClaimed(event_id=uuid.uuid4().hex, at=AT, subject=subject, tool=tool,
                          step_id=step, task_id=step.rsplit(":", 1)[0], once_per_subject=once)


def release(c: SubjectClaimed, how: Release) -> SubjectReleased:
    return SubjectReleased(event_id=uuid.uuid4().hex, at=AT, subject=c.subject, tool=c.tool,
                           step_id=c.step_id, task_id=c.task_id, release=how,
                           claim_id=c.event_id)


def test_the_first_claim_in_the_log_holds_the_subject_and_the_model_reads_why() -> None:
    book = GuardBook()
    first, second = claim("renewal-8812:3"), claim("renewal-9000:1")
    assert book.apply(first) == Granted()
    assert book.apply(second) == Blocked(
        "blocked: renewal-8812:3 on invoice:INV-2291 is not settled yet (intended, in flight or "
        "unknown); "
        "charge_customer waits until it is", holder="renewal-8812:3")
    assert book.apply(first) == Granted()  # the same record, read again
    # Another claim of the holder's own step is not the same claim: one step, one live claim.
    again = book.apply(claim("renewal-8812:3"))
    assert isinstance(again, Blocked)
    assert again.own
    assert book.apply(claim("renewal-9000:1", tool="send_email")) == Granted()  # another tool
    assert book.apply(claim("renewal-9000:1", subject="invoice:INV-1")) == Granted()
    assert book.holder_of("charge_customer", SUBJECT) == first


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


def test_the_book_holds_subjects_held_or_done_once_not_every_subject_ever_claimed() -> None:
    book = GuardBook()
    for i in range(1000):
        c = claim(f"t-{i}:1", subject=f"invoice:INV-{i}")
        assert book.apply(c) == Granted()
        book.apply(release(c, Release.DONE if i % 2 else Release.NOT_DONE))
    book.apply(release(claim("stray:1", subject="invoice:never-claimed"), Release.DONE))
    once = claim("o:1", subject="invoice:ONCE", once=True)
    book.apply(once)
    book.apply(release(once, Release.DONE))
    held = claim("h:1", subject="invoice:HELD")
    book.apply(held)
    assert set(book._subjects) == {("charge_customer", "invoice:ONCE"),
                                   ("charge_customer", "invoice:HELD")}
    assert book.apply(claim("t-999:2", subject="invoice:INV-999")) == Granted()  # free still
    assert isinstance(book.apply(claim("p:1", subject="invoice:ONCE", once=True)), Blocked)


def test_a_late_release_of_an_older_claim_never_frees_a_newer_one() -> None:
    book = GuardBook()
    old = claim("a:1")
    book.apply(old)
    book.apply(release(old, Release.ABANDONED))
    new = claim("a:1")  # the same step claims again, after its old claim was withdrawn
    assert book.apply(new) == Granted()
    book.apply(release(old, Release.ABANDONED))  # a paused decider's copy, written late
    assert book.holder_of("charge_customer", SUBJECT) == new
    assert isinstance(book.apply(claim("b:1")), Blocked)


def test_held_by_lists_a_tasks_live_claims() -> None:
    book = GuardBook()
    a = claim("a:1")
    book.apply(a)
    assert list(book.held_by("a")) == ["a:1"]
    assert set(book.holders()) == {"a"}
    book.apply(release(a, Release.ABANDONED))
    assert book.held_by("a") == {}
    assert set(book.holders()) == set()


def test_guard_moves_follow_the_tasks_journal() -> None:
    s = Stamper("a")
    c1, c2, c3 = claim("a:1"), claim("a:2"), claim("a:3")
    state = fold([s.started(), s.intended(1, claim_id=c1.event_id), s.attempted(1, 1),
                  s.settled(1, Outcome.DONE, attempt=1),
                  s.intended(2, subject="invoice:OTHER")])
    # Step 1 is done; step 2 became a step on another claim; step 3 is being placed.
    assert guard_moves([c1, c2, c3], state, placing={3}) == [
        GuardRelease(c1, Release.DONE),
        Withdraw((c2,), "another proposal became the step")]
    # Not being placed any more (a crash between claim and decision): withdrawn first...
    (move,) = guard_moves([c3], state, placing=set())
    assert isinstance(move, Withdraw)
    assert move.claims == (c3,)
    # ...and released once the journal accepted the withdrawal.
    withdrawn = fold([*events_of(s, state), withdrawal(s, 3, c3)])
    assert guard_moves([c3], withdrawn, placing=set()) == [
        GuardRelease(c3, Release.ABANDONED)]
    unknown = fold([s.started(), s.intended(1, claim_id=c1.event_id), s.attempted(1, 1),
                    s.settled(1, Outcome.UNKNOWN, attempt=1)])
    assert guard_moves([c1], unknown, placing=set()) == []  # unknown keeps its claim


def test_a_fold_behind_the_claimer_leaves_the_claim_alone() -> None:
    """A process that slept while its partitions moved wakes with a fold that lacks what the
    claimer had read: it must not call the claim abandoned (the step may be placed on it)."""
    s = Stamper("a")
    c1, c3 = claim("a:1"), claim("a:3")
    assert guard_moves([c1], fold([], "a"), placing=set()) == []  # not even started here
    (move,) = guard_moves([c1], fold([s.requested(), s.rejected()]), placing=set())
    assert isinstance(move, Withdraw)  # a rejected task places nothing: its claim is let go
    one_step = fold([s.started(), s.intended(1, claim_id=c1.event_id)])
    assert guard_moves([c3], one_step, placing=set()) == []  # step 2 unseen: behind
    two_steps = fold([*events_of(s, one_step), s.intended(2, subject="invoice:OTHER")])
    (move,) = guard_moves([c3], two_steps, placing=set())
    assert isinstance(move, Withdraw)
    assert move.claims == (c3,)


def test_a_step_placed_on_a_withdrawn_claim_is_never_accepted() -> None:
    """The frozen decider: its claim was withdrawn while it slept; its late decision loses."""
    s = Stamper("x")
    c = claim("x:1")
    state = fold([s.started(), withdrawal(s, 1, c), s.intended(1, claim_id=c.event_id)])
    assert state.steps == {}
    (refused,) = state.not_accepted
    assert refused.event.claim_id == c.event_id
    assert "withdrawn earlier in the log" in refused.reason
    # A withdrawal that comes after the step it names is void: the step keeps its claim.
    placed = fold([s.started(), s.intended(1, claim_id=c.event_id), withdrawal(s, 1, c)])
    assert 1 in placed.steps
    assert c.event_id not in placed.withdrawn_claims
    assert guard_moves([c], placed, placing=set()) == []


def events_of(s: Stamper, state: object) -> list[Any]:
    """The events a test folded so far, rebuilt (the fold keeps the decisions it needs)."""
    assert isinstance(state, TaskState)
    out: list[Any] = []
    if state.started is not None:
        out.append(state.started)
    for step in state.steps.values():
        out.append(step.intent)
        out.extend(step.effect.attempts)
        if step.effect.settlement is not None:
            out.append(step.effect.settlement)
    return out


def withdrawal(s: Stamper, n: int, *claims: SubjectClaimed) -> ClaimWithdrawn:
    first = claims[0]
    return ClaimWithdrawn(**s.stamp(), step_id=f"{s.task_id}:{n}", subject=first.subject,
                          tool=first.tool, claim_ids=[c.event_id for c in claims],
                          reason="the claim never became a step")


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


# --- the whole protocol, with paused deciders writing late -----------------------------------


@dataclass
class World:
    """The guards log and each task's journal, folded as every reader folds them. Tasks 0..2
    each want to charge one invoice once (step 1). Any number of deciders act for a task: the
    one that owns it now, and paused ones that wake up and write what they decided before."""

    book: GuardBook = field(default_factory=GuardBook)
    journals: dict[int, list[Any]] = field(default_factory=dict)
    stampers: dict[int, Stamper] = field(default_factory=dict)
    # Claims a decider saw granted and may still place a step on, whenever it wakes up.
    granted: list[SubjectClaimed] = field(default_factory=list)
    # Releases a decider computed and may write again late (a paused decider's copy).
    written_releases: list[SubjectReleased] = field(default_factory=list)

    def stamper(self, task: int) -> Stamper:
        if task not in self.stampers:
            self.stampers[task] = Stamper(f"t{task}")
            self.journals[task] = [self.stampers[task].started()]
        return self.stampers[task]

    def state(self, task: int) -> TaskState:
        self.stamper(task)
        return fold(self.journals[task])

    def append_guard(self, record: SubjectClaimed | SubjectReleased) -> Any:
        return self.book.apply(record)

    def effects(self) -> list[str]:
        """Steps the executor runs (every accepted step) that did, or may have, charged."""
        out = []
        for task in self.journals:
            step = self.state(task).step(1)
            if step is not None and step.outcome is not Outcome.NOT_DONE:
                out.append(step.step_id)
        return out


@settings(max_examples=1000, deadline=None)
@given(st.lists(st.tuples(
    st.sampled_from(["claim", "place", "owner", "done", "not_done", "late_release",
                     "redeliver"]),
    st.integers(0, 1), st.integers(0, 3)), max_size=40))
def test_no_write_of_a_paused_decider_ever_causes_a_second_effect(
        script: list[tuple[str, int, int]]) -> None:
    """Claims, late placements by paused deciders, withdrawals and releases by owners,
    settlements, stale releases written again and redelivered records, in any order: at most
    one task's charge of the invoice ever happens (done, or in flight and maybe done)."""
    w = World()
    for what, task, pick in script:
        s = w.stamper(task)
        sid = f"t{task}:1"
        match what:
            case "claim":  # a decider (owner or not) asks the guard for the invoice
                c = claim(sid, once=True)
                if w.append_guard(c) == Granted():
                    w.granted.append(c)
            case "place":  # a decider that saw a grant writes its step, however late
                mine = [c for c in w.granted if c.task_id == f"t{task}"]
                if mine:
                    c = mine[pick % len(mine)]
                    w.journals[task].append(s.intended(1, claim_id=c.event_id))
            case "owner":  # the task's owner now: withdraw, then release, what is stale
                state = w.state(task)
                for move in guard_moves(w.book.held_by(f"t{task}").values(), state, set()):
                    if isinstance(move, Withdraw):
                        w.journals[task].append(withdrawal(s, 1, *move.claims))
                    else:
                        r = release(move.claim, move.release)
                        w.written_releases.append(r)
                        w.append_guard(r)
            case "done" | "not_done":  # the executor and reconciler settle an accepted step
                step = w.state(task).step(1)
                if step is not None and step.outcome is None:
                    w.journals[task].append(s.settled(1, Outcome(what), attempt=None))
            case "late_release" if w.written_releases:  # a paused decider's copy, written late
                old = w.written_releases[pick % len(w.written_releases)]
                w.append_guard(old.model_copy(update={"event_id": uuid.uuid4().hex}))
            case "redeliver" if w.journals.get(task):  # a record delivered twice
                journal = w.journals[task]
                journal.append(journal[pick % len(journal)])
            case _:
                pass
        effects = w.effects()
        assert len(effects) <= 1, f"two charges of one invoice: {effects}"


def test_a_once_per_subject_mark_costs_a_few_hundred_bytes() -> None:
    """Marks are kept for good (an invoice is paid once, ever), so each is its step id alone:
    a whole claim kept was 1.5 KB a mark, a quarter GB per decider after 150,000 invoices."""
    import tracemalloc

    book, now, marks = GuardBook(), datetime.now(UTC), 2_000
    tracemalloc.start()
    try:
        for i in range(marks):  # each record read, applied and dropped, as from the topic
            claim = SubjectClaimed(event_id=uuid.uuid4().hex, at=now,
                                   subject=f"invoice:INV-{i:06}", tool="charge_customer",
                                   step_id=f"renewal-{i:06}:1", task_id=f"renewal-{i:06}",
                                   once_per_subject=True)
            book.apply(claim)
            book.apply(SubjectReleased(event_id=uuid.uuid4().hex, at=now, subject=claim.subject,
                                       tool=claim.tool, step_id=claim.step_id,
                                       task_id=claim.task_id, release=Release.DONE,
                                       claim_id=claim.event_id))
        kept, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert kept / marks < 600, kept / marks
    again = book.apply(SubjectClaimed(
        event_id=uuid.uuid4().hex, at=now, subject="invoice:INV-000007", tool="charge_customer",
        step_id="other-1:1", task_id="other-1", once_per_subject=True))
    assert isinstance(again, Blocked)
    assert again.reason.startswith("blocked: renewal-000007:1 already did charge_customer")
