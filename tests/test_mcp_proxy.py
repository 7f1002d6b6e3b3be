"""`halfway mcp serve`: an agent whose loop we don't own, driving the proxy through the `mcp`
SDK's own client, over stdio (the proxy as the client's subprocess) and streamable HTTP.

The agent retries like a model does: a new call after a timeout, with reworded arguments.
Judged from outside: the answers the agent reads, the provider's ledger and requests, and the
journal.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx2
import pytest
from mcp import Client
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import MCPError
from pydantic import BaseModel, ConfigDict

from halfway.contract import EffectClass, FinalState, StepSettled, TaskFinished
from halfway.models import History, ProposeCall, ProposeFinish
from halfway.tools.payments import charge_customer_spec
from halfway.tools.spec import ToolSpec

pytest.register_assert_rewrite("tests.processes")

from tests.processes import Cluster, stop  # noqa: E402

pytest_plugins = ["tests.processes"]

from halfway.mcp.calls import Call, CallQueues  # noqa: E402
from halfway.mcp.proxy import (  # noqa: E402
    mcp_tool,
    subject_of,
    without_key_advice,
    without_key_fields,
)

LONG_WAIT_S = 120.0
WAIT_S = "1.0"  # the proxy's wait for a step before it answers with what is known
SLOW_S = 8.0  # the provider's first charge: far past the 1 s charge timeout, then it commits
AGENT_TIMEOUT_S = 0.3  # an agent that gives up on a call sooner than the proxy answers
TRUTH_TRIES_MAX = 20  # calls (each up to the proxy's wait) until the settlement shows


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def text(result: Any) -> str:
    return "\n".join(getattr(block, "text", "") for block in result.content)


def charge(invoice: str) -> dict[str, Any]:
    return {"invoice": invoice, "customer": "cus_8812", "amount_cents": 4900}


def proxy_args(*extra: str) -> list[str]:
    return ["-m", "halfway", "mcp", "serve", "--wait-s", WAIT_S, *extra]


def assert_unknown_not_error(result: Any, invoice: str) -> None:
    words = text(result)
    assert not result.is_error, words
    assert words.startswith("status: unknown"), words
    assert f"do not start another charge_customer for invoice:{invoice}" in words, words
    assert result.structured_content["status"] == "unknown"


async def until_truth(call: Callable[[], Awaitable[Any]]) -> Any:
    """What an agent reads once it keeps asking after the journal settled the first call: the
    proxy may not have folded the settlement yet, and answers unknown until it has."""
    for _ in range(TRUTH_TRIES_MAX):
        result = await call()
        words = text(result)
        if not words.startswith("status: unknown"):
            return result
        assert not result.is_error, words
        assert "do not start another" in words, words
    raise AssertionError(f"still unknown after {TRUTH_TRIES_MAX} calls: {words}")


async def until_done(core: Cluster, task_id: str) -> StepSettled:
    event = await core.journal.first(
        lambda e: isinstance(e, StepSettled) and e.step_id == f"{task_id}:1"
        and e.outcome == "done", f"step {task_id}:1 done", timeout_s=LONG_WAIT_S)
    assert isinstance(event, StepSettled)
    return event


# --- the agent, through the real client and the real proxy --------------------------------------


@pytest.mark.broker
async def test_stdio_agent_retrying_a_timed_out_payment_pays_once(core: Cluster,
                                                                  tmp_path: Path) -> None:
    task_id = new_id("ide")
    invoice = f"INV-{task_id}"
    await core.faults({"match": {"nth": 1}, "times": 1, "action": {"delay_s": SLOW_S}})
    params = StdioServerParameters(command=sys.executable,
                                   args=proxy_args("--task", task_id), env=core.env())
    with (tmp_path / "proxy-stdio.log").open("w") as errlog:
        async with Client(stdio_client(params, errlog=errlog)) as agent:
            listed = (await agent.list_tools()).tools
            tool = next(t for t in listed if t.name == "charge_customer")
            assert "key" not in " ".join(tool.input_schema["properties"]).lower()
            assert "idempoten" not in (tool.description or "").lower()

            first = await agent.call_tool("charge_customer", charge(invoice))
            assert_unknown_not_error(first, invoice)  # slow at the provider: not an error

            # A model that reads "unknown" and retries anyway, rewording its arguments: first
            # giving up on its own call sooner than the proxy answers...
            with pytest.raises(MCPError, match="timed out"):
                await agent.call_tool("charge_customer", charge(invoice) | {"currency": "USD"},
                                      read_timeout_seconds=AGENT_TIMEOUT_S)
            # ...then reading the answer: the first call's state, not a second payment.
            second = await agent.call_tool("charge_customer",
                                           charge(invoice) | {"amount_cents": "49.00"})
            assert_unknown_not_error(second, invoice)
            assert second.structured_content["this_call_ran"] is False
            assert second.structured_content["step_id"] == f"{task_id}:1"

            settled = await until_done(core, task_id)  # lookups and retries settle the first
            assert settled.evidence is not None
            third = await until_truth(lambda: agent.call_tool("charge_customer",
                                                              charge(invoice)))
            words = text(third)
            # The truth, with evidence: the first call's done (answered from it, or refused
            # because the invoice is paid once, naming the payment), and this call not run.
            assert settled.evidence["charge_id"] in words, words
            assert "done" in words, words
            assert third.structured_content["this_call_ran"] is False

        # The session ended (the client closed stdin): its task finishes.
        state = (await core.journal.until_finished([task_id], timeout_s=LONG_WAIT_S))[task_id]
    assert state.final_state is FinalState.SUCCEEDED, state.finished

    ledger = [c for c in await core.ledger() if c["metadata"].get("invoice") == invoice]
    assert len(ledger) == 1, ledger  # one payment
    assert ledger[0]["id"] == settled.evidence["charge_id"]
    keys = {r["idempotency_key"] for r in await core.sim_requests()}
    assert keys == {f"{task_id}:1"}  # every attempt under the harness's one key
    steps = core.journal.states[task_id].steps
    assert sorted(steps) == [1]  # the retries never became steps


@pytest.mark.broker
async def test_http_agents_in_two_sessions_cannot_pay_one_invoice_twice(core: Cluster) -> None:
    url = await core.start_listener("mcp-http", proxy_args("--transport", "http", "--port", "0"))
    assert url.endswith("/mcp")
    task_a = new_id("agent-a")
    invoice = f"INV-{task_a}"
    await core.faults({"match": {"nth": 1}, "times": 1, "action": {"delay_s": SLOW_S}})

    # Agent A names its task with a header (the stateless 2026 protocol has no session).
    headers = {"Halfway-Task": task_a}
    async with httpx2.AsyncClient(headers=headers, timeout=httpx2.Timeout(30, read=300)) as http, \
            Client(streamable_http_client(url, http_client=http)) as agent_a:
        first = await agent_a.call_tool("charge_customer", charge(invoice))
        assert_unknown_not_error(first, invoice)

        # Agent B, another session (a stateful legacy one: its task is its Mcp-Session-Id),
        # pays the same invoice while A's payment is unknown: blocked by the subject guard.
        async with Client(url, mode="legacy") as agent_b:
            blocked = await agent_b.call_tool("charge_customer",
                                              charge(invoice) | {"currency": "usd"})
            assert_unknown_not_error(blocked, invoice)
            assert f"{task_a}:1" in text(blocked)  # names the payment that holds the invoice
            assert blocked.structured_content["this_call_ran"] is False

            settled = await until_done(core, task_a)
            assert settled.evidence is not None
            again = await until_truth(lambda: agent_b.call_tool("charge_customer",
                                                                charge(invoice)))
            # B's call is answered with A's payment: done, by another call, never "not done"
            # (which B's agent would read as "pay again").
            assert not again.is_error
            assert text(again).startswith(f"status: done by another call: {task_a}:1"), \
                text(again)
            assert settled.evidence["charge_id"] in text(again)
            assert again.structured_content["this_call_ran"] is False
            b_tasks = {e.task_id for e in core.journal.events if e.task_id.startswith("mcp-")}
            assert len(b_tasks) == 1
        # B's client closed its session (DELETE): B's task finishes.
        (b_task,) = b_tasks
        await core.journal.first(lambda e: isinstance(e, TaskFinished) and e.task_id == b_task,
                                 "B's task finished", timeout_s=LONG_WAIT_S)

    # No header and no session (the stateless protocol): the call is a task of its own, here
    # refused by the decider ("49.00" is not an integer number of cents) and then finished.
    async with Client(url) as anonymous:
        refused = await anonymous.call_tool("charge_customer",
                                            charge("INV-other") | {"amount_cents": "49.00"})
    assert refused.is_error
    assert "amount_cents" in text(refused), text(refused)
    lone = await core.journal.first(
        lambda e: isinstance(e, TaskFinished) and e.task_id.startswith("mcp-")
        and e.task_id != b_task, "the lone call's task finished", timeout_s=LONG_WAIT_S)
    assert not core.journal.states[lone.task_id].steps  # refused: nothing was placed

    # SIGTERM: the server stops gracefully, then the services under it; nothing is an error.
    (proxy,) = [p for p in core.procs if p.name.startswith("mcp-http")]
    assert await stop(proxy) == 0, proxy.tail()
    assert not [e for e in proxy.log_events() if e.get("level") == "error"], proxy.tail()

    ledger = [c for c in await core.ledger() if c["metadata"].get("invoice") == invoice]
    assert len(ledger) == 1, ledger
    assert {r["idempotency_key"] for r in await core.sim_requests()} == {f"{task_a}:1"}


@pytest.mark.broker
async def test_an_idle_session_ends_and_its_next_call_starts_the_next_task(
        core: Cluster, tmp_path: Path) -> None:
    task_id = new_id("idle")
    params = StdioServerParameters(command=sys.executable, env=core.env(),
                                   args=proxy_args("--task", task_id, "--idle-s", "1"))
    with (tmp_path / "proxy-idle.log").open("w") as errlog:
        async with Client(stdio_client(params, errlog=errlog)) as agent:
            first = await agent.call_tool("charge_customer", charge(f"INV-{task_id}"))
            assert first.structured_content["status"] == "done", text(first)
            # No call for longer than --idle-s: the session is ended and its task finishes.
            state = (await core.journal.until_finished([task_id], timeout_s=LONG_WAIT_S)
                     )[task_id]
            assert state.final_state is FinalState.SUCCEEDED, state.finished
            assert state.finished is not None
            assert state.finished.summary == "the MCP session ended"
            later = await agent.call_tool("charge_customer", charge(f"INV-{task_id}-2"))
    assert later.structured_content["status"] == "done", text(later)
    assert later.structured_content["step_id"] == f"{task_id}.2:1"  # the session's next task


@pytest.mark.broker
async def test_a_bridged_mcp_payment_retried_by_the_agent_is_one_payment(
        core: Cluster, tmp_path: Path) -> None:
    """halfway between two MCP parties: the agent calls the proxy, the proxy's app bridges the
    payments MCP server (`tests/mcp_servers/payments.py`, over stdio)."""
    from tests.test_mcp_bridge import mcp_app

    apps, environ, ledger = await mcp_app(core, tmp_path, "stdio")
    ledger.arm("create_payment", "slow", seconds=SLOW_S)
    task_id = new_id("bridged")
    invoice = f"INV-{task_id}"
    pay = {"invoice_id": invoice, "amount_cents": 4900}
    params = StdioServerParameters(
        command=sys.executable, cwd=str(apps), env=core.env(**environ),
        args=proxy_args("--app", "mcpagent:app", "--task", task_id))
    with (tmp_path / "proxy-bridged.log").open("w") as errlog:
        async with Client(stdio_client(params, errlog=errlog)) as agent:
            listed = {t.name: t for t in (await agent.list_tools()).tools}
            create = listed["create_payment"]
            assert not any("key" in name.lower() for name in create.input_schema["properties"])
            first = await agent.call_tool("create_payment", pay)
            words = text(first)
            assert not first.is_error, words
            assert words.startswith("status: unknown"), words
            for reworded in (pay | {"currency": "USD"}, pay | {"amount_cents": "49.00"}):
                retry = await agent.call_tool("create_payment", reworded)
                assert not retry.is_error, text(retry)
                assert text(retry).startswith("status: unknown"), text(retry)
                assert f"do not start another create_payment for invoice:{invoice}" \
                    in text(retry)
            settled = await until_done(core, task_id)
            assert settled.evidence is not None
            truth = await until_truth(lambda: agent.call_tool("create_payment", pay))
            assert settled.evidence["payment_id"] in text(truth), text(truth)

    payments = [p for p in ledger.payments() if p["invoice_id"] == invoice]
    assert [p["key"] for p in payments] == [f"{task_id}:1"]  # one payment, the harness's key
    assert {r["meta_key"] for r in ledger.requests("create_payment")} == {f"{task_id}:1"}


# --- the parts, without a broker ---------------------------------------------------------------


def test_listed_tools_never_ask_for_a_key() -> None:
    class Args(BaseModel):
        model_config = ConfigDict(extra="forbid")
        invoice: str
        idempotencyKey: str  # as an MCP server's schema might declare it

    spec = ToolSpec(name="create_payment", effect_class=EffectClass.KEYED, args_model=Args,
                    timeout_s=5.0, key_ttl_s=86_400.0,
                    description="Create a payment. Make the idempotency key unique for every "
                                "request. Amounts are in cents.")
    tool = mcp_tool(spec)
    assert set(tool.input_schema["properties"]) == {"invoice"}
    assert tool.input_schema["required"] == ["invoice"]
    assert tool.description is not None
    assert "idempoten" not in tool.description.lower()
    assert "Amounts are in cents." in tool.description
    assert without_key_advice("Send a new key with each request. Then wait.") == "Then wait."
    assert without_key_fields({"type": "object"}) == {"type": "object"}


def test_a_reworded_retry_still_names_its_subject() -> None:
    spec = charge_customer_spec()
    args = {"invoice": "INV-1", "customer": "cus_1", "amount_cents": 4900}
    assert subject_of(spec, args) == "invoice:INV-1"
    assert subject_of(spec, args | {"amount_cents": "49.00"}) == "invoice:INV-1"  # invalid
    assert subject_of(spec, {"customer": "cus_1"}) is None


def history(task_id: str, n: int, refusals: int = 0) -> History:
    return History(task_id=task_id, n=n, input={"mcp": {}}, tools=[],
                   refusals=["no"] * refusals)


def test_calls_are_handed_once_in_order_and_again_only_for_the_same_question() -> None:
    queues = CallQueues(per_task_max=2)
    a, b, c = (Call("t", "charge", {"i": i}, None) for i in range(3))
    assert queues.put(a)
    assert queues.put(b)
    assert not queues.put(c)  # bounded
    assert not queues.has_work("idle", 1, 0)
    assert queues.has_work("t", 1, 0)
    assert not queues.withdraw(a)  # promised to the decider
    first = queues.take(history("t", 1))
    assert isinstance(first, ProposeCall)
    assert first.args == {"i": 0}
    assert a.handed == (1, 0)
    # The decider dropped its answer and asks the same question: the same call again.
    assert queues.has_work("t", 1, 0)
    again = queues.take(history("t", 1))
    assert isinstance(again, ProposeCall)
    assert again.args == {"i": 0}
    assert queues.withdraw(b)  # not promised: the agent's handler takes it back
    assert not queues.has_work("t", 2, 0)
    queues.finish("t")
    assert queues.has_work("t", 2, 0)
    assert isinstance(queues.take(history("t", 2)), ProposeFinish)
