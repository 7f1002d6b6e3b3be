"""The MCP bridge: an MCP server's tools as halfway tools.

Unit tests of the pure parts (effect classes from annotations and overrides, what a result or
an error proves, the argument schema), the adapter against the real test server
(`tests/mcp_servers/payments.py`, over stdio and streamable HTTP, no broker), and the whole
harness through real processes and the real journal.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import textwrap
import uuid
from pathlib import Path
from typing import Any

import pytest
from mcp.shared.exceptions import MCPError
from mcp_types import (
    CONNECTION_CLOSED,
    INTERNAL_ERROR,
    INVALID_PARAMS,
    REQUEST_TIMEOUT,
    CallToolResult,
    TextContent,
    Tool,
    ToolAnnotations,
)
from pydantic import ValidationError

from halfway import App
from halfway.contract import EffectClass, FinalState, Outcome, SettlementSource, TaskRequested
from halfway.core.args import parse_args
from halfway.core.classify import (
    ConnectionLost,
    NotSent,
    TimedOut,
    ToolRefused,
    Unexpected,
    classify,
)
from halfway.journal.records import stamp
from halfway.mcp import McpBridge, McpUnavailable
from halfway.mcp.overrides import ToolOverride, effect_class_of, parse_overrides
from halfway.mcp.results import call_failure, call_result, lookup_result
from halfway.tools.spec import CallContext, Found, LookupFailed, NotFound, Succeeded

pytest.register_assert_rewrite("tests.processes")

from tests.mcp_servers.payments import Ledger  # noqa: E402
from tests.processes import Cluster  # noqa: E402

pytest_plugins = ["tests.processes"]

SERVER = Path(__file__).resolve().parent / "mcp_servers" / "payments.py"
LONG_WAIT_S = 120.0
SLOW_COMMIT_S = 6.0  # past the create's 1 s timeout and past both of its attempts
SERVER_START_S = 30.0

OVERRIDES: dict[str, Any] = {
    "create_payment": {"effect": "keyed", "key_ttl_s": 86_400, "timeout_s": 1.0,
                       "attempts": 2, "subject": "invoice:{invoice_id}",
                       "lookup": "find_payment", "evidence_id": "payment_id"},
    "send_receipt": {"timeout_s": 1.0},
    "get_balance": {"timeout_s": 5.0},
}

# The user's app, imported by each service from its working directory.
APP = '''
import os

from halfway import App

app = App(name="mcppay", instructions="You collect payments.")
if os.environ.get("PAYMENTS_MCP_URL"):
    target = {"url": os.environ["PAYMENTS_MCP_URL"]}
else:
    target = {"command": ["python", os.environ["PAYMENTS_MCP_SERVER"],
                          "--db", os.environ["PAYMENTS_MCP_DB"]]}
app.mcp("payments", **target, tools=%r)
'''


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def listed(name: str, annotations: ToolAnnotations | None = None,
           properties: dict[str, Any] | None = None, required: list[str] | None = None
           ) -> Tool:
    schema: dict[str, Any] = {"type": "object", "properties": properties or {}}
    if required:
        schema["required"] = required
    return Tool(name=name, description=f"{name}.", input_schema=schema, annotations=annotations)


def text_result(text: str, *, is_error: bool = False, structured: Any = None
                ) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=text)] if text else [],
                          structured_content=structured, is_error=is_error)


# --- effect classes ------------------------------------------------------------------------------


@pytest.mark.parametrize(("annotations", "expected"), [
    (None, EffectClass.UNKEYED),  # missing annotations are the unsafe case
    (ToolAnnotations(), EffectClass.UNKEYED),
    (ToolAnnotations(destructive_hint=False), EffectClass.UNKEYED),
    (ToolAnnotations(read_only_hint=False, idempotent_hint=False), EffectClass.UNKEYED),
    (ToolAnnotations(idempotent_hint=True), EffectClass.IDEMPOTENT),
    (ToolAnnotations(read_only_hint=True), EffectClass.READ),
    (ToolAnnotations(read_only_hint=True, idempotent_hint=True), EffectClass.READ),
])
def test_effect_class_from_annotations(annotations: ToolAnnotations | None,
                                       expected: EffectClass) -> None:
    assert effect_class_of(annotations, None) is expected
    assert effect_class_of(annotations, ToolOverride()) is expected


def test_an_override_wins_over_the_hints() -> None:
    keyed = ToolOverride(effect="keyed", key_ttl_s=60)
    assert effect_class_of(None, keyed) is EffectClass.KEYED
    assert effect_class_of(ToolAnnotations(read_only_hint=True), keyed) is EffectClass.KEYED
    unkeyed = ToolOverride(effect="unkeyed")
    assert effect_class_of(ToolAnnotations(idempotent_hint=True), unkeyed) \
        is EffectClass.UNKEYED


def test_overrides_are_checked_at_declaration() -> None:
    with pytest.raises(ValueError, match="key_ttl_s"):
        parse_overrides("billing", {"create_payment": {"effect": "keyed"}})
    with pytest.raises(ValueError, match=r"create_payment: unknown setting 'retires'"):
        parse_overrides("billing", {"create_payment": {"retires": 3}})  # a typo is an error
    with pytest.raises(ValueError, match="positive"):
        parse_overrides("billing", {"create_payment": {"timeout_s": 0}})
    with pytest.raises(ValueError, match="exactly one"):
        App(name="a").mcp("billing", command=["x"], url="http://127.0.0.1:1/mcp")


# --- what a result proves ------------------------------------------------------------------------


def test_a_normal_result_is_done_with_the_structured_content() -> None:
    result = call_result(text_result("paid", structured={"payment_id": "pay_1"}),
                         errors_are_refusals=False)
    assert result == Succeeded(evidence={"payment_id": "pay_1"})
    wrapped = call_result(text_result("", structured={"result": "pay_2"}),
                          errors_are_refusals=False)
    assert wrapped == Succeeded(evidence={"result": "pay_2"})
    text_only = call_result(text_result("receipt sent"), errors_are_refusals=False)
    assert text_only == Succeeded(evidence={"text": "receipt sent"})


def test_an_error_result_is_unknown_unless_errors_are_refusals() -> None:
    error = text_result("card_declined", is_error=True)
    unknown = call_result(error, errors_are_refusals=False)
    assert isinstance(unknown, Unexpected)
    assert classify(unknown).outcome is Outcome.UNKNOWN
    assert "card_declined" in classify(unknown).reason
    refused = call_result(error, errors_are_refusals=True)
    assert refused == ToolRefused("card_declined")
    assert classify(refused, attempt=2).outcome is Outcome.NOT_DONE


@pytest.mark.parametrize(("exc", "kind", "outcome"), [
    (MCPError(REQUEST_TIMEOUT, "timed out"), TimedOut, Outcome.UNKNOWN),
    (TimeoutError(), TimedOut, Outcome.UNKNOWN),
    (MCPError(CONNECTION_CLOSED, "Connection closed"), ConnectionLost, Outcome.UNKNOWN),
    (MCPError(INTERNAL_ERROR, "boom"), Unexpected, Outcome.UNKNOWN),
    (MCPError(-32009, "key in flight"), Unexpected, Outcome.UNKNOWN),
    (MCPError(INVALID_PARAMS, "bad arguments"), ToolRefused, Outcome.NOT_DONE),
    (RuntimeError("output schema"), Unexpected, Outcome.UNKNOWN),
])
def test_what_a_failure_after_sending_proves(exc: BaseException, kind: type,
                                             outcome: Outcome) -> None:
    failure = call_failure(exc, 1.0)
    assert isinstance(failure, kind)
    assert classify(failure, attempt=1).outcome is outcome


def test_a_lookup_result() -> None:
    assert isinstance(lookup_result(text_result("", structured={"result": None})), NotFound)
    assert isinstance(lookup_result(text_result("", structured={"found": False})), NotFound)
    assert isinstance(lookup_result(text_result("")), NotFound)
    found = lookup_result(text_result("{}", structured={"result": {"payment_id": "pay_1"}}))
    assert found == Found(evidence={"payment_id": "pay_1"})
    assert isinstance(lookup_result(text_result("down", is_error=True)), LookupFailed)


# --- specs from a listing ------------------------------------------------------------------------


def bridge(**tools: Any) -> McpBridge:
    return McpBridge("payments", command=["python", str(SERVER)], tools=tools)


LISTING = [
    listed("create_payment", None,
           {"invoice_id": {"type": "string"}, "amount_cents": {"type": "integer"},
            "idempotencyKey": {"type": "string"}}, ["invoice_id", "amount_cents"]),
    listed("find_payment", ToolAnnotations(read_only_hint=True),
           {"invoice_id": {"type": "string"}, "idempotencyKey": {"type": "string"}}),
    listed("send_receipt", None, {"email": {"type": "string"}}, ["email"]),
]


def test_specs_from_a_listing_hide_the_key_and_are_deterministic() -> None:
    overrides = {"create_payment": OVERRIDES["create_payment"]}
    tools = {t.spec.name: t for t in bridge(**overrides).tools_from(LISTING)}
    create = tools["create_payment"].spec
    assert create.effect_class is EffectClass.KEYED
    assert create.has_lookup
    assert tools["send_receipt"].spec.effect_class is EffectClass.UNKEYED
    assert not tools["send_receipt"].spec.has_lookup
    schema = create.args_model.model_json_schema()
    assert "idempotencyKey" not in schema["properties"]  # the model never chooses the key
    args = parse_args(create.args_model, {"invoice_id": "INV-1", "amount_cents": 4900})
    assert create.subject(args) == "invoice:INV-1"
    with pytest.raises(ValidationError, match="set by the harness"):
        parse_args(create.args_model, {"invoice_id": "INV-1", "amount_cents": 4900,
                                       "idempotencyKey": "mine"})
    with pytest.raises(ValidationError, match="is not of type 'integer'"):
        parse_args(create.args_model, {"invoice_id": "INV-1", "amount_cents": "49.00"})

    from halfway.app.app import fingerprint_of

    again = bridge(**overrides).tools_from(list(reversed(LISTING)))
    assert fingerprint_of(t.spec for t in again) == fingerprint_of(t.spec
                                                                   for t in tools.values())


def test_a_listing_that_does_not_fit_the_overrides_is_an_error() -> None:
    with pytest.raises(ValueError, match="has no tool refund_payment"):
        bridge(refund_payment={"effect": "idempotent"}).tools_from(LISTING)
    with pytest.raises(ValueError, match="must be read-only"):
        bridge(create_payment={"lookup": "send_receipt"}).tools_from(LISTING)
    with pytest.raises(ValueError, match="not required arguments"):
        bridge(find_payment={"subject": "invoice:{invoice_id}"}).tools_from(LISTING)


UNUSABLE_SCHEMAS = {
    "banana": {"type": "banana"},  # not a JSON Schema
    "nowhere": {"x": {"$ref": "#/$defs/nowhere"}},  # a reference to nothing
    "remote": {"x": {"$ref": "http://127.0.0.1:9/schema.json"}},  # never fetched
    "itself": {"$ref": "#"},  # checking anything recurses for ever
}


def test_a_tool_whose_schema_cannot_check_arguments_is_left_out_and_the_rest_served(
        ) -> None:
    """The server's mistake, not the app's: no service stops (a crash loop under a
    supervisor), and no proposal of the tool reaches a schema that raises while placing it."""
    unusable = [Tool(name=f"bad_{why}", description="Bad.",
                     input_schema={"type": "object", "properties": schema}
                     if why in ("nowhere", "remote") else {"type": "object", **schema}
                     if why == "itself" else schema)
                for why, schema in UNUSABLE_SCHEMAS.items()]
    tools = bridge(bad_nowhere={"errors_are_refusals": True}).tools_from([*LISTING, *unusable])
    assert sorted(t.spec.name for t in tools) == ["create_payment", "find_payment",
                                                  "send_receipt"]


def test_arguments_a_schema_cannot_check_are_refused_in_words_not_raised() -> None:
    """A reference that recurses for some arguments only: a refusal the model reads (and
    counts), never an exception in the decider."""
    [tool] = bridge().tools_from([Tool(name="loops", description="Loops.", input_schema={
        "type": "object", "properties": {"a": {"$ref": "#/properties/a"}}})])
    with pytest.raises(ValidationError, match="cannot check them: RecursionError"):
        parse_args(tool.spec.args_model, {"a": 1})
    assert parse_args(tool.spec.args_model, {}) is not None


# --- the adapter against the real server ---------------------------------------------------------


def context(key: str, attempt: int = 1, timeout_s: float = 5.0) -> CallContext:
    return CallContext(f"{key}-task:1", key, attempt, timeout_s)


async def prepared(target: dict[str, Any]) -> App:
    app = App(name="mcppay")
    app.mcp("payments", **target, tools=OVERRIDES)
    await app.prepare(wait_s=SERVER_START_S)
    return app


async def test_a_dropped_session_is_unknown_settled_by_lookup_and_reopened(tmp_path: Path
                                                                         ) -> None:
    db = tmp_path / "ledger.sqlite"
    ledger = Ledger(db)
    app = await prepared({"command": ["python", str(SERVER), "--db", str(db)]})
    registry = app.registry()
    try:
        create = registry.get("create_payment")
        assert create is not None
        args = parse_args(create.spec.args_model, {"invoice_id": "INV-7", "amount_cents": 700})
        ledger.arm("create_payment", "drop")  # commit, then the server process exits
        result = await create.adapter.call(args, context("k-drop"))
        assert isinstance(result, ConnectionLost), result
        assert classify(result).outcome is Outcome.UNKNOWN
        found = await create.adapter.lookup(args, context("k-drop"))  # a new session
        assert isinstance(found, Found), found
        assert found.evidence["key"] == "k-drop"
        assert [p["key"] for p in ledger.payments()] == ["k-drop"]
        bridged = app._mcp["payments"]
        assert bridged.connection.opened == 2
        # The new session is reused: more calls open nothing.
        for n in range(3):
            again = await create.adapter.call(args, context(f"k-{n}"))
            assert isinstance(again, Succeeded), again
        assert bridged.connection.opened == 2
    finally:
        await registry.aclose()


async def test_a_server_that_cannot_be_reached_is_never_reached(tmp_path: Path) -> None:
    app = App(name="mcppay")
    app.mcp("payments", url="http://127.0.0.1:9/mcp", tools=OVERRIDES)
    with pytest.raises(McpUnavailable, match=r"did not list its tools within 0\.5 s"):
        await app.prepare(wait_s=0.5)
    with pytest.raises(RuntimeError, match=r"await app\.prepare"):
        app.registry()
    # Known tools, then the server goes away: the call never leaves.
    bridged = McpBridge("payments", url="http://127.0.0.1:9/mcp",
                        tools={"create_payment": OVERRIDES["create_payment"]})
    tools = {t.spec.name: t for t in bridged.tools_from(LISTING)}
    create = tools["create_payment"]
    args = parse_args(create.spec.args_model, {"invoice_id": "INV-1", "amount_cents": 1})
    result = await create.adapter.call(args, context("k-down"))
    assert isinstance(result, NotSent), result
    assert classify(result, attempt=1).outcome is Outcome.NOT_DONE
    assert classify(result, attempt=2).outcome is Outcome.UNKNOWN
    assert isinstance(await create.adapter.lookup(args, context("k-down")), LookupFailed)
    await bridged.aclose()


async def test_a_service_start_waits_for_a_server_that_is_down(tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port nothing listens on, yet
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    app = App(name="mcppay")
    app.mcp("payments", url=f"http://127.0.0.1:{port}/mcp", tools=OVERRIDES)
    preparing = asyncio.create_task(app.prepare())  # as a service does: no bound
    server = None
    try:
        connection = app._mcp["payments"].connection
        async with asyncio.timeout(SERVER_START_S):
            while connection.failures < 2:  # it tried, failed, and is trying again
                assert not preparing.done(), preparing
                await asyncio.sleep(0.05)
        server = await asyncio.create_subprocess_exec(
            sys.executable, str(SERVER), "--db", str(tmp_path / "ledger.sqlite"), "--http",
            "--port", str(port), stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL)
        assert server.stdout is not None
        async with asyncio.timeout(SERVER_START_S):
            assert (await server.stdout.readline()).startswith(b"listening on")
            await preparing
        assert sorted(app.tool_names) == ["create_payment", "find_payment", "get_balance",
                                          "send_receipt"]
    finally:
        preparing.cancel()
        await app.close_mcp()
        if server is not None:
            server.terminate()
            await server.wait()


# --- through the harness -------------------------------------------------------------------------


async def mcp_app(core: Cluster, tmp_path: Path, transport: str) -> tuple[Path, dict[str, str],
                                                                           Ledger]:
    """The app's directory, the services' environment and the server's ledger."""
    apps = tmp_path / "apps"
    apps.mkdir()
    (apps / "mcpagent.py").write_text(textwrap.dedent(APP % (OVERRIDES,)))
    db = tmp_path / "ledger.sqlite"
    ledger = Ledger(db)
    if transport == "http":
        url = await core.start_listener(
            "mcp-payments", [str(SERVER), "--db", str(db), "--http", "--port", "0"])
        environ = {"PAYMENTS_MCP_URL": url}
    else:
        environ = {"PAYMENTS_MCP_SERVER": str(SERVER), "PAYMENTS_MCP_DB": str(db)}
    return apps, environ, ledger


