"""The HTTP API, the web page and the status tables, against a real PostgreSQL read model.

Each test session makes its own schema from `projector/schema.sql` and fills it with plain SQL
inserts (the projector is not needed to read): one task that succeeded (with a contradiction),
one with an unknown step being checked, one that needs attention, one that failed with a step
not done, and one compensated. The page is checked in a real headless Chromium (Debian's
package): its DOM must say the three states in words, and a screenshot is kept for people
(.halfway/artifacts/web-page.png).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg
import jsonschema
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

import halfway.api
from halfway.api import app as api_app
from halfway.api import openapi, queries
from halfway.api.status import as_json, at, status_table, task_json, tasks_table
from halfway.infra import paths
from halfway.settings import pg_dsn

broker = pytest.mark.broker

SCHEMA_SQL = Path(halfway.api.__file__).parent.parent / "projector" / "schema.sql"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_TIMEOUT_S = 90.0
WAIT_S = 30.0  # upper bound for any await on the API or the database
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0

T0 = datetime.now(UTC).replace(microsecond=0) - timedelta(minutes=10)
NEXT_CHECK = datetime.now(UTC).replace(microsecond=0) + timedelta(minutes=5)
UNKNOWN_TASK = "renewal-8812"
EXPECTED_STATES = {  # newest first: each task is updated a minute after the one before
    "t-compensated": "compensated",
    "t-failed": "failed",
    "t-attention": "needs_attention",
    UNKNOWN_TASK: "unknown",
    "t-succeeded": "succeeded",
}


# --- a read model in a schema of its own -----------------------------------------------------


@pytest.fixture(scope="session")
def postgres_up() -> str:
    from halfway.infra import postgres

    if not postgres.is_external():
        postgres.up()  # raises InfraError, failing the test, when it cannot start
    return pg_dsn()


@contextlib.asynccontextmanager
async def new_schema(dsn: str) -> AsyncIterator[str]:
    """A fresh, empty read model; dropped afterwards."""
    schema = f"halfway_test_{uuid.uuid4().hex[:10]}"
    conn = await asyncpg.connect(dsn, timeout=WAIT_S)
    try:
        await conn.execute(SCHEMA_SQL.read_text().replace("{schema}", schema))
        yield schema
    finally:
        await conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
        await conn.close()


async def insert_task(conn: asyncpg.Connection, schema: str, task_id: str, *,
                      updated_at: datetime, status: str = "running",
                      final_state: str | None = None, needs_attention: bool = False,
                      summary: str | None = None, steps: int = 1) -> None:
    await conn.execute(
        f"""INSERT INTO {schema}.tasks (task_id, status, final_state, needs_attention, input,
            allowed_tools, summary, steps, started_at, finished_at, updated_at)
            VALUES ($1, $2, $3, $4, $5::jsonb, $6::jsonb, $7, $8, $9, $10, $11)""",
        task_id, status, final_state, needs_attention, json.dumps({"customer": "cus_8812"}),
        json.dumps(["charge_customer", "send_email"]), summary, steps, T0,
        updated_at if status == "finished" else None, updated_at)


async def insert_step(conn: asyncpg.Connection, schema: str, task_id: str, n: int, *,
                      status: str, updated_at: datetime, tool: str = "charge_customer",
                      subject: str | None = "cus_8812", effect_class: str = "keyed",
                      evidence: dict[str, Any] | None = None, reason: str | None = None,
                      source: str | None = None, attempts: int = 1, unknowns: int = 0,
                      checks: int = 0, last_check: str | None = None,
                      next_check_at: datetime | None = None, needs_attention: bool = False,
                      contradictions: int = 0) -> str:
    step_id = f"{task_id}:{n}"
    settled = status in ("done", "not_done")
    await conn.execute(
        f"""INSERT INTO {schema}.steps (step_id, task_id, n, tool, args, key, subject,
            effect_class, decided_by, status, outcome, evidence, reason, source, attempts,
            unknowns, checks, last_check, next_check_at, needs_attention, contradictions,
            intended_at, settled_at, updated_at)
            VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7, $8, $9, $10, $11, $12::jsonb, $13, $14,
                    $15, $16, $17, $18, $19, $20, $21, $22, $23, $24)""",
        step_id, task_id, n, tool, json.dumps({"customer": subject, "amount": 4200}), step_id,
        subject, effect_class, "scripted-model", status,
        status if status in ("done", "not_done", "unknown") else None,
        None if evidence is None else json.dumps(evidence), reason, source, attempts, unknowns,
        checks, last_check, next_check_at, needs_attention, contradictions, T0,
        updated_at if settled else None, updated_at)
    for attempt in range(1, attempts + 1):
        await conn.execute(
            f"INSERT INTO {schema}.attempts (step_id, attempt, key, started_at) "
            "VALUES ($1, $2, $3, $4)", step_id, attempt, step_id, T0 + timedelta(seconds=attempt))
    return step_id


async def insert_check(conn: asyncpg.Connection, schema: str, step_id: str, at_: datetime,
                       next_check_at: datetime | None) -> None:
    await conn.execute(
        f"INSERT INTO {schema}.checks (event_id, step_id, at, found, next_check_at) "
        "VALUES ($1, $2, $3, 'nothing', $4)", uuid.uuid4().hex, step_id, at_, next_check_at)


async def seed(conn: asyncpg.Connection, schema: str) -> None:
    """The five tasks of EXPECTED_STATES, each updated a minute after the one before."""
    def minute(i: int) -> datetime:
        return T0 + timedelta(minutes=i)

    await insert_task(conn, schema, "t-succeeded", updated_at=minute(1), status="finished",
                      final_state="succeeded", steps=2, summary="renewed and receipted")
    await insert_step(conn, schema, "t-succeeded", 1, status="done", updated_at=minute(1),
                      tool="lookup_customer", effect_class="read", source="call",
                      evidence={"customer": "cus_1", "plan": "pro"})
    await insert_step(conn, schema, "t-succeeded", 2, status="done", updated_at=minute(1),
                      evidence={"charge_id": "ch_1", "amount": 4200}, source="webhook",
                      unknowns=1, contradictions=1)

    await insert_task(conn, schema, UNKNOWN_TASK, updated_at=minute(2))
    step = await insert_step(conn, schema, UNKNOWN_TASK, 1, status="unknown",
                             updated_at=minute(2), reason="no reply within 5 s", source="call",
                             unknowns=1, checks=2, last_check="nothing",
                             next_check_at=NEXT_CHECK)
    await insert_check(conn, schema, step, minute(1), minute(2))
    await insert_check(conn, schema, step, minute(2), NEXT_CHECK)

    await insert_task(conn, schema, "t-attention", updated_at=minute(3), status="finished",
                      final_state="needs_attention", needs_attention=True)
    await insert_step(conn, schema, "t-attention", 1, status="unknown", updated_at=minute(3),
                      reason="no reply within 5 s", source="call", unknowns=1, checks=6,
                      last_check="nothing", needs_attention=True)

    await insert_task(conn, schema, "t-failed", updated_at=minute(4), status="finished",
                      final_state="failed", summary="the card was declined")
    await insert_step(conn, schema, "t-failed", 1, status="not_done", updated_at=minute(4),
                      reason="card_declined: insufficient funds", source="call")

    await insert_task(conn, schema, "t-compensated", updated_at=minute(5), status="finished",
                      final_state="compensated", steps=2)
    await insert_step(conn, schema, "t-compensated", 1, status="done", updated_at=minute(5),
                      evidence={"charge_id": "ch_2"}, source="call")
    await insert_step(conn, schema, "t-compensated", 2, status="not_done", tool="send_email",
                      updated_at=minute(5), reason="mailbox unavailable", source="call",
                      effect_class="unkeyed")
    await conn.execute(
        f"""INSERT INTO {schema}.compensations (step_id, task_id, tool, args, key, status,
            outcome, evidence, reason, attempts, updated_at)
            VALUES ($1, $2, 'refund_charge', $3::jsonb, $4, 'done', 'done', $5::jsonb, NULL, 1,
                    $6)""",
        "t-compensated:1", "t-compensated", json.dumps({"charge_id": "ch_2"}),
        "t-compensated:1:undo", json.dumps({"refund_id": "re_2"}), minute(5))


@pytest.fixture(scope="session")
async def read_model(postgres_up: str) -> AsyncIterator[tuple[str, str]]:
    async with new_schema(postgres_up) as schema:
        conn = await asyncpg.connect(postgres_up, timeout=WAIT_S)
        try:
            await seed(conn, schema)
        finally:
            await conn.close()
        yield postgres_up, schema


@contextlib.asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[TestClient[Any, Any]]:
    async with TestClient(TestServer(app, host="127.0.0.1")) as client:
        yield client


@pytest.fixture(scope="session")
async def client(read_model: tuple[str, str]) -> AsyncIterator[TestClient[Any, Any]]:
    async with serving(api_app.make_app(*read_model)) as c:
        yield c


async def fetch_task(read_model: tuple[str, str], task_id: str) -> dict[str, Any]:
    conn = await asyncpg.connect(read_model[0], timeout=WAIT_S)
    try:
        task = await queries.get_task(conn, read_model[1], task_id)
    finally:
        await conn.close()
    assert task is not None
    return task


def validates(instance: Any, schema_name: str) -> None:
    """`instance` matches the OpenAPI document's schema of that name."""
    doc = openapi.document()
    jsonschema.Draft202012Validator(
        {"$ref": f"#/components/schemas/{schema_name}", "components": doc["components"]},
    ).validate(instance)


