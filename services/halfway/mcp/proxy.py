"""`halfway mcp serve`: halfway as an MCP server in front of agents whose loop we don't own.

    halfway mcp serve --app ticketagent:app                      # stdio (an IDE, a desktop app)
    halfway mcp serve --app ticketagent:app --transport http --port 18110   # streamable HTTP

The app's tools (its own and those it bridges from MCP servers: all are tools of its registry)
are listed as MCP tools, and every `tools/call` becomes a journaled step of a task, decided,
keyed, executed, reconciled and answered by the harness in one process (the decider, executor,
reconciler and outcomes publisher of `halfway dev`, on the deployment's topic prefix).

Theory of operation
-------------------
- **A session is a task.** Its id comes from the call's `_meta` (`io.halfway/task`), else the
  `Halfway-Task` header or `?task=` in the URL, else the transport's session (`Mcp-Session-Id`,
  as `mcp-{id}`), else, on stdio, the connection (`--task`, or a new id per connection). A call
  over HTTP with none of them (the stateless 2026 protocol without a header) is a task of its
  own, finished with its answer: the subject guard still protects it across tasks. A task the
  harness ended (too many refused calls, say) is followed by the next, `{id}.2`, `{id}.3`, ...
- **A call is the model's answer.** The proxy queues it for its task (bounded) and the decider
  places it as it places any model's proposal (`halfway.mcp.calls`): validated, keyed by the
  harness, guarded by subject, journaled before it runs. Nothing in a tool's description or
  schema mentions a key; the model never sees one to vary.
- **The answer is the journal's.** The proxy waits, at most `call_wait_s`, for the step to
  settle or be refused, and answers in three states (`halfway.mcp.answers`). A step still
  unknown at the limit is answered "unknown, being checked ... do not start another", never
  "error"; its lookups and webhooks go on settling it.
- **The retry is a new call** with reworded arguments, so protection cannot depend on the
  model: a call on the same tool and subject as an earlier call of the session whose end the
  agent has not read (it was told unknown, or is still waiting) is not placed: it is answered
  with the earlier call's state (waiting for it to settle, up to the limit), so the retries
  read "unknown ... do not start another" until the first settles, then its truth. Only a
  first call proven not done lets the retry run. Once the agent has read how a call ended, a
  call on its subject is a new one. Across sessions the decider's subject guard answers
  (`blocked: ... not settled yet`), and once-per-subject tools refuse a second effect for good.
- **Ending a session finishes its task** (stdio: the connection closes; HTTP: the session's
  DELETE, or `session_idle_s` without a call), once every step of it settled. Tasks of
  sessions this process does not know (it restarted) are finished after the same idle time.

Bounds: SESSIONS_MAX sessions, QUEUED_CALLS_PER_TASK_MAX waiting calls per task,
`call_wait_s` per answer, CALLS_REMEMBERED_PER_SESSION calls per session for the retry rule,
TASKS_PER_SESSION_MAX tasks per session.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from typing import Any

import mcp_types as types
from mcp.server.lowlevel import Server
from mcp.shared.exceptions import MCPError
from mcp_types import INTERNAL_ERROR, INVALID_PARAMS
from pydantic import BaseModel

from halfway import log
from halfway.contract import EffectClass, SubjectHeld, TaskPolicy, TaskRequested, parse_step_id
from halfway.contract.ids import STEP_N_MAX, is_task_id
from halfway.contract.topics import JOURNAL, TASKS
from halfway.core.args import parse_args
from halfway.core.fold import TaskState, TaskStatus
from halfway.journal import JournalWriter
from halfway.journal.admin import topic_partitions
from halfway.journal.records import stamp
from halfway.loops import run_beside
from halfway.mcp.answers import (
    NOT_DONE,
    Answer,
    Holder,
    handed_answer,
    not_started_answer,
    placing_answer,
    unsettled,
)
from halfway.mcp.calls import (
    SESSION_INPUT_KEY,
    AgentModel,
    Call,
    CallQueues,
    GatedDecider,
)
from halfway.models import Model
from halfway.settings import KafkaSettings
from halfway.tools.registry import Registry, Tool
from halfway.tools.spec import ToolSpec

TASK_META_KEY = "io.halfway/task"  # a call's `_meta` entry naming its task
TASK_HEADER = "halfway-task"
TASK_QUERY = "task"
SESSION_HEADER = "mcp-session-id"
SESSION_ID_CHARS_MAX = 40  # room for `.{generation}` within a task id's 48 characters
TASKS_PER_SESSION_MAX = 1000  # `{id}.2` ... `{id}.1000`
SESSIONS_MAX = 1000
CALLS_REMEMBERED_PER_SESSION = 64
CALL_WAIT_S = 25.0  # below common MCP client timeouts (60 s), so the agent reads our answer
SESSION_IDLE_S = 1800.0  # the SDK's own idle limit for HTTP sessions
READY_WAIT_S = 60.0  # for the decider to read the journal before the first call is placed
READY_POLL_S = 0.05
FINISH_WAIT_S = 1.5  # at a stdio session's end: the SDK's client kills the server after 2 s
REAP_EVERY_S_MAX = 5.0
HTTP_PATH = "/mcp"
HTTP_SHUTDOWN_S = 5.0  # calls still waiting for their answer when the server stops
# Sentences of a tool's description that tell the model to supply a key: the harness names
# every call itself, and a model told to make keys unique makes every retry a new effect.
KEY_ADVICE = re.compile(r"idempoten|\bkeys?\b[^.]*\b(unique|every request|each request|new)\b",
                        re.IGNORECASE)
KEY_PROPERTY = re.compile(r"^idempotency[_-]?key$", re.IGNORECASE)
HOW_ANSWERED = ("Through halfway: the harness names and journals each call; the answer says "
                "done (with evidence), not done, or unknown. When it says unknown, do not "
                "call again for the same thing: the harness is checking it.")


@dataclass(eq=False)
class Session:
    key: str  # the session's id; its tasks are `key`, `key.2`, ...
    task_id: str
    generation: int = 1
    one_call: bool = False  # no session around the call: its task ends with it
    last_active_s: float = field(default_factory=time.monotonic)
    calls: deque[Call] = field(
        default_factory=lambda: deque(maxlen=CALLS_REMEMBERED_PER_SESSION))
    waiting: int = 0  # calls of this session being answered now
    ending: bool = False


class Proxy:
    """Sessions, their calls and their answers; the MCP server's handlers."""

    def __init__(self, app: Any, settings: KafkaSettings, writer: JournalWriter, model: Model,
                 *, call_wait_s: float = CALL_WAIT_S, session_idle_s: float = SESSION_IDLE_S,
                 stdio_task: str | None = None) -> None:
        self.app = app
        self.registry: Registry = app.registry()
        self.settings = settings
        self.writer = writer
        self.call_wait_s = call_wait_s
        self.session_idle_s = session_idle_s
        self.stdio_task = stdio_task or f"mcp-{uuid.uuid4().hex[:12]}"
        self.queues = CallQueues()
        self.decider = GatedDecider(
            settings, self.registry, AgentModel(self.queues, model), writer,
            instructions=app.instructions, app_label=app.label, queues=self.queues,
            on_news=self._news, on_idle=self._idle)
        self.sessions: dict[str, Session] = {}
        self._by_task: dict[str, Session] = {}
        self._orphans: dict[str, float] = {}  # session tasks no session here knows: idle since
        self._pulse = asyncio.Event()
        self._ready = False
        self._log = log.get("halfway.mcp")

    # -- the journal's news ------------------------------------------------------------------

    def _news(self, task_ids: set[str]) -> None:
        """The decider folded something: waiting calls look again; ended tasks are let go."""
        for task_id in task_ids:
            state = self.decider.follower.states.get(task_id)
            if state is not None and state.status in (TaskStatus.FINISHED, TaskStatus.REJECTED):
                self.queues.forget(task_id)
                self._orphans.pop(task_id, None)
                session = self._by_task.get(task_id)
                if session is not None and session.ending and session.waiting == 0:
                    self._drop(session)
        self._pulse.set()
        self._pulse = asyncio.Event()

    def _idle(self, task_id: str) -> None:
        """The decider would ask for a session task but nobody called: if no session of this
        process owns it (a restart), it is finished after the idle time."""
        if task_id not in self._by_task:
            self._orphans.setdefault(task_id, time.monotonic())

    async def _changed(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._pulse.wait()

    def _state(self, task_id: str) -> TaskState:
        return self.decider.follower.states.get(task_id) or TaskState(task_id=task_id)

    def _still_held(self, held: SubjectHeld) -> bool:
        holder = self.decider.guards.book.holder_of(held.tool, held.subject)
        return holder is not None and holder.step_id == held.holder

    def _holder(self, held: SubjectHeld) -> Holder:
        """The blocking step as this process sees it (its task's fold, if it follows it)."""
        task_id, n = parse_step_id(held.holder)
        state = self.decider.follower.states.get(task_id)
        return Holder(self._still_held(held), None if state is None else state.step(n),
                      seen=state is not None)

    async def ready(self) -> None:
        """The decider has read the guards and every journal partition to its end: a session
        that comes back finds its task's state, and a subject that looks free is."""
        if self._ready:
            return
        try:
            async with asyncio.timeout(READY_WAIT_S):
                await self.decider.guards.caught_up()
                journal = JOURNAL.name(self.settings.topic_prefix)
                count = len(await topic_partitions(self.settings, journal))
                while True:
                    lags = self.decider.follower.partition_lags()
                    owned = sum(1 for topic, *_ in lags if topic == journal)
                    if owned >= count and all(up for *_, up in lags):
                        break
                    await asyncio.sleep(READY_POLL_S)  # nothing notifies a catch-up
        except TimeoutError:
            raise MCPError(INTERNAL_ERROR, f"halfway has not read its journal within "
                                           f"{READY_WAIT_S:g} s: is the broker up?") from None
        self._ready = True

    # -- sessions ----------------------------------------------------------------------------

    def session_key(self, ctx: Any) -> str | None:
        """The session a call belongs to (see the module's theory); None: the call alone."""
        meta = ctx.meta or {}
        named = meta.get(TASK_META_KEY) if isinstance(meta, dict) else None
        request = ctx.request
        if named is None and request is not None:
            named = request.headers.get(TASK_HEADER) or request.query_params.get(TASK_QUERY)
            if named is None and (sid := request.headers.get(SESSION_HEADER)):
                named = f"mcp-{sid}"
            if named is None:
                return None
        if named is None:
            named = self.stdio_task
        if not isinstance(named, str) or len(named) > SESSION_ID_CHARS_MAX \
                or not is_task_id(named):
            raise MCPError(INVALID_PARAMS, f"the task id {str(named)[:80]!r} is not usable: at "
                                           f"most {SESSION_ID_CHARS_MAX} characters of "
                                           f"A-Z a-z 0-9 . _ -, starting with a letter or digit")
        return named

    async def session_for(self, key: str | None, client: str) -> Session:
        if key is not None and (found := self.sessions.get(key)) is not None:
            session = found
        else:
            if len(self.sessions) >= SESSIONS_MAX:
                raise MCPError(INTERNAL_ERROR, f"this proxy serves {SESSIONS_MAX} sessions "
                                               f"already; end one first")
            one_call = key is None
            key = key or f"mcp-{uuid.uuid4().hex[:12]}"
            generation, task_id = self._open_task(key)
            session = Session(key, task_id, generation, one_call=one_call)
            self.sessions[key] = session
            self._by_task[task_id] = session
            self._orphans.pop(task_id, None)
            await self._request(session, client)
        over = self._state(session.task_id).status in (TaskStatus.FINISHED, TaskStatus.REJECTED)
        if session.ending and not over and self.queues.resume(session.task_id):
            session.ending = False  # back before its task was told to finish: it goes on
        elif session.ending or over:
            # Its task ended (or is finishing): the session goes on in its next task.
            self._next_task(session)
            session.ending = False
            await self._request(session, client)
        session.last_active_s = time.monotonic()
        return session

    def _open_task(self, key: str) -> tuple[int, str]:
        """The session's first task that has not ended (a session that comes back after a
        restart continues its task)."""
        for generation in range(1, TASKS_PER_SESSION_MAX + 1):
            task_id = key if generation == 1 else f"{key}.{generation}"
            status = self._state(task_id).status
            if status not in (TaskStatus.FINISHED, TaskStatus.REJECTED):
                return generation, task_id
        raise MCPError(INTERNAL_ERROR, f"session {key} has had {TASKS_PER_SESSION_MAX} tasks; "
                                       f"start a new session")

    def _next_task(self, session: Session) -> None:
        if session.generation >= TASKS_PER_SESSION_MAX:
            raise MCPError(INTERNAL_ERROR, f"session {session.key} has had "
                                           f"{TASKS_PER_SESSION_MAX} tasks; start a new session")
        self._by_task.pop(session.task_id, None)
        session.generation += 1
        session.task_id = f"{session.key}.{session.generation}"
        self._by_task[session.task_id] = session

    async def _request(self, session: Session, client: str) -> None:
        """Ask for the session's task (asking again for a running one is harmless: the first
        request counts)."""
        request = TaskRequested(
            **stamp(session.task_id),
            input={"prompt": f"an MCP session of {client} through halfway mcp serve",
                   SESSION_INPUT_KEY: {"session": session.key, "client": client}},
            allowed_tools=sorted(self.registry.names()),
            policy=TaskPolicy(max_steps=STEP_N_MAX))
        await self.writer.append(request, TASKS)
        self._log.info("session task requested", session=session.key, task_id=session.task_id)

    def end(self, key: str) -> None:
        """The session ended: its task finishes once its steps settled."""
        session = self.sessions.get(key)
        if session is None:
            return
        session.ending = True
        self.queues.finish(session.task_id)
        self.decider.follower.touch(session.task_id)
        if session.waiting == 0 and self._state(session.task_id).status in (
                TaskStatus.FINISHED, TaskStatus.REJECTED):
            self._drop(session)
        self._log.info("session ended", session=key, task_id=session.task_id)

    def _drop(self, session: Session) -> None:
        self.sessions.pop(session.key, None)
        self._by_task.pop(session.task_id, None)

    async def end_all(self, wait_s: float) -> None:
        """End every session and wait (bounded) for their tasks to finish."""
        tasks = [s.task_id for s in self.sessions.values()]
        for key in list(self.sessions):
            self.end(key)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(wait_s):
                while not all(self._state(t).status in (TaskStatus.FINISHED, TaskStatus.REJECTED)
                              for t in tasks):
                    await self._pulse.wait()

    async def reap_idle(self) -> None:
        """End sessions idle past `session_idle_s`; finish orphaned session tasks alike."""
        every_s = min(REAP_EVERY_S_MAX, self.session_idle_s / 4)
        while True:
            await asyncio.sleep(every_s)
            now = time.monotonic()
            for session in list(self.sessions.values()):
                if not session.ending and session.waiting == 0 \
                        and now - session.last_active_s > self.session_idle_s:
                    self.end(session.key)
            for task_id, since in list(self._orphans.items()):
                if now - since > self.session_idle_s and task_id not in self._by_task:
                    del self._orphans[task_id]
                    self.queues.finish(task_id)
                    self.decider.follower.touch(task_id)
                    self._log.info("orphaned session task finished", task_id=task_id)

    # -- MCP handlers ------------------------------------------------------------------------

    async def list_tools(self, ctx: Any, params: Any) -> types.ListToolsResult:
        return types.ListToolsResult(tools=[mcp_tool(t.spec) for t in self._tools()])

    def _tools(self) -> list[Tool]:
        return [t for name in sorted(self.registry.names())
                if (t := self.registry.get(name)) is not None]

    async def call_tool(self, ctx: Any, params: types.CallToolRequestParams
                        ) -> types.CallToolResult:
        tool = self.registry.get(params.name)
        if tool is None:
            raise MCPError(INVALID_PARAMS, f"there is no tool named {params.name[:200]!r}")
        args = dict(params.arguments or {})
        key = self.session_key(ctx)
        await self.ready()
        session = await self.session_for(key, client_name(ctx))
        with log.bound(task_id=session.task_id):
            session.waiting += 1
            try:
                answer = await self._answer(session, tool.spec, args)
            finally:
                session.waiting -= 1
                session.last_active_s = time.monotonic()
            if session.one_call:
                self.end(session.key)
            self._log.info("call answered", tool=tool.spec.name, status=answer.status)
        return as_result(answer)

    async def _answer(self, session: Session, spec: ToolSpec, args: dict[str, Any]) -> Answer:
        deadline = time.monotonic() + self.call_wait_s
        subject = subject_of(spec, args)
        earlier = self._retried(session, spec.name, subject)
        if earlier is not None:
            # A retry of a call the agent has not read the end of: never placed, answered
            # with that call (unless it turns out not done: then the retry is a new call).
            first = await self._outcome(session, earlier, deadline, own=False)
            if first.status != NOT_DONE:
                earlier.told = earlier.told or first.final
                return repeat_of(first)
        call = Call(session.task_id, spec.name, args, subject)
        if not self.queues.put(call):
            return not_started_answer(spec.name, subject, f"{self.queues.per_task_max} calls of "
                                      f"this session are waiting already; wait for their answers")
        session.calls.append(call)
        self.decider.follower.touch(session.task_id)
        answer = await self._outcome(session, call, deadline)
        call.told = answer.final
        return answer

    async def _outcome(self, session: Session, call: Call, deadline: float, *,
                       own: bool = True) -> Answer:
        """The call's answer once it is final, or what is known at `deadline`. `own`: this
        handler made the call (and takes it back if the decider never took it)."""
        withdrawn = False
        answer: Answer | None = None
        try:
            while True:
                answer = self._answer_now(call)
                remaining_s = deadline - time.monotonic()
                if (answer is not None and answer.final) or remaining_s <= 0:
                    break
                await self._changed(remaining_s)
        finally:
            if own and call.handed is None and self.queues.withdraw(call):
                withdrawn = True
                with contextlib.suppress(ValueError):
                    session.calls.remove(call)  # never ran: no retry is its repeat
        if answer is not None:
            return answer
        if withdrawn:
            return not_started_answer(call.tool, call.subject, self._why_waiting(call.task_id))
        return placing_answer(call.tool, call.subject)  # promised to the decider: may still run

    def _answer_now(self, call: Call) -> Answer | None:
        if call.handed is None:
            return None
        n, refused = call.handed
        return handed_answer(self._state(call.task_id), call.tool, call.subject, n, refused,
                             holder=self._holder)

    def _retried(self, session: Session, tool: str, subject: str | None) -> Call | None:
        """The latest call of this session on the same tool and subject, if the agent has not
        read how it ended: it may still happen, or it happened and the agent, told "unknown",
        asks again. A call on a subject whose end the agent has read is a new call."""
        if subject is None:
            return None
        for call in reversed(session.calls):
            if call.tool == tool and call.subject == subject:
                return None if call.told else call
        return None

    def _why_waiting(self, task_id: str) -> str:
        state = self._state(task_id)
        for step in sorted(state.steps.values(), key=lambda s: s.n):
            if unsettled(step):
                return (f"the session's earlier step {step.step_id} ({step.intent.tool} "
                        f"{step.intent.subject or ''}".rstrip() + f") is {step.status.value}; "
                        f"the harness runs one step of a session at a time, and this one waited "
                        f"{self.call_wait_s:g} s")
        refused = state.refusals[-1] if state.refusals else None
        if refused is not None and refused.blocked is not None \
                and self._still_held(refused.blocked):
            return (f"the session waits for {refused.blocked.subject}, which "
                    f"{refused.blocked.holder} holds")
        return f"the harness did not get to it within {self.call_wait_s:g} s"

    def server(self) -> Server[Any]:
        return Server("halfway", version="1", instructions=self.app.instructions or None,
                      on_list_tools=self.list_tools, on_call_tool=self.call_tool)


# -- pure helpers -------------------------------------------------------------------------------


def mcp_tool(spec: ToolSpec) -> types.Tool:
    """A tool as the agent sees it: its description and argument schema, no key anywhere."""
    effect = spec.effect_class
    return types.Tool(
        name=spec.name,
        description=f"{without_key_advice(spec.description)}\n\n{HOW_ANSWERED}".strip(),
        input_schema=without_key_fields(spec.args_model.model_json_schema()),
        annotations=types.ToolAnnotations(
            read_only_hint=effect is EffectClass.READ,
            # Through the proxy a repeated call is a new step (a new key): only what is safe
            # to repeat by nature is idempotent to the agent.
            idempotent_hint=effect in (EffectClass.READ, EffectClass.IDEMPOTENT)))


def without_key_advice(description: str) -> str:
    sentences = re.split(r"(?<=[.!?])\s+", description.strip())
    return " ".join(s for s in sentences if not KEY_ADVICE.search(s))


def without_key_fields(schema: dict[str, Any]) -> dict[str, Any]:
    """The schema without an idempotency-key property (the harness supplies keys)."""
    props = schema.get("properties")
    if not isinstance(props, dict):
        return schema
    keep = {k: v for k, v in props.items() if not KEY_PROPERTY.match(k)}
    out = dict(schema, properties=keep)
    if isinstance(schema.get("required"), list):
        out["required"] = [r for r in schema["required"] if r in keep]
    return out


def subject_of(spec: ToolSpec, args: dict[str, Any]) -> str | None:
    """The subject a call touches. Leniently: a retry reworded so that it no longer validates
    ("49.00" for 4900) still names its invoice, and must still count as a retry."""
    parsed: BaseModel | None = None
    try:
        parsed = parse_args(spec.args_model, args)
    except Exception:
        fields = spec.args_model.model_fields  # none: a bridged tool's (its schema is the truth)
        known = {k: v for k, v in args.items() if k in fields} if fields else dict(args)
        parsed = spec.args_model.model_construct(**known)
    try:
        subject = spec.subject(parsed)
    except Exception:
        return None
    return subject if isinstance(subject, str) and subject else None


def repeat_of(answer: Answer) -> Answer:
    """An earlier call's answer given to its retry, which did not run."""
    facts = dict(answer.facts, this_call_ran=False)
    text = answer.text
    if "(this is an earlier call" not in text:
        text += " (this answers an earlier call of this session on the same subject; the " \
                "harness did not run this one)"
    return replace(answer, text=text, facts=facts)


def as_result(answer: Answer) -> types.CallToolResult:
    return types.CallToolResult(content=[types.TextContent(text=answer.text)],
                                structured_content=_jsonable(answer.facts),
                                is_error=answer.is_error)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
    return value


def client_name(ctx: Any) -> str:
    try:
        params = ctx.session.client_params
        info = params.client_info if params is not None else None
        return str(info.name)[:100] if info is not None else "an MCP client"
    except Exception:
        return "an MCP client"


# -- serving ------------------------------------------------------------------------------------


class EndOnDelete:
    """ASGI: a session's DELETE (the client closed it) ends its task after the SDK answered."""

    def __init__(self, app: Any, on_end: Callable[[str], None]) -> None:
        self.app = app
        self.on_end = on_end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)
        if scope.get("type") == "http" and scope.get("method") == "DELETE":
            headers = dict(scope.get("headers") or [])
            sid = headers.get(SESSION_HEADER.encode())
            if sid:
                self.on_end(f"mcp-{sid.decode('latin-1')}")


