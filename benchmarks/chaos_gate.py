"""A TCP relay in front of the payment provider whose port can be shut for a while.

A provider that is up never refuses a connection, and paysim's state (its ledger, the ground
truth) lives in its process, so it cannot be restarted to close its port. The services talk to
paysim through this relay instead; `shut_for(s)` stops listening (a connection attempt is then
refused, ECONNREFUSED: the request never left, proof of not done) and resets every connection it
relays (what a provider's load balancer restarting looks like: a request in flight may or may
not have been executed), then listens again on the same port.

Bytes are relayed as they come, both ways; when either side closes, both are closed, so a reply
that paysim drops (`lose_reply`) is dropped for the client too.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

HOST = "127.0.0.1"
BACKLOG = 1024  # as paysim's: hundreds of clients may connect at once
CHUNK_BYTES = 64 * 1024
UPSTREAM_CONNECT_TIMEOUT_S = 5.0  # paysim on loopback accepts at once; this is a hang


class TcpGate:
    def __init__(self, upstream_host: str, upstream_port: int, host: str = HOST) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.host = host
        self.port = 0
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self.connections = 0  # accepted and relayed
        self.upstream_failures = 0  # accepted, but paysim could not be reached
        self.windows = 0  # times the port was shut
        self.shut_s = 0.0  # total time shut
        self.reset = 0  # connections reset when the port was shut

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def start(self) -> str:
        await self._listen()
        return self.url

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._relay, self.host, self.port,
                                                  reuse_address=True, backlog=BACKLOG)
        self.port = self._server.sockets[0].getsockname()[1]

    async def shut_for(self, duration_s: float) -> None:
        """Refuse connections for `duration_s`, resetting the ones open now; then listen again."""
        if self._server is None:
            return
        self.windows += 1
        started = time.monotonic()
        server, self._server = self._server, None
        server.close()
        for writer in list(self._writers):
            self.reset += 1
            writer.transport.abort()
        await server.wait_closed()
        try:
            await asyncio.sleep(duration_s)  # the window itself: the experiment's schedule
        finally:
            await self._listen()
            self.shut_s += time.monotonic() - started

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._writers):
            writer.transport.abort()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(UPSTREAM_CONNECT_TIMEOUT_S):
                up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except (OSError, TimeoutError):
            self.upstream_failures += 1
            writer.transport.abort()
            return
        self.connections += 1
        self._writers |= {writer, up_writer}
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            self._writers -= {writer, up_writer}


async def _pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
    try:
        while chunk := await source.read(CHUNK_BYTES):
            sink.write(chunk)
            await sink.drain()
    except (ConnectionError, OSError):
        pass  # a reset on either side ends the relay; the other side is closed below
    finally:
        sink.close()
        with contextlib.suppress(ConnectionError, OSError):
            await sink.wait_closed()