# --- the API -----------------------------------------------------------------------------------


@broker
async def test_tasks_are_listed_newest_first_each_with_one_state(client: TestClient) -> None:
    response = await client.get("/api/tasks")
    assert response.status == 200
    body = await response.json()
    validates(body, "TaskList")

    assert [(t["task_id"], t["state"]) for t in body["tasks"]] == list(EXPECTED_STATES.items())
    unknown = next(t for t in body["tasks"] if t["task_id"] == UNKNOWN_TASK)
    assert unknown["step_counts"] == {"done": 0, "not_done": 0, "unknown": 1, "in_flight": 0,
                                      "intended": 0}
    assert datetime.fromisoformat(unknown["next_check_at"]) == NEXT_CHECK
    assert "failed" not in unknown["state_words"]


@broker
@pytest.mark.parametrize("state", sorted(set(EXPECTED_STATES.values())))
async def test_the_state_filter_returns_only_that_state(client: TestClient, state: str) -> None:
    response = await client.get("/api/tasks", params={"state": state})
    assert response.status == 200
    body = await response.json()
    assert [t["task_id"] for t in body["tasks"]] == [
        task for task, s in EXPECTED_STATES.items() if s == state]
    assert body["state"] == state


@broker
async def test_limit_keeps_the_newest(client: TestClient) -> None:
    body = await (await client.get("/api/tasks", params={"limit": "2"})).json()
    assert [t["task_id"] for t in body["tasks"]] == list(EXPECTED_STATES)[:2]
    assert (body["count"], body["limit"]) == (2, 2)


