"""modelsim: an OpenAI-compatible chat-completions endpoint that thinks by script, for demos and
tests.

Run it as its own process: `python -m halfway.simulators.modelsim --port 0 [--api-key KEY]
[--models a,b]` prints exactly one line, `listening on http://127.0.0.1:PORT`, once it accepts
connections; point the official `openai` client at it with
`OPENAI_BASE_URL=http://127.0.0.1:PORT/v1` and `OPENAI_API_KEY=KEY`. In tests, serve it on the
test's own loop: `async with serving() as (url, sim): ...` (or `start_in_process`).

What it models. OpenAI's `POST /v1/chat/completions` and `GET /v1/models`, faithfully where the
harness's adapter (`halfway.models.openai_chat`) depends on it:

- Authentication: `Authorization: Bearer KEY` must carry the configured key (`--api-key`, by
  default `API_KEY_DEFAULT`; an empty key turns the check off, as a local server without auth
  would). Wrong or missing: 401 with OpenAI's body, `{"error": {"message", "type":
  "invalid_request_error", "param": null, "code": "invalid_api_key"}}`; the message shows the
  key masked, as OpenAI does.
- Validation, each a 400 `invalid_request_error` naming the `param`, as OpenAI's: a body that
  is not a JSON object; no `model`; no `messages` (or an empty list, or a message without a
  known role); `stream: true` (not modelled); `n` other than 1; `parallel_tool_calls` without
  `tools`; a tool name outside `^[a-zA-Z0-9_-]{1,64}$`; a tool call id longer than 40
  characters (`string_above_max_length`); a `tool` message that answers no call of the
  assistant message right before it; an assistant message with tool calls not followed by one
  `tool` message for each of them. A body over `BODY_BYTES_MAX` is a 413.
- An unknown model: 404 `model_not_found`.
- An answer: `{"id": "chatcmpl-...", "object": "chat.completion", "created", "model",
  "choices": [{"index": 0, "message": {"role": "assistant", "content", "tool_calls",
  "refusal": null}, "finish_reason": "tool_calls" | "stop"}], "usage": {"prompt_tokens",
  "completion_tokens", "total_tokens"}}`, a tool call being `{"id": "call_...", "type":
  "function", "function": {"name", "arguments"}}` with the arguments as JSON text. Tokens are
  counted the simple deterministic way: characters / 4 of the messages (prompt) and of the
  answer (completion), at least 1.

How it thinks (deterministically, like `ScriptedModel`, and from the conversation alone: it
keeps no memory of a task, so a task resumed by another decider gets the same answers). The
first user message carries the task's input as a line `Context (JSON):` followed by a JSON
object (how the adapter writes it); `context["script"]` is a list of steps `{"tool", "args"}`
and `context.get("summary")` the final answer. The step it proposes is 1 + the number of
decided steps: `tool` messages that answer the *first* call of an assistant message and do not
start with "refused" (a refused proposal is not a step; answers to the further calls of an
answer, which the harness did not run, are not either). So when the last result is a refusal
it proposes the same script step again, correcting itself. After the script it answers the
summary (default "done") as plain text with `finish_reason: "stop"`. A script step may carry:

- `"parallel": [{"tool", "args"}, ...]`: the answer has several tool calls, the step's first;
- `"malformed": true`: the first call's arguments are not valid JSON the first time the step
  is asked (no refusal since the last decided step), and valid once it was refused.

It ignores `parallel_tool_calls: false`, `tool_choice` and whether the script's tools are among
`tools`: the script decides, so tests can make a model misbehave.

Faults. Per task: `context["model_faults"]`, a list of `{"kind": "429" | "500" | "503" | "401" |
"400" | "slow" | "garbage", "times": N (default 1), "step": n (only when step n is asked),
"delay_s": x (slow), "retry_after_s": x (429)}`. A question of the task (named by its
`X-Halfway-Task` header, else by a hash of its first user message) consumes one use of the
first fault in the list that has uses left and whose `step` matches; the simulator remembers
the uses per task (the list itself travels with every question). Global faults, for tests that
cannot put anything in the context: `POST /control/faults` with the same list (or `{"faults":
[...]}`) replaces them, `DELETE /control/faults` clears them, `GET /control/faults` shows them
with the uses left; a question consumes a global fault first, a task's own only if no global
one matched. What each kind does:

- "429": 429 `rate_limit_exceeded`, with `retry-after` (seconds) and `retry-after-ms`
  headers when `retry_after_s` is given;
- "500", "503": that status with a `server_error` body;
- "401": 401 `invalid_api_key`; "400": 400 `invalid_request_error`;
- "slow": waits `delay_s` (at most `DELAY_S_MAX`) before answering normally; the wait ends
  early when the simulator stops;
- "garbage": 200 with an HTML page instead of a chat completion, as a misconfigured proxy
  would answer.

A bad fault list (in the context or posted) is a 400 that says what is wrong, as is a context
`script` that is not a list of steps with a `tool`.

Counting: every request to `/v1/chat/completions` is counted on arrival, failed ones included:
`GET /control/requests` answers `{"total": N, "by_task": {task: n}}`, and the in-process
simulator has the same counts (`ModelSim.requests_total`, `ModelSim.requests_of(task)`).
`POST /control/reset` forgets the counts, the global faults and every task's fault uses. The
controls take no key.

Bounds: at most `TASKS_MAX` tasks are remembered (their counts and fault uses); past it the
least recently asked one is forgotten (its count starts again from 0, its faults are armed
again). At most `FAULTS_MAX` faults in a list, `FAULT_TIMES_MAX` uses each, `MODELS_MAX`
models, `BODY_BYTES_MAX` per request; a wait is at most `DELAY_S_MAX`.

Not modelled: streaming, other endpoints (completions, responses, embeddings), images and
audio, `tool_choice`, organization and project headers, rate-limit headers other than
`retry-after`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import re
import secrets
import sys
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from halfway.simulators import keyed

PROVIDER = "modelsim"
HOST = keyed.HOST
API_KEY_DEFAULT = "sk-modelsim"
MODELS_DEFAULT = ("gpt-4o-mini",)
MODELS_MAX = 100
MODEL_NAME_CHARS_MAX = 200
TASKS_MAX = 100_000  # tasks whose counts and fault uses are remembered; the oldest is forgotten
FAULTS_MAX = 100  # in one list (a context's, or the global one)
FAULT_TIMES_MAX = 10_000
DELAY_S_MAX = 600.0
RETRY_AFTER_S_MAX = 3_600.0
BODY_BYTES_MAX = 8 * 1024 * 1024
MESSAGES_MAX = 100_000
TOOLS_MAX = 128  # OpenAI's limit on `tools`
CALL_ID_CHARS_MAX = 40  # OpenAI's limit on a tool call id
SUMMARY_DEFAULT = "done"
TASK_HEADER = "X-Halfway-Task"
CONTEXT_MARKER = "Context (JSON):"
REFUSED = "refused"
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")

FaultKind = Literal["429", "500", "503", "401", "400", "slow", "garbage"]


class Fault(BaseModel):
    """One fault: what a question that consumes it gets, `times` times."""

    model_config = ConfigDict(extra="forbid")

    kind: FaultKind
    times: int = Field(1, ge=1, le=FAULT_TIMES_MAX)
    step: int | None = Field(None, ge=1, description="only when this step is asked")
    delay_s: float = Field(0.0, ge=0.0, le=DELAY_S_MAX, description="slow: the wait")
    retry_after_s: float | None = Field(None, ge=0.0, le=RETRY_AFTER_S_MAX,
                                        description="429: the retry-after header")

    @field_validator("kind", mode="before")
    @classmethod
    def _status_as_text(cls, value: Any) -> Any:
        return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


FAULTS = TypeAdapter(Annotated[list[Fault], Field(max_length=FAULTS_MAX)])


class BadRequest(ValueError):
    """A request OpenAI would answer 400: `param` names what is wrong."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.code = message, param, code


