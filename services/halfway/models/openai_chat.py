"""The decider's model adapter for any OpenAI-compatible chat-completions endpoint.

`OpenAIModel("gpt-4o-mini")` asks through the official client (`openai.AsyncOpenAI`), which
reads `OPENAI_BASE_URL` and `OPENAI_API_KEY` itself: OpenAI, or any server that speaks its
chat-completions API (vLLM, Ollama, LiteLLM, `halfway.simulators.modelsim`).

The conversation is the journal's, never the adapter's memory (`messages_of`): the app's
instructions and the harness's rules as the system message, the task's prompt and context as
the user message, then every decided step as the call the model made (its step id is the call
id) answered by the step's three-state line, and every refused proposal answered by why. A
resumed task, on any decider, asks the same question.

The answer (`proposal_of`): a tool call is a `ProposeCall` (further calls of the same answer
go to `also`: the harness runs one at a time; arguments that are not a JSON object set
`malformed`, which the decider turns into a refusal the model reads); plain text is a
`ProposeFinish` with the text as the summary; anything else is `ModelUnavailable`.

Failures (`failure_of`) are `ModelUnavailable`: transient (timeouts, dropped connections, 408,
409, 429, 5xx, an answer that is not a chat completion) or permanent (400, 401, 403, 404, 422,
any other 4xx: asking again cannot help), with the endpoint's status and `retry-after`. The
client is built with `max_retries=0` on purpose: the decider journals every failed question
(`model.failed`) and asks again with backoff from the journal, so retries are counted, bounded
and survive a restart, instead of hiding inside one question's timeout. The API key never
appears in an error.

An answer is read up to MODEL_REPLY_BYTES_MAX bytes (`http_client_of`): one declared larger
(`Content-Length`), one that grows past it as it is read (chunked, or until the connection
closes) and one compressed against the adapter's asking (its size unknown until decoded) are
refused unread as transient failures, their connection closed.
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import json
import re
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Mapping, Sequence
from typing import Any

import httpx2
import openai

from halfway.models.base import (
    History,
    ModelUnavailable,
    Proposal,
    ProposeCall,
    ProposeFinish,
    RefusalView,
    StepView,
    ToolInfo,
    Usage,
)

# Of one question, the whole of it (connecting, sending, the model thinking, reading). The
# decider bounds a question a little longer (halfway.decider.service), as a last guard.
MODEL_TIMEOUT_S = 120.0
# Of one answer of the endpoint, the bytes read (its body, as sent: the adapter asks for it
# uncompressed). A decision is a few KiB (a call's arguments at most 64 KiB, a summary 2,000
# characters): past this the answer is refused, the rest never read (`http_client_of`).
MODEL_REPLY_BYTES_MAX = 4 * 1024 * 1024
ERROR_CHARS_MAX = 1000
SUMMARY_CHARS_MAX = 2000
TOOL_NAME_CHARS_MAX = 200
ALSO_MAX = 15  # further calls kept of one answer (the journal keeps at most 16)
ALSO_ARGS_BYTES_MAX = 16 * 1024  # of one further call's arguments as JSON; larger ones keep {}
RETRY_AFTER_S_MAX = 3600.0
TOOLS_CACHE_MAX = 32  # distinct tool lists whose JSON is kept
CALL_ID_CHARS_MAX = 40  # OpenAI refuses longer tool call ids (string_above_max_length)
SECRET_CHARS_MIN = 6  # a shorter key (a placeholder for a local endpoint) is not scrubbed
TASK_HEADER = "X-Halfway-Task"
STEP_HEADER = "X-Halfway-Step"
CONTEXT_MARKER = "Context (JSON):"
NO_PROMPT = "(no prompt)"
NOT_RUN = ("not run: the harness runs one tool call at a time; propose it again as the next "
           "step if it is still needed")
HARNESS_RULES = """\
How this harness works:
- Every tool call you make is journaled before it runs, and its result is one of three states: \
"done: ..." with evidence; "not done, safe to try again: ..." with the reason; or "unknown, \
being checked: ...": the harness is finding out whether it happened, so do not start another \
one.
- Make one tool call per answer. The harness runs one at a time; further calls in the same \
answer are not run.
- A result that starts with "refused" means the harness did not run your call, and says why: \
correct the call instead of repeating it.
- When the task is finished, answer without a tool call: your text is the task's summary."""

