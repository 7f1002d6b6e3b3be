"""The HTTP API and the web page over the read model (PostgreSQL), read-only.

- `GET /api/tasks?state=&limit=`, `GET /api/tasks/{task_id}`: JSON, the same shapes as
  `halfway tasks --json` and `halfway status --json` (`halfway.api.status`).
- `GET /api/events`: Server-Sent Events. One poller per process reads a version of the read
  model (`queries.version`) every POLL_S while anyone listens and sends `changed` to every
  client when it moves. PostgreSQL could notify instead (LISTEN), but the projector does not
  NOTIFY and polling one cheap row is honest about what it costs: one query per 500 ms.
- `GET /`: the page (static/index.html), which re-reads the API on `ready` and `changed`.
- `GET /api/openapi.json`: `halfway.api.openapi`.

The read model missing (no projector has run yet) or PostgreSQL down answers 503 with a JSON
`error`, never 500: the API starts without the database and works as soon as it is there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import socket
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
from aiohttp import web

from halfway import log
from halfway.api import openapi, queries, status
from halfway.contract.ids import is_task_id
from halfway.settings import api_host, api_port, pg_dsn, pg_schema

POLL_S = 0.5
SSE_CLIENTS_MAX = 32  # each holds a connection open; past this a client gets 503
KEEPALIVE_S = 15.0  # a comment line this often finds clients that went away
STREAM_S_MAX = 3600.0  # then the stream ends and EventSource reconnects by itself
READY_TIMEOUT_S = 10.0
POOL_SIZE_MAX = 4
CONNECT_TIMEOUT_S = 5.0
ACQUIRE_TIMEOUT_S = 5.0
QUERY_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 5.0
SHUTDOWN_TIMEOUT_S = 5.0
ERROR_CHARS_MAX = 500
STATIC = Path(__file__).parent / "static"
QUERY_PARAMS = ("state", "limit")
LIMIT_TEXT = re.compile(r"[0-9]{1,6}")

_MISSING = (asyncpg.UndefinedTableError, asyncpg.InvalidSchemaNameError)
# What "the database cannot answer" looks like: refused, timed out, or a server error.
_UNAVAILABLE = (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError)


class Live:
    """The SSE clients and the one poller that tells them when the read model changes.

    Each client has a queue of one: a `changed` not yet sent already covers any later change,
    so a slow client never makes anything grow."""

    def __init__(self, api: Api) -> None:
        self._api = api
        self._clients: set[asyncio.Queue[str | None]] = set()
        self._poller: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()  # the poller has read a first version (or failed to)
        self._closed = False

    def subscribe(self) -> asyncio.Queue[str | None] | None:
        """A queue for one client; None when SSE_CLIENTS_MAX are connected or shutting down."""
        if self._closed or len(self._clients) >= SSE_CLIENTS_MAX:
            return None
        queue: asyncio.Queue[str | None] = asyncio.Queue(maxsize=1)
        self._clients.add(queue)
        if self._poller is None:
            self._poller = asyncio.create_task(self._poll(), name="halfway-api-poller")
        return queue

    def unsubscribe(self, queue: asyncio.Queue[str | None]) -> None:
        self._clients.discard(queue)

    async def wait_ready(self) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._ready.wait(), READY_TIMEOUT_S)

    async def _poll(self) -> None:
        logger = log.get("halfway.api")
        last: Any = None
        try:
            while self._clients:
                try:
                    current: Any = await self._api.read(queries.version)
                except web.HTTPException as exc:  # unavailable: a change when it comes back
                    current = ("unavailable", exc.text)
                except Exception as exc:  # a bug must not end the live updates in silence
                    logger.exception("cannot read the read model's version")
                    current = ("error", repr(exc))
                if last is not None and current != last:
                    logger.debug("read model changed", version=repr(current))
                    self._send(json.dumps({"at": datetime.now(UTC).isoformat()}))
                last = current
                self._ready.set()
                await asyncio.sleep(POLL_S)
        finally:
            # No await between the loop's last check and here: a client that subscribes now
            # finds no poller and starts a new one.
            self._poller = None
            self._ready.clear()

    def _send(self, item: str | None) -> None:
        for queue in self._clients:
            if item is None:  # shutting down: the end goes in even if a change is pending
                while not queue.empty():
                    queue.get_nowait()
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(item)

    async def close(self) -> None:
        self._closed = True
        self._send(None)
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller


class Api:
    """What the handlers share: the pool, the schema, the live clients."""

    def __init__(self, dsn: str, schema: str) -> None:
        self.dsn = dsn
        self.schema = queries.checked_schema(schema)
        self.pool: asyncpg.Pool | None = None
        self.live = Live(self)

    async def start(self) -> None:
        # min_size=0: no connection yet, so the API starts (and says 503) without PostgreSQL.
        self.pool = await asyncpg.create_pool(
            self.dsn, min_size=0, max_size=POOL_SIZE_MAX, timeout=CONNECT_TIMEOUT_S,
            command_timeout=QUERY_TIMEOUT_S)

    async def stop(self) -> None:
        await self.live.close()
        if self.pool is not None:
            try:
                await asyncio.wait_for(self.pool.close(), CLOSE_TIMEOUT_S)
            except TimeoutError:
                self.pool.terminate()

    async def read(self, query: Any, *args: Any) -> Any:
        """`await query(conn, schema, *args)`; the read model missing or unreachable raises
        HTTPServiceUnavailable with the reason in words."""
        assert self.pool is not None, "Api.start() was not called"
        try:
            async with self.pool.acquire(timeout=ACQUIRE_TIMEOUT_S) as conn:
                return await query(conn, self.schema, *args)
        except _MISSING:
            raise _error(web.HTTPServiceUnavailable,
                         f"the read model (schema {self.schema!r}) does not exist yet: is the "
                         "projector running?") from None
        except _UNAVAILABLE as exc:
            raise _error(web.HTTPServiceUnavailable,
                         f"cannot read the read model: {type(exc).__name__}: {exc}") from None


API = web.AppKey("api", Api)


def _error(kind: type[web.HTTPException], reason: str) -> web.HTTPException:
    return kind(text=json.dumps({"error": reason[:ERROR_CHARS_MAX]}),
                content_type="application/json")


def _json(data: Any) -> web.Response:
    return web.json_response(data, headers={"Cache-Control": "no-store"})


def _list_params(request: web.Request) -> tuple[str | None, int]:
    unknown = sorted(set(request.query) - set(QUERY_PARAMS))
    if unknown:
        raise _error(web.HTTPBadRequest, f"unknown query parameter(s) {', '.join(unknown)}: "
                     f"known are {', '.join(QUERY_PARAMS)}")
    for name in QUERY_PARAMS:
        if len(request.query.getall(name, [])) > 1:
            raise _error(web.HTTPBadRequest, f"{name} is given more than once")
    state = request.query.get("state") or None  # state= (empty) means every state
    if state is not None and state not in queries.TASK_STATES:
        raise _error(web.HTTPBadRequest, f"unknown state {state[:60]!r}: one of "
                     f"{', '.join(queries.TASK_STATES)}")
    raw = request.query.get("limit", str(queries.LIMIT_DEFAULT))
    # ASCII digits only, and few: str.isdigit() takes "²", and int() refuses 5000 digits.
    if not LIMIT_TEXT.fullmatch(raw) or not 1 <= int(raw) <= queries.LIMIT_MAX:
        raise _error(web.HTTPBadRequest,
                     f"limit must be a whole number in 1..{queries.LIMIT_MAX}, got {raw[:20]!r}")
    return state, int(raw)


async def list_tasks(request: web.Request) -> web.Response:
    state, limit = _list_params(request)
    rows = await request.app[API].read(queries.list_tasks, state, limit)
    return _json({"tasks": status.tasks_json(rows), "count": len(rows), "state": state,
                  "limit": limit})


async def get_task(request: web.Request) -> web.Response:
    task_id = request.match_info["task_id"]
    if not is_task_id(task_id):
        raise _error(web.HTTPBadRequest, f"{task_id[:60]!r} is not a task id")
    task = await request.app[API].read(queries.get_task, task_id)
    if task is None:
        raise _error(web.HTTPNotFound, f"no task {task_id!r} in the read model")
    return _json(status.task_json(task))


async def events(request: web.Request) -> web.StreamResponse:
    live = request.app[API].live
    queue = live.subscribe()
    if queue is None:
        raise _error(web.HTTPServiceUnavailable,
                     f"too many live clients (at most {SSE_CLIENTS_MAX}); reload later")
    response = web.StreamResponse(headers={
        "Content-Type": "text/event-stream", "Cache-Control": "no-store",
        "X-Accel-Buffering": "no",  # a proxy in front must not hold the events back
    })
    try:
        await response.prepare(request)
        # `ready` after the poller knows the current version: a client that reads the API on
        # `ready` misses no change, since every later one is a `changed`.
        await live.wait_ready()
        await response.write(b"retry: 2000\nevent: ready\ndata: {}\n\n")
        async with asyncio.timeout(STREAM_S_MAX):
            while True:
                try:
                    item = await asyncio.wait_for(queue.get(), KEEPALIVE_S)
                except TimeoutError:
                    await response.write(b": keepalive\n\n")
                    continue
                if item is None:
                    break
                await response.write(f"event: changed\ndata: {item}\n\n".encode())
    except (TimeoutError, ConnectionResetError):
        pass  # the stream's time is up, or the client went away
    finally:
        live.unsubscribe(queue)
    return response


async def page(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


async def openapi_json(request: web.Request) -> web.Response:
    return _json(openapi.document())


def make_app(dsn: str, schema: str) -> web.Application:
    """The API over the read model in `schema` of the database at `dsn`."""
    app = web.Application()
    api = app[API] = Api(dsn, schema)

    async def start(_: web.Application) -> None:
        await api.start()

    async def shutdown(_: web.Application) -> None:
        await api.live.close()  # the event streams end, so shutting down waits for nothing

    async def cleanup(_: web.Application) -> None:
        await api.stop()

    app.on_startup.append(start)
    app.on_shutdown.append(shutdown)
    app.on_cleanup.append(cleanup)
    app.router.add_get("/", page)
    app.router.add_get("/api/tasks", list_tasks)
    app.router.add_get("/api/tasks/{task_id}", get_task)
    app.router.add_get("/api/events", events)
    app.router.add_get("/api/openapi.json", openapi_json)
    return app


async def serve_api(host: str | None = None, port: int | None = None) -> None:
    """The process entry point (`halfway run api`): serve until SIGTERM or SIGINT.

    Prints one line, `listening on http://HOST:PORT`, once it accepts connections (port 0
    picks a free port, which the line then names)."""
    log.configure()
    logger = log.get("halfway.api")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    app = make_app(pg_dsn(), pg_schema())
    # Our own socket, so that with port 0 we can read back the port the kernel chose.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    host = host or api_host()
    sock.bind((host, api_port() if port is None else port))
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    try:
        await web.SockSite(runner, sock).start()
        url = f"http://{host}:{sock.getsockname()[1]}"
        print(f"listening on {url}", flush=True)  # the one line a parent process reads
        logger.info("api listening", url=url, schema=app[API].schema)
        await stop.wait()
    finally:
        await runner.cleanup()
    logger.info("api stopped")
