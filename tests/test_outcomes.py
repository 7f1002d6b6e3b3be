"""Outcomes: what users see change, derived from the journal, published, and followed.

The pure part (derive) is tested on hand-written logs and by a property over random ones; the
topic end to end with the real services as child processes, the outcomes publisher in this
process, and the client as a subscriber started before the task is requested.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import uuid
from collections import defaultdict
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from halfway.client import HalfwayClient, OutcomeStream
from halfway.contract import Event, FinalState, Outcome, SettlementSource
from halfway.contract.jsonschema import JSON_DIR
from halfway.contract.outcomes import OutcomeChanged, parse_outcome
from halfway.core.fold import TaskState, apply, fold
from halfway.journal import JournalWriter
from halfway.outcomes import Change, OutcomesPublisher, changes, messages, read_outcomes, visible
from halfway.settings import KafkaSettings
from tests.factories import Stamper

pytest.register_assert_rewrite("tests.processes")

from tests.processes import (  # noqa: E402
    Cluster,
    journal_now,
    renewal_request,
)

pytest_plugins = ["tests.processes"]

TASK = "renewal-8812"
STEP = f"{TASK}:1"


def states(log: list[Event], about: str) -> list[str]:
    return [m.state for m in messages(log, TASK) if m.about == about]


# --- derive: hand-written logs -------------------------------------------------------------------


def test_the_slow_charge_is_told_in_three_states() -> None:
    s = Stamper(TASK)
    log: list[Event] = [s.started(), s.intended(1), s.attempted(1, 1),
                        s.settled(1, Outcome.UNKNOWN, attempt=1, reason="no reply within 5 s")]
    first_check = s.checked(1, next_in=timedelta(seconds=2))
    second_check = s.checked(1, next_in=timedelta(seconds=4))
    done = s.settled(1, Outcome.DONE, source=SettlementSource.LOOKUP,
                     evidence={"charge_id": "ch_42"})
    log += [first_check, second_check, done, s.finished()]

    out = messages(log, TASK)

    step = [m for m in out if m.subject == "step"]
    # unknown -> unknown with a new next check time is a change: users see when it comes.
    assert [m.state for m in step] == ["intended", "in_flight", "unknown", "unknown", "unknown",
                                       "done"]
    assert [m.next_check_at for m in step[2:5]] == [None, first_check.next_check_at,
                                                    second_check.next_check_at]
    unknown = step[3]
    assert unknown.words.startswith("unknown, being checked: charge_customer invoice:INV-2291")
    assert "next check at" in unknown.words
    assert "do not start another one" in unknown.words
    assert unknown.reason == "no reply within 5 s"
    assert unknown.reference == STEP
    assert unknown.at == first_check.at  # the journal event that caused it, never the clock
    assert step[-1].words.startswith("done: ")
    assert step[-1].evidence == {"charge_id": "ch_42"}
    assert step[-1].at == done.at
    assert [m.message_id for m in step] == [f"{TASK}/{STEP}/{n}" for n in range(1, 7)]
    task = [m for m in out if m.subject == "task"]
    assert [(m.state, m.finished) for m in task] == [("running", False), ("succeeded", True)]
    assert [m.message_id for m in task] == [f"{TASK}/task/1", f"{TASK}/task/2"]
    assert messages(log, TASK) == out  # the same log, the same messages: ids are deterministic


def test_a_subscription_keeps_the_newest_subjects_and_drops_their_repeats(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Dedupe keeps one seq per subject, of the newest SUBJECTS_KEPT subjects: a subscriber to
    every task does not keep every subject ever seen."""
    from halfway import client

    monkeypatch.setattr(client, "SUBJECTS_KEPT", 10)
    stream = OutcomeStream(KafkaSettings(bootstrap="127.0.0.1:1", topic_prefix="dedupe.",
                                         replication_factor=1), None, from_beginning=True)
    tasks = [messages([Stamper(f"t-{i}").started()], f"t-{i}") for i in range(30)]
    for i, sent in enumerate(tasks):
        for message in sent:
            stream._take(message.model_dump_json().encode(), 0, i)
    delivered = len(stream._ready)
    assert delivered == sum(len(sent) for sent in tasks)
    assert len(stream._last_seq) == 10
    for message in tasks[-1]:
        stream._take(message.model_dump_json().encode(), 0, 99)  # a repeat of the newest
    assert len(stream._ready) == delivered


def test_redeliveries_and_ignored_duplicates_change_nothing() -> None:
    s = Stamper(TASK)
    settled = s.settled(1, Outcome.DONE, attempt=1)
    base = [s.started(), s.intended(1), s.attempted(1, 1), settled]
    zombie_intent = s.intended(1, args={"amount_cents": "49.00"})  # first decision wins
    late_unknown = s.settled(1, Outcome.UNKNOWN, attempt=1)  # never replaces done
    assert messages([*base, settled, zombie_intent, late_unknown], TASK) == messages(base, TASK)


