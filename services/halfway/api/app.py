"""The HTTP API and the web page over the read model (PostgreSQL), and the operators' writes.

- `GET /api/tasks?state=&limit=`, `GET /api/tasks/{task_id}`: JSON, the same shapes as
  `halfway tasks --json` and `halfway status --json` (`halfway.api.status`).
- `GET /api/events`: Server-Sent Events. One poller per process reads a version of the read
  model (`queries.version`) every POLL_S while anyone listens and sends `changed` to every
  client when it moves. PostgreSQL could notify instead (LISTEN), but the projector does not
  NOTIFY and polling one cheap row is honest about what it costs: one query per 500 ms.
  Fair: at most SSE_CLIENTS_PER_CLIENT_MAX streams per client (its token's name, or its address
  when it has no token; past it, 429) within SSE_CLIENTS_MAX for everyone (past it, 503). A
  stream whose connection closed gives its slot back at once.
- `POST /api/tasks`, `POST /api/tasks/{task_id}/abort`, `POST /api/steps/{step_id}/resolve`:
  start a task, call one off, settle a step by hand (`halfway.api.operate`).
- `GET /`: the page (static/index.html), which re-reads the API on `ready` and `changed`.
- `GET /api/openapi.json`: `halfway.api.openapi`.

Who may do what (bearer tokens with scopes) and which Host names are answered:
`halfway.api.auth`. The page and the OpenAPI document hold no data and need no token.

The read model missing (no projector has run yet) or PostgreSQL down answers 503 with a JSON
`error`, never 500, and never names the database's host or role (the log has the details): the
API starts without the database and works as soon as it is there.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
from aiohttp import web

from halfway import log
from halfway import settings as env
from halfway.api import openapi, operate, queries, status
from halfway.api.auth import TokenConfigError, Tokens, allowed_host_names, is_loopback
from halfway.api.http import (
    ACCESS,
    Access,
    check_host,
    error,
    json_ok,
    json_route_errors,
    require,
)
from halfway.contract.ids import is_task_id
from halfway.listening import CannotListen, authority, bound_socket
from halfway.settings import KafkaSettings, api_host, api_port, pg_dsn, pg_schema

POLL_S = 0.5
SSE_CLIENTS_MAX = 32  # each holds a connection open; past this a client gets 503
SSE_CLIENTS_PER_CLIENT_MAX = 4  # per token name (or address): one client cannot take them all
KEEPALIVE_S = 15.0  # a comment line this often finds clients that went away
STREAM_S_MAX = 3600.0  # then the stream ends and EventSource reconnects by itself
READY_TIMEOUT_S = 10.0
POOL_SIZE_MAX = 4
CONNECT_TIMEOUT_S = 5.0
ACQUIRE_TIMEOUT_S = 5.0
QUERY_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 5.0
SHUTDOWN_TIMEOUT_S = 5.0
STATIC = Path(__file__).parent / "static"
QUERY_PARAMS = ("state", "limit")
LIMIT_TEXT = re.compile(r"[0-9]{1,6}")

_MISSING = (asyncpg.UndefinedTableError, asyncpg.InvalidSchemaNameError)
# What "the database cannot answer" looks like: refused, timed out, or a server error.
_UNAVAILABLE = (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError)
_Stream = tuple[str, asyncio.BaseTransport | None]  # whose, and the connection it goes to


class Live:
    """The SSE clients and the one poller that tells them when the read model changes.

    Each client has a queue of one: a `changed` not yet sent already covers any later change,
    so a slow client never makes anything grow."""

    def __init__(self, api: Api) -> None:
        self._api = api
        self._clients: dict[asyncio.Queue[str | None], _Stream] = {}
        self._per_client: dict[str, int] = {}  # at most SSE_CLIENTS_MAX keys
        self._poller: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()  # the poller has read a first version (or failed to)
        self._closed = False

    def subscribe(self, who: str,
                  transport: asyncio.BaseTransport | None) -> asyncio.Queue[str | None]:
        """A queue for one stream of client `who` over `transport`; 503 when SSE_CLIENTS_MAX
        streams are open or shutting down, 429 when `who` has SSE_CLIENTS_PER_CLIENT_MAX."""
        self._drop_closed()
        if self._closed or len(self._clients) >= SSE_CLIENTS_MAX:
            raise error(web.HTTPServiceUnavailable,
                       f"too many live clients (at most {SSE_CLIENTS_MAX}); reload later")
        if self._per_client.get(who, 0) >= SSE_CLIENTS_PER_CLIENT_MAX:
            raise error(web.HTTPTooManyRequests,
                       f"too many live streams for {who} (at most "
                       f"{SSE_CLIENTS_PER_CLIENT_MAX} each); close one first")
        queue: asyncio.Queue[str | None] = asyncio.Queue(maxsize=1)
        self._clients[queue] = (who, transport)
        self._per_client[who] = self._per_client.get(who, 0) + 1
        if self._poller is None:
            self._poller = asyncio.create_task(self._poll(), name="halfway-api-poller")
        return queue

    def unsubscribe(self, queue: asyncio.Queue[str | None]) -> None:
        stream = self._clients.pop(queue, None)
        if stream is None:
            return
        who, _ = stream
        left = self._per_client[who] - 1
        if left:
            self._per_client[who] = left
        else:
            del self._per_client[who]

    def _drop_closed(self) -> None:
        """Free the slots of streams whose connection is closed, and end their handlers.
        aiohttp cancels no handler when its client goes (outside its test server), so a
        handler would notice only at its next keepalive write, KEEPALIVE_S later."""
        for queue, (_, transport) in list(self._clients.items()):
            if transport is None or transport.is_closing():
                self.unsubscribe(queue)
                _end(queue)

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
                self._drop_closed()  # a stream whose client went ends within POLL_S
        finally:
            # No await between the loop's last check and here: a client that subscribes now
            # finds no poller and starts a new one.
            self._poller = None
            self._ready.clear()

    def _send(self, item: str) -> None:
        for queue in self._clients:
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(item)

    async def close(self) -> None:
        self._closed = True
        for queue in self._clients:
            _end(queue)
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller


def _end(queue: asyncio.Queue[str | None]) -> None:
    """Tell a stream's handler to end: the end goes in even if a change is pending."""
    while not queue.empty():
        queue.get_nowait()
    queue.put_nowait(None)


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
            raise error(web.HTTPServiceUnavailable,
                       f"the read model (schema {self.schema!r}) does not exist yet: is the "
                       "projector running?") from None
        except _UNAVAILABLE as exc:
            # The details (a host, a role, a DSN) are for the log, never for a client.
            log.get("halfway.api").warning("cannot read the read model",
                                           error=f"{type(exc).__name__}: {exc}")
            raise error(web.HTTPServiceUnavailable,
                       "cannot read the read model: the database does not answer (the API's "
                       "log says why)") from None


