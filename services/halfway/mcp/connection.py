"""One MCP client session per server per process: opened once, reused by every call, reopened
with a bounded backoff when it breaks, closed at shutdown.

The SDK's `Client` holds its transport (a stdio child process, or an HTTP client pool) in task
groups that must be entered and left by one task, so a session lives in a runner task of its
own; calls from any task send their requests through it. Whether a request was sent is what
the outcome turns on, so this module draws the line: `NotConnected` (raised by `client()`)
means nothing was sent on the session, since no session could be had; a failure after
`client()` returned is the caller's to classify.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from typing import Any

import httpx2
from mcp import Client
from mcp.client.stdio import StdioServerParameters
from mcp.client.streamable_http import streamable_http_client

from halfway import log

BACKOFF_S_MIN = 0.5  # after the first failed connect
BACKOFF_S_MAX = 30.0  # the cap of the doubling
CLOSE_TIMEOUT_S = 5.0  # closing a session (a stdio child gets terminated by the SDK after it)
ERROR_CHARS_MAX = 300
HTTP_TIMEOUT_S = 30.0  # connect, write, pool: as the SDK's own HTTP client
HTTP_READ_TIMEOUT_S = 300.0  # a server may hold a response stream open; calls have their own

Target = StdioServerParameters | str


class NotConnected(Exception):
    """No session: the server could not be reached (or is in its backoff); nothing was sent."""


def backoff_s(failures: int) -> float:
    """The wait after `failures` failed connects in a row: doubling, capped, with jitter."""
    base = min(BACKOFF_S_MAX, BACKOFF_S_MIN * 2 ** max(0, failures - 1))
    return base * random.uniform(0.8, 1.0)


def describe(exc: BaseException) -> str:
    """An exception in a few words; an exception group by its first leaf (anyio wraps)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}"[:ERROR_CHARS_MAX]


class Connection:
    """The session with one MCP server (`target`: stdio parameters, or a streamable HTTP URL
    with optional `headers`)."""

    def __init__(self, server: str, target: Target, *,
                 headers: dict[str, str] | None = None) -> None:
        self.server = server
        self.target = target
        self.headers = dict(headers or {})
        self._client: Client | None = None
        self._runner: asyncio.Task[None] | None = None
        self._stop: asyncio.Event | None = None
        self._lock: asyncio.Lock | None = None
        self._broken = False
        self._closed = False
        self._failures = 0
        self._retry_at = 0.0  # monotonic seconds: no connect before it
        self._last_error = ""
        self.opened = 0  # sessions opened so far (1 while nothing broke)

    @property
    def _log(self) -> Any:
        # Bound at use, not at import: the process configures its logging after the app loads.
        return log.get("halfway.mcp").bind(server=self.server)

    async def client(self, timeout_s: float) -> Client:
        """The open session, opened now if there is none (within `timeout_s`)."""
        if self._closed:
            raise NotConnected(f"the session with MCP server {self.server} is closed")
        if self._usable():
            assert self._client is not None
            return self._client
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # one connect at a time; the others wait for its result
            if self._usable():
                assert self._client is not None
                return self._client
            wait_s = self._retry_at - time.monotonic()
            if wait_s > 0:
                raise NotConnected(f"MCP server {self.server} unreachable ({self._last_error}); "
                                   f"next try in {wait_s:.1f} s")
            await self._close_runner()
            try:
                async with asyncio.timeout(timeout_s):
                    client = await self._open()
            except Exception as exc:
                self._failures += 1
                self._retry_at = time.monotonic() + backoff_s(self._failures)
                self._last_error = (f"connect timed out after {timeout_s:g} s"
                                    if isinstance(exc, TimeoutError) else describe(exc))
                await self._close_runner()
                self._log.warning("MCP server unreachable", error=self._last_error,
                                  failures=self._failures)
                raise NotConnected(f"MCP server {self.server} unreachable: "
                                   f"{self._last_error}") from None
            self._failures = 0
            self._broken = False
            self._client = client
            self.opened += 1
            self._log.info("MCP session open", sessions_opened=self.opened)
            return client

    @property
    def failures(self) -> int:
        """Failed connects in a row (0 once a session is open)."""
        return self._failures

    def retry_in_s(self) -> float:
        """How long until the next connect may be tried (0: now)."""
        return max(0.0, self._retry_at - time.monotonic())

    def mark_broken(self) -> None:
        """The session dropped under a call: the next call opens a new one."""
        self._broken = True

    async def aclose(self) -> None:
        self._closed = True
        await self._close_runner()

    def _usable(self) -> bool:
        if self._client is None or self._broken:
            return False
        if self._runner is None or self._runner.done():
            return False  # the transport failed and took the session down
        # A stdio child that exited leaves the Client open on a closed dispatcher: a request
        # sent now would fail before it leaves, so it counts as no session (reopen first).
        # Read defensively: if the SDK's internals change, a dead session is found by the
        # call failing with "connection closed" instead, which is classified unknown.
        dispatcher = getattr(self._client.session, "_dispatcher", None)
        return not getattr(dispatcher, "_closed", False)

    async def _open(self) -> Client:
        ready: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
        self._stop = asyncio.Event()
        self._runner = asyncio.create_task(self._run(ready, self._stop),
                                           name=f"mcp-session-{self.server}")
        return await ready

    async def _run(self, ready: asyncio.Future[Client], stop: asyncio.Event) -> None:
        """Own the session: enter it, hand it out, keep it until told to stop."""
        try:
            async with self._new_client() as client:
                if not ready.done():
                    ready.set_result(client)
                await stop.wait()
        except BaseException as exc:
            if not ready.done():
                ready.set_exception(exc if isinstance(exc, Exception) else
                                    ConnectionError(describe(exc)))
            elif not isinstance(exc, asyncio.CancelledError):
                self._log.warning("MCP session ended", error=describe(exc))
            if isinstance(exc, asyncio.CancelledError):
                raise

    def _new_client(self) -> Client:
        if isinstance(self.target, str):
            # The SDK's default timeouts (a response stream may stay open), the app's headers.
            http = httpx2.AsyncClient(headers=self.headers, timeout=httpx2.Timeout(
                HTTP_TIMEOUT_S, read=HTTP_READ_TIMEOUT_S))
            transport: Any = streamable_http_client(self.target, http_client=http)
            return _ClosingHttp(Client(transport), http)
        return Client(self.target)

    async def _close_runner(self) -> None:
        runner, self._runner = self._runner, None
        self._client = None
        if runner is None:
            return
        if self._stop is not None:
            self._stop.set()
        try:
            async with asyncio.timeout(CLOSE_TIMEOUT_S):
                with contextlib.suppress(Exception):  # its end was logged by the runner
                    await asyncio.shield(runner)
        except TimeoutError:
            runner.cancel()
            with contextlib.suppress(BaseException):
                await runner


class _ClosingHttp:
    """A Client over our own HTTP client, which is closed after the session (the SDK closes
    only the clients it made itself)."""

    def __init__(self, client: Client, http: httpx2.AsyncClient) -> None:
        self.client = client
        self.http = http

    async def __aenter__(self) -> Client:
        try:
            return await self.client.__aenter__()
        except BaseException:
            await self.http.aclose()
            raise

    async def __aexit__(self, *exc: Any) -> None:
        try:
            await self.client.__aexit__(*exc)
        finally:
            await self.http.aclose()
