"""The bridge: an MCP server's tools as ordinary halfway tools (a `ToolSpec` and an adapter
each), so the decider, the executor and the reconciler treat them like any other tool.

    app.mcp("billing", command=["python", "billing_server.py"],
            tools={"create_payment": {"effect": "keyed", "key_ttl_s": 86_400,
                                      "subject": "invoice:{invoice_id}",
                                      "lookup": "find_payment"}})

Theory of operation:

- **Discovery.** The server's tools are listed once per process, when a service starts
  (`App.prepare()`, before the registry is built): the decider must offer them to the model and
  the executor must serve them before either acts. While the server is down the service waits,
  retrying with a bounded backoff and saying so in its log, instead of exiting (a supervisor
  would restart it into the same wall: a crash loop) or starting without those tools (the app's
  label would differ between processes, and steps for the missing tools would wait for an
  executor that has them). The specs are built from the listing and the app's overrides alone,
  in name order, so every process that sees the same server computes the same app label.
- **Effect class**: from the app's override, else from the tool's annotations, missing ones
  meaning `unkeyed` (`halfway.mcp.overrides`).
- **The key** travels with every attempt, in the request's `_meta` under
  `io.halfway/idempotency-key` (the step id under `io.halfway/step-id`), and in the
  `idempotencyKey` argument when the tool's input schema declares one; that argument is hidden
  from the model's schema (`halfway.mcp.schema`).
- **Outcomes** (`halfway.mcp.results`): the answer is classified; whether the request was sent
  is decided by whether a session could be had (`halfway.mcp.connection`).
- **Lookups**: the tool named by the override's `lookup`, a read-only tool of the same server,
  called with our key (in `_meta`, and as `idempotencyKey` if it declares one) and those of
  the step's arguments its schema declares. The tasks extension (a task handle to poll) is not
  used: the SDK installed (mcp 2.3) ships the 2025-11-25 task types but no client for the
  2026-07-28 tasks extension, and a lost `CreateTaskResult` leaves no handle anyway, so the
  lookup tool is what settles an unknown.
- **Sessions**: one per server per process, reused by every call and lookup, reopened with a
  bounded backoff after it breaks, closed when the service stops.
"""

from __future__ import annotations

import asyncio
import shlex
import string
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mcp_types
from mcp.client.stdio import StdioServerParameters
from mcp.shared.exceptions import MCPError
from pydantic import BaseModel

from halfway import log
from halfway.app.app import TOOL_NAME
from halfway.contract import EffectClass, SagaRole
from halfway.core.classify import ConnectionLost, NotSent
from halfway.mcp.connection import Connection, NotConnected, describe
from halfway.mcp.overrides import ToolOverride, effect_class_of, parse_overrides
from halfway.mcp.results import call_failure, call_result, lookup_result
from halfway.mcp.schema import McpArgs, UnusableSchema, args_model
from halfway.tools.registry import Tool
from halfway.tools.spec import CallContext, CallResult, LookupFailed, LookupResult, ToolSpec

KEY_META = "io.halfway/idempotency-key"
STEP_META = "io.halfway/step-id"
KEY_ARGUMENT = "idempotencyKey"  # the argument a server may declare for our key
DEFAULT_TIMEOUT_S = 10.0  # one attempt of a bridged tool, unless its override says
CONNECT_TIMEOUT_S = 10.0  # opening a session (a stdio server is a process to start)
LIST_TIMEOUT_S = 30.0  # listing the tools, every page
LIST_PAGES_MAX = 100  # a paginator that never ends cannot hang a service's start
SCHEMA_REASON_CHARS_MAX = 500  # of why a tool's schema is left out, in a log line
SERVER_NAME = TOOL_NAME


class McpUnavailable(Exception):
    """The server did not answer within the wait a caller allowed (`App.prepare(wait_s=...)`)."""


@dataclass(frozen=True, slots=True)
class LookupTool:
    name: str
    properties: frozenset[str]
    takes_key: bool  # declares `idempotencyKey`


def _meta(ctx: CallContext) -> dict[str, Any]:
    return {KEY_META: ctx.key, STEP_META: ctx.step_id}