@broker
@pytest.mark.parametrize("query", [
    "state=bogus", "limit=0", "limit=-1", "limit=abc", "limit=1001", "limit=1.5", "colour=red",
    "limit=%C2%B2", "limit=" + "9" * 5000,
    "state=failed&state=unknown",
])
async def test_bad_query_parameters_are_refused_with_a_reason(client: TestClient,
                                                              query: str) -> None:
    response = await client.get(f"/api/tasks?{query}")
    assert response.status == 400
    assert response.content_type == "application/json"
    body = await response.json()
    validates(body, "Error")
    assert body["error"]


@broker
async def test_a_task_has_its_steps_attempts_checks_and_words(client: TestClient) -> None:
    response = await client.get(f"/api/tasks/{UNKNOWN_TASK}")
    assert response.status == 200
    task = await response.json()
    validates(task, "Task")

    assert task["state"] == "unknown"
    [step] = task["steps"]
    assert step["status"] == "unknown"
    assert step["key"] == f"{UNKNOWN_TASK}:1"
    assert datetime.fromisoformat(step["next_check_at"]) == NEXT_CHECK
    assert [a["attempt"] for a in step["attempt_log"]] == [1]
    assert [datetime.fromisoformat(c["next_check_at"]) for c in step["check_log"]][-1] == \
        NEXT_CHECK
    assert step["state_words"] == "unknown, being checked"
    assert f"reference {UNKNOWN_TASK}:1" in step["says"]
    assert "next check at" in step["says"]
    assert "failed" not in json.dumps(task)


@broker
async def test_a_compensated_task_shows_its_undo_and_a_contradiction_is_surfaced(
        client: TestClient) -> None:
    task = await (await client.get("/api/tasks/t-compensated")).json()
    validates(task, "Task")
    undo = task["steps"][0]["compensation"]
    assert (undo["key"], undo["status"], undo["evidence"]) == (
        "t-compensated:1:undo", "done", {"refund_id": "re_2"})
    assert task["steps"][1]["compensation"] is None
    assert task["steps"][1]["state_words"] == "not done, safe to try again"

    succeeded = await (await client.get("/api/tasks/t-succeeded")).json()
    assert [s["contradictions"] for s in succeeded["steps"]] == [0, 1]