def test_escalation_shows_on_the_step_and_the_task_until_an_operator_resolves_it() -> None:
    s = Stamper(TASK)
    log: list[Event] = [s.started(), s.intended(1), s.attempted(1, 1),
                        s.settled(1, Outcome.UNKNOWN, attempt=1), s.checked(1, next_in=None)]
    out = messages(log, TASK)
    assert "an operator must resolve it" in out[-2].words
    assert (out[-2].subject, out[-2].state, out[-2].next_check_at) == ("step", "unknown", None)
    assert (out[-1].subject, out[-1].state, out[-1].finished) == ("task", "needs_attention",
                                                                  False)
    assert STEP in out[-1].words

    log.append(s.settled(1, Outcome.DONE, source=SettlementSource.OPERATOR))
    after = messages(log, TASK)[len(out):]
    assert [(m.subject, m.state) for m in after] == [("step", "done"), ("task", "running")]


def test_a_call_off_is_news_for_subscribers_before_the_task_ends() -> None:
    s = Stamper(TASK)
    log: list[Event] = [s.started(), s.intended(1), s.attempted(1, 1)]
    before = messages(log, TASK)
    log.append(s.aborted("the customer cancelled", by="alice"))
    (called_off,) = messages(log, TASK)[len(before):]
    assert (called_off.subject, called_off.state, called_off.finished) == ("task", "running",
                                                                           False)
    assert called_off.words.startswith("running, called off by alice: the customer cancelled")
    assert called_off.reason == "the customer cancelled"


def test_a_contradiction_is_surfaced_not_dropped() -> None:
    s = Stamper(TASK)
    log = [s.started(), s.intended(1), s.attempted(1, 1), s.settled(1, Outcome.DONE, attempt=1),
           s.settled(1, Outcome.NOT_DONE, source=SettlementSource.WEBHOOK, reason="refunded")]
    out = messages(log, TASK)
    step = [m for m in out if m.subject == "step"][-1]
    assert step.state == "done"  # the first definitive settlement counts
    assert "a later report (webhook) says not_done: refunded" in step.words
    task = out[-1]  # and the task needs a person: reports about its step disagree
    assert (task.subject, task.state) == ("task", "needs_attention")
    assert "reports about it contradict each other" in task.words


def test_a_compensation_is_a_subject_of_its_own() -> None:
    s = Stamper(TASK)
    log = [s.started(), s.intended(1), s.attempted(1, 1), s.settled(1, Outcome.DONE, attempt=1),
           s.undo_intended(1), s.undo_attempted(1, 1),
           s.undo_settled(1, Outcome.UNKNOWN, attempt=1),
           s.undo_settled(1, Outcome.DONE, source=SettlementSource.LOOKUP),
           s.finished(FinalState.COMPENSATED)]
    out = messages(log, TASK)
    undo = [m for m in out if m.subject == "compensation"]
    assert [m.state for m in undo] == ["intended", "in_flight", "unknown", "done"]
    assert {m.reference for m in undo} == {f"{STEP}:undo"}
    assert undo[0].message_id == f"{TASK}/{STEP}:undo/1"
    assert "undo of charge_customer invoice:INV-2291 by refund_charge" in undo[-1].words
    assert (out[-1].state, out[-1].finished) == ("compensated", True)


def test_a_message_fits_the_topic_whatever_evidence_and_reasons_the_journal_holds() -> None:
    """A writer of the journal may settle a step with a megabyte of evidence (or a contradiction
    quoting it): its message was 1.7 MB, refused by the broker and tried again forever, and the
    task's subscribers never heard that it finished."""
    s = Stamper("big-1")
    evidence = {"charge_id": "ch_1"} | {f"k{i}": i for i in range(60_000)}
    journal = [s.started(), s.intended(1), s.attempted(1, 1),
               s.settled(1, Outcome.DONE, attempt=1, evidence=evidence),
               s.settled(1, Outcome.NOT_DONE, reason="x" * 500_000, attempt=1), s.finished()]
    told = messages(journal, "big-1")
    assert told[-1].finished
    for message in told:
        assert len(message.model_dump_json().encode()) <= 64 * 1024, message.message_id
    done = next(m for m in told if m.state == "done")
    assert done.evidence is not None
    assert done.evidence["truncated"] is True
    assert done.evidence["charge_id"] == "ch_1"  # the first fields, the effect's name, stay
    assert messages(journal, "big-1") == told  # bounded the same way every time (dedupe)