async def start_services(core: Cluster, apps: Path, environ: dict[str, str]) -> None:
    for service in ("decider", "executor", "reconciler"):
        await core.start(service, "--app", "mcpagent:app", cwd=apps, **environ)


def task(task_id: str, tool: str, args: dict[str, Any]) -> TaskRequested:
    return TaskRequested(**stamp(task_id), allowed_tools=[tool],
                         input={"prompt": f"use {tool}",
                                "script": [{"tool": tool, "args": args}]})


@pytest.mark.broker
@pytest.mark.parametrize("transport", ["stdio", "http"])
async def test_a_create_that_times_out_and_commits_late_is_one_payment(
        core: Cluster, tmp_path: Path, transport: str) -> None:
    apps, environ, ledger = await mcp_app(core, tmp_path, transport)
    ledger.arm("create_payment", "slow", seconds=SLOW_COMMIT_S)
    await start_services(core, apps, environ)
    task_id = new_id("mcp-pay")
    await core.publish(task(task_id, "create_payment",
                            {"invoice_id": f"INV-{task_id}", "amount_cents": 4900}))

    state = (await core.journal.until_finished([task_id], timeout_s=LONG_WAIT_S))[task_id]

    assert state.final_state is FinalState.SUCCEEDED, state.finished
    step = state.step(1)
    assert step is not None
    assert step.outcome is Outcome.DONE
    key = step.intent.key
    payments = ledger.payments()
    assert [p["key"] for p in payments] == [key]  # one effect in the server's ledger
    settlement = step.effect.settlement
    assert settlement is not None
    assert settlement.source is SettlementSource.LOOKUP  # the reply never came in time
    assert settlement.evidence is not None
    assert settlement.evidence["payment_id"] == payments[0]["payment_id"]
    assert step.effect.unknowns, "the first attempt should have timed out"
    attempts = ledger.requests("create_payment")
    assert len(attempts) == len(step.effect.attempts) == 2  # the retry, with the same key
    for seen in attempts:  # the key on every attempt, in _meta and in the declared argument
        assert seen["meta_key"] == key
        assert seen["arg_key"] == key
        assert seen["step_id"] == f"{task_id}:1"
    lookups = ledger.requests("find_payment")
    assert lookups
    assert all(seen["meta_key"] == key for seen in lookups)
    assert step.intent.decided_by.app is not None
    assert step.intent.decided_by.app.startswith("mcppay@")