@broker
async def test_an_absent_task_is_404_and_a_malformed_id_400(client: TestClient) -> None:
    response = await client.get("/api/tasks/no-such-task")
    assert response.status == 404
    assert "no-such-task" in (await response.json())["error"]

    response = await client.get("/api/tasks/not%20an%20id")
    assert response.status == 400
    assert (await response.json())["error"]


@broker
async def test_a_missing_read_model_is_503_not_500(postgres_up: str) -> None:
    async with serving(api_app.make_app(postgres_up, "halfway_test_never_made")) as c:
        for path in ("/api/tasks", "/api/tasks/t-1"):
            response = await c.get(path)
            assert response.status == 503
            assert "does not exist yet" in (await response.json())["error"]


def test_a_schema_name_that_is_not_a_plain_identifier_is_refused() -> None:
    with pytest.raises(ValueError, match="invalid schema name"):
        api_app.make_app("postgresql://nowhere/x", 'halfway"; drop schema halfway; --')


# --- OpenAPI -----------------------------------------------------------------------------------


def test_openapi_describes_every_route_and_nothing_else() -> None:
    app = api_app.make_app("postgresql://nowhere/x", "halfway")
    served = {(route.resource.canonical, route.method.lower())
              for route in app.router.routes()
              if route.resource is not None and route.method != "HEAD"}
    doc = openapi.document()
    described = {(path, method) for path, ops in doc["paths"].items() for method in ops}
    assert served == described
    assert doc["openapi"].startswith("3.1")
    # Every $ref points at a schema the document has.
    refs = set(re.findall(r'"\$ref": "#/components/schemas/(\w+)"', json.dumps(doc)))
    assert refs <= set(doc["components"]["schemas"])
    for schema in doc["components"]["schemas"].values():
        jsonschema.Draft202012Validator.check_schema(schema)


@broker
async def test_the_page_is_served_at_the_root(client: TestClient) -> None:
    response = await client.get("/")
    assert response.status == 200
    assert response.content_type == "text/html"
    page = await response.text()
    assert "/api/events" in page
    assert "/api/tasks" in page


@broker
async def test_openapi_is_served(client: TestClient) -> None:
    response = await client.get("/api/openapi.json")
    assert response.status == 200
    assert await response.json() == json.loads(json.dumps(openapi.document()))


# --- the text tables ---------------------------------------------------------------------------


@broker
async def test_status_of_an_unknown_step_says_unknown_the_reference_and_the_next_check(
        read_model: tuple[str, str]) -> None:
    task = await fetch_task(read_model, UNKNOWN_TASK)
    text = status_table(task)
    assert "unknown" in text
    assert f"{UNKNOWN_TASK}:1" in text
    assert at(NEXT_CHECK) in text
    assert "do not start another one" in text
    assert "failed" not in text.lower()
    # With `now`, how far away the check is.
    assert "(in 5m 0s)" in status_table(task, now=NEXT_CHECK - timedelta(minutes=5))


@broker
async def test_status_says_done_with_evidence_and_not_done_with_the_reason(
        read_model: tuple[str, str]) -> None:
    succeeded = status_table(await fetch_task(read_model, "t-succeeded"))
    assert "charge_id=ch_1" in succeeded
    assert "contradiction" in succeeded
    failed = status_table(await fetch_task(read_model, "t-failed"))
    assert "not done, safe to try again" in failed
    assert "card_declined: insufficient funds" in failed
    attention = status_table(await fetch_task(read_model, "t-attention"))
    assert "unknown, an operator must resolve it" in attention
    assert "failed" not in attention
    compensated = status_table(await fetch_task(read_model, "t-compensated"))
    assert "undo: done; evidence refund_id=re_2 (reference t-compensated:1:undo)" in compensated