def test_a_rejected_task_is_over() -> None:
    s = Stamper(TASK)
    (only,) = messages([s.rejected("tool not allowed: wire_money")], TASK)
    assert (only.state, only.finished, only.reason) == ("rejected", True,
                                                        "tool not allowed: wire_money")
    assert "nothing was done" in only.words


# --- derive: the property ------------------------------------------------------------------------

N = st.integers(1, 2)
OUTCOMES = st.sampled_from(list(Outcome))
SOURCES = st.sampled_from(list(SettlementSource))
OPS = st.one_of(
    st.tuples(st.just("started")),
    st.tuples(st.just("rejected")),
    st.tuples(st.just("intended"), N),
    st.tuples(st.just("attempted"), N, st.integers(1, 3)),
    st.tuples(st.just("settled"), N, OUTCOMES, st.none() | st.integers(1, 3), SOURCES,
              st.sampled_from(["ch_1", "ch_2"])),
    st.tuples(st.just("checked"), N, st.none() | st.integers(1, 30)),
    st.tuples(st.just("undo_intended"), N),
    st.tuples(st.just("undo_attempted"), N, st.integers(1, 2)),
    st.tuples(st.just("undo_settled"), N, OUTCOMES, st.none() | st.integers(1, 2)),
    st.tuples(st.just("finished"), st.sampled_from(list(FinalState))),
    st.tuples(st.just("redeliver"), st.integers(0, 1000)),
)


def build(ops: list[tuple[Any, ...]]) -> tuple[list[Event], set[int]]:
    """A log from ops, and the positions of the redeliveries (an earlier record, again)."""
    s = Stamper(TASK)
    log: list[Event] = []
    redelivered: set[int] = set()
    for op in ops:
        match op:
            case ("redeliver", i):
                if log:
                    redelivered.add(len(log))
                    log.append(log[i % len(log)])
                continue
            case ("started",):
                event: Event = s.started()
            case ("rejected",):
                event = s.rejected()
            case ("intended", n):
                event = s.intended(n)
            case ("attempted", n, a):
                event = s.attempted(n, a)
            case ("settled", n, outcome, a, source, charge):
                event = s.settled(n, outcome, attempt=a, source=source,
                                  evidence={"charge_id": charge})
            case ("checked", n, seconds):
                event = s.checked(n, None if seconds is None else timedelta(seconds=seconds))
            case ("undo_intended", n):
                event = s.undo_intended(n)
            case ("undo_attempted", n, a):
                event = s.undo_attempted(n, a)
            case ("undo_settled", n, outcome, a):
                event = s.undo_settled(n, outcome, attempt=a)
            case ("finished", final):
                event = s.finished(final)
        log.append(event)
    return log, redelivered


def without_repeats(views: list[Change]) -> list[Change]:
    return [v for i, v in enumerate(views) if i == 0 or views[i - 1] != v]


@settings(max_examples=300, deadline=None)
@given(st.lists(OPS, max_size=40))
def test_changes_event_by_event_are_each_subjects_states_in_log_order(ops) -> None:
    log, redelivered = build(ops)
    seen: dict[str, list[Change]] = defaultdict(list)  # what changes() reported
    views: dict[str, list[Change]] = defaultdict(list)  # the visible state after every event
    before: TaskState | None = None
    for i, event in enumerate(log):
        after = apply(before or TaskState(task_id=TASK), event)
        found = changes(before, after)
        if i in redelivered:
            assert found == [], f"a redelivered {event.type} changed {found}"
        for change in found:
            assert change.at is not None
            assert change.at <= event.at, "a change caused by a fact not yet in the log"
            seen[change.about].append(change)
        for about, view in visible(after).items():
            views[about].append(view)
        before = after

    assert seen.keys() == views.keys()
    for about, reported in seen.items():
        assert reported == without_repeats(views[about]), about
        assert all(a != b for a, b in itertools.pairwise(reported)), about
    numbered = messages(log, TASK)
    assert len({m.message_id for m in numbered}) == len(numbered)
    assert numbered == messages(log, TASK)


# --- the contract --------------------------------------------------------------------------------


def test_a_message_round_trips_and_matches_its_committed_schema() -> None:
    s = Stamper(TASK)
    log = [s.started(), s.intended(1), s.attempted(1, 1), s.settled(1, Outcome.UNKNOWN,
                                                                     attempt=1), s.checked(1)]
    schema = json.loads((JSON_DIR / "outcome.changed.schema.json").read_text())
    for message in messages(log, TASK):
        wire = message.model_dump_json()
        assert parse_outcome(wire) == message
        jsonschema.validate(json.loads(wire), schema)
        assert message.record_key() == TASK.encode()