def parse_faults(raw: Any, where: str) -> list[Fault]:
    """A fault list from JSON (a list, or `{"faults": [...]}`); BadRequest says what is wrong."""
    if isinstance(raw, dict) and set(raw) == {"faults"}:
        raw = raw["faults"]
    try:
        return FAULTS.validate_python(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(list)'}: {e['msg']}"
                             for e in exc.errors(include_url=False))
        raise BadRequest(f"{where} is not a valid fault list: {problems}", where) from None


class Armed:
    """A fault list with the uses left of each fault."""

    def __init__(self, faults: Sequence[Fault]) -> None:
        self.faults = list(faults)
        self.left = [f.times for f in self.faults]

    def take(self, step: int) -> Fault | None:
        for i, fault in enumerate(self.faults):
            if self.left[i] > 0 and fault.step in (None, step):
                self.left[i] -= 1
                return fault
        return None

    def describe(self) -> list[dict[str, Any]]:
        return [{**f.model_dump(), "left": left} for f, left in zip(self.faults, self.left,
                                                                     strict=True)]


# --- reading a conversation ----------------------------------------------------------------------


def text_of(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content
                       if isinstance(part, dict) and isinstance(part.get("text"), str))
    return ""


def first_user_text(messages: Sequence[Any]) -> str | None:
    for message in messages:
        if isinstance(message, dict) and message.get("role") == "user":
            return text_of(message.get("content"))
    return None


