"""The gateway's connections, bounded before any request is read (slowloris).

aiohttp bounds a request only once its headers are in (the gateway's slots and BODY_READ_S
start there), and by default keeps a connection that never completes its headers for an hour
(its keep-alive timeout, not reset by a trickle of header lines). A client that opens
connections and sends a header line now and then would hold them all, up to the process's
file-descriptor limit, and a genuine webhook could then not connect. `Connections` adds two
bounds around aiohttp, not in place of its HTTP:

- a deadline for a request's headers (HEADERS_READ_S): from the connection's start, and on a
  kept-alive connection from the end of the previous request's handling. A connection still
  waiting for them then is closed. A request being handled is never closed by it;
- a cap on open connections (CONNECTIONS_MAX, and below the file-descriptor limit): a new
  connection past it closes the one that has waited longest for its headers (the idlest),
  so a genuine webhook gets in during such an attack. Only when every connection is inside
  a request is the new one closed instead.

Closed connections are counted and logged at most once every CLOSED_LOG_INTERVAL_S
(`log.Throttled`), with the totals and the closings unlogged since the line before: a flood
writes a line a minute, not one per connection.

aiohttp tells its `Server` of each connection's start and end (`connection_made`,
`connection_lost`): `watch` wraps those two on the server the runner made. Which connections
are inside a request is told by its `middleware()`: the handler runs once the headers are in.
"""

from __future__ import annotations

import asyncio
import resource
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from halfway import log

# Providers send a request whole, at once: headers still arriving after this are a stalled or
# hostile client holding a connection (a connection's own start counts, so does the time idle
# on a kept-alive one). nginx's client_header_timeout is 60 s for every kind of client; ours
# are servers sending a few hundred bytes.
HEADERS_READ_S = 10.0
# Open connections at once. A webhook is served in milliseconds (REQUESTS_AT_ONCE_MAX of them
# inside a request at most, but for quick refusals): thousands open are idle or hostile. Also
# kept FDS_KEPT_FREE under the process's file-descriptor limit, so that a connection past the
# cap is accepted (and another closed), never left unaccepted by a process out of descriptors,
# and the broker's connections and the log still have theirs.
CONNECTIONS_MAX = 4096
FDS_KEPT_FREE = 256
CONNECTIONS_MIN = 16  # however low the descriptor limit: the gateway must serve something
# Closed connections are logged once per this interval at most, with the counts since.
CLOSED_LOG_INTERVAL_S = 60.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
Middleware = Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]


def connections_max_here() -> int:
    """CONNECTIONS_MAX, or fewer where the file-descriptor limit is lower."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return CONNECTIONS_MAX
    return max(CONNECTIONS_MIN, min(CONNECTIONS_MAX, soft - FDS_KEPT_FREE))


class Connections:
    """The open connections of one server: waiting for a request's headers (oldest first,
    with when they began waiting) or inside a request."""

    def __init__(self, headers_read_s: float = HEADERS_READ_S,
                 connections_max: int | None = None) -> None:
        if headers_read_s <= 0:
            raise ValueError(f"headers_read_s must be positive, got {headers_read_s}")
        self.headers_read_s = headers_read_s
        self.connections_max = connections_max_here() if connections_max is None \
            else connections_max
        if self.connections_max < 1:
            raise ValueError(f"connections_max must be at least 1, got {connections_max}")
        self._waiting: OrderedDict[web.RequestHandler, float] = OrderedDict()  # loop time
        self._in_request: set[web.RequestHandler] = set()
        self._sweep_at: asyncio.TimerHandle | None = None
        self._stopped = False
        self.late = 0  # closed: no request's headers within headers_read_s (since the start)
        self.shed = 0  # closed at the cap (the idlest, or a new one when none is idle)
        self._closings = log.Throttled(CLOSED_LOG_INTERVAL_S)
        self._log = log.get("halfway.gateway")

    @property
    def open(self) -> int:
        return len(self._waiting) + len(self._in_request)

    def watch(self, server: web.Server) -> None:
        """Be told of each connection `server` makes and loses (`make_runner`'s runner)."""
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler: web.RequestHandler, transport: Any) -> None:
            made(handler, transport)
            self._opened(handler)

        def connection_lost(handler: web.RequestHandler, exc: BaseException | None = None,
                            ) -> None:
            self._closed(handler)
            lost(handler, exc)

        server.connection_made = connection_made  # type: ignore[method-assign]
        server.connection_lost = connection_lost  # type: ignore[method-assign]

    def stop(self) -> None:
        self._stopped = True
        if self._sweep_at is not None:
            self._sweep_at.cancel()
            self._sweep_at = None

    def middleware(self) -> Middleware:
        """The app's middleware that marks a connection inside a request while it is handled
        (aiohttp calls the handler once the request's headers are in)."""
        @web.middleware
        async def inside_a_request(request: web.Request, handler: Handler,
                                   ) -> web.StreamResponse:
            connection = request.protocol
            self._entered(connection)
            try:
                return await handler(request)
            finally:
                self._left(connection)

        return inside_a_request

    # -- what the server and the middleware tell ---------------------------------------------

    def _opened(self, connection: web.RequestHandler) -> None:
        if self.open >= self.connections_max and not self._make_room():
            self._close(connection, "shed")  # every connection is inside a request
            return
        self._wait(connection)

    def _closed(self, connection: web.RequestHandler) -> None:
        self._waiting.pop(connection, None)
        self._in_request.discard(connection)

    def _entered(self, connection: web.RequestHandler) -> None:
        if self._waiting.pop(connection, None) is not None:
            self._in_request.add(connection)

    def _left(self, connection: web.RequestHandler) -> None:
        if connection in self._in_request:  # else closed meanwhile
            self._in_request.discard(connection)
            self._wait(connection)

    # -- the two bounds ------------------------------------------------------------------------

    def _wait(self, connection: web.RequestHandler) -> None:
        """`connection` waits for a request's headers from now: the newest to wait."""
        loop = asyncio.get_running_loop()
        self._waiting[connection] = loop.time()
        self._waiting.move_to_end(connection)
        if self._sweep_at is None and not self._stopped:
            self._sweep_at = loop.call_at(loop.time() + self.headers_read_s, self._sweep)

    def _make_room(self) -> bool:
        """Close the connection that has waited longest for its headers; False if none is
        waiting."""
        if not self._waiting:
            return False
        idlest, _ = self._waiting.popitem(last=False)
        self._close(idlest, "shed")
        return True

    def _sweep(self) -> None:
        """Close the connections whose headers are overdue; come back for the next one due.
        Those waiting are in the order they began to, so the overdue ones come first."""
        self._sweep_at = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._waiting:
            connection, since = next(iter(self._waiting.items()))
            if now < since + self.headers_read_s:
                if not self._stopped:
                    self._sweep_at = loop.call_at(since + self.headers_read_s, self._sweep)
                return
            del self._waiting[connection]
            self._close(connection, "late")

    def _close(self, connection: web.RequestHandler, why: str) -> None:
        connection.force_close()  # its connection_lost comes later: nothing of it is kept
        if why == "late":
            self.late += 1
        else:
            self.shed += 1
        # One line a CLOSED_LOG_INTERVAL_S at most: the totals so far, and how many closings
        # went unlogged since the line before.
        self._closings.warning(self._log, "closed", "connections closed", why=why,
                               late=self.late, shed=self.shed,
                               headers_read_s=self.headers_read_s,
                               connections_max=self.connections_max, open=self.open)
