"""`halfway run worker` and the local folds it rests on.

A follower folds its own process's journal appends as soon as they are acknowledged, but only
when every record before them is folded: the fold stays in log order, and the fetched copy is
then skipped. A worker (a decider and an executor in one process, each in its own group) acts
on the other's appends that way; it mixes with separate deciders and executors, and a task is
charged once whatever runs it.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, cast

import pytest
from aiokafka import TopicPartition
from aiokafka.coordinator.protocol import ConsumerProtocolMemberMetadata

from halfway import App, CallContext
from halfway.contract import Event, FinalState, Outcome, TaskRequested
from halfway.contract.topics import JOURNAL, TASKS, TopicSpec
from halfway.core.fold import TaskStatus, fold
from halfway.journal import JournalWriter, membership
from halfway.journal.admin import delete_topics, ensure_topics
from halfway.journal.follower import LOCAL_AHEAD_MAX, JournalFollower
from halfway.models import ScriptedModel
from halfway.serve import WORKER_GATHER_MS, Service, run_service
from halfway.settings import KafkaSettings
from tests.factories import Stamper
from tests.followers import unstarted
from tests.processes import Cluster, charges_for, journal_now, renewal_request

pytest_plugins = ["tests.processes"]

SETTINGS = KafkaSettings(bootstrap="127.0.0.1:1", topic_prefix="local.", replication_factor=1)
# The writer of a worker's other part: its appends are folded here as acknowledged.
PARTNER = cast(JournalWriter, object())
JOURNAL_TP = TopicPartition("local.journal", 0)
def follower(applied_to: int) -> JournalFollower:
    """A follower (never started) whose journal partition 0 is caught up to `applied_to`."""
    return unstarted(SETTINGS, "local.decider", [JOURNAL_TP], side=TASKS,
                     applied_to=applied_to, caught_up=True)


async def test_an_own_append_is_folded_at_once_only_in_log_order() -> None:
    s = Stamper("t1", now=datetime(2026, 12, 1, tzinfo=UTC), tick=timedelta(seconds=1))
    requested, started, intended = s.requested(), s.started(), s.intended(1)
    f = follower(applied_to=4)
    f._apply(requested, JOURNAL_TP, 4 + 0)  # already folded: offset 4 is not past 4
    assert f.states.get("t1") is None

    # Offset 5 follows what is folded: folded now, and the fetch's copy is skipped.
    f._appended("local.journal", requested, 0, 5, PARTNER)
    assert f.states["t1"].status is TaskStatus.REQUESTED
    assert f._folded("local.journal", 0, 5)
    # Offset 7 leaves a gap (someone else's record at 6 is not folded yet): it waits for the
    # fetch, which brings 6 and then 7, in order.
    f._appended("local.journal", intended, 0, 7, PARTNER)
    assert not f._folded("local.journal", 0, 7)
    assert f.states["t1"].status is TaskStatus.REQUESTED
    f._apply(started, JOURNAL_TP, 6)
    f._apply(intended, JOURNAL_TP, 7)
    f._fold_all_ahead()  # the fetched 7 is forgotten, not folded twice
    assert f._partitions[JOURNAL_TP].ahead == {}
    assert f.states["t1"].status is TaskStatus.RUNNING
    assert 1 in f.states["t1"].steps
    # Another topic's append, or a partition not caught up, is never folded locally.
    f._appended("other.journal", s.finished(FinalState.SUCCEEDED), 0, 8, PARTNER)
    f._partitions[JOURNAL_TP].caught_up = False
    f._appended("local.journal", s.finished(FinalState.SUCCEEDED), 0, 8, PARTNER)
    assert f.states["t1"].status is TaskStatus.RUNNING


async def test_a_partners_append_wakes_the_loop_and_an_own_one_waits_for_note_write() -> None:
    """Both are folded as acknowledged; the partner's may be our next move, so our loop wakes
    at once, while our own service's append wakes it from `note_write`, just after: the part
    that has a move to make goes first."""
    s = Stamper("t1", now=datetime(2026, 12, 1, tzinfo=UTC), tick=timedelta(seconds=1))
    f = follower(applied_to=4)
    f._appended("local.journal", s.requested(), 0, 5, f._writer)
    assert f.states["t1"].status is TaskStatus.REQUESTED
    assert not f._wake.is_set()
    f.note_write("t1", 0, 5)
    assert f._wake.is_set()
    f._wake.clear()
    f._appended("local.journal", s.started(), 0, 6, PARTNER)
    assert f.states["t1"].status is TaskStatus.RUNNING
    assert f._wake.is_set()


async def test_an_own_append_past_a_gap_is_folded_once_the_gap_is() -> None:
    s = Stamper("t1", now=datetime(2026, 12, 1, tzinfo=UTC), tick=timedelta(seconds=1))
    requested, started, intended = s.requested(), s.started(), s.intended(1)
    attempted, settled = s.attempted(1, 1), s.settled(1, Outcome.DONE)
    f = follower(applied_to=4)
    part = f._partitions[JOURNAL_TP]
    f._appended("local.journal", requested, 0, 5, PARTNER)

    # A worker's two producers: the executor's append at 7 is acknowledged before the
    # decider's at 6. 7 waits; 6 folds, and 7 right after it, with no fetch.
    f._appended("local.journal", intended, 0, 7, PARTNER)
    assert f.states["t1"].status is TaskStatus.REQUESTED
    f._appended("local.journal", started, 0, 6, PARTNER)
    assert f._folded("local.journal", 0, 7)
    assert 1 in f.states["t1"].steps
    assert part.ahead == {}

    # Past another writer's record (8): folded once the fetch brought 8.
    f._appended("local.journal", settled, 0, 9, PARTNER)
    f._fold_all_ahead()
    assert not f._folded("local.journal", 0, 9)  # nothing before it came yet
    f._apply(attempted, JOURNAL_TP, 8)
    f._fold_all_ahead()
    assert f._folded("local.journal", 0, 9)
    assert f.states["t1"].steps[1].effect.settlement is not None

    # Bounded: past LOCAL_AHEAD_MAX the fetch alone brings them; a revoked partition's go.
    for offset in range(11, 11 + LOCAL_AHEAD_MAX + 5):
        f._appended("local.journal", s.checked(1), 0, offset, PARTNER)
    assert len(part.ahead) == LOCAL_AHEAD_MAX
    del f._partitions[JOURNAL_TP]
    f._fold_all_ahead()
    assert not f._ahead


def test_group_members_of_one_process_get_the_same_partitions_in_every_group() -> None:
    """Range assignment ranks members by process first: two workers' deciders and executors
    (each group's member ids in another order) get matching partitions."""
    class Cluster:
        def partitions_for_topic(self, topic: str) -> set[int]:
            return set(range(6))

    def meta(process: str) -> ConsumerProtocolMemberMetadata:
        return ConsumerProtocolMemberMetadata(0, ["j"], b"app@1\0" + process.encode())

    assignor = membership.labelled_range("app@1", lambda _labels: None)
    deciders = assignor.assign(Cluster(), {"m-b": meta("p1"), "m-a": meta("p2")})
    executors = assignor.assign(Cluster(), {"m-a": meta("p1"), "m-b": meta("p2")})
    by_process = [
        ({"p1": deciders["m-b"], "p2": deciders["m-a"]}),
        ({"p1": executors["m-a"], "p2": executors["m-b"]}),
    ]
    for process in ("p1", "p2"):
        assert (by_process[0][process].assignment == by_process[1][process].assignment)
    assert by_process[0]["p1"].assignment != by_process[0]["p2"].assignment


@pytest.mark.broker
async def test_a_worker_runs_tasks_and_mixes_with_a_separate_executor(core: Cluster) -> None:
    worker = await core.start("worker")
    first = [f"worker-{i}" for i in range(4)]
    await core.publish(*(renewal_request(t) for t in first))
    states = await core.journal.until_finished(first)
    assert all(s.final_state is FinalState.SUCCEEDED for s in states.values())
    assert worker.logged("partitions assigned")
    # Its decider hands a step to its executor, which journals it with its first attempt.
    assert any(e.get("attempted") for e in worker.logged("step decided"))

    # Both its parts let the broker gather journal fetches (what they need fast is folded
    # in-process); its decider reads requests at once, with a consumer of their own.
    gathers = {e["group"]: (e.get("gather_ms"), e.get("at_once"))
               for e in worker.logged("partitions assigned") if "group" in e}
    prefix = core.settings.topic_prefix
    assert gathers == {f"{prefix}decider": (WORKER_GATHER_MS, [f"{prefix}tasks"]),
                       f"{prefix}executor": (WORKER_GATHER_MS, [])}, gathers

    # A separate executor and a separate decider join their groups: the work is shared, a step
    # decided elsewhere reaches the worker's executor through its gathered fetches, and every
    # charge is made once.
    await core.start("executor")
    await core.start("decider")
    more = [f"worker-more-{i}" for i in range(12)]
    await core.publish(*(renewal_request(t) for t in more))
    states = await core.journal.until_finished(more)
    assert all(s.final_state is FinalState.SUCCEEDED for s in states.values())
    charges = await core.ledger()
    for task_id in [*first, *more]:
        assert len(charges_for(charges, f"{task_id}:1")) == 1, task_id


async def test_a_move_that_keeps_failing_rests_longer_each_time_and_never_spins(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup whose arguments no longer parse fails at once, every time: the effect rests
    (busy, not tried) for a growing while instead of being tried again at once."""
    from types import SimpleNamespace

    from halfway.journal import steps

    monkeypatch.setattr(steps, "MOVE_RETRY_S_MIN", 0.05)
    touched: list[str] = []
    woken = asyncio.Event()

    def touch(task_id: str) -> None:
        touched.append(task_id)
        woken.set()

    worker = steps.StepWorker()
    worker.follower = SimpleNamespace(touch=touch)  # type: ignore[assignment]
    effect = SimpleNamespace(move_id="t-1:1", task_id="t-1")

    async def failing() -> None:
        raise steps.MoveFailed

    rests = []
    for i in range(3):
        woken.clear()
        worker.start_move(effect, failing())  # type: ignore[arg-type]
        await asyncio.sleep(0)  # the move runs and fails
        await asyncio.sleep(0)
        assert worker.busy(effect)  # resting: a change of the task does not start it again
        assert touched == ["t-1"] * i  # not looked at again at once (that was the spin)
        rests.append(worker._resting["t-1:1"][0])
        await asyncio.wait_for(woken.wait(), 5)  # looked at again once the rest is over
        assert touched == ["t-1"] * (i + 1)
        assert not worker.busy(effect)
    assert rests == [1, 2, 3]  # failures in a row, each resting twice as long

    async def succeeding() -> None:
        return None

    worker.start_move(effect, succeeding())  # type: ignore[arg-type]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert "t-1:1" not in worker._resting
    assert not worker.busy(effect)


async def test_a_timer_that_fired_is_forgotten_and_one_replaced_never_fires() -> None:
    """One timer per waiting effect, and only while it waits: the map follows the effects
    waiting now, not every effect that ever waited (it held one per effect for good)."""
    from types import SimpleNamespace

    from halfway.journal import steps

    touched: list[str] = []
    all_woken = asyncio.Event()
    effects = 1000

    def touch(task_id: str) -> None:
        touched.append(task_id)
        if len(touched) == effects:
            all_woken.set()

    worker = steps.StepWorker()
    worker.follower = SimpleNamespace(touch=touch)  # type: ignore[assignment]
    now = datetime.now(UTC)
    for i in range(effects):
        effect = SimpleNamespace(move_id=f"t-{i}:1", task_id=f"t-{i}")
        worker.wake_at(effect, now + timedelta(days=1), now)  # type: ignore[arg-type]
        worker.wake_at(effect, now, now)  # type: ignore[arg-type]  # replaces the first
    assert len(worker._timers) == effects
    await asyncio.wait_for(all_woken.wait(), 5)
    assert sorted(touched) == sorted(f"t-{i}" for i in range(effects))  # each once
    assert worker._timers == {}


@pytest.mark.broker
async def test_a_worker_with_a_scripted_model_journals_each_step_with_the_next_move(
        kafka_settings: KafkaSettings, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scripted model answers without I/O: a worker journals a task's start with step 1's
    decision and attempt, each settlement with the next step's decision and attempt, and the
    last with the finish. Four appends in series for three steps, each in log order, each
    call sent once, and the fold of what is read back is the task done."""
    app = App(name="carry")
    sent: list[str] = []

    @app.tool(effect="keyed", key_ttl_s=3600, timeout_s=5.0, evidence_id="thing_id")
    async def make_thing(n: int, *, ctx: CallContext) -> dict[str, Any]:
        """Make thing n."""
        sent.append(ctx.key)
        return {"thing_id": f"thing-{ctx.key}"}

    @make_thing.lookup
    async def find_thing(n: int, *, ctx: CallContext) -> dict[str, Any] | None:
        return {"thing_id": f"thing-{ctx.key}"} if ctx.key in sent else None

    appends: list[list[str]] = []
    finished = asyncio.Event()
    append_all = JournalWriter.append_all

    async def recorded(self: JournalWriter, events: Sequence[Event],
                       spec: TopicSpec = JOURNAL) -> list[Any]:
        metas = await append_all(self, events, spec)
        if spec is JOURNAL:
            appends.append([e.type for e in events])
            if events[-1].type == "task.finished":
                finished.set()
        return metas

    monkeypatch.setattr(JournalWriter, "append_all", recorded)
    settings = kafka_settings.with_prefix(f"carry-{uuid.uuid4().hex[:8]}.")
    await ensure_topics(settings)
    worker = asyncio.create_task(run_service(Service.WORKER, settings, app.registry(),
                                             ScriptedModel(), app=app))
    try:
        task_id = f"carried-{uuid.uuid4().hex[:6]}"
        async with JournalWriter(settings.as_kind("caller")) as caller:
            await caller.append(TaskRequested(
                event_id=uuid.uuid4().hex, task_id=task_id, at=datetime.now(UTC),
                input={"script": [{"tool": "make_thing", "args": {"n": n}} for n in (1, 2, 3)]},
                allowed_tools=["make_thing"]), TASKS)
        async with asyncio.timeout(60):
            await finished.wait()
        events = [e for e in await journal_now(settings) if e.task_id == task_id]
    finally:
        worker.cancel()
        await asyncio.gather(worker, return_exceptions=True)
        await delete_topics(settings)
    pair = ["step.intended", "step.attempted"]
    assert appends == [["task.started", *pair], ["step.settled", *pair],
                       ["step.settled", *pair], ["step.settled", "task.finished"]]
    assert [e.type for e in events] == [t for batch in appends for t in batch]
    assert sent == [f"{task_id}:{n}" for n in (1, 2, 3)]
    state = fold(events, task_id)
    assert state.final_state is FinalState.SUCCEEDED
    assert all(step.outcome is Outcome.DONE and
               step.effect.attempts[0].intent_id == step.intent.event_id
               for step in state.steps.values())
