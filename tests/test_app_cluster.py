"""A user's app through real processes: `halfway run SERVICE --app MODULE:ATTR`.

The user's module lives in a directory of its own and is imported from the services' working
directory, as a user would run it. Judged from outside: the journal, the provider's ledger and
the model's call log.
"""

from __future__ import annotations

import textwrap
import uuid
from pathlib import Path

import pytest

from halfway.contract import FinalState, Outcome, SettlementSource, StepSettled, StepUnserved
from halfway.render import step_line

pytest.register_assert_rewrite("tests.processes")

from tests.processes import Cluster, charges_for, renewal_request, stop  # noqa: E402

pytest_plugins = ["tests.processes"]
pytestmark = pytest.mark.broker

LONG_WAIT_S = 120.0
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "tickets"

OTHER_APP = '''
from halfway import App

app = App(name="other", instructions="You only look things up.")


@app.tool(effect="read")
async def look_up(query: str) -> dict:
    """Look something up."""
    return {"query": query}
'''


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


async def test_a_step_no_executor_serves_is_reported_not_silent(core: Cluster,
                                                                tmp_path: Path) -> None:
    apps = tmp_path / "apps"
    apps.mkdir()
    (apps / "otheragent.py").write_text(textwrap.dedent(OTHER_APP))
    await core.start("decider")  # the built-in app: it decides a charge
    other = await core.start("executor", "--app", "otheragent:app", cwd=apps)
    await core.start("reconciler")
    task_id = new_id("unserved")
    await core.publish(renewal_request(task_id, reask=False))

    event = await core.journal.first(
        lambda e: isinstance(e, StepUnserved) and e.task_id == task_id,
        "the executor says it does not serve the step's tool", timeout_s=LONG_WAIT_S)
    assert isinstance(event, StepUnserved)
    assert event.tool == "charge_customer"
    assert event.app.startswith("other@")
    state = core.journal.states[task_id]
    step = state.step(1)
    assert step is not None
    assert "no executor here serves tool charge_customer" in step_line(step)

    # An executor of the right app joins the same group: both members say the group is mixed.
    right = await core.start("executor")
    mixed = "the members of this group serve different apps: tasks are split between them, " \
            "and a step for a tool one lacks waits for one that has it; run one app per " \
            "group (topic prefix)"
    await other.until_logged(mixed, timeout_s=LONG_WAIT_S)
    await right.until_logged(mixed, timeout_s=LONG_WAIT_S)
    logged = right.logged(mixed)[-1]
    assert len(logged["apps"]) == 2
    assert any(label.startswith("builtin@") for label in logged["apps"])
    await stop(other)

    state = (await core.journal.until_finished([task_id], timeout_s=LONG_WAIT_S))[task_id]
    assert state.final_state is FinalState.SUCCEEDED, state.finished


async def test_the_example_app_through_several_processes(core: Cluster) -> None:
    helpdesk = await core.start_listener(
        "helpdesk", [str(EXAMPLE / "helpdesk.py"), "--port", "0"], cwd=EXAMPLE)
    services = {"HELPDESK_URL": helpdesk}
    for service in ("decider", "executor", "reconciler"):
        await core.start(service, "--app", "ticketagent:app", cwd=EXAMPLE, **services)
    # The helpdesk answers the first ticket late: the call times out, the ticket exists.
    import httpx

    async with httpx.AsyncClient(base_url=helpdesk, timeout=30.0) as client:
        (await client.post("/faults", json={"slow_first_s": 8})).raise_for_status()
        task_id = new_id("tkt")
        from halfway.contract import TaskRequested
        from halfway.journal.records import stamp

        args = {"ref": "ACME-42", "title": "Printer on fire"}
        await core.publish(TaskRequested(
            **stamp(task_id), allowed_tools=["open_ticket"],
            input={"prompt": "Open a ticket for ACME-42: printer on fire",
                   "script": [{"tool": "open_ticket", "args": args}]}))

        state = (await core.journal.until_finished([task_id], timeout_s=LONG_WAIT_S))[task_id]

        assert state.final_state is FinalState.SUCCEEDED, state.finished
        step = state.step(1)
        assert step is not None
        assert step.outcome is Outcome.DONE
        settlement = step.effect.settlement
        assert settlement is not None
        assert settlement.source is SettlementSource.LOOKUP  # the reply came too late
        assert step.effect.unknowns, "the first attempt should have timed out"
        tickets = (await client.get("/tickets")).json()["data"]
        assert [t["ref"] for t in tickets] == ["ACME-42"]  # one effect in the ledger
        assert settlement.evidence is not None
        assert settlement.evidence["ticket_id"] == tickets[0]["id"]
    assert step.intent.decided_by.app is not None
    assert step.intent.decided_by.app.startswith("tickets@")
    asked = [c for c in core.model_calls() if c["task_id"] == task_id]
    assert sorted(c["n"] for c in asked) == [1, 2]  # the model asked once per step