@broker
async def test_tasks_table_has_a_line_per_task_and_json_round_trips(
        read_model: tuple[str, str]) -> None:
    conn = await asyncpg.connect(read_model[0], timeout=WAIT_S)
    try:
        rows = await queries.list_tasks(conn, read_model[1], None, 100)
    finally:
        await conn.close()
    lines = tasks_table(rows).splitlines()
    assert lines[0].split()[:2] == ["TASK", "STATE"]
    assert [line.split()[:2] for line in lines[1:]] == [list(i) for i in EXPECTED_STATES.items()]
    assert tasks_table([]) == "no tasks"
    task = await fetch_task(read_model, UNKNOWN_TASK)
    assert json.loads(as_json(task_json(task)))["steps"][0]["key"] == f"{UNKNOWN_TASK}:1"


# --- live updates ------------------------------------------------------------------------------


async def next_event(response: Any) -> str:
    """The name of the next SSE event on the stream (comments skipped); bounded."""
    async with asyncio.timeout(WAIT_S):
        while True:
            line = (await response.content.readline()).decode()
            if not line:
                raise AssertionError("the event stream ended")
            if line.startswith("event: "):
                return line.removeprefix("event: ").strip()


@broker
async def test_events_say_changed_when_the_read_model_changes(
        postgres_up: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api_app, "SSE_CLIENTS_MAX", 1)
    async with new_schema(postgres_up) as schema, serving(
            api_app.make_app(postgres_up, schema)) as c:
        stream = await c.get("/api/events")
        assert stream.status == 200
        assert stream.content_type == "text/event-stream"
        assert await next_event(stream) == "ready"

        second = await c.get("/api/events")  # one client at most (patched)
        assert second.status == 503
        assert "too many" in (await second.json())["error"]

        conn = await asyncpg.connect(postgres_up, timeout=WAIT_S)
        try:
            await insert_task(conn, schema, "t-new", updated_at=datetime.now(UTC))
        finally:
            await conn.close()
        assert await next_event(stream) == "changed"
        stream.close()


@broker
async def test_serve_api_prints_its_address_serves_and_stops_on_sigterm(
        read_model: tuple[str, str]) -> None:
    env = {**os.environ, "HALFWAY_PG_SCHEMA": read_model[1], "HALFWAY_API_PORT": "0"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import asyncio; from halfway.api import serve_api; "
        "asyncio.run(serve_api())", env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL)
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)).decode()
        match = re.fullmatch(r"listening on (http://127\.0\.0\.1:(\d+))\n", line)
        assert match, line
        async with TestClient(TestServer(web.Application())) as probe:
            response = await probe.session.get(f"{match[1]}/api/tasks?state=unknown")
            assert response.status == 200
            assert [t["task_id"] for t in (await response.json())["tasks"]] == [UNKNOWN_TASK]
            # A live client does not hold the shutdown up: its stream ends.
            stream = await probe.session.get(f"{match[1]}/api/events")
            assert await next_event(stream) == "ready"
            proc.send_signal(signal.SIGTERM)
            async with asyncio.timeout(STOP_TIMEOUT_S):
                await stream.content.read()  # returns at the end of the stream
            assert stream.content.at_eof()
        assert await asyncio.wait_for(proc.wait(), STOP_TIMEOUT_S) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


# --- the page, in a real browser ---------------------------------------------------------------
#
# Headless Chromium driven over the DevTools protocol (a WebSocket: aiohttp's client). The
# one-shot `--dump-dom --virtual-time-budget` cannot be used: virtual time stands still while a
# request is pending, and the page's event stream is a request that never ends, so it would
# wait forever. Over the protocol the test waits for what it needs (a MutationObserver in the
# page resolves a promise once the DOM shows it), never for a fixed time.

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                  "--window-size=1280,900", "--remote-debugging-port=0")
STDERR_LINES_KEPT = 200
CHROMIUM_LAUNCHES = 3
WS_MESSAGE_BYTES_MAX = 64 * 1024 * 1024  # a screenshot comes back as one base64 message

# Resolves once PREDICATE (a JS expression) is true, checked on every DOM change.
UNTIL_JS = """new Promise((resolve) => {
  const ok = () => { try { return Boolean(PREDICATE); } catch (e) { return false; } };
  if (ok()) { resolve(true); return; }
  const watch = new MutationObserver(() => { if (ok()) { watch.disconnect(); resolve(true); } });
  watch.observe(document, {subtree: true, childList: true, attributes: true,
                           characterData: true});
})"""