async def serve_proxy(app: Any, model: Model, *, transport: str, host: str, port: int,
                      call_wait_s: float, session_idle_s: float, task: str | None) -> None:
    """Run the harness's services for `app` and the MCP server in front of them until the
    stdio connection closes or SIGTERM."""
    from halfway.journal.admin import ensure_topics_once_up
    from halfway.serve import Service, run_service, stop_on_signals

    settings = KafkaSettings.from_env()
    await ensure_topics_once_up(settings)
    await app.prepare()  # the tools of the app's MCP servers (the bridge): listed once
    registry = app.registry()
    # SIGTERM cancels this task; over HTTP the server then stops gracefully (`serve_http`),
    # and the services after it.
    stop_on_signals()
    logger = log.get("halfway.mcp")
    try:
        async with JournalWriter(settings) as writer:
            proxy = Proxy(app, settings, writer, model, call_wait_s=call_wait_s,
                          session_idle_s=session_idle_s, stdio_task=task)
            logger.info("halfway mcp serve", app=app.label, transport=transport,
                        tools=sorted(registry.names()), prefix=settings.topic_prefix)

            async def serve_then_finish() -> None:
                if transport == "stdio":
                    await serve_stdio(proxy)
                else:
                    await serve_http(proxy, host, port)
                await proxy.end_all(FINISH_WAIT_S)

            # The services stop when the server has finished; one that ends before stops the
            # server with its error (LoopEnded if it was cancelled): no call is taken that
            # nobody would decide or perform.
            await run_beside(serve_then_finish(), proxy.decider.run(), proxy.reap_idle(),
                             *(run_service(s, settings, registry, app=app)
                               for s in (Service.EXECUTOR, Service.RECONCILER, Service.OUTCOMES)))
    except asyncio.CancelledError:
        logger.info("halfway mcp serve: stopped")
    finally:
        await registry.aclose()
        close = getattr(model, "aclose", None)
        if close is not None:
            await close()