def context_of(messages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The JSON object after the `Context (JSON):` line of the first user message, or {}: a
    model that cannot read its context just finishes."""
    text = first_user_text(messages) or ""
    at = text.find(CONTEXT_MARKER)
    if at < 0:
        return {}
    try:
        value, _ = json.JSONDecoder().raw_decode(text[at + len(CONTEXT_MARKER):].lstrip())
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@dataclass(frozen=True, slots=True)
class Reading:
    """What the conversation says: how many steps were decided, and how many proposals were
    refused since the last of them."""

    decided: int
    refused_since: int

    @property
    def step(self) -> int:
        return self.decided + 1


def read(messages: Sequence[Mapping[str, Any]]) -> Reading:
    first_calls: set[str] = set()
    decided = refused_since = 0
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            first_calls.add(str(message["tool_calls"][0].get("id")))
        elif role == "tool" and str(message.get("tool_call_id")) in first_calls:
            if text_of(message.get("content")).lstrip().startswith(REFUSED):
                refused_since += 1
            else:
                decided += 1
                refused_since = 0
    return Reading(decided, refused_since)


@dataclass(frozen=True, slots=True)
class ScriptStep:
    tool: str
    args: dict[str, Any]
    parallel: tuple[tuple[str, dict[str, Any]], ...]
    malformed: bool


def _call_of(raw: Any, where: str) -> tuple[str, dict[str, Any]]:
    if not isinstance(raw, dict) or not isinstance(raw.get("tool"), str) or not raw["tool"]:
        raise BadRequest(f"{where} must be an object with a `tool` name", where)
    args = raw.get("args", {})
    if not isinstance(args, dict):
        raise BadRequest(f"{where}.args must be a JSON object", where)
    return raw["tool"], args


def script_of(context: Mapping[str, Any]) -> list[ScriptStep]:
    raw = context.get("script", [])
    if not isinstance(raw, list):
        raise BadRequest("context.script must be a list of steps", "context.script")
    steps = []
    for i, entry in enumerate(raw):
        where = f"context.script[{i}]"
        tool, args = _call_of(entry, where)
        parallel = entry.get("parallel", [])
        if not isinstance(parallel, list):
            raise BadRequest(f"{where}.parallel must be a list of calls", where)
        steps.append(ScriptStep(
            tool, args, tuple(_call_of(p, f"{where}.parallel[{j}]")
                              for j, p in enumerate(parallel)),
            bool(entry.get("malformed", False))))
    return steps


# --- checking a request --------------------------------------------------------------------------


def check(body: Mapping[str, Any]) -> None:
    """What OpenAI refuses with a 400 before any model thinks (BadRequest)."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("you must provide a model parameter", "model")
    if body.get("stream"):
        raise BadRequest("modelsim does not stream; send stream: false", "stream")
    if body.get("n", 1) != 1:
        raise BadRequest("modelsim answers one choice; n must be 1", "n")
    tools = body.get("tools")
    if tools is not None:
        _check_tools(tools)
    if body.get("parallel_tool_calls") is not None and not tools:
        raise BadRequest("parallel_tool_calls is only allowed when 'tools' are specified.",
                         "parallel_tool_calls")
    _check_messages(body.get("messages"))


def _check_tools(tools: Any) -> None:
    if not isinstance(tools, list) or len(tools) > TOOLS_MAX:
        raise BadRequest(f"'tools' must be a list of at most {TOOLS_MAX} tools", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(tool, dict) or tool.get("type") != "function"
                or not isinstance(function, dict)):
            raise BadRequest(f"Invalid 'tools[{i}]': expected a function tool", f"tools[{i}]")
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.match(name):
            raise BadRequest(f"Invalid 'tools[{i}].function.name': string does not match "
                             f"pattern. Expected a string that matches the pattern "
                             f"'^[a-zA-Z0-9_-]+$' of at most 64 characters.",
                             f"tools[{i}].function.name", "invalid_value")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise BadRequest(f"Invalid 'tools[{i}].function.parameters': expected an object",
                             f"tools[{i}].function.parameters")


def _check_messages(messages: Any) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadRequest("you must provide a non-empty 'messages' array", "messages",
                         "empty_array" if isinstance(messages, list) else None)
    if len(messages) > MESSAGES_MAX:
        raise BadRequest(f"'messages' has more than {MESSAGES_MAX} messages", "messages")
    unanswered: list[str] = []  # the calls of the last assistant message not answered yet
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            raise BadRequest(f"Invalid '{where}': expected an object with a role, one of "
                             f"{', '.join(sorted(ROLES))}", f"{where}.role")
        role = message["role"]
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in unanswered:
                raise BadRequest(f"Invalid parameter: messages with role 'tool' must be a "
                                 f"response to a preceeding message with 'tool_calls' "
                                 f"({where}.tool_call_id {call_id!r})", f"{where}.tool_call_id")
            unanswered.remove(call_id)
            continue
        if unanswered:
            raise BadRequest(f"An assistant message with 'tool_calls' must be followed by tool "
                             f"messages responding to each 'tool_call_id'. The following "
                             f"tool_call_ids did not have response messages: "
                             f"{', '.join(unanswered)}", f"{where}.role")
        if role == "assistant" and message.get("tool_calls"):
            unanswered = _call_ids(message["tool_calls"], where)
    if unanswered:
        raise BadRequest(f"An assistant message with 'tool_calls' must be followed by tool "
                         f"messages responding to each 'tool_call_id'. The following "
                         f"tool_call_ids did not have response messages: "
                         f"{', '.join(unanswered)}", "messages")


def _call_ids(calls: Any, where: str) -> list[str]:
    if not isinstance(calls, list):
        raise BadRequest(f"Invalid '{where}.tool_calls': expected an array", f"{where}.tool_calls")
    ids = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(call, dict) or not isinstance(function, dict)
                or not isinstance(function.get("name"), str)
                or not isinstance(function.get("arguments"), str)):
            raise BadRequest(f"Invalid '{at}': expected a function call with a name and "
                             f"arguments as a string", at)
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise BadRequest(f"Invalid '{at}.id': expected a string", f"{at}.id")
        if len(call_id) > CALL_ID_CHARS_MAX:
            raise BadRequest(f"Invalid '{at}.id': string too long. Expected a string with "
                             f"maximum length {CALL_ID_CHARS_MAX}, but got a string with "
                             f"length {len(call_id)} instead.", f"{at}.id",
                             "string_above_max_length")
        ids.append(call_id)
    return ids


