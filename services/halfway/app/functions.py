"""A tool written as a plain Python function, and what its outcome proves.

The tool author writes no three-state logic; this module maps what the function did:

- it returned: `done`, with the value as evidence (a dict as it is, anything else as
  `{"result": value}`; made JSON-safe and cut to EVIDENCE_BYTES_MAX);
- it raised `Refused("why")`: proof of `not_done`;
- it raised an error that proves the request never left (connection refused, DNS failure, a
  connect timeout, no free pooled connection: httpx, aiohttp, or the OS's own): "never reached"
  (`not_done` on the first attempt, `unknown` after, as for every tool: `halfway.core.classify`);
- it raised httpx's `HTTPStatusError` or aiohttp's `ClientResponseError` (their
  `raise_for_status()`): the provider's answer,
  classified like any reply (a 4xx refusal is `not_done`; 408, 409, 429 and 5xx are `unknown`);
- it ran past `timeout_s`, or raised anything else (`SystemExit` and `KeyboardInterrupt`
  included: a tool never stops the process; only `asyncio.CancelledError`, the harness's own
  cancellation, goes through): `unknown`, it may have happened.

A lookup function returns the evidence (a non-empty dict) when the effect named by `ctx.key`
exists, None when nothing is found (which proves nothing on its own), or raises `Refused` when
it found the effect and it failed. Anything it raises, and anything else it returns, is a
failed lookup: it says nothing about the effect.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from halfway.app import runaway
from halfway.contract.events import Outcome
from halfway.core.classify import (
    CallFailure,
    ConnectionLost,
    NotSent,
    Replied,
    TimedOut,
    ToolRefused,
    Unexpected,
    Unproven,
    classify,
)
from halfway.tools.spec import (
    CallContext,
    CallResult,
    Found,
    LookupFailed,
    LookupResult,
    NotFound,
    Succeeded,
)

EVIDENCE_BYTES_MAX = 16 * 1024  # of a tool's returned evidence, as JSON; more is cut
ERROR_CHARS_MAX = 500  # of an exception's words, kept in the journal
FIELD_CHARS_MAX = 255  # of a field's name and value, kept from evidence too big to keep whole
FIELDS_KEPT_MAX = 100  # fields kept from evidence too big to keep whole


class Refused(Exception):
    """Raise it from a tool to say the effect did not happen (the provider said no, the input
    is wrong for it): proof of `not_done`, and the model reads `reason`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = clean_text(str(reason)) or "refused"


# aiohttp's connector error includes its DNS failure (ClientConnectorDNSError) and refused
# connections; its connection-pool wait timing out is ConnectionTimeoutError. The HTTP
# libraries' classes are looked up only once the library is loaded (an exception of theirs
# means it is): a process that never uses one does not pay for importing it.
_NEVER_SENT_OS: tuple[type[BaseException], ...] = (ConnectionRefusedError, socket.gaierror)
_CONNECTION_LOST_OS: tuple[type[BaseException], ...] = (
    ConnectionResetError, BrokenPipeError, ConnectionAbortedError)


@dataclass(frozen=True)
class _HttpErrors:
    never_sent: tuple[type[BaseException], ...] = _NEVER_SENT_OS
    connection_lost: tuple[type[BaseException], ...] = _CONNECTION_LOST_OS
    timed_out: tuple[type[BaseException], ...] = (TimeoutError,)
    httpx_status: tuple[type[BaseException], ...] = ()
    aiohttp_status: tuple[type[BaseException], ...] = ()


_known: dict[tuple[bool, bool], _HttpErrors] = {}


def _http_errors() -> _HttpErrors:
    loaded = ("httpx" in sys.modules, "aiohttp" in sys.modules)
    if (known := _known.get(loaded)) is not None:
        return known
    never_sent, lost, timed_out = [*_NEVER_SENT_OS], [*_CONNECTION_LOST_OS], [TimeoutError]
    httpx_status: list[type[BaseException]] = []
    aiohttp_status: list[type[BaseException]] = []
    if loaded[0]:
        import httpx

        never_sent += [httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout,
                       httpx.UnsupportedProtocol]
        lost += [httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError]
        timed_out.append(httpx.TimeoutException)
        httpx_status.append(httpx.HTTPStatusError)
    if loaded[1]:
        import aiohttp

        never_sent += [aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError,
                       aiohttp.InvalidURL]
        lost += [aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError]
        aiohttp_status.append(aiohttp.ClientResponseError)  # its raise_for_status()
    known = _known[loaded] = _HttpErrors(tuple(never_sent), tuple(lost), tuple(timed_out),
                                         tuple(httpx_status), tuple(aiohttp_status))
    return known


def clean_text(text: str) -> str:
    """`text` with each lone surrogate ("\\ud800") replaced by U+FFFD: UTF-8 cannot encode
    one, so a journal entry holding one could not be written."""
    return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")


def words_of(exc: BaseException) -> str:
    """An exception in words for the journal: its type and message, bounded."""
    try:
        return clean_text(f"{type(exc).__name__}: {exc}"[:ERROR_CHARS_MAX])
    except BaseException:  # an exception whose str() fails still has a name
        return clean_text(type(exc).__name__[:ERROR_CHARS_MAX])