class McpToolAdapter:
    """Calls one tool of the server (and its lookup tool) through the shared session."""

    def __init__(self, bridge: McpBridge, name: str, *, takes_key: bool,
                 errors_are_refusals: bool, lookup: LookupTool | None) -> None:
        self.bridge = bridge
        self.name = name
        self.takes_key = takes_key
        self.errors_are_refusals = errors_are_refusals
        self.lookup_tool = lookup

    async def call(self, args: BaseModel, ctx: CallContext) -> CallResult:
        started = time.monotonic()
        connection = self.bridge.connection
        try:
            client = await connection.client(min(self.bridge.connect_timeout_s, ctx.timeout_s))
        except NotConnected as exc:
            return NotSent(str(exc))
        left_s = ctx.timeout_s - (time.monotonic() - started)
        if left_s <= 0:
            return NotSent(f"the session with MCP server {self.bridge.name} opened too late to "
                           f"send within {ctx.timeout_s:g} s")
        arguments = args.model_dump(mode="json")
        if self.takes_key:
            arguments[KEY_ARGUMENT] = ctx.key
        try:
            result = await client.call_tool(self.name, arguments, read_timeout_seconds=left_s,
                                            meta=_meta(ctx))  # type: ignore[arg-type]
        except Exception as exc:
            failure = call_failure(exc, ctx.timeout_s)
            if isinstance(failure, ConnectionLost):
                connection.mark_broken()
            return failure
        return call_result(result, errors_are_refusals=self.errors_are_refusals)

    async def lookup(self, args: BaseModel, ctx: CallContext) -> LookupResult:
        lookup = self.lookup_tool
        if lookup is None:
            return LookupFailed("this tool has no lookup")
        connection = self.bridge.connection
        try:
            client = await connection.client(min(self.bridge.connect_timeout_s, ctx.timeout_s))
        except NotConnected as exc:
            return LookupFailed(str(exc))
        arguments = {k: v for k, v in args.model_dump(mode="json").items()
                     if k in lookup.properties}
        if lookup.takes_key:
            arguments[KEY_ARGUMENT] = ctx.key
        try:
            result = await client.call_tool(lookup.name, arguments,
                                            read_timeout_seconds=ctx.timeout_s,
                                            meta=_meta(ctx))  # type: ignore[arg-type]
        except Exception as exc:
            if isinstance(call_failure(exc, ctx.timeout_s), ConnectionLost):
                connection.mark_broken()
            return LookupFailed(f"the lookup tool {lookup.name} failed: {describe(exc)}")
        return lookup_result(result)