_BEARER = re.compile(r"(?i)(bearer\s+)\S+")
_KEYISH = re.compile(r"\bsk-[A-Za-z0-9_-]{16,}")  # an OpenAI-style key, shown unmasked
_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


# --- the question --------------------------------------------------------------------------------


def call_id_of(raw: str) -> str:
    """A call id the endpoint accepts: the step id itself when short enough, else a stable
    digest of it (a task id may be 48 characters, an id at most 40)."""
    if 0 < len(raw) <= CALL_ID_CHARS_MAX:
        return raw
    return "call_" + hashlib.sha256(raw.encode()).hexdigest()[:CALL_ID_CHARS_MAX - 5]


def _arguments(args: Mapping[str, Any]) -> str:
    return json.dumps(args, separators=(",", ":"), ensure_ascii=False, default=str)


def _call(call_id: str, tool: str, args: Mapping[str, Any]) -> dict[str, Any]:
    return {"id": call_id_of(call_id), "type": "function",
            "function": {"name": tool, "arguments": _arguments(args)}}


def _answered(call_id: str, content: str) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": call_id_of(call_id), "content": content}


def refusal_words(reason: str) -> str:
    """A refusal as its result: it starts with "refused", whatever the reason's words."""
    return reason if reason.startswith("refused") else f"refused: {reason}"


def messages_of(history: History) -> list[dict[str, Any]]:
    """The conversation for the step being decided, from the history alone."""
    system = f"{history.instructions.strip()}\n\n{HARNESS_RULES}".strip()
    user = history.prompt
    if history.context:
        context = json.dumps(history.context, sort_keys=True, default=str)
        user = f"{user}\n\n{CONTEXT_MARKER}\n{context}" if user else f"{CONTEXT_MARKER}\n{context}"
    messages: list[dict[str, Any]] = [{"role": "system", "content": system},
                                      {"role": "user", "content": user or NO_PROMPT}]
    for turn in history.turns:
        if isinstance(turn, StepView):
            step_id = turn.step_id or f"{history.task_id}:{turn.n}"
            calls = [_call(step_id, turn.tool, turn.args),
                     *(_call(c.call_id, c.tool, c.args) for c in turn.also)]
            messages.append({"role": "assistant", "content": None, "tool_calls": calls})
            messages.append(_answered(step_id, turn.line))
            messages.extend(_answered(c.call_id, NOT_RUN) for c in turn.also)
        elif isinstance(turn, RefusalView):
            messages.append({"role": "assistant", "content": None,
                             "tool_calls": [_call(turn.call_id, turn.tool, turn.args)]})
            messages.append(_answered(turn.call_id, refusal_words(turn.reason)))
    return messages


def tools_of(tools: Sequence[ToolInfo]) -> list[dict[str, Any]]:
    """The tools as chat-completions `tools` (function tools)."""
    return [{"type": "function",
             "function": {"name": t.name, "description": t.description,
                          "parameters": t.args_schema or {"type": "object", "properties": {}}}}
            for t in tools]


# --- the answer ----------------------------------------------------------------------------------


def _args_of(tool: str, text: Any) -> tuple[dict[str, Any], str | None]:
    """(arguments, None), or ({}, why they cannot be read)."""
    if text is None or (isinstance(text, str) and not text.strip()):
        return {}, None  # some servers send "" for a call without arguments
    try:
        value = json.loads(text)
    except (TypeError, ValueError, RecursionError) as exc:
        problem = str(exc)[:200]
    else:
        if isinstance(value, dict):
            return value, None
        problem = f"got a JSON {_JSON_TYPES.get(type(value), 'value')}"
    return {}, (f"the arguments of {tool[:TOOL_NAME_CHARS_MAX]} are not a JSON object: "
                f"{problem}; propose the call again with its arguments as one JSON object")


def _name_and_arguments(call: Any) -> tuple[str, Any]:
    function = getattr(call, "function", None)
    if function is not None:
        return str(getattr(function, "name", "") or ""), getattr(function, "arguments", None)
    custom = getattr(call, "custom", None)  # a custom tool call: free text, not JSON
    return str(getattr(custom, "name", "") or ""), getattr(custom, "input", None)