@pytest.mark.broker
async def test_unannotated_tools_are_never_retried_and_read_only_ones_are(
        core: Cluster, tmp_path: Path) -> None:
    apps, environ, ledger = await mcp_app(core, tmp_path, "stdio")
    ledger.arm("send_receipt", "slow", seconds=3.0)  # past its 1 s timeout; it lands
    ledger.arm("get_balance", "error", times=2)  # two isError answers, then the balance
    await start_services(core, apps, environ)
    receipt, balance = new_id("mcp-rcpt"), new_id("mcp-bal")
    await core.publish(task(receipt, "send_receipt",
                            {"invoice_id": "INV-1", "email": "ada@example.com"}),
                       task(balance, "get_balance", {}))

    states = await core.journal.until_settled_or_stuck([receipt, balance],
                                                       timeout_s=LONG_WAIT_S)

    read = states[balance].step(1)
    assert read is not None
    assert read.outcome is Outcome.DONE
    assert states[balance].final_state is FinalState.SUCCEEDED
    assert len(ledger.requests("get_balance")) == 3  # retried past two errors
    unkeyed = states[receipt].step(1)
    assert unkeyed is not None
    assert unkeyed.outcome is Outcome.UNKNOWN
    assert states[receipt].needs_attention  # nothing may settle it but an operator
    assert len(unkeyed.effect.attempts) == 1
    assert len(ledger.requests("send_receipt")) == 1  # never sent again
    assert len(ledger.receipts()) == 1
    assert all(seen["meta_key"] == unkeyed.intent.key
               for seen in ledger.requests("send_receipt"))