class McpBridge:
    """One MCP server an app declares (`App.mcp`): its session and its tools."""

    def __init__(self, name: str, *, command: Sequence[str] | str | None = None,
                 url: str | None = None,
                 tools: Mapping[str, Mapping[str, Any] | ToolOverride] | None = None,
                 env: Mapping[str, str] | None = None, cwd: str | None = None,
                 headers: Mapping[str, str] | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S,
                 connect_timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        if SERVER_NAME.fullmatch(name) is None:
            raise ValueError(f"MCP server name {name!r} must match {SERVER_NAME.pattern}")
        if (command is None) == (url is None):
            raise ValueError(f"MCP server {name}: give command=[...] (stdio) or url=... "
                             f"(streamable HTTP), exactly one")
        if timeout_s <= 0 or connect_timeout_s <= 0:
            raise ValueError(f"MCP server {name}: timeouts must be positive")
        target: StdioServerParameters | str
        if command is not None:
            argv = shlex.split(command) if isinstance(command, str) else [str(c) for c in command]
            if not argv:
                raise ValueError(f"MCP server {name}: command is empty")
            if headers:
                raise ValueError(f"MCP server {name}: headers are for url=..., not command")
            # "python" means this interpreter: the server runs in the app's environment.
            executable = sys.executable if argv[0] in ("python", "python3") else argv[0]
            target = StdioServerParameters(command=executable, args=argv[1:],
                                           env=dict(env) if env else None, cwd=cwd)
        else:
            assert url is not None
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"MCP server {name}: url must be http:// or https://, "
                                 f"got {url!r}")
            if env or cwd:
                raise ValueError(f"MCP server {name}: env and cwd are for command=[...]")
            target = url
        self.name = name
        self.overrides = parse_overrides(name, tools)
        self.timeout_s = float(timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.connection = Connection(name, target, headers=dict(headers or {}))
        self.tools: list[Tool] | None = None

    @property
    def _log(self) -> Any:
        # Bound at use, not at import: the process configures its logging after the app loads.
        return log.get("halfway.mcp").bind(server=self.name)

    async def discover(self, wait_s: float | None = None) -> list[Tool]:
        """The server's tools as halfway tools, listed once. While the server cannot be
        reached, waits (backoff, logged); `wait_s` bounds the wait (None: until it answers)."""
        if self.tools is not None:
            return self.tools
        deadline = None if wait_s is None else time.monotonic() + wait_s
        while True:
            try:
                listed = await self._list()
                break
            except (NotConnected, MCPError, TimeoutError, OSError) as exc:
                now = time.monotonic()
                if deadline is not None and now >= deadline:
                    raise McpUnavailable(f"MCP server {self.name} did not list its tools "
                                         f"within {wait_s:g} s: {describe(exc)}") from None
                pause_s = max(0.05, self.connection.retry_in_s())
                if deadline is not None:
                    pause_s = min(pause_s, deadline - now)
                self._log.warning("waiting for the MCP server to list its tools",
                                  error=describe(exc), retry_in_s=round(pause_s, 2))
                await asyncio.sleep(pause_s)
        self.tools = self.tools_from(listed)
        self._log.info("MCP tools bridged", tools=[t.spec.name for t in self.tools])
        return self.tools

    async def _list(self) -> list[mcp_types.Tool]:
        client = await self.connection.client(self.connect_timeout_s)
        listed: list[mcp_types.Tool] = []
        cursor: str | None = None
        try:
            async with asyncio.timeout(LIST_TIMEOUT_S):
                for _ in range(LIST_PAGES_MAX):
                    page = await client.list_tools(cursor=cursor, cache_mode="refresh")
                    listed.extend(page.tools)
                    cursor = page.next_cursor
                    if cursor is None:
                        return listed
        except MCPError:
            self.connection.mark_broken()  # reopen before trying again
            raise
        raise ValueError(f"MCP server {self.name}: more than {LIST_PAGES_MAX} pages of tools")

    def tools_from(self, listed: Sequence[mcp_types.Tool]) -> list[Tool]:
        """Specs and adapters from a listing and the overrides: deterministic (name order)."""
        by_name = {t.name: t for t in listed}
        unknown = sorted(set(self.overrides) - set(by_name))
        if unknown:
            raise ValueError(f"MCP server {self.name} has no tool {', '.join(unknown)} (named "
                             f"in its overrides); its tools: {', '.join(sorted(by_name))}")
        out = []
        for name in sorted(by_name):
            if TOOL_NAME.fullmatch(name) is None:
                # A chat API would refuse the name; the tool stays out, in every process alike.
                self._log.warning("MCP tool left out: its name is not a valid tool name",
                                  tool=name, pattern=TOOL_NAME.pattern)
                continue
            try:
                out.append(self._tool(by_name[name], by_name))
            except UnusableSchema as exc:
                # The server's mistake, not the app's: its other tools are served, and no
                # process crash-loops on it. Left out in every process alike.
                self._log.error("MCP tool left out: its input schema cannot check arguments",
                                tool=name, reason=str(exc)[:SCHEMA_REASON_CHARS_MAX],
                                overridden=name in self.overrides)
        return out

    def _tool(self, tool: mcp_types.Tool, by_name: Mapping[str, mcp_types.Tool]) -> Tool:
        override = self.overrides.get(tool.name) or ToolOverride()
        effect = effect_class_of(tool.annotations, override)
        takes_key = KEY_ARGUMENT in (tool.input_schema.get("properties") or {})
        model = args_model(tool.name, tool.input_schema, hidden=[KEY_ARGUMENT])
        lookup = self._lookup_of(tool.name, override.lookup, by_name)
        undo = override.undo_plan()
        role = override.saga_role
        if role is None and undo is not None:
            role = SagaRole.COMPENSABLE  # declaring an undo is declaring it compensable
        description = (override.description or tool.description or
                       (tool.annotations.title if tool.annotations else None) or tool.title or
                       f"{tool.name} (a tool of MCP server {self.name})")
        try:
            spec = ToolSpec(
                name=tool.name, description=description.strip(), args_model=model,
                effect_class=effect, timeout_s=override.timeout_s or self.timeout_s,
                subject=_subject_of(override.subject, tool.name, model),
                key_ttl_s=override.key_ttl_s, key_ttl_margin_s=override.key_ttl_margin_s,
                has_lookup=lookup is not None, read_attempts_max=override.read_attempts,
                attempts_max=override.attempts, completes_within_s=override.completes_within_s,
                saga_role=role, undo=undo, once_per_subject=override.once_per_subject,
                evidence_id=override.evidence_id, extra={"mcp_server": self.name})
        except ValueError as exc:
            raise ValueError(f"MCP server {self.name}: {exc}") from None
        adapter = McpToolAdapter(self, tool.name, takes_key=takes_key,
                                 errors_are_refusals=override.errors_are_refusals, lookup=lookup)
        return Tool(spec, adapter)

    def _lookup_of(self, tool: str, name: str | None, by_name: Mapping[str, mcp_types.Tool]
                   ) -> LookupTool | None:
        if name is None:
            return None
        found = by_name.get(name)
        if found is None:
            raise ValueError(f"MCP server {self.name}, tool {tool}: its lookup {name} is not a "
                             f"tool of the server")
        if effect_class_of(found.annotations, self.overrides.get(name)) is not EffectClass.READ:
            raise ValueError(f"MCP server {self.name}, tool {tool}: its lookup {name} must be "
                             f"read-only (readOnlyHint, or an override with effect \"read\")")
        properties = frozenset((found.input_schema.get("properties") or {}).keys())
        return LookupTool(name, properties - {KEY_ARGUMENT}, KEY_ARGUMENT in properties)

    async def aclose(self) -> None:
        await self.connection.aclose()


def _subject_of(subject: str | Callable[[Any], str | None] | None, tool: str,
                model: type[McpArgs]) -> Callable[[BaseModel], str | None]:
    if subject is None:
        return lambda _args: None
    if callable(subject):
        return subject
    names = {field for _, field, _, _ in string.Formatter().parse(subject) if field}
    required = set(model.json_schema.get("required") or ())
    missing = sorted(names - required)
    if missing:
        raise ValueError(f"tool {tool}: subject {subject!r} names {missing}, which are not "
                         f"required arguments of the tool")
    return lambda args: subject.format_map(args.model_dump())