def _also_of(calls: Sequence[Any]) -> tuple[tuple[str, dict[str, Any]], ...]:
    kept = []
    for call in calls[:ALSO_MAX]:
        name, text = _name_and_arguments(call)
        args, malformed = _args_of(name, text)
        if malformed is not None or len(_arguments(args).encode()) > ALSO_ARGS_BYTES_MAX:
            args = {}
        kept.append((name[:TOOL_NAME_CHARS_MAX] or "?", args))
    return tuple(kept)


def usage_of(response: Any) -> Usage | None:
    usage = getattr(response, "usage", None)
    if usage is None:
        return None
    prompt = getattr(usage, "prompt_tokens", None)
    completion = getattr(usage, "completion_tokens", None)
    if not isinstance(prompt, int) and not isinstance(completion, int):
        return None
    return Usage(input_tokens=prompt if isinstance(prompt, int) else 0,
                 output_tokens=completion if isinstance(completion, int) else 0)


def _no_answer(error: str) -> ModelUnavailable:
    return ModelUnavailable(error[:ERROR_CHARS_MAX], transient=True)


def proposal_of(response: Any) -> Proposal:
    """The decision in a chat completion; ModelUnavailable (transient) when it has none."""
    choices = getattr(response, "choices", None)
    if not isinstance(choices, list) or not choices:
        what = "no choices" if isinstance(choices, list) else f"a {type(response).__name__}"
        raise _no_answer(f"the endpoint's answer is not a chat completion ({what})")
    choice = choices[0]
    message = getattr(choice, "message", None)
    finish_reason = getattr(choice, "finish_reason", None)
    usage = usage_of(response)
    calls = list(getattr(message, "tool_calls", None) or [])
    legacy = getattr(message, "function_call", None)  # the deprecated single function call
    if calls or legacy is not None:
        if calls:
            name, text = _name_and_arguments(calls[0])
        else:
            name, text = str(getattr(legacy, "name", "") or ""), getattr(legacy, "arguments", None)
        args, malformed = _args_of(name, text)
        return ProposeCall(tool=name, args=args, usage=usage, malformed=malformed,
                           also=_also_of(calls[1:]))
    if message is None:
        raise _no_answer("the endpoint's answer has no message")
    refusal = getattr(message, "refusal", None)
    if refusal:
        raise _no_answer(f"the model refused to answer: {refusal}")
    if finish_reason in ("length", "content_filter"):
        raise _no_answer(f"the model stopped without a decision (finish_reason "
                         f"{finish_reason})")
    content = getattr(message, "content", None)
    summary = content.strip() if isinstance(content, str) else ""
    # Text is the final answer when the model stopped, or did not say why it ended (some
    # compatible servers leave finish_reason null). No text is no decision: a task must not
    # "succeed" on an answer that holds nothing (a reasoning model's answer elsewhere, say).
    if not summary or finish_reason not in ("stop", None):
        raise _no_answer(f"the model's answer has neither a tool call nor a final text "
                         f"(finish_reason {finish_reason!r})")
    return ProposeFinish(summary=summary[:SUMMARY_CHARS_MAX], usage=usage)


# --- reading the answer --------------------------------------------------------------------------


class ReplyRefused(httpx2.RequestError):
    """An answer of the endpoint left unread: larger than MODEL_REPLY_BYTES_MAX, or compressed
    (its size unknown until decoded). Its connection is closed, not reused."""


def _refusal(response: httpx2.Response, why: str) -> ReplyRefused:
    return ReplyRefused(f"the endpoint's answer (HTTP {response.status_code}) {why}",
                        request=response.request)


