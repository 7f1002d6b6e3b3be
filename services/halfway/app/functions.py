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
- it ran past `timeout_s`, or raised anything else: `unknown`, it may have happened.

A lookup function returns the evidence when the effect named by `ctx.key` exists, None when
nothing is found (which proves nothing on its own), or raises `Refused` when it found the
effect and it failed. Anything it raises is a failed lookup: it says nothing about the effect.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel
from pydantic_core import to_jsonable_python

from halfway.core.classify import (
    CallFailure,
    ConnectionLost,
    NotSent,
    Replied,
    TimedOut,
    ToolRefused,
    Unexpected,
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


class Refused(Exception):
    """Raise it from a tool to say the effect did not happen (the provider said no, the input
    is wrong for it): proof of `not_done`, and the model reads `reason`."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = str(reason) or "refused"


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


def failure_of(exc: BaseException, timeout_s: float) -> CallFailure:
    """What an exception raised by a tool function proves (see the module docstring)."""
    try:
        words = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS_MAX]
    except Exception:  # an exception whose str() fails still has a name
        words = type(exc).__name__
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
                           message=str(error.get("message") or "")[:ERROR_CHARS_MAX])
        except Exception:
            return Replied(response.status_code, message=response.text[:ERROR_CHARS_MAX])
    if isinstance(exc, errors.aiohttp_status):
        return Replied(exc.status,  # type: ignore[attr-defined]
                       message=str(exc.message)[:ERROR_CHARS_MAX])  # type: ignore[attr-defined]
    return Unexpected(words)


def evidence_of(value: Any) -> dict[str, Any]:
    """A returned value as evidence: never empty, always JSON, bounded."""
    try:
        data = to_jsonable_python(value, fallback=str)
    except Exception as exc:
        data = f"<not JSON: {type(exc).__name__}>"
    if not isinstance(data, dict) or not data:
        data = {"result": data}
    text = json.dumps(data, separators=(",", ":"), default=str)
    if len(text.encode()) <= EVIDENCE_BYTES_MAX:
        return data
    # Too big to journal whole: keep what names the effect, and an excerpt.
    small = {k: v for k, v in data.items()
             if isinstance(v, str | int | float | bool) and len(str(v)) <= 255}
    return {**small, "truncated": True,
            "excerpt": text.encode()[:EVIDENCE_BYTES_MAX // 2].decode(errors="ignore")}


class FunctionAdapter:
    """Calls the tool's function (and its lookup) with the step's arguments and context."""

    def __init__(self, fn: Callable[..., Any], fields: tuple[str, ...], *,
                 takes_ctx: bool) -> None:
        self.fn = fn
        self.fields = fields
        self.takes_ctx = takes_ctx
        self.lookup_fn: Callable[..., Any] | None = None
        self.lookup_takes_ctx = False

    async def call(self, args: BaseModel, ctx: CallContext) -> CallResult:
        try:
            async with asyncio.timeout(ctx.timeout_s):
                value = await self._invoke(self.fn, args, ctx, self.takes_ctx)
        except Exception as exc:  # our timeout included: failure_of says TimedOut
            return failure_of(exc, ctx.timeout_s)
        return Succeeded(evidence=evidence_of(value))

    async def lookup(self, args: BaseModel, ctx: CallContext) -> LookupResult:
        if self.lookup_fn is None:
            return LookupFailed("this tool has no lookup")
        try:
            async with asyncio.timeout(ctx.timeout_s):
                value = await self._invoke(self.lookup_fn, args, ctx, self.lookup_takes_ctx)
        except Refused as exc:
            return Found(evidence={"refused": exc.reason[:ERROR_CHARS_MAX]}, succeeded=False,
                         reason=exc.reason[:ERROR_CHARS_MAX])
        except TimeoutError:
            return LookupFailed(f"the lookup took longer than {ctx.timeout_s:g} s")
        except Exception as exc:
            return LookupFailed(f"the lookup failed: {type(exc).__name__}: {exc}"
                                [:ERROR_CHARS_MAX])
        if value is None:
            return NotFound(f"the lookup found nothing for {ctx.key}")
        return Found(evidence=evidence_of(value))

    async def _invoke(self, fn: Callable[..., Any], args: BaseModel, ctx: CallContext,
                      takes_ctx: bool) -> Any:
        kwargs = {name: getattr(args, name) for name in self.fields}
        if takes_ctx:
            kwargs["ctx"] = ctx
        if inspect.iscoroutinefunction(fn):
            return await fn(**kwargs)
        # A plain function runs on a worker thread, so it never blocks the event loop; past
        # the timeout the thread runs on, and the outcome is unknown.
        return await asyncio.to_thread(fn, **kwargs)
