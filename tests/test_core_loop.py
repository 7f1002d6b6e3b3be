"""The core loop through real processes: a caller, the decider, the executor and the provider.

Every test runs `halfway run decider|executor` and the payment simulator as child processes on
a topic prefix of its own, kills them with SIGKILL where the story needs a crash, and judges
only by what is outside the processes: the journal (folded with `halfway.core.fold`), the
provider's ledger and the model's call log. Waits are bounded and wait on journal events; no
test asserts on elapsed time.
"""

from __future__ import annotations

import uuid
from collections import Counter

import pytest
from aiokafka.partitioner import murmur2

from halfway.contract import (
    Event,
    FinalState,
    Outcome,
    SettlementSource,
    StepAttempted,
    StepIntended,
    StepSettled,
    TaskFinished,
    TaskRequested,
    TaskStarted,
)
from halfway.contract.topics import TASKS
from halfway.core.fold import TaskState, fold

# tests.processes is also a pytest plugin (process logs in failure reports, `pytest_plugins`
# below); registered before its import so its asserts are rewritten like a test's.
pytest.register_assert_rewrite("tests.processes")

from tests.processes import (  # noqa: E402
    Cluster,
    charges_for,
    journal_now,
    kill9,
    renewal_request,
    unknown_steps,
)

pytest_plugins = ["tests.processes"]
pytestmark = pytest.mark.broker

# The services' charge timeout is the `core` cluster's (tests.processes): 1 s unless a test
# says otherwise.
SLOWER_S = 2.0  # a provider delay past that timeout
# For waits that span a kill -9 (a killed member holds its partitions until its session, 10 s,
# expires) or hundreds of tasks: bounded, with room for a busy 2-core CI machine.
LONG_WAIT_S = 120.0


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def settlements(events: list[Event], step_id: str) -> list[StepSettled]:
    return [e for e in events if isinstance(e, StepSettled) and e.step_id == step_id]


def of_type(events: list[Event], kind: type[Event], task_id: str) -> list[Event]:
    return [e for e in events if isinstance(e, kind) and e.task_id == task_id]


def tasks_partition(task_id: str) -> int:
    """The tasks partition the writer's default partitioner puts this task's requests on."""
    return (murmur2(task_id.encode()) & 0x7FFFFFFF) % TASKS.partitions


# --- 1. the renewal -------------------------------------------------------------------------------


async def test_the_renewal_through_real_processes(core: Cluster) -> None:
    await core.faults({"match": {"nth": 1}, "times": 1, "action": {"delay_s": SLOWER_S}})
    await core.start("decider")
    await core.start("executor")
    await core.start("reconciler")
    task_id = new_id("renewal")
    key = f"{task_id}:1"
    await core.publish(renewal_request(task_id))

    state = (await core.journal.until_finished([task_id]))[task_id]

    assert state.final_state is FinalState.SUCCEEDED, state.finished
    step = state.step(1)
    assert step is not None
    assert step.intent.key == key
    outcomes = [s.outcome for s in settlements(core.journal.of(task_id), key)]
    assert Outcome.UNKNOWN in outcomes, f"the first attempt should time out: {outcomes}"
    assert Outcome.DONE in outcomes[outcomes.index(Outcome.UNKNOWN):], outcomes
    assert step.outcome is Outcome.DONE
    settlement = step.effect.settlement
    assert settlement is not None
    assert settlement.evidence is not None
    charge_id = settlement.evidence["charge_id"]
    charges = charges_for(await core.ledger(), key)
    assert [c["id"] for c in charges] == [charge_id], charges
    assert charges[0]["amount"] == 4900


# --- 2. kill -9 the executor mid-call -------------------------------------------------------------