def failure_of(exc: BaseException, timeout_s: float) -> CallFailure:
    """What an exception raised by a tool function proves (see the module docstring)."""
    words = words_of(exc)
    if isinstance(exc, Refused):
        return ToolRefused(exc.reason[:ERROR_CHARS_MAX])
    errors = _http_errors()
    if isinstance(exc, errors.never_sent):
        return NotSent(words)
    if isinstance(exc, errors.timed_out):
        return TimedOut(timeout_s)
    if isinstance(exc, errors.connection_lost):
        return ConnectionLost(words)
    if isinstance(exc, errors.httpx_status):
        response = exc.response  # type: ignore[attr-defined]
        try:
            error = response.json()["error"]
            return Replied(response.status_code, code=error.get("code") or error.get("type"),
                           message=clean_text(str(error.get("message") or "")[:ERROR_CHARS_MAX]))
        except Exception:
            return Replied(response.status_code,
                           message=clean_text(response.text[:ERROR_CHARS_MAX]))
    if isinstance(exc, errors.aiohttp_status):
        message = clean_text(str(exc.message)[:ERROR_CHARS_MAX])  # type: ignore[attr-defined]
        return Replied(exc.status, message=message)  # type: ignore[attr-defined]
    return Unexpected(words)


def evidence_of(value: Any) -> dict[str, Any]:
    """A returned value as evidence: never empty, always JSON (any encoder takes it), and at
    most EVIDENCE_BYTES_MAX encoded (as `json.dumps` writes it, the widest form)."""
    if _flat(value):  # most evidence, on every call's path: JSON as it is
        with contextlib.suppress(ValueError):  # an int too long to write: the slow path
            if value and _size(value) <= EVIDENCE_BYTES_MAX:
                return dict(value)
    try:
        data = _json_data(value)
    except BaseException:  # user code runs here (a __str__): anything may come
        # One field that is not JSON costs only itself.
        data = _fields_of(value) if isinstance(value, Mapping) else _not_json(value)
    if not isinstance(data, dict) or not data:
        data = {"result": data}
    if _size(data) <= EVIDENCE_BYTES_MAX:
        return data
    # Too big to journal whole: keep the short fields (what names the effect), in order, while
    # they fit in half the bound, and an excerpt of the rest.
    kept: dict[str, Any] = {}
    room = EVIDENCE_BYTES_MAX // 2 - _size({"truncated": True, "excerpt": ""})
    for name, field in data.items():
        if len(kept) == FIELDS_KEPT_MAX:
            break
        if len(name) > FIELD_CHARS_MAX or not isinstance(field, str | int | float | bool) \
                or len(str(field)) > FIELD_CHARS_MAX:
            continue
        room -= _size(name) + _size(field) + 4  # ": " and ", "
        if room < 0:
            break
        kept[name] = field
    text = json.dumps(data, ensure_ascii=False)
    out = {**kept, "truncated": True, "excerpt": ""}
    out["excerpt"] = _cut(text, EVIDENCE_BYTES_MAX - _size(out))
    return out


def _flat(value: Any) -> bool:
    """A dict of ASCII text (no lone surrogate can hide there), whole numbers, booleans and
    nulls: JSON whole, with nothing to clean."""
    if type(value) is not dict:
        return False
    for name, field in value.items():
        if type(name) is not str or not name.isascii():
            return False
        kind = type(field)
        if kind is str:
            if not field.isascii():
                return False
        elif kind is not int and kind is not bool and field is not None:
            return False
    return True


def _json_data(value: Any) -> Any:
    """`value` as plain JSON data (NaN and infinities as null, lone surrogates replaced, in
    keys too); raises if it is not JSON."""
    text = json.dumps(value, ensure_ascii=False, default=_plain)
    return json.loads(clean_text(text), parse_constant=lambda _nan: None)


def _plain(value: Any) -> Any:
    """What `json` does not know (a model, a dataclass, a datetime, a set), as pydantic has it."""
    if isinstance(value, Mapping):
        return dict(value)
    return to_jsonable_python(value, fallback=str, inf_nan_mode="null")


def _fields_of(value: Mapping[Any, Any]) -> Any:
    try:
        fields = list(value.items())
    except BaseException:
        return _not_json(value)
    data: dict[str, Any] = {}
    for name, field in fields:
        try:
            name = clean_text(name if isinstance(name, str) else str(name))
        except BaseException:
            name = f"<key {len(data)}>"
        try:
            data[name] = _json_data(field)
        except BaseException:
            data[name] = _not_json(field)
    return data


def _not_json(value: Any) -> str:
    return clean_text(f"<not JSON: {type(value).__name__}>"[:FIELD_CHARS_MAX])


def _size(data: Any) -> int:
    """Bytes of `data` as JSON in its widest form (ASCII escapes, spaced separators)."""
    return len(json.dumps(data))