# --- answers -------------------------------------------------------------------------------------


def _error(status: int, message: str, kind: str = "invalid_request_error", *,
           param: str | None = None, code: str | None = None,
           headers: Mapping[str, str] | None = None) -> web.Response:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return web.json_response(body, status=status, headers=_headers(headers))


def _headers(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    return {"x-request-id": f"req_{secrets.token_hex(16)}", **(extra or {})}


def _masked(key: str) -> str:
    return f"{key[:3]}***{key[-4:]}" if len(key) > 8 else "***"


def _tokens(chars: int) -> int:
    return max(1, chars // 4)


def _answer(model: str, messages: Sequence[Any], script: Sequence[ScriptStep],
            reading: Reading, summary: str) -> dict[str, Any]:
    prompt_chars = len(json.dumps(messages, separators=(",", ":"), default=str))
    if reading.step <= len(script):
        step = script[reading.step - 1]
        calls = []
        for i, (tool, args) in enumerate(((step.tool, step.args), *step.parallel)):
            arguments = json.dumps(args)
            if i == 0 and step.malformed and reading.refused_since == 0:
                arguments = arguments[:-1]  # cut short: not JSON
            calls.append({"id": f"call_{secrets.token_hex(12)}", "type": "function",
                          "function": {"name": tool, "arguments": arguments}})
        message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": calls,
                                   "refusal": None}
        finish_reason = "tool_calls"
        completion_chars = len(json.dumps(calls, separators=(",", ":")))
    else:
        message = {"role": "assistant", "content": summary, "refusal": None}
        finish_reason = "stop"
        completion_chars = len(summary)
    prompt_tokens, completion_tokens = _tokens(prompt_chars), _tokens(completion_chars)
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}", "object": "chat.completion",
        "created": int(time.time()), "model": model, "system_fingerprint": f"fp_{PROVIDER}",
        "choices": [{"index": 0, "message": message, "logprobs": None,
                     "finish_reason": finish_reason}],
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


