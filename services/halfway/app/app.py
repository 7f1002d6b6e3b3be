"""App: a user's agent (its tools, its instructions, optionally its model) for halfway to run.

    from halfway import App, Refused

    app = App(name="tickets", instructions="You open support tickets.")

    @app.tool(effect="keyed", key_ttl_s=86_400, timeout_s=5.0, subject="ticket:{ref}")
    async def open_ticket(ref: str, title: str, *, ctx) -> dict:
        \"\"\"Open a support ticket.\"\"\"      # what the model reads
        ...                                   # send ctx.key with the request
        return {"ticket_id": "T-1"}           # the evidence

    @open_ticket.lookup
    async def find_ticket(ref: str, title: str, *, ctx) -> dict | None:
        ...                                   # the effect named by ctx.key, or None

The decorator builds a `ToolSpec` (the one model of a tool: `halfway.tools.spec` says what
each option means) and a `FunctionAdapter` (`halfway.app.functions`: what a return value or an
exception proves). The argument model comes from the function's type hints and is strict: the
model's arguments are validated before a step is placed, and `"49.00"` is never an integer.

Every service of a deployment runs the same app (`--app MODULE:ATTR`); `label` (name and a
fingerprint of the tools' semantics) is journaled with each decision, so a step decided by one
app and met by an executor of another is reported, never silently stalled.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
import string
import typing
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, create_model

from halfway.app.functions import FunctionAdapter
from halfway.contract import CompensationPlan, EffectClass, SagaRole
from halfway.models.base import Model
from halfway.tools.registry import Registry, Tool
from halfway.tools.spec import Adapter, ToolSpec

if TYPE_CHECKING:
    from halfway.mcp.bridge import McpBridge

APP_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
TOOL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")  # what chat APIs accept as names
DEFAULT_TIMEOUT_S = 10.0
CTX = "ctx"

UndoSpec = CompensationPlan | Mapping[str, Any] | tuple[str, Mapping[str, Any]]


class FunctionTool:
    """What `@app.tool` returns: still the function (call it directly in your own tests), plus
    `.lookup` to declare how the harness asks the provider whether the effect exists."""

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any]) -> None:
        if not callable(fn):
            raise TypeError(f"@app.tool decorates a function, not {type(fn).__name__}")
        self.fn = fn
        self.name: str = options.pop("name") or getattr(fn, "__name__", "")
        if not isinstance(self.name, str) or TOOL_NAME.fullmatch(self.name) is None:
            raise ValueError(f"tool name {self.name!r:.80} must match {TOOL_NAME.pattern}")
        description = options.pop("description") or inspect.getdoc(fn) or ""
        if not isinstance(description, str):
            raise TypeError(f"tool {self.name}: description must be a string, not "
                            f"{type(description).__name__}")
        self.description = description.strip()
        if not self.description:
            raise ValueError(f"tool {self.name}: give it a docstring (the model reads it) or a "
                             f"description")
        self.args_model, takes_ctx = _args_model(fn, self.name)
        self.adapter = FunctionAdapter(fn, tuple(self.args_model.model_fields),
                                       takes_ctx=takes_ctx)
        self._options = options
        self._subject = _subject_of(options.pop("subject"), self.name, self.args_model)
        self.__doc__ = fn.__doc__
        self.__name__ = getattr(fn, "__name__", self.name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def lookup(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """Declare the lookup: same arguments as the tool (and `ctx`); returns the evidence (a
        non-empty dict) if the effect named by `ctx.key` exists, None if nothing is found.
        Anything else it returns is a failed lookup, which proves nothing."""
        params = inspect.signature(fn).parameters
        unknown = [p for p in params if p != CTX and p not in self.args_model.model_fields]
        if unknown:
            raise TypeError(f"lookup of {self.name}: parameters {unknown} are not arguments "
                            f"of the tool")
        self.adapter.lookup_fn = fn
        self.adapter.lookup_takes_ctx = CTX in params
        return fn

    def spec(self) -> ToolSpec:
        o = self._options
        undo = undo_plan(o["undo"])
        role = o["saga_role"]
        if role is None and undo is not None:
            role = SagaRole.COMPENSABLE  # declaring an undo is declaring it compensable
        return ToolSpec(
            name=self.name, description=self.description, args_model=self.args_model,
            effect_class=EffectClass(o["effect"]), timeout_s=o["timeout_s"],  # checked there
            subject=self._subject, key_ttl_s=o["key_ttl_s"],
            key_ttl_margin_s=o["key_ttl_margin_s"],
            has_lookup=self.adapter.lookup_fn is not None,
            read_attempts_max=o["read_attempts"], attempts_max=o["attempts"],
            completes_within_s=o["completes_within_s"],
            saga_role=None if role is None else SagaRole(role), undo=undo,
            once_per_subject=o["once_per_subject"], evidence_id=o["evidence_id"])


class App:
    """A user's agent: `name`, `instructions` (the model's system prompt), its tools, and
    optionally its own `model` (any object with the `halfway.models.Model` interface; the
    `--model` option or HALFWAY_MODEL overrides it)."""

    def __init__(self, name: str, instructions: str = "", *, model: Model | None = None
                 ) -> None:
        if not isinstance(name, str) or APP_NAME.fullmatch(name) is None:
            raise ValueError(f"app name {name!r:.80} must match {APP_NAME.pattern}")
        if not isinstance(instructions, str):
            raise TypeError(f"app {name}: instructions must be a string (the system prompt), "
                            f"not {type(instructions).__name__}")
        self.name = name
        self.instructions = instructions
        self.model = model
        self._tools: dict[str, FunctionTool | Tool] = {}
        self._registry: Registry | None = None
        self._closers: list[Callable[[], Awaitable[None]]] = []
        self._mcp: dict[str, McpBridge] = {}  # declared MCP servers, by name
        self._mcp_ready = False  # their tools are listed and added

    def tool(self, fn: Callable[..., Any] | None = None, *, name: str | None = None,
             description: str | None = None, effect: str | EffectClass = EffectClass.UNKEYED,
             key_ttl_s: float | None = None, key_ttl_margin_s: float | None = None,
             timeout_s: float = DEFAULT_TIMEOUT_S,
             subject: str | Callable[[Any], str | None] | None = None,
             evidence_id: str | None = None, once_per_subject: bool = False,
             completes_within_s: float | None = None, attempts: int = 10,
             read_attempts: int = 3, saga_role: str | SagaRole | None = None,
             undo: UndoSpec | None = None) -> Any:
        """Declare a tool. `effect` says what repeating a call does (read, idempotent, keyed,
        unkeyed); it defaults to the cautious `unkeyed` (at most one request, ever)."""
        options = dict(name=name, description=description, effect=EffectClass(effect),
                       key_ttl_s=key_ttl_s, key_ttl_margin_s=key_ttl_margin_s,
                       timeout_s=timeout_s, subject=subject, evidence_id=evidence_id,
                       once_per_subject=once_per_subject,
                       completes_within_s=completes_within_s, attempts=attempts,
                       read_attempts=read_attempts, saga_role=saga_role, undo=undo)

        def register(f: Callable[..., Any]) -> FunctionTool:
            tool = FunctionTool(f, dict(options))
            tool.spec()  # every mistake in the declaration shows at import, not at a call
            self._add(tool.name, tool)
            return tool

        return register(fn) if fn is not None else register

    def on_shutdown(self, fn: Callable[[], Awaitable[None]]) -> Callable[[], Awaitable[None]]:
        """Declare clean-up for when a service stops (close a shared HTTP client, say)."""
        self._closers.append(fn)
        return fn

    def mcp(self, name: str, *, command: Sequence[str] | str | None = None,
            url: str | None = None, tools: Mapping[str, Mapping[str, Any]] | None = None,
            env: Mapping[str, str] | None = None, cwd: str | None = None,
            headers: Mapping[str, str] | None = None, timeout_s: float = DEFAULT_TIMEOUT_S,
            connect_timeout_s: float | None = None) -> None:
        """Bridge an MCP server's tools into this app: `command=[...]` runs it over stdio,
        `url="http://..."` speaks streamable HTTP. `tools` holds per-tool overrides
        (`{"create_payment": {"effect": "keyed", "key_ttl_s": 86_400, "lookup":
        "find_payment", "subject": "invoice:{invoice_id}"}}`; see `halfway.mcp.bridge`).
        The tools are listed when a service starts (`prepare`)."""
        from halfway.mcp.bridge import CONNECT_TIMEOUT_S, McpBridge

        if self._registry is not None:
            raise RuntimeError(f"app {self.name} is already running; declare servers before")
        if name in self._mcp:
            raise ValueError(f"app {self.name} already has an MCP server named {name}")
        bridge = McpBridge(name, command=command, url=url, tools=tools, env=env, cwd=cwd,
                           headers=headers, timeout_s=timeout_s,
                           connect_timeout_s=connect_timeout_s or CONNECT_TIMEOUT_S)
        self._mcp[name] = bridge
        self.on_shutdown(bridge.aclose)  # its session closes when the service stops

    async def prepare(self, wait_s: float | None = None) -> None:
        """List the tools of the app's MCP servers and add them (once; a no-op without
        servers). A server that is down is waited for, retried with a bounded backoff: until
        it answers (`wait_s` None, what services do), or for at most `wait_s`, then
        `halfway.mcp.McpUnavailable`. Every service calls it before it uses the registry."""
        if self._mcp_ready:
            return
        for bridge in self._mcp.values():
            await bridge.discover(wait_s)
        for bridge in self._mcp.values():
            for tool in bridge.tools or ():
                if tool.spec.name in self._tools:
                    raise ValueError(f"app {self.name}: MCP server {bridge.name}'s tool "
                                     f"{tool.spec.name} has the name of another tool")
        for bridge in self._mcp.values():
            for tool in bridge.tools or ():
                self._add(tool.spec.name, tool)
        self._mcp_ready = True

    async def close_mcp(self) -> None:
        """Close the sessions with the app's MCP servers (a service does it when it stops)."""
        for bridge in self._mcp.values():
            await bridge.aclose()

    def _check_prepared(self) -> None:
        if self._mcp and not self._mcp_ready:
            raise RuntimeError(f"app {self.name} bridges MCP servers "
                               f"({', '.join(self._mcp)}): await app.prepare() first, which "
                               f"lists their tools (the services do)")

    def add(self, spec: ToolSpec, adapter: Adapter) -> None:
        """Add a tool written as an adapter class (`halfway.tools.spec.Adapter`)."""
        self._add(spec.name, Tool(spec, adapter))

    def _add(self, name: str, tool: FunctionTool | Tool) -> None:
        if self._registry is not None:
            raise RuntimeError(f"app {self.name} is already running; add tools before")
        if name in self._tools:
            raise ValueError(f"app {self.name} already has a tool named {name}")
        self._tools[name] = tool

    @property
    def tool_names(self) -> list[str]:
        self._check_prepared()
        return list(self._tools)

    def registry(self) -> Registry:
        """The tools as the services use them (built once; undo tools checked)."""
        self._check_prepared()
        if self._registry is None:
            tools = [t if isinstance(t, Tool) else Tool(t.spec(), t.adapter)
                     for t in self._tools.values()]
            registry = Registry(tools, closers=self._closers)
            registry.check_undos()
            self._registry = registry
        return self._registry

    @property
    def fingerprint(self) -> str:
        """A short hash of what the tools mean to the harness (names, effect classes, argument
        schemas, subjects, saga roles, undos): two instances that differ here must not share
        a consumer group."""
        self._check_prepared()
        return fingerprint_of(t.spec if isinstance(t, Tool) else t.spec()
                              for t in self._tools.values())

    @property
    def label(self) -> str:
        return f"{self.name}@{self.fingerprint}"