async def test_an_executor_killed_mid_call_is_replaced_and_the_step_settles_once(
        core: Cluster) -> None:
    # The call must still be in flight when the kill lands: the provider takes 8 s and the
    # executor would wait 30 s, so only the kill can end the attempt.
    long_timeout = {"HALFWAY_CHARGE_TIMEOUT_S": "30"}
    await core.faults({"match": {"nth": 1}, "times": 1, "action": {"delay_s": 8.0}})
    await core.start("decider")
    await core.start("reconciler")
    first = await core.start("executor", **long_timeout)
    task_id = new_id("crash-exec")
    step_id = f"{task_id}:1"
    await core.publish(renewal_request(task_id))

    await core.journal.first(lambda e: isinstance(e, StepAttempted) and e.step_id == step_id,
                             "step.attempted")
    # step.attempted is written before the request leaves: wait until the provider has it, so
    # the kill cuts off a call that is executing (the charge lands while nobody listens).
    await core.until_provider_has(step_id)
    await kill9(first)
    in_log = await journal_now(core.settings)
    assert settlements(in_log, step_id) == [], "the step settled before the kill landed"

    await core.start("executor", **long_timeout)
    state = (await core.journal.until_finished([task_id], LONG_WAIT_S))[task_id]

    assert state.final_state is FinalState.SUCCEEDED, state.finished
    step = state.step(1)
    assert step is not None
    assert step.outcome is Outcome.DONE
    found = settlements(core.journal.of(task_id), step_id)
    # The new executor first says what the crash left: attempt 1, outcome unknown.
    assert found[0].outcome is Outcome.UNKNOWN, found[0]
    assert found[0].attempt == 1, found[0]
    assert found[0].source is SettlementSource.CALL, found[0]
    assert len(charges_for(await core.ledger(), step_id)) == 1


# --- 3. kill -9 the decider right after its decision ----------------------------------------------


async def test_a_decider_killed_after_deciding_rereads_the_decision(core: Cluster) -> None:
    # Step 1 stays in flight (unknown, then looked up) while the decider is killed and back.
    await core.faults({"match": {"nth": 1}, "times": 1, "action": {"delay_s": 3.0}})
    decider = await core.start("decider")
    await core.start("executor")
    await core.start("reconciler")
    task_id = new_id("crash-dec")
    await core.publish(renewal_request(task_id))

    await core.journal.first(lambda e: isinstance(e, StepIntended) and e.task_id == task_id
                             and e.n == 1, "step.intended")
    await kill9(decider)
    in_log = await journal_now(core.settings)
    assert of_type(in_log, TaskFinished, task_id) == [], "the task finished before the kill"

    await core.start("decider")
    state = (await core.journal.until_finished([task_id], LONG_WAIT_S))[task_id]

    questions = Counter(c["n"] for c in core.model_calls() if c["task_id"] == task_id)
    assert questions[1] == 1, f"the restarted decider asked the model again: {questions}"
    assert state.final_state is FinalState.SUCCEEDED, state.finished
    step = state.step(1)
    assert step is not None
    assert step.intent.args["amount_cents"] == 4900
    charges = charges_for(await core.ledger(), step.intent.key)
    assert [c["amount"] for c in charges] == [4900], charges


# --- 4. two of each, with rebalances --------------------------------------------------------------