API = web.AppKey("api", Api)


def _list_params(request: web.Request) -> tuple[str | None, int]:
    unknown = sorted(set(request.query) - set(QUERY_PARAMS))
    if unknown:
        raise error(web.HTTPBadRequest, f"unknown query parameter(s) {', '.join(unknown)}: "
                    f"known are {', '.join(QUERY_PARAMS)}")
    for name in QUERY_PARAMS:
        if len(request.query.getall(name, [])) > 1:
            raise error(web.HTTPBadRequest, f"{name} is given more than once")
    state = request.query.get("state") or None  # state= (empty) means every state
    if state is not None and state not in queries.TASK_STATES:
        raise error(web.HTTPBadRequest, f"unknown state {state[:60]!r}: one of "
                    f"{', '.join(queries.TASK_STATES)}")
    raw = request.query.get("limit", str(queries.LIMIT_DEFAULT))
    # ASCII digits only, and few: str.isdigit() takes "²", and int() refuses 5000 digits.
    if not LIMIT_TEXT.fullmatch(raw) or not 1 <= int(raw) <= queries.LIMIT_MAX:
        raise error(web.HTTPBadRequest,
                    f"limit must be a whole number in 1..{queries.LIMIT_MAX}, got {raw[:20]!r}")
    return state, int(raw)


async def list_tasks(request: web.Request) -> web.Response:
    require(request, "read")
    state, limit = _list_params(request)
    rows = await request.app[API].read(queries.list_tasks, state, limit)
    return json_ok({"tasks": status.tasks_json(rows), "count": len(rows), "state": state,
                    "limit": limit})


async def get_task(request: web.Request) -> web.Response:
    require(request, "read")
    task_id = request.match_info["task_id"]
    if not is_task_id(task_id):
        raise error(web.HTTPBadRequest, f"{task_id[:60]!r} is not a task id")
    task = await request.app[API].read(queries.get_task, task_id)
    if task is None:
        raise error(web.HTTPNotFound, f"no task {task_id!r} in the read model")
    return json_ok(status.task_json(task))