def fingerprint_of(specs: Iterable[ToolSpec]) -> str:
    facts = sorted(
        (s.name, s.effect_class.value, s.key_ttl_s, s.has_lookup,
         json.dumps(s.args_model.model_json_schema(), sort_keys=True),
         None if s.saga_role is None else s.saga_role.value,
         None if s.undo is None else s.undo.model_dump_json(), s.once_per_subject,
         s.evidence_id, s.completes_within_s)
        for s in specs)
    return hashlib.sha256(json.dumps(facts, default=str).encode()).hexdigest()[:12]


def _args_model(fn: Callable[..., Any], tool: str) -> tuple[type[BaseModel], bool]:
    """The strict argument model from the function's signature; whether it takes `ctx`."""
    if not callable(fn):
        raise TypeError(f"tool {tool}: not a function")
    signature = inspect.signature(fn)
    try:
        hints = typing.get_type_hints(fn, include_extras=True)
    except Exception as exc:
        raise TypeError(f"tool {tool}: its type hints cannot be resolved: {exc}") from exc
    fields: dict[str, Any] = {}
    takes_ctx = False
    for param in signature.parameters.values():
        if param.name == CTX:
            takes_ctx = True
            continue
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD, param.POSITIONAL_ONLY):
            raise TypeError(f"tool {tool}: parameter {param.name} must be a plain named "
                            f"argument (the model passes arguments by name)")
        if param.name not in hints:
            raise TypeError(f"tool {tool}: parameter {param.name} needs a type hint (the "
                            f"model reads the argument schema from it)")
        default = ... if param.default is param.empty else param.default
        fields[param.name] = (hints[param.name], default)
    model = create_model(f"{_camel(tool)}Args",
                         __config__=ConfigDict(extra="forbid", strict=True), **fields)
    try:
        model.model_json_schema()
    except Exception as exc:
        raise TypeError(f"tool {tool}: its arguments have no JSON schema: {exc}") from exc
    return model, takes_ctx