async def test_two_deciders_and_two_executors_share_the_work_through_rebalances(
        core: Cluster) -> None:
    # Two deciders may both ask the model for a step around a rebalance, and a decider killed
    # between the model's answer and its step.intended asks again once replaced: allowed (the
    # step was not decided in the journal, or the fold keeps the first decision). Asked again,
    # the model answers "49.00"; the decider refuses that (step.refused) and the model, reading
    # why, corrects itself, so every task still succeeds with one charge of 4900. The
    # questions asked more than once are reported.
    waves = 3
    per_wave = 10

    def request(task_id: str) -> TaskRequested:
        return renewal_request(task_id, invoice=f"INV-{task_id}")

    await core.faults(
        # A third of the calls much slower than the timeout (unknown, looked up, retried with
        # the same key), the rest a little slow: work is in flight while the groups rebalance.
        {"match": {"probability": 0.3, "seed": 4}, "action": {"delay_s": 4.0}},
        {"match": {}, "action": {"delay_s": 0.3}},
    )
    d1 = await core.start("decider")
    e1 = await core.start("executor")
    await core.start("reconciler")
    ids = [new_id(f"pair-{i:02d}") for i in range(waves * per_wave)]
    mine = set(ids)
    wave = [ids[i * per_wave:(i + 1) * per_wave] for i in range(waves)]

    def intended(among: set[str]) -> set[str]:
        return {e.task_id for e in core.journal.events
                if isinstance(e, StepIntended) and e.task_id in among}

    async def at_least_intended(among: list[str], count: int) -> None:
        await core.journal.wait_for(lambda: True if len(intended(set(among))) >= count else None,
                                    f"{count} tasks with step.intended", LONG_WAIT_S)

    # Wave 1 with one of each; the second of each joins while wave 1 is in flight.
    await core.publish(*(request(t) for t in wave[0]))
    await at_least_intended(wave[0], 3)
    d2 = await core.start("decider")
    e2 = await core.start("executor")
    # The rebalance is over when every member has its share: the first ones were assigned
    # everything, then their half.
    for proc, assignments in ((d1, 2), (e1, 2), (d2, 1), (e2, 1)):
        await proc.until_logged("partitions assigned", count=assignments)
    unfinished_at_rebalance = [t for t in wave[0] if not core.journal.finished(t)]
    # Wave 2 shared by both pairs; the first pair dies with some of it in flight.
    await core.publish(*(request(t) for t in wave[1]))
    await at_least_intended(wave[1], 3)
    await kill9(d1)  # another rebalance, once the dead members' sessions expire
    await kill9(e1)
    # Wave 3 waits for the survivors.
    await core.publish(*(request(t) for t in wave[2]))

    await core.journal.until_finished(ids, LONG_WAIT_S)

    log = await journal_now(core.settings)
    charges = await core.ledger()
    intents = Counter(e.task_id for e in log if isinstance(e, StepIntended) and e.task_id in mine)
    questions = Counter((c["task_id"], c["n"]) for c in core.model_calls())
    print(f"wave 1 tasks unfinished when the first rebalance was over: "
          f"{len(unfinished_at_rebalance)} of {per_wave}")
    print("work: " + ", ".join(f"{p.name} decided {len(p.logged('step decided'))} steps, "
                               f"answered {len(p.logged('attempt answered'))} calls"
                               for p in (d1, d2, e1, e2)))
    print(f"step.intended records: {sum(intents.values())} for {len(ids)} tasks; "
          f"tasks with more than one: {sorted(t for t, n in intents.items() if n > 1)}; "
          f"model questions: {sum(questions[(t, n)] for t in ids for n in (1, 2))}, asked "
          f"more than once: {sorted(k for k, v in questions.items() if v > 1)}")
    problems = []
    for task_id in ids:
        events = [e for e in log if e.task_id == task_id]
        state = fold(events, task_id)
        first_intent = next((e for e in events if isinstance(e, StepIntended) and e.n == 1),
                            None)
        mine_charged = charges_for(charges, f"{task_id}:1")
        if state.final_state is not FinalState.SUCCEEDED:
            problems.append(f"{task_id}: finished {state.final_state}: {state.finished}")
        if first_intent is None or sorted(state.steps) != [1]:
            problems.append(f"{task_id}: steps {sorted(state.steps)}")
        elif state.steps[1].intent.event_id != first_intent.event_id:
            problems.append(f"{task_id}: the fold did not keep the first decision")
        if len(mine_charged) != 1:
            problems.append(f"{task_id}: {len(mine_charged)} charges")
        if len(of_type(events, TaskStarted, task_id)) < 1:
            problems.append(f"{task_id}: never started")
    assert problems == []
    assert d2.logged("step decided"), "the second decider never decided anything"
    assert e2.logged("attempt answered"), "the second executor never called the provider"


# --- 5. two hundred at once, with a misbehaving provider ------------------------------------------