async def events(request: web.Request) -> web.StreamResponse:
    principal = require(request, "read")
    live = request.app[API].live
    # Fair by who it is: a token's name, else the address (one address, many tabs).
    queue = live.subscribe(f"token {principal.name}" if principal.authenticated
                           else f"address {request.remote}", request.transport)
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
    return json_ok(openapi.document())


def make_app(dsn: str, schema: str, *, kafka: KafkaSettings | None = None,
             tokens: Tokens | None = None, dev: bool = False,
             allowed_hosts: frozenset[str] | None = None) -> web.Application:
    """The API over the read model in `schema` of the database at `dsn`, writing to the
    journal of `kafka` (default: from the environment). No `tokens`: reads are open and the
    write endpoints refused, unless `dev`. `allowed_hosts`: the Host names answered (default:
    the loopback names)."""
    app = web.Application(middlewares=[check_host, json_route_errors],
                          client_max_size=operate.BODY_BYTES_MAX)
    api = app[API] = Api(dsn, schema)
    journal = app[operate.JOURNAL] = operate.Journal(kafka or KafkaSettings.from_env("api"))
    app[ACCESS] = Access(tokens or Tokens(), dev,
                         allowed_hosts or allowed_host_names(None, None))

    async def start(_: web.Application) -> None:
        await api.start()

    async def shutdown(_: web.Application) -> None:
        await api.live.close()  # the event streams end, so shutting down waits for nothing

    async def cleanup(_: web.Application) -> None:
        await api.stop()
        await journal.stop()

    app.on_startup.append(start)
    app.on_shutdown.append(shutdown)
    app.on_cleanup.append(cleanup)
    app.router.add_get("/", page)
    app.router.add_get("/api/tasks", list_tasks)
    app.router.add_get("/api/tasks/{task_id}", get_task)
    app.router.add_post("/api/tasks", operate.start_task)
    app.router.add_post("/api/tasks/{task_id}/abort", operate.abort)
    app.router.add_post("/api/steps/{step_id}/resolve", operate.resolve_step)
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
    host = host or api_host()
    try:
        trust = access_from_env(host)
        # The API writes as its own Kafka principal: requests and operator events only.
        kafka = KafkaSettings.from_env("api")
        dsn, schema = pg_dsn(), _schema_from_env()
        sock = await bound_socket(host, api_port() if port is None else port,
                                  host_setting="HALFWAY_API_HOST",
                                  port_setting="HALFWAY_API_PORT")
    # ValueError: SettingsError names the variable; CannotListen the one to change.
    except (ApiConfigError, ValueError, CannotListen) as exc:
        logger.error("api not started", reason=str(exc))
        print(f"halfway api: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    app = make_app(dsn, schema, kafka=kafka, **trust)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    try:
        await web.SockSite(runner, sock).start()
        url = f"http://{authority(host, sock.getsockname()[1])}"
        print(f"listening on {url}", flush=True)  # the one line a parent process reads
        access = app[ACCESS]
        logger.info("api listening", url=url, schema=app[API].schema,
                    tokens=access.tokens.names, dev=access.dev,
                    allowed_hosts=sorted(access.allowed_hosts))
        await stop.wait()
    finally:
        await runner.cleanup()
    logger.info("api stopped")


class ApiConfigError(Exception):
    """The API must not start as configured; the message says why and what to set."""


def _schema_from_env() -> str:
    try:
        return queries.checked_schema(pg_schema())
    except ValueError as exc:
        raise ApiConfigError(f"HALFWAY_PG_SCHEMA: {exc}") from None


def access_from_env(host: str) -> dict[str, Any]:
    """make_app's trust arguments from the environment (tokens, dev mode, Host names), for an
    API listening on `host`. Refuses (ApiConfigError) bad token files, and an API with no token
    that would listen beyond loopback outside dev mode: the read model is customer data."""
    try:
        tokens = Tokens.load(env.api_tokens(), env.api_tokens_file())
        allowed = allowed_host_names(env.api_allowed_hosts(), host)
    except (TokenConfigError, ValueError) as exc:
        raise ApiConfigError(str(exc)) from None
    dev = env.api_dev_mode() and not tokens.configured  # tokens, when there are, rule
    if not tokens.configured and not dev and not is_loopback(host):
        raise ApiConfigError(
            f"the API would listen on {host} with no API token: every task's data would be "
            "open to anyone who reaches it. Set HALFWAY_API_TOKENS or HALFWAY_API_TOKENS_FILE "
            "(docs/operator-api.md), or HALFWAY_API_DEV=1 for local development")
    return {"tokens": tokens, "dev": dev, "allowed_hosts": allowed}