def _subject_of(subject: str | Callable[[Any], str | None] | None, tool: str,
                args_model: type[BaseModel]) -> Callable[[BaseModel], str | None]:
    if subject is None:
        return lambda _args: None
    if callable(subject):
        return subject
    if not isinstance(subject, str):
        raise TypeError(f"tool {tool}: subject must be a template such as \"ticket:{{ref}}\" "
                        f"or a function of the arguments, not {type(subject).__name__}")
    try:
        names = {field for _, field, _, _ in string.Formatter().parse(subject)
                 if field is not None}  # "" is a positional field, which no argument fills
    except ValueError as exc:  # an unmatched brace
        raise ValueError(f"tool {tool}: subject {subject!r:.80} is not a template: {exc}"
                         ) from None
    missing = sorted(names - set(args_model.model_fields))
    if missing:
        raise ValueError(f"tool {tool}: subject {subject!r} names {missing}, which are not "
                         f"its arguments")
    return lambda args: subject.format_map(args.model_dump())


def undo_plan(undo: UndoSpec | None) -> CompensationPlan | None:
    """An undo as declared (a plan, a mapping, or `("tool", {args})`) as the plan it is."""
    if undo is None or isinstance(undo, CompensationPlan):
        return undo
    if isinstance(undo, tuple):
        tool, args = undo
        return CompensationPlan(tool=tool, args=dict(args))
    return CompensationPlan.model_validate(dict(undo))


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[_-]", name) if part)