@pytest.mark.parametrize("mutation", [
    {"message_id": f"{TASK}/{STEP}/7"},  # not the id of this subject's change number
    {"state": "succeeded"},  # a task state on a step
    {"step_id": "other-task:1", "message_id": f"{TASK}/other-task:1/1"},
    {"finished": True},  # only the task can be over
    {"color": "green"},
])
def test_the_model_refuses_inconsistent_messages(mutation: dict[str, Any]) -> None:
    s = Stamper(TASK)
    step_message = messages([s.started(), s.intended(1)], TASK)[-1]
    assert step_message.subject == "step"
    with pytest.raises(ValidationError):
        OutcomeChanged.model_validate(step_message.model_dump() | mutation)


# --- end to end: real services, the publisher, a subscriber ---------------------------------------

SLOWER_S = 2.0  # the provider's first charge: slower than the `core` cluster's 1 s timeout
WAIT_S = 90.0


def start_publisher(settings: KafkaSettings, writer: JournalWriter,
                    ) -> asyncio.Task[None]:
    # No CLI command runs it yet: it runs in this process, on the test's topics.
    return asyncio.create_task(OutcomesPublisher(settings, writer).run(), name="outcomes")


async def stop_publisher(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def until(stream: OutcomeStream, seen: list[OutcomeChanged],
                wanted: Callable[[OutcomeChanged], bool], what: str,
                publisher: asyncio.Task[None]) -> None:
    """Collect messages into `seen` until one is `wanted` (bounded)."""
    try:
        async with asyncio.timeout(WAIT_S):
            async for message in stream:
                seen.append(message)
                if wanted(message):
                    return
    except TimeoutError:
        detail = publisher.exception() if publisher.done() else "running"
        raise AssertionError(f"no {what} within {WAIT_S:g} s; publisher {detail}; seen "
                             f"{[(m.about, m.state) for m in seen]}") from None


@pytest.mark.broker
async def test_a_subscriber_sees_every_change_of_a_slow_renewal_once(core: Cluster) -> None:
    await core.faults({"match": {"nth": 1}, "times": 1, "action": {"delay_s": SLOWER_S}})
    for service in ("decider", "executor", "reconciler"):
        await core.start(service)
    assert core.writer is not None
    publisher = start_publisher(core.settings, core.writer)
    task_id = f"outcomes-{uuid.uuid4().hex[:8]}"
    step_id = f"{task_id}:1"
    request = renewal_request(task_id)
    seen: list[OutcomeChanged] = []

    async with HalfwayClient(core.settings) as client, client.outcomes(task_id) as stream:
        # The subscriber is positioned before the task exists.
        await client.start_task(task_id, request.input, request.allowed_tools)
        await until(stream, seen, lambda m: m.subject == "step" and m.state == "unknown",
                    "unknown step", publisher)
        # A publisher restarted mid-task replays the journal from zero: what it published
        # already is not published under new ids, and what it missed while down still comes.
        await stop_publisher(publisher)
        publisher = start_publisher(core.settings, core.writer)
        await until(stream, seen, lambda m: m.subject == "task" and m.finished,
                    "finished task", publisher)

        log = [e for e in await journal_now(core.settings) if e.task_id == task_id]
        expected = messages(log, task_id)
        assert [(m.message_id, m.state) for m in seen] == [
            (m.message_id, m.state) for m in expected]
        assert seen == expected
        step = [m.state for m in seen if m.step_id == step_id and m.subject == "step"]
        assert step[:2] == ["intended", "in_flight"], step
        assert "unknown" in step, step
        assert step[-1] == "done", step
        assert "done" not in step[:step.index("unknown")], step
        done = [m for m in seen if m.step_id == step_id and m.subject == "step"][-1]
        assert done.evidence is not None, done
        assert str(done.evidence["charge_id"]).startswith("ch_"), done
        assert [m.state for m in seen if m.subject == "task"] == ["running", "succeeded"]

        # On the topic itself: duplicates at most, never a new id or two contents for one id.
        on_topic: dict[str, OutcomeChanged] = {}
        async for message in read_outcomes(core.settings):
            if message.task_id == task_id:
                assert on_topic.setdefault(message.message_id, message) == message
        assert set(on_topic) == {m.message_id for m in expected}

        # A subscriber to every task sees the same, deduped, in the same order.
        everything: list[OutcomeChanged] = []
        async with client.outcomes() as every_task:
            await until(every_task, everything,
                        lambda m: m.task_id == task_id and m.subject == "task" and m.finished,
                        "finished task on the all-tasks stream", publisher)
        assert [m for m in everything if m.task_id == task_id] == expected

        # The client rebuilds the task from the journal alone.
        state = await client.task_state(task_id)
        assert state == fold(log, task_id)
        assert await client.wait_finished(task_id, WAIT_S) == state
    await stop_publisher(publisher)