GARBAGE = ("<html><head><title>200 OK</title></head><body>"
           "<h1>Welcome to nginx!</h1></body></html>")


# --- the simulator -------------------------------------------------------------------------------


class ModelSim:
    """The simulator's state; `make_app()` serves it. `url` is set once it is served."""

    def __init__(self, *, api_key: str | None = API_KEY_DEFAULT,
                 models: Sequence[str] = MODELS_DEFAULT) -> None:
        models = tuple(models)
        if not models or len(models) > MODELS_MAX:
            raise ValueError(f"serve 1 to {MODELS_MAX} models, got {len(models)}")
        for name in models:
            if not name or len(name) > MODEL_NAME_CHARS_MAX:
                raise ValueError(f"a model name must be 1 to {MODEL_NAME_CHARS_MAX} characters")
        self.api_key = api_key or None
        self.models = models
        self.url: str | None = None
        self.requests_total = 0
        self._by_task: OrderedDict[str, int] = OrderedDict()
        self._task_faults: OrderedDict[str, tuple[str, Armed]] = OrderedDict()
        self._global = Armed([])
        self._stopping = asyncio.Event()

    @property
    def openai_base_url(self) -> str:
        """What the `openai` client takes as `base_url` (OPENAI_BASE_URL)."""
        if self.url is None:
            raise RuntimeError("the simulator is not served")
        return f"{self.url}/v1"

    # counting

    @property
    def requests_by_task(self) -> dict[str, int]:
        return dict(self._by_task)

    def requests_of(self, task: str) -> int:
        return self._by_task.get(task, 0)

    def counts(self) -> dict[str, Any]:
        return {"total": self.requests_total, "by_task": self.requests_by_task}

    def _count(self, task: str | None) -> None:
        self.requests_total += 1
        if task is None:
            return
        self._by_task[task] = self._by_task.get(task, 0) + 1
        self._by_task.move_to_end(task)
        while len(self._by_task) > TASKS_MAX:
            self._by_task.popitem(last=False)

    # faults

    def set_faults(self, faults: Sequence[Fault | Mapping[str, Any]]) -> None:
        """Replace the global faults (BadRequest, a ValueError, for a bad list)."""
        self._global = Armed(parse_faults([f.model_dump() if isinstance(f, Fault) else f
                                           for f in faults], "faults"))

    def clear_faults(self) -> None:
        self._global = Armed([])

    def faults(self) -> list[dict[str, Any]]:
        return self._global.describe()

    def reset(self) -> None:
        self.requests_total = 0
        self._by_task.clear()
        self._task_faults.clear()
        self.clear_faults()

    def _fault_for(self, task: str | None, context: Mapping[str, Any],
                   step: int) -> Fault | None:
        fault = self._global.take(step)
        if fault is not None or task is None or "model_faults" not in context:
            return fault
        raw = context["model_faults"]
        faults = parse_faults(raw, "context.model_faults")
        fingerprint = json.dumps(raw, sort_keys=True, default=str)
        known = self._task_faults.get(task)
        if known is None or known[0] != fingerprint:
            known = (fingerprint, Armed(faults))
            self._task_faults[task] = known
        self._task_faults.move_to_end(task)
        while len(self._task_faults) > TASKS_MAX:
            self._task_faults.popitem(last=False)
        return known[1].take(step)

    # serving

    def _authorized(self, request: web.Request) -> web.Response | None:
        if self.api_key is None:
            return None
        given = request.headers.get("Authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() == "bearer" and secrets.compare_digest(key.strip().encode(),
                                                                 self.api_key.encode()):
            return None
        if not key.strip():
            message = ("You didn't provide an API key. You need to provide your API key in an "
                       "Authorization header using Bearer auth (i.e. Authorization: Bearer "
                       "YOUR_KEY).")
        else:
            message = f"Incorrect API key provided: {_masked(key.strip())}."
        return _error(401, message, code="invalid_api_key")

    async def _chat_completions(self, request: web.Request) -> web.StreamResponse:
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            self._count(request.headers.get(TASK_HEADER) or None)
            return _error(413, f"The request body is larger than {BODY_BYTES_MAX} bytes.")
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):
            body = None
        if not isinstance(body, dict):
            body = None
        task = request.headers.get(TASK_HEADER) or self._task_of_prompt(body)
        self._count(task)
        if (refused := self._authorized(request)) is not None:
            return refused
        if body is None:
            return _error(400, "We could not parse the JSON body of your request. The body "
                               "must be a JSON object.")
        try:
            return await self._think(body, task)
        except BadRequest as exc:
            return _error(400, exc.message, param=exc.param, code=exc.code)

    @staticmethod
    def _task_of_prompt(body: Mapping[str, Any] | None) -> str | None:
        messages = body.get("messages") if body is not None else None
        text = first_user_text(messages) if isinstance(messages, list) else None
        if text is None:
            return None
        return f"prompt-{hashlib.sha256(text.encode()).hexdigest()[:16]}"

    async def _think(self, body: Mapping[str, Any], task: str | None) -> web.StreamResponse:
        check(body)
        model = body["model"]
        if model not in self.models:
            return _error(404, f"The model `{model[:MODEL_NAME_CHARS_MAX]}` does not exist or "
                               f"you do not have access to it.", code="model_not_found")
        messages = body["messages"]
        context = context_of(messages)
        reading = read(messages)
        script = script_of(context)
        fault = self._fault_for(task, context, reading.step)
        if fault is not None:
            answered = await self._fault(fault)
            if answered is not None:
                return answered
        summary = str(context.get("summary", SUMMARY_DEFAULT))
        return web.json_response(_answer(model, messages, script, reading, summary),
                                 headers=_headers())

    async def _fault(self, fault: Fault) -> web.StreamResponse | None:
        """The fault's answer, or None to answer normally (after a slow fault's wait)."""
        match fault.kind:
            case "429":
                headers = {}
                if fault.retry_after_s is not None:
                    headers = {"retry-after": f"{fault.retry_after_s:g}",
                               "retry-after-ms": str(int(fault.retry_after_s * 1000))}
                return _error(429, "Rate limit reached for requests. Please try again later.",
                              "requests", code="rate_limit_exceeded", headers=headers)
            case "500":
                return _error(500, "The server had an error while processing your request. "
                                   "Sorry about that!", "server_error")
            case "503":
                return _error(503, "The engine is currently overloaded, please try again "
                                   "later.", "server_error")
            case "401":
                return _error(401, "Incorrect API key provided.", code="invalid_api_key")
            case "400":
                return _error(400, "Invalid request (an injected fault).")
            case "garbage":
                return web.Response(status=200, text=GARBAGE, content_type="text/html",
                                    headers=_headers())
            case "slow":
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(),
                                           timeout=min(fault.delay_s, DELAY_S_MAX))
                return None

    async def _list_models(self, request: web.Request) -> web.Response:
        if (refused := self._authorized(request)) is not None:
            return refused
        return web.json_response({"object": "list",
                                  "data": [self._model(name) for name in self.models]},
                                 headers=_headers())

    async def _get_model(self, request: web.Request) -> web.Response:
        if (refused := self._authorized(request)) is not None:
            return refused
        name = request.match_info["model"]
        if name not in self.models:
            return _error(404, f"The model `{name[:MODEL_NAME_CHARS_MAX]}` does not exist or you "
                               f"do not have access to it.", code="model_not_found")
        return web.json_response(self._model(name), headers=_headers())

    @staticmethod
    def _model(name: str) -> dict[str, Any]:
        return {"id": name, "object": "model", "created": 0, "owned_by": PROVIDER}

    async def _unknown(self, request: web.Request) -> web.Response:
        return _error(404, f"Invalid URL ({request.method} {request.path})")

    # controls

    async def _requests(self, request: web.Request) -> web.Response:
        return web.json_response(self.counts())

    async def _set_faults(self, request: web.Request) -> web.Response:
        try:
            raw = json.loads(await request.read())
            self._global = Armed(parse_faults(raw, "faults"))
        except BadRequest as exc:
            return _error(400, exc.message, param=exc.param)
        except ValueError:
            return _error(400, 'expected a JSON list of faults (or {"faults": [...]})')
        return web.json_response({"faults": self.faults()})

    async def _clear_faults(self, request: web.Request) -> web.Response:
        self.clear_faults()
        return web.json_response({"faults": []})

    async def _show_faults(self, request: web.Request) -> web.Response:
        return web.json_response({"faults": self.faults()})

    async def _reset(self, request: web.Request) -> web.Response:
        self.reset()
        return web.json_response({"reset": True})

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=BODY_BYTES_MAX)
        app.router.add_post("/v1/chat/completions", self._chat_completions)
        app.router.add_get("/v1/models", self._list_models)
        app.router.add_get("/v1/models/{model}", self._get_model)
        app.router.add_get("/control/requests", self._requests)
        app.router.add_get("/control/faults", self._show_faults)
        app.router.add_post("/control/faults", self._set_faults)
        app.router.add_delete("/control/faults", self._clear_faults)
        app.router.add_post("/control/reset", self._reset)
        app.router.add_route("*", "/v1/{tail:.*}", self._unknown)

        async def stopping(app: web.Application) -> None:
            self._stopping.set()  # slow answers stop waiting

        app.on_shutdown.append(stopping)
        return app