class Browser:
    """One headless Chromium and one page in it, over the DevTools protocol."""

    def __init__(self, proc: asyncio.subprocess.Process, ws: Any, stderr: list[str]) -> None:
        self.proc, self._ws, self.stderr = proc, ws, stderr
        self._ids = iter(range(1, 1_000_000))
        self._replies: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._events: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())
        self.session: str | None = None

    async def _read(self) -> None:
        try:
            async for message in self._ws:
                data = json.loads(message.data)
                reply = self._replies.pop(data["id"], None) if "id" in data else None
                if reply is not None and not reply.done():
                    reply.set_result(data)
                elif "method" in data:
                    self._events.put_nowait(data)
        finally:
            for reply in self._replies.values():
                if not reply.done():
                    reply.set_exception(AssertionError("chromium closed the DevTools socket"))

    async def call(self, method: str, params: dict[str, Any] | None = None, *,
                   page: bool = True) -> dict[str, Any]:
        request: dict[str, Any] = {"id": next(self._ids), "method": method,
                                   "params": params or {}}
        if page and self.session is not None:
            request["sessionId"] = self.session
        reply = self._replies[request["id"]] = asyncio.get_running_loop().create_future()
        await self._ws.send_str(json.dumps(request))
        try:
            answer = await asyncio.wait_for(reply, WAIT_S)
        except TimeoutError:
            raise AssertionError(f"chromium did not answer {method} within {WAIT_S:g} s\n"
                                 + self.log()) from None
        if "error" in answer:
            raise AssertionError(f"{method}: {answer['error']}")
        return answer["result"]

    async def event(self, method: str) -> dict[str, Any]:
        async with asyncio.timeout(WAIT_S):
            while True:
                event = await self._events.get()
                if event["method"] == method and event.get("sessionId") == self.session:
                    return event.get("params", {})

    async def open(self, url: str) -> None:
        target = await self.call("Target.createTarget", {"url": "about:blank"}, page=False)
        attached = await self.call("Target.attachToTarget",
                                   {"targetId": target["targetId"], "flatten": True}, page=False)
        self.session = attached["sessionId"]
        await self.call("Page.enable")
        await self.call("Page.navigate", {"url": url})
        await self.event("Page.loadEventFired")

    async def js(self, expression: str) -> Any:
        result = await self.call("Runtime.evaluate", {
            "expression": expression, "awaitPromise": True, "returnByValue": True})
        if "exceptionDetails" in result:
            raise AssertionError(f"the page threw: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def until(self, predicate: str) -> None:
        """Wait until the JS expression `predicate` holds in the page (bounded)."""
        try:
            async with asyncio.timeout(WAIT_S):
                await self.js(UNTIL_JS.replace("PREDICATE", predicate))
        except TimeoutError:
            text = await self.js("document.body.innerText")
            raise AssertionError(f"the page never showed {predicate}:\n{text}") from None

    async def text(self, selector: str) -> str:
        value = await self.js(f"document.querySelector({json.dumps(selector)}).innerText")
        return " ".join(str(value).split())

    async def screenshot(self) -> bytes:
        shot = await self.call("Page.captureScreenshot", {"format": "png"})
        return base64.b64decode(shot["data"])

    def log(self) -> str:
        return "--- chromium stderr (last lines)\n" + "\n".join(self.stderr[-40:])

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.call("Browser.close", page=False), STOP_TIMEOUT_S)
        await self._ws.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader


@dataclasses.dataclass
class Launched:
    proc: asyncio.subprocess.Process
    stderr: list[str]
    address: asyncio.Future[str]
    drainer: asyncio.Task[None]


async def launch_chromium(chromium: Path, profile: Path) -> Launched:
    """Chromium in a process group of its own, its stderr drained all along (a full pipe would
    stall it); `address` resolves with the DevTools address it prints."""
    proc = await asyncio.create_subprocess_exec(
        str(chromium), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "about:blank",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE, start_new_session=True)
    stderr: list[str] = []
    address: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def drain() -> None:
        assert proc.stderr is not None
        async for raw in proc.stderr:
            line = raw.decode(errors="replace").rstrip()
            stderr.append(line)
            del stderr[:-STDERR_LINES_KEPT]
            found = re.search(r"DevTools listening on (ws://\S+)", line)
            if found and not address.done():
                address.set_result(found[1])
        if not address.done():
            address.set_exception(AssertionError("chromium exited before listening:\n"
                                                 + "\n".join(stderr[-40:])))

    return Launched(proc, stderr, address, asyncio.create_task(drain()))