UNFIT_UNDO_APP = '''
from halfway import App, Refused

app = App(name="unfit", instructions="Hold, then pay.")


@app.tool(effect="idempotent", saga_role="compensable", undo=("release", {"n": "$result.id"}))
async def hold(item: str) -> dict:
    """Hold an item."""
    return {"id": "not-a-number"}


@app.tool(effect="idempotent")
async def release(n: int) -> dict:
    """Release a hold."""
    return {"released": n}


@app.tool(effect="unkeyed", saga_role="pivot")
async def pay(amount: int) -> dict:
    """Pay."""
    raise Refused("the card was declined")
'''


async def test_an_undo_whose_arguments_do_not_fit_its_tool_is_not_done_never_sent(
        core: Cluster, tmp_path: Path) -> None:
    """An undo's arguments are filled from the step's result: one that does not fit the undo
    tool is never sent, so it is not done (not "unknown, it may have happened" after a
    traceback), and the saga needs an operator to undo the step."""
    from halfway.contract import CompensationAttempted, TaskPolicy, TaskRequested
    from halfway.journal.records import stamp

    apps = tmp_path / "apps"
    apps.mkdir()
    (apps / "unfitagent.py").write_text(textwrap.dedent(UNFIT_UNDO_APP))
    await core.start("worker", "--app", "unfitagent:app", cwd=apps)
    task_id = new_id("unfit")
    await core.publish(TaskRequested(
        **stamp(task_id), allowed_tools=["hold", "pay"], policy=TaskPolicy(saga=True),
        input={"script": [{"tool": "hold", "args": {"item": "seat-1"}},
                          {"tool": "pay", "args": {"amount": 49}}]}))

    state = (await core.journal.until_finished([task_id], timeout_s=LONG_WAIT_S))[task_id]
    assert state.final_state is FinalState.NEEDS_ATTENTION, state.finished
    step = state.step(1)
    assert step is not None
    assert step.undo.outcome is Outcome.NOT_DONE
    settlement = step.undo.settlement
    assert settlement is not None
    assert settlement.reason is not None
    assert settlement.reason.startswith("not sent: its arguments do not fit release (n: ")
    assert not [e for e in core.journal.events
                if isinstance(e, CompensationAttempted) and e.task_id == task_id]


STUBBORN_APP = '''
import asyncio

from halfway import App

app = App(name="stubborn", instructions="Do it.")


@app.tool(effect="keyed", key_ttl_s=3600, timeout_s=1.0)
async def stubborn(n: int) -> dict:
    """Never stops, whatever it is told."""
    while True:
        try:
            await asyncio.sleep(3600)
        except BaseException:
            pass


@stubborn.lookup
async def find(n: int) -> dict | None:
    return None
'''