def _cut(text: str, room: int) -> str:
    """A start of `text` whose JSON string takes at most `room` bytes (escapes counted)."""
    cut = text[:max(room, 0)]
    while (size := _size(cut)) > room and cut:
        cut = cut[:len(cut) * room // size]
    return cut


class FunctionAdapter:
    """Calls the tool's function (and its lookup) with the step's arguments and context."""

    # A call returns only once the function's code has ended, however long past its timeout
    # (`runaway`): the executor puts no deadline of its own around it.
    waits_for_its_code = True

    def __init__(self, fn: Callable[..., Any], fields: tuple[str, ...], *,
                 takes_ctx: bool) -> None:
        self.fn = fn
        self.name = getattr(fn, "__name__", "tool")
        self.fields = fields
        self.takes_ctx = takes_ctx
        self.lookup_fn: Callable[..., Any] | None = None
        self.lookup_takes_ctx = False

    async def call(self, args: BaseModel, ctx: CallContext) -> CallResult:
        deadline = asyncio.timeout(ctx.timeout_s)
        watch = runaway.Watch()
        try:
            async with deadline:
                value = await self._invoke(self.fn, args, ctx, self.takes_ctx, watch)
        except asyncio.CancelledError:
            raise  # the harness cancels calls (shutdown): not an outcome of the tool
        except BaseException as exc:  # our timeout included: failure_of says TimedOut
            # SystemExit and KeyboardInterrupt too: a tool never stops the process.
            if deadline.expired():
                # Over only once its code has ended: until then it may still send.
                await runaway.until_ended(watch, self.name)
                return TimedOut(ctx.timeout_s)
            failure = failure_of(exc, ctx.timeout_s)
            if self.lookup_fn is not None and not isinstance(exc, Refused):
                verdict = classify(failure, attempt=ctx.attempt)
                if verdict.outcome is Outcome.NOT_DONE:
                    return Unproven(verdict.reason)  # the lookup corroborates it, or not
            return failure
        if deadline.expired():
            # The tool swallowed our cancellation and answered anyway: what it says on its way
            # out (a value, a refusal) is no proof, and the request may be out.
            await runaway.until_ended(watch, self.name)
            return TimedOut(ctx.timeout_s)
        return Succeeded(evidence=evidence_of(value))

    async def lookup(self, args: BaseModel, ctx: CallContext) -> LookupResult:
        if self.lookup_fn is None:
            return LookupFailed("this tool has no lookup")
        deadline = asyncio.timeout(ctx.timeout_s)
        try:
            async with deadline:
                # A lookup has no effect: one running on is not waited for.
                value = await self._invoke(self.lookup_fn, args, ctx, self.lookup_takes_ctx,
                                           runaway.Watch())
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if deadline.expired() or isinstance(exc, TimeoutError):
                # Past our timeout, even a refusal is no proof: the tool swallowed the
                # cancellation and said something on its way out.
                return LookupFailed(f"the lookup took longer than {ctx.timeout_s:g} s")
            if isinstance(exc, Refused):
                return Found(evidence={"refused": exc.reason[:ERROR_CHARS_MAX]},
                             succeeded=False, reason=exc.reason[:ERROR_CHARS_MAX])
            return LookupFailed(f"the lookup failed: {words_of(exc)}"[:ERROR_CHARS_MAX])
        if deadline.expired():  # it swallowed our cancellation: its answer proves nothing
            return LookupFailed(f"the lookup took longer than {ctx.timeout_s:g} s")
        if value is None:
            return NotFound(f"the lookup found nothing for {ctx.key}")
        if not isinstance(value, Mapping) or not value:
            # Neither the effect nor "nothing": counted as either, it could prove a done
            # effect not done (an empty lookup can), so it proves nothing.
            what = "an empty dict" if isinstance(value, Mapping) else type(value).__name__
            return LookupFailed(clean_text(f"the lookup returned {what}, not the effect (a "
                                           f"dict) or None")[:ERROR_CHARS_MAX])
        return Found(evidence=evidence_of(value))

    async def _invoke(self, fn: Callable[..., Any], args: BaseModel, ctx: CallContext,
                      takes_ctx: bool, watch: runaway.Watch) -> Any:
        kwargs = {name: getattr(args, name) for name in self.fields}
        if takes_ctx:
            kwargs["ctx"] = ctx
        if inspect.iscoroutinefunction(fn):
            # In a task of its own: our timeout stops waiting for it at once, and `watch`
            # says when its code has ended (`runaway`).
            return await runaway.in_task(fn(**kwargs), watch)
        # A plain function runs on a worker thread, so it never blocks the event loop; past
        # the timeout the thread runs on (nothing stops it), and `watch` says when it ends.
        thread = asyncio.get_running_loop().run_in_executor(
            None, runaway.in_thread, watch, _caught, fn, kwargs)
        returned, value = await asyncio.shield(thread)  # never cancelled: it runs all the same
        if not returned:
            raise value  # raised here, it reaches `call`'s handler whatever it is
        return value


def _caught(fn: Callable[..., Any], kwargs: dict[str, Any]) -> tuple[bool, Any]:
    """Run `fn`, with what it raised as a value: carried on a future, a GeneratorExit would be
    thrown into the task at its top, which closes our frames instead of reaching them."""
    try:
        return True, fn(**kwargs)
    except BaseException as exc:
        return False, exc