async def stop_chromium(launched: Launched) -> None:
    """Waits for it to exit, and kills its whole group if it does not."""
    try:
        await asyncio.wait_for(launched.proc.wait(), STOP_TIMEOUT_S)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launched.proc.pid, signal.SIGKILL)
        await launched.proc.wait()
    launched.drainer.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await launched.drainer


@contextlib.asynccontextmanager
async def chromium_browser(chromium: Path, profile: Path) -> AsyncIterator[Browser]:
    """A listening Chromium. It starts in under a second here, but on a loaded machine one
    start in a few dozen hung before listening: such a start is killed and made again, with a
    fresh profile, at most CHROMIUM_LAUNCHES times."""
    import aiohttp

    stalls: list[str] = []
    for attempt in range(CHROMIUM_LAUNCHES):
        launched = await launch_chromium(chromium, profile.with_name(f"{profile.name}-{attempt}"))
        try:
            url = await asyncio.wait_for(asyncio.shield(launched.address), START_TIMEOUT_S)
            break
        except TimeoutError:
            stalls.append("\n".join(launched.stderr[-40:]))
            launched.address.cancel()  # its exit is expected now, not news
            with contextlib.suppress(ProcessLookupError):
                os.killpg(launched.proc.pid, signal.SIGKILL)
            await stop_chromium(launched)
        except BaseException:
            await stop_chromium(launched)
            raise
    else:
        raise AssertionError(f"chromium did not listen within {START_TIMEOUT_S:g} s, "
                             f"{CHROMIUM_LAUNCHES} times:\n" + "\n---\n".join(stalls))
    try:
        async with aiohttp.ClientSession() as session:
            ws = await session.ws_connect(url, max_msg_size=WS_MESSAGE_BYTES_MAX,
                                          timeout=aiohttp.ClientWSTimeout(ws_close=WAIT_S))
            browser = Browser(launched.proc, ws, launched.stderr)
            try:
                yield browser
            finally:
                await browser.close()  # while the session, and so the socket, is still open
    finally:
        await stop_chromium(launched)


@pytest.fixture
def chromium() -> Path:
    if not CHROMIUM.exists():
        pytest.fail("install chromium: apt-get install -y chromium")
    return CHROMIUM


def keep_screenshot(png: bytes, tmp_path: Path) -> None:
    """In the test's folder, and where the lead looks: .halfway/artifacts/web-page.png."""
    (tmp_path / "web-page.png").write_bytes(png)
    kept = paths.halfway_home() / "artifacts" / "web-page.png"
    kept.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tmp_path / "web-page.png", kept)


def step_selector(step_id: str) -> str:
    return f'#detail article[data-step="{step_id}"]'


