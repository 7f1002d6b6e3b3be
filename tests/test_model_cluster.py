"""A real model endpoint behind the decider: `halfway run decider --model openai:NAME`.

The decider runs as its own process and asks our OpenAI-compatible simulator
(`halfway.simulators.modelsim`) through the official `openai` client; the executor and the
reconciler run the built-in app against paysim. The simulator counts every request per task,
so each test states how many questions a task may cost, and the journal says what happened:
`model.failed` for each failed question, usage with each decision, the parallel calls that
were not run.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest

from halfway.contract import FinalState, ModelFailed, Outcome, StepIntended, TaskRequested
from halfway.core.decide import MODEL_FAILURES_MAX
from halfway.simulators.modelsim import ModelSim, serving

pytest.register_assert_rewrite("tests.processes")

from tests.processes import Cluster, charges_for, kill9  # noqa: E402

pytest_plugins = ["tests.processes"]
pytestmark = pytest.mark.broker

MODEL = "gpt-4o-mini"
KEY = "sk-test-halfway"
LONG_WAIT_S = 120.0


@pytest.fixture
async def sim() -> AsyncIterator[ModelSim]:
    async with serving(port=0, api_key=KEY, models=(MODEL,)) as (_url, model_sim):
        yield model_sim


async def start_services(core: Cluster, sim: ModelSim, *, api_key: str = KEY) -> None:
    await core.start("decider", "--model", f"openai:{MODEL}",
                     OPENAI_BASE_URL=sim.openai_base_url, OPENAI_API_KEY=api_key)
    await core.start("executor")
    await core.start("reconciler")


def charge(task_id: str, n: int = 1) -> dict[str, Any]:
    return {"tool": "charge_customer",
            "args": {"invoice": f"INV-{task_id}-{n}", "customer": "cus_1",
                     "amount_cents": 4900, "currency": "usd"}}


def request(task_id: str, script: list[dict[str, Any]], **context: Any) -> TaskRequested:
    return TaskRequested(
        event_id=uuid.uuid4().hex, task_id=task_id, at=datetime.now(UTC),
        input={"prompt": "Renew the subscription: charge the invoice.", "script": script,
               "summary": "renewed", **context},
        allowed_tools=["charge_customer"])


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def failures(core: Cluster, task_id: str) -> list[ModelFailed]:
    return [e for e in core.journal.of(task_id) if isinstance(e, ModelFailed)]


async def test_transient_model_errors_are_journaled_and_recover(core: Cluster,
                                                                sim: ModelSim) -> None:
    await start_services(core, sim)
    task_id = new_id("flaky")
    faults = [{"kind": "429", "times": 2, "retry_after_s": 0}, {"kind": "500"}]
    await core.publish(request(task_id, [charge(task_id)], model_faults=faults))

    state = (await core.journal.until_finished([task_id], timeout_s=LONG_WAIT_S))[task_id]

    assert state.final_state is FinalState.SUCCEEDED, state.finished
    failed = failures(core, task_id)
    assert [(f.status, f.transient) for f in failed] == [(429, True), (429, True), (500, True)]
    # Three failed questions, the decision for step 1, and the finish: nothing else.
    assert sim.requests_of(task_id) == 5
    step = state.step(1)
    assert step is not None
    assert step.outcome is Outcome.DONE
    assert step.intent.decided_by.model == MODEL
    usage = step.intent.decided_by.usage
    assert usage is not None
    assert usage.input_tokens > 0
    assert usage.output_tokens > 0
    assert step.intent.decided_by.app is not None
    assert step.intent.decided_by.app.startswith("builtin@")
    assert state.usage.questions == 5
    assert state.usage.input_tokens >= usage.input_tokens


async def test_a_refused_key_ends_the_task_after_one_question(core: Cluster,
                                                              sim: ModelSim) -> None:
    await start_services(core, sim, api_key="sk-wrong")
    task_id = new_id("nokey")
    await core.publish(request(task_id, [charge(task_id)]))

    state = (await core.journal.until_finished([task_id], timeout_s=LONG_WAIT_S))[task_id]

    assert state.final_state is FinalState.FAILED
    assert state.finished is not None
    assert "the model is unavailable" in state.finished.summary
    assert "401" in state.finished.summary
    assert "sk-wrong" not in state.finished.summary  # never the key itself
    assert [(f.status, f.transient) for f in failures(core, task_id)] == [(401, False)]
    assert sim.requests_of(task_id) == 1
    assert state.steps == {}


async def test_a_model_that_keeps_failing_is_bounded(core: Cluster, sim: ModelSim) -> None:
    await start_services(core, sim)
    task_id = new_id("down")
    faults = [{"kind": "503", "times": 1000}]
    await core.publish(request(task_id, [charge(task_id)], model_faults=faults))

    state = (await core.journal.until_finished([task_id], timeout_s=LONG_WAIT_S))[task_id]

    assert state.final_state is FinalState.NEEDS_ATTENTION
    assert state.finished is not None
    assert "503" in state.finished.summary
    assert sim.requests_of(task_id) == MODEL_FAILURES_MAX
    assert len(failures(core, task_id)) == MODEL_FAILURES_MAX


async def test_parallel_tool_calls_run_one_step_at_a_time(core: Cluster, sim: ModelSim) -> None:
    await start_services(core, sim)
    task_id = new_id("parallel")
    first = charge(task_id, 1)
    second = charge(task_id, 2)
    script = [{**first, "parallel": [second]}, second]
    await core.publish(request(task_id, script))

    state = (await core.journal.until_finished([task_id], timeout_s=LONG_WAIT_S))[task_id]

    assert state.final_state is FinalState.SUCCEEDED, state.finished
    one, two = state.step(1), state.step(2)
    assert one is not None
    assert two is not None
    # The second call of the first answer was journaled with step 1, not run...
    assert [(c.tool, c.args) for c in one.intent.also_proposed] == \
        [("charge_customer", second["args"])]
    # ...and became step 2 once step 1 had settled, when the model proposed it again.
    assert two.intent.args == second["args"]
    assert two.intent.at > one.effect.settlement.at  # type: ignore[union-attr]
    ledger = await core.ledger()
    assert len(charges_for(ledger, f"{task_id}:1")) == 1
    assert len(charges_for(ledger, f"{task_id}:2")) == 1
    assert sim.requests_of(task_id) == 3  # step 1 (with its parallel call), step 2, finish


async def test_malformed_arguments_are_a_refusal_the_model_reads(core: Cluster,
                                                                 sim: ModelSim) -> None:
    await start_services(core, sim)
    task_id = new_id("malformed")
    await core.publish(request(task_id, [{**charge(task_id), "malformed": True}]))

    state = (await core.journal.until_finished([task_id], timeout_s=LONG_WAIT_S))[task_id]

    assert state.final_state is FinalState.SUCCEEDED, state.finished
    assert len(state.refusals) == 1
    assert "are not a JSON object" in state.refusals[0].reason
    assert sim.requests_of(task_id) == 3  # the malformed answer, its correction, the finish


async def test_a_restarted_decider_rereads_every_decision(core: Cluster, sim: ModelSim) -> None:
    # The first charge is slow: the task is held on it while its decider is killed.
    await core.faults({"match": {"nth": 1}, "times": 1, "action": {"delay_s": 3.0}})
    decider = await core.start("decider", "--model", f"openai:{MODEL}",
                               OPENAI_BASE_URL=sim.openai_base_url, OPENAI_API_KEY=KEY)
    await core.start("executor")
    await core.start("reconciler")
    task_id = new_id("restart")
    await core.publish(request(task_id, [charge(task_id, 1), charge(task_id, 2)]))
    await core.journal.first(lambda e: isinstance(e, StepIntended) and e.task_id == task_id,
                             "step 1 decided")
    await kill9(decider)
    assert sim.requests_of(task_id) == 1
    await core.start("decider", "--model", f"openai:{MODEL}",
                     OPENAI_BASE_URL=sim.openai_base_url, OPENAI_API_KEY=KEY)

    state = (await core.journal.until_finished([task_id], timeout_s=LONG_WAIT_S))[task_id]

    assert state.final_state is FinalState.SUCCEEDED, state.finished
    assert len(state.steps) == 2
    # One question per decision: step 1 (before the kill), step 2 and the finish (after).
    assert sim.requests_of(task_id) == 3
    intents = [e for e in core.journal.of(task_id) if isinstance(e, StepIntended)]
    assert [e.n for e in intents] == [1, 2]