@pytest.mark.load
async def test_two_hundred_renewals_at_once_each_charge_once(core: Cluster) -> None:
    count = 200
    await core.faults(
        # A fifth of the calls slower than the timeout.
        {"match": {"probability": 0.2, "seed": 7}, "action": {"delay_s": SLOWER_S}},
        # A tenth of all calls charge and then answer 500 (saved under the key and replayed):
        # 0.125 of the four fifths the first rule leaves.
        {"match": {"probability": 0.125, "seed": 11},
         "action": {"status": 500, "when": "after_commit"}},
    )
    await core.start("decider")
    await core.start("executor")
    await core.start("reconciler")
    ids = [new_id(f"many-{i:03d}") for i in range(count)]
    await core.publish(*(renewal_request(t, invoice=f"INV-{t}", customer=f"cus-{t}")
                         for t in ids))

    states = await core.journal.until_settled_or_stuck(ids, LONG_WAIT_S)

    charges = await core.ledger()
    per_key = Counter((c.get("metadata") or {}).get("halfway_key") for c in charges)
    requests = await core.sim_requests()
    faults = Counter(str(r["fault"]) for r in requests if r["fault"])
    finals = Counter(str(s.final_state) for s in states.values())
    unknowns = [e for e in core.journal.events
                if isinstance(e, StepSettled) and e.outcome is Outcome.UNKNOWN]
    print(f"final states: {dict(finals)}; charges: {len(charges)}; create requests: "
          f"{len(requests)}; faults hit: {dict(faults)}; unknown settlements: {len(unknowns)}")
    assert any("500" in f for f in faults), faults
    assert any("delay" in f for f in faults), faults

    problems = []
    for task_id, state in states.items():
        if state.finished is None and not unknown_steps(state):
            problems.append(f"{task_id}: no final state and no unknown step")
        if state.final_state is not FinalState.SUCCEEDED and not unknown_steps(state):
            problems.append(f"{task_id}: {state.final_state} ({state.finished})")
        if per_key[f"{task_id}:1"] != 1:
            problems.append(f"{task_id}: {per_key[f'{task_id}:1']} charges")
    nobody_intended = set(per_key) - {f"{t}:1" for t in ids}
    assert not nobody_intended, f"charges nobody intended: {sorted(map(str, nobody_intended))}"
    assert problems == []  # a task with no charge is here, with its final state


# --- starting a task twice ------------------------------------------------------------------------


async def test_a_task_requested_twice_starts_once(core: Cluster) -> None:
    before, during = new_id("twice-a"), new_id("twice-b")
    # `before`: both requests are in the tasks topic before the decider runs.
    await core.publish(renewal_request(before))
    await core.publish(renewal_request(before, invoice="INV-OTHER", amount_cents=9900))
    await core.start("decider")
    await core.start("executor")
    await core.start("reconciler")
    # `during`: the second request arrives once the task has started.
    await core.publish(renewal_request(during))
    await core.journal.first(lambda e: isinstance(e, TaskStarted) and e.task_id == during,
                             "task.started")
    await core.publish(renewal_request(during, invoice="INV-OTHER", amount_cents=9900))
    # A later task on the same tasks partition: once it finishes, the decider has read the
    # duplicate before it (one partition, one order).
    sentinel = next(t for t in (new_id("twice-s") for _ in range(1000))
                    if tasks_partition(t) == tasks_partition(during))
    await core.publish(renewal_request(sentinel))
    await core.journal.until_finished([before, during, sentinel])

    log = await journal_now(core.settings)
    charges = await core.ledger()
    for task_id in (before, during):
        state: TaskState = fold([e for e in log if e.task_id == task_id], task_id)
        assert len(of_type(log, TaskStarted, task_id)) == 1, f"{task_id} started twice"
        assert state.started is not None
        assert state.started.input["script"][0]["args"]["amount_cents"] == 4900
        assert state.final_state is FinalState.SUCCEEDED, state.finished
        assert [c["amount"] for c in charges_for(charges, f"{task_id}:1")] == [4900]
    assert not any(c["amount"] == 9900 for c in charges)