async def test_a_tool_that_will_not_stop_keeps_its_step_in_flight_but_not_its_process(
        core: Cluster, tmp_path: Path) -> None:
    """A tool that swallows its timeout's cancellation may still send: its step stays in
    flight (never "unknown", which a lookup finding nothing could turn into "not done" before
    a late request lands), it is said in the log, and a stopped worker exits without waiting
    for it (exit 0, not a kill)."""
    from halfway.contract import StepAttempted, TaskRequested
    from halfway.journal.records import stamp

    apps = tmp_path / "apps"
    apps.mkdir()
    (apps / "stubbornagent.py").write_text(textwrap.dedent(STUBBORN_APP))
    worker = await core.start("worker", "--app", "stubbornagent:app", cwd=apps)
    task_id = new_id("stubborn")
    await core.publish(TaskRequested(
        **stamp(task_id), allowed_tools=["stubborn"],
        input={"script": [{"tool": "stubborn", "args": {"n": 1}}]}))

    await core.journal.first(lambda e: isinstance(e, StepAttempted) and e.task_id == task_id,
                             "the step attempted", timeout_s=LONG_WAIT_S)
    await worker.until_logged("a tool call runs on past its timeout (it would not stop when "
                              "cancelled, or runs on a thread): its step stays in flight until "
                              "it ends, as it may still send", timeout_s=LONG_WAIT_S)
    assert not [e for e in core.journal.events
                if isinstance(e, StepSettled) and e.task_id == task_id]
    assert await stop(worker) == 0  # not killed: it did not wait for the tool
    assert worker.logged("stopped with tool calls that would not stop still running: exiting "
                         "without waiting for them")


ONE_SEAT_APP = '''
import asyncio

from halfway import App

app = App(name="seats", instructions="Book the seat.")


@app.tool(effect="idempotent", subject="seat:{seat}")
async def book(seat: str, who: str) -> dict:
    """Book a seat for a while."""
    await asyncio.sleep(0.2)
    return {"seat": seat, "who": who}
'''


async def test_tasks_waiting_on_one_subject_are_woken_one_at_a_time(
        core: Cluster, tmp_path: Path) -> None:
    """Ten tasks on one seat: each release wakes the first waiting task, not all of them. Woken
    together, each would ask again and be refused again: 45 refusals (and questions) for ten
    tasks, N(N-1)/2, where one at a time makes about one each."""
    from halfway.contract import StepRefused, TaskRequested
    from halfway.journal.records import stamp

    apps = tmp_path / "apps"
    apps.mkdir()
    (apps / "seatagent.py").write_text(textwrap.dedent(ONE_SEAT_APP))
    await core.start("worker", "--app", "seatagent:app", cwd=apps)
    seat, tasks = new_id("seat"), [new_id("seat-task") for _ in range(10)]
    for task_id in tasks:
        await core.publish(TaskRequested(
            **stamp(task_id), allowed_tools=["book"],
            input={"script": [{"tool": "book", "args": {"seat": seat, "who": task_id}}]}))

    states = await core.journal.until_finished(tasks, timeout_s=LONG_WAIT_S)
    assert all(s.final_state is FinalState.SUCCEEDED for s in states.values())
    blocked = [e for e in core.journal.events
               if isinstance(e, StepRefused) and e.task_id in states and e.blocked is not None]
    assert len(blocked) <= 2 * len(tasks), len(blocked)


async def test_a_task_requested_but_not_started_can_be_called_off_and_never_starts(
        core: Cluster) -> None:
    """Its decider down, a task waits on the tasks topic: an operator may call it off, and
    it is rejected when a decider comes, never started."""
    from halfway.contract import TaskRejected
    from halfway.resolve import abort_task

    task_id = new_id("early")
    await core.publish(renewal_request(task_id, reask=False))
    await abort_task(core.settings, task_id, reason="wrong customer", by="os:alice")
    await core.start("worker")
    rejected = await core.journal.first(
        lambda e: isinstance(e, TaskRejected) and e.task_id == task_id, "the task rejected",
        timeout_s=LONG_WAIT_S)
    assert isinstance(rejected, TaskRejected)
    assert rejected.reason == "called off before it started, by os:alice: wrong customer"
    assert not [e for e in core.journal.events if e.task_id == task_id
                and e.type in ("task.started", "step.intended")]
    assert charges_for(await core.ledger(), f"{task_id}:1") == []  # and the provider saw none