@broker
async def test_the_page_shows_the_three_states_in_words_in_a_real_browser(
        postgres_up: str, chromium: Path, tmp_path: Path) -> None:
    async with new_schema(postgres_up) as schema, serving(
            api_app.make_app(postgres_up, schema)) as c:
        conn = await asyncpg.connect(postgres_up, timeout=WAIT_S)
        try:
            await seed(conn, schema)
            async with chromium_browser(chromium, tmp_path / "profile") as browser:
                await browser.open(str(c.make_url(f"/#task={UNKNOWN_TASK}")))
                step = f"{UNKNOWN_TASK}:1"
                await browser.until(f"document.querySelector('{step_selector(step)}') && "
                                    "document.querySelectorAll('tr.task').length === 5 && "
                                    "document.getElementById('live').className === 'on'")

                card = await browser.text(step_selector(step))
                assert (f"unknown — being checked (reference {step}), next check at "
                        f"{at(NEXT_CHECK)}") in card, card
                assert "Do not start another one" in card
                assert "no reply within 5 s" in card
                assert "attempt 1 at" in card
                assert "failed" not in (await browser.text("#detail")).lower()
                assert await browser.js(
                    "document.querySelector('tr.task.selected').dataset.task") == UNKNOWN_TASK
                color = await browser.js("getComputedStyle(document.querySelector("
                                         f"'{step_selector(step)} .state')).color")
                assert color == "rgb(138, 90, 0)"  # amber (--unknown), never red

                png = await browser.screenshot()
                assert png[:8] == b"\x89PNG\r\n\x1a\n"
                await asyncio.to_thread(keep_screenshot, png, tmp_path)

                # Live: the step settles in the read model; the page follows, no reload.
                await conn.execute(
                    f"""UPDATE {schema}.steps SET status = 'done', outcome = 'done',
                        evidence = '{{"charge_id": "ch_8812"}}'::jsonb, source = 'lookup',
                        next_check_at = NULL, settled_at = now(), updated_at = now()
                        WHERE step_id = $1""", step)
                await browser.until(
                    f"document.querySelector('{step_selector(step)}').dataset.status === 'done'")
                assert "done — evidence: charge_id=ch_8812" in await browser.text(
                    step_selector(step))

                # Done with evidence, not done with the reason, an undo, a contradiction.
                for task_id, step_id, words in [
                    ("t-succeeded", "t-succeeded:1", "done — evidence: "),
                    ("t-succeeded", "t-succeeded:1", "customer=cus_1"),
                    ("t-succeeded", "t-succeeded:2", "1 later report(s) disagree"),
                    ("t-compensated", "t-compensated:2",
                     "not done — safe to try again: mailbox unavailable"),
                    ("t-compensated", "t-compensated:1", "Undo t-compensated:1:undo"),
                    ("t-attention", "t-attention:1", "unknown — no further check is planned: "
                                                     "an operator must resolve it"),
                    ("t-attention", "t-attention:1", "halfway resolve t-attention:1 done"),
                ]:
                    await browser.js(f"location.hash = 'task={task_id}'")
                    await browser.until(f"document.querySelector('{step_selector(step_id)}')")
                    assert words in await browser.text(step_selector(step_id))
                assert "failed" not in (await browser.text("#detail")).lower()

                # The state filter.
                await browser.js("(() => { const s = document.getElementById('state'); "
                                 "s.value = 'needs_attention'; "
                                 "s.dispatchEvent(new Event('change')); })()")
                await browser.until("document.querySelectorAll('tr.task').length === 1")
                assert await browser.js(
                    "document.querySelector('tr.task').dataset.task") == "t-attention"
        finally:
            await conn.close()


@broker
async def test_the_status_command_says_unknown_the_reference_and_the_next_check(
        read_model: tuple[str, str]) -> None:
    # The command an operator types, end to end: `halfway status TASK` on the read model.
    _dsn, schema = read_model
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "halfway", "status", UNKNOWN_TASK,
        env={**os.environ, "HALFWAY_PG_SCHEMA": schema},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    text = out.decode()
    assert "unknown" in text
    assert f"{UNKNOWN_TASK}:1" in text
    assert at(NEXT_CHECK) in text
    assert "failed" not in text.lower()


def test_status_of_a_called_off_saga_shows_its_undo_being_checked() -> None:
    now = datetime(2026, 12, 2, 9, 0, tzinfo=UTC)
    step = {"n": 1, "tool": "hold_flight", "subject": "flight:LH-454:Ada", "status": "done",
            "key": "trip-1:1", "attempts": 1, "next_check_at": None, "outcome": "done",
            "evidence": {"hold_id": "hold_1"}, "reason": None, "contradictions": 0,
            "needs_attention": False,
            "compensation": {"tool": "release_flight_hold", "key": "trip-1:1:undo",
                             "status": "unknown", "outcome": "unknown", "evidence": None,
                             "reason": "no reply within 5 s", "needs_attention": False,
                             "next_check_at": now + timedelta(seconds=30)}}
    task = {"task_id": "trip-1", "state": "running", "started_at": now, "updated_at": now,
            "finished_at": None, "summary": None, "aborted_by": "alice",
            "aborted_reason": "the customer cancelled", "steps": [step]}
    text = status_table(task, now=now)
    assert "called off by alice: the customer cancelled" in text
    assert "step 1 undo: unknown" in text
    assert "no reply within 5 s; next check" in text
    assert "(in 30s)" in text
    step["compensation"] |= {"needs_attention": True, "next_check_at": None}
    escalated = status_table(task, now=now)
    assert "step 1 undo: unknown; no reply within 5 s; no further check is planned: an " \
        "operator must say whether it happened (halfway resolve trip-1:1:undo done|not_done)" \
        in escalated
    assert "being checked" not in escalated
    task["not_accepted"] = [{"type": "compensation.settled", "step_id": "trip-1:1",
                             "tool": None, "reason": "the first verdict stands"}]
    assert "not accepted: compensation.settled trip-1:1: the first verdict stands" in \
        status_table(task, now=now)