# --- process -------------------------------------------------------------------------------------


async def start_in_process(port: int = 0, *, api_key: str | None = API_KEY_DEFAULT,
                           models: Sequence[str] = MODELS_DEFAULT, host: str = HOST,
                           ) -> tuple[str, ModelSim, Callable[[], Awaitable[None]]]:
    """Serve a simulator on this event loop: (base URL, the simulator, a coroutine function
    that stops it). The `openai` client's base URL is the base URL + `/v1`."""
    sim = ModelSim(api_key=api_key, models=models)
    url, runner = await keyed.start(sim.make_app(), host, port)
    sim.url = url
    return url, sim, runner.cleanup


@contextlib.asynccontextmanager
async def serving(port: int = 0, *, api_key: str | None = API_KEY_DEFAULT,
                  models: Sequence[str] = MODELS_DEFAULT,
                  host: str = HOST) -> AsyncIterator[tuple[str, ModelSim]]:
    """`async with serving() as (url, sim)`: a simulator on this loop, stopped on exit."""
    url, sim, stop = await start_in_process(port, api_key=api_key, models=models, host=host)
    try:
        yield url, sim
    finally:
        await stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m halfway.simulators.modelsim",
        description="An OpenAI-compatible chat-completions endpoint that follows a script "
                    "(modelsim).")
    parser.add_argument("--host", default=HOST)
    parser.add_argument("--port", type=int, default=0, help="0: any free port")
    parser.add_argument("--api-key", default=API_KEY_DEFAULT,
                        help="the key clients must send as a Bearer token; '' accepts any")
    parser.add_argument("--models", default=",".join(MODELS_DEFAULT),
                        help="the model names served, comma-separated")
    args = parser.parse_args(argv)
    models = [name.strip() for name in args.models.split(",") if name.strip()]
    try:
        sim = ModelSim(api_key=args.api_key, models=models)
    except ValueError as exc:
        parser.error(str(exc))
    return asyncio.run(keyed.serve(sim.make_app, args.host, args.port))


if __name__ == "__main__":
    sys.exit(main())