async def serve_stdio(proxy: Proxy) -> None:
    from mcp.server.stdio import stdio_server

    server = proxy.server()
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


async def serve_http(proxy: Proxy, host: str, port: int) -> None:
    import uvicorn

    mcp_server = proxy.server()
    starlette = mcp_server.streamable_http_app(streamable_http_path=HTTP_PATH, host=host,
                                           max_sessions=SESSIONS_MAX,
                                           session_idle_timeout=proxy.session_idle_s)
    sock = socket.create_server((host, port))
    bound = sock.getsockname()[1]
    config = uvicorn.Config(EndOnDelete(starlette, proxy.end), log_config=None,
                            access_log=False, lifespan="on",
                            timeout_graceful_shutdown=HTTP_SHUTDOWN_S)
    server = _quiet_server(config)
    # Printed once the socket accepts connections: scripts and tests wait for this line.
    print(f"listening on http://{host}:{bound}{HTTP_PATH}", flush=True)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        await asyncio.shield(serving)
    except asyncio.CancelledError:
        # Stopped (SIGTERM): the calls under way get their answers, within HTTP_SHUTDOWN_S.
        server.should_exit = True
        await serving
        raise


def _quiet_server(config: Any) -> Any:
    """uvicorn's server without its signal handlers. Its own would run beside the process's
    (a loop delivers a signal to every handler registered for it): the process's cancels the
    server mid-shutdown, with a traceback, before uvicorn has answered the calls under way."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server(config)