def _declared_bytes(headers: httpx2.Headers) -> int | None:
    """The body's size its `Content-Length` says; None without one (chunked, or until the
    connection closes) or when it cannot be read (the bytes are counted as read then)."""
    value = headers.get("content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


class _CountedBody(httpx2.AsyncByteStream):
    """A response body that stops with ReplyRefused once past MODEL_REPLY_BYTES_MAX."""

    def __init__(self, stream: httpx2.AsyncByteStream, response: httpx2.Response) -> None:
        self._stream = stream
        self._response = response

    @property
    def elapsed(self) -> Any:  # httpx2's `Response.elapsed` reads it from its stream
        return getattr(self._stream, "elapsed", None)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        parts = self._stream.__aiter__()
        read = 0
        try:
            async for part in parts:
                read += len(part)
                if read > MODEL_REPLY_BYTES_MAX:
                    raise _refusal(self._response, f"is more than MODEL_REPLY_BYTES_MAX "
                                                   f"({MODEL_REPLY_BYTES_MAX} bytes): not read "
                                                   f"further")
                yield part
        finally:
            if isinstance(parts, AsyncGenerator):
                await parts.aclose()

    async def aclose(self) -> None:
        await self._stream.aclose()


async def _bounded(response: httpx2.Response) -> None:
    """Of every answer, before any of its body is read (a response hook): refused when
    compressed or declared larger than MODEL_REPLY_BYTES_MAX, else counted as it is read. The
    client then closes it, and its connection with it, unread."""
    coding = response.headers.get("content-encoding", "").strip().lower()
    if coding not in ("", "identity"):
        raise _refusal(response, f"is compressed ({coding[:40]}) though none was asked for: "
                                 f"its size is unknown until decoded (MODEL_REPLY_BYTES_MAX, "
                                 f"{MODEL_REPLY_BYTES_MAX} bytes, bounds it): not read")
    declared = _declared_bytes(response.headers)
    if declared is not None and declared > MODEL_REPLY_BYTES_MAX:
        raise _refusal(response, f"is {declared} bytes, more than MODEL_REPLY_BYTES_MAX "
                                 f"({MODEL_REPLY_BYTES_MAX} bytes): not read")
    if isinstance(response.stream, httpx2.AsyncByteStream):
        response.stream = _CountedBody(response.stream, response)


def http_client_of(timeout_s: float = MODEL_TIMEOUT_S) -> httpx2.AsyncClient:
    """The HTTP client under the official client the adapter makes: the official client's own
    defaults (its connection pool and reuse, redirects, proxies from the environment), asking
    for answers uncompressed and reading at most MODEL_REPLY_BYTES_MAX bytes of each."""
    return openai.DefaultAsyncHttpxClient(timeout=timeout_s,
                                          headers={"Accept-Encoding": "identity"},
                                          event_hooks={"response": [_bounded]})


def _refused_of(exc: BaseException) -> ReplyRefused | None:
    """The refused answer behind a failure (the official client wraps it in
    APIConnectionError)."""
    for error in (exc, exc.__cause__, exc.__context__):
        if isinstance(error, ReplyRefused):
            return error
    return None


# --- failures ------------------------------------------------------------------------------------


def retry_after_of(headers: Mapping[str, str] | None, *, now_s: float | None = None
                   ) -> float | None:
    """What `retry-after-ms` or `retry-after` (seconds or an HTTP date) asks, at most
    RETRY_AFTER_S_MAX; None when neither says."""
    if not headers:
        return None
    seconds: float | None = None
    try:
        if (ms := headers.get("retry-after-ms")) is not None:
            seconds = float(ms) / 1000.0
        elif (value := headers.get("retry-after")) is not None:
            try:
                seconds = float(value)
            except ValueError:
                when = email.utils.parsedate_to_datetime(value)
                seconds = when.timestamp() - (time.time() if now_s is None else now_s)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if seconds is None or seconds != seconds:  # NaN
        return None
    return min(max(seconds, 0.0), RETRY_AFTER_S_MAX)


def _scrubbed(text: str, secret: str | None) -> str:
    if secret and len(secret) >= SECRET_CHARS_MIN:
        text = text.replace(secret, "***")
    return _KEYISH.sub("sk-***", _BEARER.sub(r"\1***", text))


def _status_words(exc: openai.APIStatusError) -> str:
    body = exc.body
    message = body.get("message") if isinstance(body, dict) else None
    if not isinstance(message, str) or not message:
        message = body if isinstance(body, str) and body else exc.message
    code = exc.code or (exc.type if isinstance(exc.type, str) else None)
    return f"HTTP {exc.status_code}{f' {code}' if code else ''}: {message}"


def _transient_status(status: int) -> bool:
    return status in (408, 409, 429) or status >= 500 or status < 400


def failure_of(exc: BaseException, *, timeout_s: float = MODEL_TIMEOUT_S,
               secret: str | None = None) -> ModelUnavailable:
    """What a failed question tells the decider. `secret` (the API key) never shows."""
    status: int | None = None
    retry_after_s: float | None = None
    if (refused := _refused_of(exc)) is not None:  # a bad answer, like one not a completion
        error, transient = str(refused), True
    elif isinstance(exc, openai.APITimeoutError | TimeoutError):
        error, transient = f"no answer within {timeout_s:g} s", True
    elif isinstance(exc, openai.APIConnectionError):
        cause = exc.__cause__
        why = f"{type(cause).__name__}: {cause}" if cause is not None else exc.message
        error, transient = f"no connection to the model's endpoint: {why}", True
    elif isinstance(exc, openai.APIStatusError):
        status = exc.status_code
        error, transient = _status_words(exc), _transient_status(status)
        retry_after_s = retry_after_of(exc.response.headers)
    elif isinstance(exc, openai.APIResponseValidationError):
        error, transient = f"the endpoint's answer is not a chat completion: {exc.message}", True
    else:
        error, transient = f"{type(exc).__name__}: {exc}", True
    return ModelUnavailable(_scrubbed(error, secret)[:ERROR_CHARS_MAX], transient=transient,
                            status=status, retry_after_s=retry_after_s)


# --- the model -----------------------------------------------------------------------------------


class OpenAIModel:
    """A model behind an OpenAI-compatible chat-completions endpoint."""

    version: str | None = None

    def __init__(self, model: str, *, client: openai.AsyncOpenAI | None = None,
                 timeout_s: float = MODEL_TIMEOUT_S) -> None:
        if not model:
            raise ValueError("name the model, e.g. gpt-4o-mini")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.name = model
        self.timeout_s = timeout_s
        self._owns_client = client is None
        if client is None:
            try:
                client = openai.AsyncOpenAI(max_retries=0, timeout=timeout_s,
                                            http_client=http_client_of(timeout_s))
            except openai.OpenAIError as exc:
                raise ValueError(f"set OPENAI_API_KEY (any value for a local endpoint without "
                                 f"auth) to use the model {model}: {exc}") from None
        self.client = client
        self._tools: OrderedDict[tuple[int, ...],
                                 tuple[tuple[ToolInfo, ...], list[dict[str, Any]]]] = OrderedDict()

    def tools_for(self, tools: Sequence[ToolInfo]) -> list[dict[str, Any]]:
        """`tools_of(tools)`, built once per list of the same ToolInfo objects (the registry
        keeps them: a JSON schema costs CPU on every question otherwise)."""
        key = tuple(id(t) for t in tools)
        cached = self._tools.get(key)
        # The cache holds the objects, so their ids cannot be reused while it names them.
        if cached is not None and all(a is b for a, b in zip(cached[0], tools, strict=True)):
            self._tools.move_to_end(key)
            return cached[1]
        built = tools_of(tools)
        self._tools[key] = (tuple(tools), built)
        while len(self._tools) > TOOLS_CACHE_MAX:
            self._tools.popitem(last=False)
        return built

    async def decide(self, history: History) -> Proposal:
        params: dict[str, Any] = {
            "model": self.name,
            "messages": messages_of(history),
            "extra_headers": {TASK_HEADER: history.task_id, STEP_HEADER: str(history.n)},
            "timeout": self.timeout_s,
        }
        tools = self.tools_for(history.tools)
        if tools:
            params["tools"] = tools
            params["parallel_tool_calls"] = False
        try:
            # The client's timeout bounds each phase (connect, each read); this bounds the whole.
            async with asyncio.timeout(self.timeout_s):
                response = await self.client.chat.completions.create(**params)
        except Exception as exc:
            raise failure_of(exc, timeout_s=self.timeout_s, secret=self._secret()) from exc
        try:
            return proposal_of(response)
        except ModelUnavailable:
            raise
        except Exception as exc:  # an answer shaped in a way nothing above expected
            raise _no_answer(f"the endpoint's answer could not be read: "
                             f"{type(exc).__name__}: {exc}") from exc

    def _secret(self) -> str | None:
        key = getattr(self.client, "api_key", None)
        return key if isinstance(key, str) else None

    async def aclose(self) -> None:
        """Close the client this model made (a client passed in is its owner's to close)."""
        if self._owns_client:
            await self.client.close()

    async def __aenter__(self) -> OpenAIModel:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()
