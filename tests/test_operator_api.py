"""The operators' API: start, call off and resolve through HTTP with bearer tokens.

The must-shows run against the real broker and PostgreSQL: a paysim whose charge hangs, a
decider and an executor as child processes (no reconciler: the unknown step stays unknown until
an operator settles it), the API and the projector in this process. A `read` token is refused
(403) where an `operate` one resolves; who acted (`api:NAME`) is in the journal and in the
task's status read back from the API. Around them: tokens and their sources, 401 vs 403 and the
challenge, the Host check, the per-client limit on live streams, bad bodies, and 503s that
name no host, role or secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import re
import sys
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import asyncpg
import pytest
from aiohttp.test_utils import TestClient, TestServer

from halfway import settings as env
from halfway.api import app as api_app
from halfway.api.auth import (
    DEV,
    Principal,
    Refusal,
    TokenConfigError,
    TokenEntry,
    Tokens,
    allowed_host_names,
    authorize,
    host_name,
)
from halfway.contract import FinalState, Outcome, SettlementSource, StepSettled, TaskAborted
from halfway.contract.topics import TASKS
from halfway.core.fold import StepStatus, fold
from halfway.journal import read_topic
from halfway.projector import store
from halfway.projector.service import Projector
from halfway.resolve import ResolveRefused, operator_identity, os_user
from halfway.settings import KafkaSettings

pytest.register_assert_rewrite("tests.processes")

from tests.processes import (  # noqa: E402
    CLUSTER_KEY,
    Cluster,
    cluster,
    journal_now,
    renewal_request,
)

pytest_plugins = ["tests.processes"]

OPS = "ops-token-0123456789abcdef"  # scopes read, start, operate
READER = "reader-token-0123456789abcdef"  # scope read
STARTER = "starter-token-0123456789abcdef"  # scope start
TOKENS = Tokens([TokenEntry(name="ops", scopes=["read", "start", "operate"], token=OPS),
                 TokenEntry(name="dashboard", scopes=["read"], token=READER),
                 TokenEntry(name="ci", scopes=["start"],
                            token_sha256=hashlib.sha256(STARTER.encode()).hexdigest())])
WAIT_S = 90.0
NOWHERE_PG = "postgresql://secret_role:hunter2@127.0.0.1:1/halfway"  # nothing listens on :1
NOWHERE_KAFKA = KafkaSettings("127.0.0.1:1", "nowhere.", 1)


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


@contextlib.asynccontextmanager
async def serving(dsn: str = NOWHERE_PG, schema: str = "halfway", *,
                  kafka: KafkaSettings = NOWHERE_KAFKA, **access: Any,
                  ) -> AsyncIterator[TestClient[Any, Any]]:
    access.setdefault("tokens", TOKENS)
    async with TestClient(TestServer(api_app.make_app(dsn, schema, kafka=kafka, **access),
                                     host="127.0.0.1")) as client:
        yield client


# --- tokens ------------------------------------------------------------------------------------


def test_tokens_come_from_the_short_form_and_files_and_only_digests_are_kept(
        tmp_path: Path) -> None:
    jsonl = tmp_path / "tokens.jsonl"
    jsonl.write_text("# the operators\n\n" + json.dumps(
        {"name": "bob", "scopes": ["operate"],
         "token_sha256": hashlib.sha256(b"bob-token-0123456789abcdef").hexdigest()}) + "\n")
    toml = tmp_path / "tokens.toml"
    toml.write_text('[[token]]\nname = "carol"\nscopes = ["read", "start"]\n'
                    'token = "carol-token-0123456789abcdef"\n')
    for path, name, token, scopes in [
            (jsonl, "bob", "bob-token-0123456789abcdef", {"operate"}),
            (toml, "carol", "carol-token-0123456789abcdef", {"read", "start"})]:
        tokens = Tokens.load("alice:read+operate:alice-token-0123456789abcdef", str(path))
        assert tokens.names == ["alice", name]
        assert tokens.authenticate(token) == Principal(name, frozenset(scopes), True)
        assert tokens.authenticate("alice-token-0123456789abcdef").scopes == {"read", "operate"}
        assert tokens.authenticate("alice-token-0123456789abcdeF") is None
        assert "alice-token" not in repr(vars(tokens))  # digests only


@pytest.mark.parametrize(("short_form", "file_text", "words"), [
    ("alice:read", None, "NAME:SCOPE+SCOPE:TOKEN"),
    ("alice:admin:alice-token-0123456789abcdef", None, "scopes.0"),
    ("alice:read:short-secret", None, "at least 16 characters"),
    ("alice:read:alice-token-0123456789abcdef,alice:start:other-token-0123456789abcdef", None,
     "given twice"),
    ("alice:read:same-token-0123456789abcdef,bob:start:same-token-0123456789abcdef", None,
     "same as another"),
    ("", '{"name": "x", "scopes": ["read"]}', "line 1: entry: Value error, give exactly one"),
    ("", 'not json', "line 1: not JSON"),
    ("", '{"name": "x", "scopes": ["read"], "token": "x-token-0123456789abcdef", "admin": 1}',
     "admin: Extra inputs"),
])
def test_a_bad_token_configuration_is_refused_with_where_and_why_never_the_token(
        tmp_path: Path, short_form: str, file_text: str | None, words: str) -> None:
    path = None
    if file_text is not None:
        path = tmp_path / "tokens.jsonl"
        path.write_text(file_text + "\n")
    with pytest.raises(TokenConfigError, match=re.escape(words)) as caught:
        Tokens.load(short_form, None if path is None else str(path))
    assert "0123456789abcdef" not in str(caught.value)


def test_401_without_a_known_token_403_without_the_scope_each_with_its_challenge() -> None:
    missing = authorize(TOKENS, None, "read", dev=False)
    assert missing == Refusal(401, missing.reason, 'Bearer realm="halfway"')
    wrong = authorize(TOKENS, "Bearer not-a-token-we-know-at-all", "read", dev=False)
    assert isinstance(wrong, Refusal)
    assert (wrong.status, wrong.challenge) == (401, 'Bearer realm="halfway", error="invalid_token"')
    basic = authorize(TOKENS, "Basic b3BzOnNlY3JldA==", "read", dev=False)
    assert isinstance(basic, Refusal)
    assert basic.status == 401
    assert 'error="invalid_request"' in basic.challenge
    scope = authorize(TOKENS, f"Bearer {READER}", "operate", dev=False)
    assert isinstance(scope, Refusal)
    assert (scope.status, scope.challenge) == (
        403, 'Bearer realm="halfway", error="insufficient_scope", scope="operate"')
    assert authorize(TOKENS, f"bearer {OPS}", "operate", dev=False) == \
        Principal("ops", frozenset({"read", "start", "operate"}), True)
    # Tokens rule when there are: dev mode does not open anything then.
    assert isinstance(authorize(TOKENS, None, "read", dev=True), Refusal)


def test_with_no_tokens_reads_are_open_and_writes_refused_unless_dev_mode() -> None:
    none = Tokens()
    reader = authorize(none, None, "read", dev=False)
    assert isinstance(reader, Principal)
    assert reader.scopes == {"read"}
    assert not reader.authenticated
    refused = authorize(none, None, "operate", dev=False)
    assert isinstance(refused, Refusal)
    assert refused.status == 403
    assert "no API tokens are configured" in refused.reason
    assert authorize(none, None, "operate", dev=True) == DEV
    assert DEV.by == "api:dev"


def test_the_api_refuses_to_listen_beyond_loopback_without_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HALFWAY_API_TOKENS", "HALFWAY_API_TOKENS_FILE", "HALFWAY_API_DEV",
                 "HALFWAY_API_ALLOWED_HOSTS"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(api_app.ApiConfigError, match="open to anyone"):
        api_app.access_from_env("0.0.0.0")
    assert api_app.access_from_env("127.0.0.1")["tokens"].configured is False
    monkeypatch.setenv("HALFWAY_API_DEV", "1")
    assert api_app.access_from_env("0.0.0.0")["dev"] is True
    monkeypatch.delenv("HALFWAY_API_DEV")
    monkeypatch.setenv("HALFWAY_API_TOKENS", f"ops:read:{OPS}")
    monkeypatch.setenv("HALFWAY_API_ALLOWED_HOSTS", "halfway.example.com, ops.internal:8443")
    access = api_app.access_from_env("0.0.0.0")
    assert access["allowed_hosts"] == {"halfway.example.com", "ops.internal"}
    monkeypatch.setenv("HALFWAY_API_TOKENS", "ops:read:short")
    with pytest.raises(api_app.ApiConfigError, match="HALFWAY_API_TOKENS entry 1"):
        api_app.access_from_env("127.0.0.1")


async def test_serve_api_exits_with_the_reason_instead_of_serving_open_data(
        tmp_path: Path) -> None:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("HALFWAY_API_")}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "halfway", "run", "api",
        env={**environ, "HALFWAY_API_HOST": "0.0.0.0", "HALFWAY_API_PORT": "0"},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert b"listening" not in out
    assert b"HALFWAY_API_TOKENS" in err


# --- the Host header ---------------------------------------------------------------------------


def test_host_names_are_parsed_and_the_defaults_are_loopback_and_the_bind_address() -> None:
    assert [host_name(h) for h in ("127.0.0.1:18100", "[::1]:80", "LocalHost.", "a b",
                                   "[::1", "x:port", "")] == [
        "127.0.0.1", "::1", "localhost", None, None, None, None]
    assert allowed_host_names(None, "0.0.0.0") == {"localhost", "127.0.0.1", "::1"}
    assert "10.1.2.3" in allowed_host_names(None, "10.1.2.3")


async def test_a_host_that_is_not_ours_gets_421_on_every_path() -> None:
    async with serving() as c:
        for path in ("/", "/api/tasks", "/api/openapi.json"):
            response = await c.get(path, headers={"Host": "evil.example:18100", **bearer(OPS)})
            assert response.status == 421, path
            assert "evil.example" in (await response.json())["error"]
        response = await c.post("/api/tasks", json={}, headers={"Host": "evil.example"})
        assert response.status == 421
        assert (await c.get("/api/openapi.json", headers={"Host": "localhost:1"})).status == 200
    async with serving(allowed_hosts=frozenset({"halfway.example.com"})) as c:
        assert (await c.get("/api/openapi.json",
                            headers={"Host": "halfway.example.com"})).status == 200
        assert (await c.get("/api/openapi.json")).status == 421  # 127.0.0.1 is not named


# --- bodies, scopes and failures that name nothing secret --------------------------------------


async def test_reads_and_writes_answer_401_and_403_with_a_challenge() -> None:
    async with serving() as c:
        response = await c.get("/api/tasks")
        assert response.status == 401
        assert response.headers["WWW-Authenticate"] == 'Bearer realm="halfway"'
        response = await c.post("/api/steps/t-1:1/resolve", headers=bearer(READER),
                                json={"outcome": "not_done", "reason": "no"})
        assert response.status == 403
        assert response.headers["WWW-Authenticate"] == \
            'Bearer realm="halfway", error="insufficient_scope", scope="operate"'
        assert "lacks the 'operate' scope" in (await response.json())["error"]
        response = await c.post("/api/tasks", headers=bearer("wrong-token-0123456789abcdef"),
                                json={})
        assert response.status == 401
        assert 'error="invalid_token"' in response.headers["WWW-Authenticate"]
        # The page and the document hold no data.
        assert (await c.get("/api/openapi.json")).status == 200
    async with serving(tokens=Tokens()) as c:
        response = await c.post("/api/tasks/t-1/abort", json={"reason": "x"})
        assert response.status == 403
        assert "no API tokens are configured" in (await response.json())["error"]


@pytest.mark.parametrize(("path", "body", "status", "words"), [
    ("/api/steps/t-1:1/resolve", {"outcome": "done"}, 422, "done needs evidence"),
    ("/api/steps/t-1:1/resolve", {"outcome": "not_done", "reason": "  "}, 422, "reason"),
    ("/api/steps/t-1:1/resolve", {"outcome": "unknown", "reason": "x"}, 422, "outcome"),
    ("/api/steps/t-1:1/resolve", {"outcome": "not_done", "reason": "x", "by": "the CFO"}, 422,
     "by: Extra inputs are not permitted"),
    ("/api/steps/not-a-step/resolve", {"outcome": "not_done", "reason": "x"}, 400,
     "not a step id"),
    ("/api/tasks", {"task_id": "t 1", "allowed_tools": ["x"]}, 422, "task_id"),
    ("/api/tasks", {"task_id": "t-1", "allowed_tools": []}, 422, "allowed_tools"),
    ("/api/tasks", {"task_id": "t-1", "allowed_tools": ["x"], "input": {"pad": "x" * 300_000}},
     413, "larger than"),
    ("/api/tasks/t-1/abort", {}, 422, "reason: Field required"),
    ("/api/tasks/t-1/abort", "not json", 400, "not JSON"),
])
async def test_a_bad_body_is_refused_with_the_reason_before_the_journal_is_touched(
        path: str, body: Any, status: int, words: str) -> None:
    async with serving() as c:  # the broker is nowhere: reaching it would be a 503
        data = body if isinstance(body, str) else json.dumps(body)
        response = await c.post(path, data=data, headers={
            **bearer(OPS), "Content-Type": "application/json"})
        assert response.status == status, await response.text()
        assert words in (await response.json())["error"]
        response = await c.post(path, data=data, headers={**bearer(OPS),
                                                          "Content-Type": "text/plain"})
        assert response.status in (400, 415)


async def test_when_kafka_or_postgresql_is_down_the_answer_is_503_naming_no_host_or_role(
        ) -> None:
    async with serving() as c:
        for path, body in [("/api/tasks", {"task_id": "t-1", "allowed_tools": ["x"]}),
                           ("/api/tasks/t-1/abort", {"reason": "x"}),
                           ("/api/steps/t-1:1/resolve", {"outcome": "not_done", "reason": "x"})]:
            response = await c.post(path, json=body, headers=bearer(OPS))
            assert response.status == 503, await response.text()
            words = (await response.json())["error"]
            assert "repeating the request is safe" in words
            assert "could not be reached" in words  # refused at once: no wait to speak of
            assert "127.0.0.1" not in words
        response = await c.get("/api/tasks", headers=bearer(OPS))
        assert response.status == 503
        words = (await response.json())["error"]
        for secret in ("127.0.0.1", "secret_role", "hunter2", ":1"):
            assert secret not in words


# --- the command line's operator ---------------------------------------------------------------


def test_the_command_line_journals_the_os_user_and_refuses_an_empty_by() -> None:
    assert operator_identity(None, "alice") == "os:alice"
    assert operator_identity("the CFO", "alice") == "the CFO (os:alice)"
    assert operator_identity("os:alice", "alice") == "os:alice"
    with pytest.raises(ResolveRefused, match="--by must name who acts"):
        operator_identity("  ", "alice")
    assert operator_identity(None) == f"os:{os_user()}"


@pytest.mark.parametrize("command", [["resolve", "t-1:1", "not_done", "--reason", "x"],
                                     ["abort", "t-1", "--reason", "x"]])
async def test_an_empty_by_is_refused_on_the_command_line(command: list[str]) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "halfway", *command, "--by", "",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 2
    assert "--by must name who acts" in err.decode()


# --- live streams: fair per client -------------------------------------------------------------


async def next_event(response: Any) -> str:
    async with asyncio.timeout(WAIT_S):
        while True:
            line = (await response.content.readline()).decode()
            if not line:
                raise AssertionError("the event stream ended")
            if line.startswith("event: "):
                return line.removeprefix("event: ").strip()


@pytest.fixture
async def empty_read_model(infrastructure: None) -> AsyncIterator[str]:
    schema = f"t_op_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(env.pg_dsn(), timeout=WAIT_S)
    try:
        await store.migrate(conn, schema)
        yield schema
    finally:
        await store.drop_schema(conn, schema)
        await conn.close()


@pytest.mark.broker
async def test_one_client_cannot_take_every_live_stream(
        empty_read_model: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(api_app, "SSE_CLIENTS_PER_CLIENT_MAX", 2)
    streams = []
    async with serving(env.pg_dsn(), empty_read_model) as c:
        try:
            for _ in range(2):
                streams.append(stream := await c.get("/api/events", headers=bearer(OPS)))
                assert stream.status == 200
                assert await next_event(stream) == "ready"
            third = await c.get("/api/events", headers=bearer(OPS))
            assert third.status == 429
            assert "too many live streams for token ops" in (await third.json())["error"]
            # Another client still gets one.
            streams.append(other := await c.get("/api/events", headers=bearer(READER)))
            assert other.status == 200
            assert await next_event(other) == "ready"
        finally:
            for stream in streams:
                stream.close()
    async with serving(env.pg_dsn(), empty_read_model, tokens=Tokens()) as c:
        # No tokens: counted by address.
        streams = [await c.get("/api/events") for _ in range(2)]
        try:
            assert [s.status for s in streams] == [200, 200]
            third = await c.get("/api/events")
            assert third.status == 429
            assert "address 127.0.0.1" in (await third.json())["error"]
        finally:
            for stream in streams:
                stream.close()


# --- the must-shows: start, abort and resolve through the API, against the real services --------


@pytest.fixture
async def operated(kafka_settings: KafkaSettings, tmp_path: Path, empty_read_model: str,
                   request: pytest.FixtureRequest) -> AsyncIterator[tuple[Cluster, Any]]:
    """paysim whose charges hang far past the 1 s timeout, a decider and an executor (no
    reconciler: an unknown step waits for an operator), the projector and the API here."""
    async with cluster(kafka_settings, tmp_path) as c:
        request.node.stash[CLUSTER_KEY] = c
        await c.faults({"match": {}, "action": {"delay_s": 30.0}})
        await c.start("decider")
        await c.start("executor")
        projector = asyncio.create_task(
            Projector(c.settings, env.pg_dsn(), schema=empty_read_model).run())
        try:
            async with serving(env.pg_dsn(), empty_read_model, kafka=c.settings) as client:
                yield c, client
        finally:
            projector.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await projector


def start_body(task_id: str) -> dict[str, Any]:
    request = renewal_request(task_id, reask=False)
    return {"task_id": task_id, "input": request.input, "allowed_tools": request.allowed_tools}


async def until_shown(client: Any, task_id: str, probe: Callable[[dict[str, Any]], bool],
                      ) -> dict[str, Any]:
    """The task from the API once `probe` holds; re-read on every `changed` of the live
    stream (never on a timer)."""
    stream = await client.get("/api/events", headers=bearer(READER))
    task: dict[str, Any] = {}
    try:
        assert await next_event(stream) == "ready"
        async with asyncio.timeout(WAIT_S):
            while True:
                response = await client.get(f"/api/tasks/{task_id}", headers=bearer(READER))
                if response.status == 200:
                    task = await response.json()
                    if probe(task):
                        return task
                assert await next_event(stream) == "changed"
    except TimeoutError:
        raise AssertionError(f"the API never showed it: {json.dumps(task)[:2000]}") from None
    finally:
        stream.close()


async def until_unknown(c: Cluster, task_id: str) -> None:
    def unknown() -> bool | None:
        step = fold(c.journal.of(task_id), task_id).step(1)
        return True if step is not None and step.status is StepStatus.UNKNOWN else None

    await c.journal.wait_for(unknown, f"step {task_id}:1 unknown")


@pytest.mark.broker
async def test_start_and_resolve_through_the_api_a_read_token_cannot_and_who_acted_is_shown(
        operated: tuple[Cluster, Any]) -> None:
    c, client = operated
    task_id = f"api-{uuid.uuid4().hex[:8]}"
    step_id = f"{task_id}:1"

    response = await client.post("/api/tasks", json=start_body(task_id), headers=bearer(STARTER))
    assert response.status == 202, await response.text()
    answer = await response.json()
    assert (answer["task_id"], answer["requested_by"]) == (task_id, "api:ci")
    requested = [d.event async for d in read_topic(c.settings, TASKS)
                 if d.event.task_id == task_id]
    assert [e.event_id for e in requested] == [answer["event_id"]]
    assert requested[0].requested_by == "api:ci"  # who asked is journaled with the request

    # The charge hangs: the step is unknown, and with no reconciler it stays so.
    await until_unknown(c, task_id)

    body = {"outcome": "done", "evidence": {"charge_id": "ch_confirmed_by_the_bank"}}
    refused = await client.post(f"/api/steps/{step_id}/resolve", json=body,
                                headers=bearer(READER))
    assert refused.status == 403
    assert "lacks the 'operate' scope" in (await refused.json())["error"]
    refused = await client.post(f"/api/steps/{step_id}/resolve", json=body,
                                headers=bearer(STARTER))
    assert refused.status == 403

    response = await client.post(f"/api/steps/{step_id}/resolve", json=body, headers=bearer(OPS))
    assert response.status == 202, await response.text()
    assert (await response.json())["by"] == "api:ops"

    # Journaled: one operator settlement, by api:ops; the task moves on and succeeds.
    state = (await c.journal.until_finished([task_id]))[task_id]
    assert state.final_state is FinalState.SUCCEEDED, state.finished
    settled = state.step(1).effect.settlement
    assert settled.source is SettlementSource.OPERATOR
    assert settled.evidence == {"charge_id": "ch_confirmed_by_the_bank", "resolved_by": "api:ops"}
    operator = [e for e in await journal_now(c.settings) if isinstance(e, StepSettled)
                and e.task_id == task_id and e.source is SettlementSource.OPERATOR]
    assert len(operator) == 1  # the refused tokens journaled nothing

    # Shown: the task's status, read back from the read model through the API.
    task = await until_shown(client, task_id, lambda t: t["state"] == "succeeded")
    [step] = task["steps"]
    assert (step["status"], step["source"]) == ("done", "operator")
    assert step["evidence"]["resolved_by"] == "api:ops"
    assert "resolved_by=api:ops" in step["says"]

    # A second verdict is refused (409); a step not in the journal is 404.
    again = await client.post(f"/api/steps/{step_id}/resolve", headers=bearer(OPS),
                              json={"outcome": "not_done", "reason": "changed my mind"})
    assert again.status == 409
    words = (await again.json())["error"]
    assert "already done" in words
    assert '"force": true' in words  # the body field, not the command line's --force
    absent = await client.post(f"/api/steps/{task_id}:7/resolve", headers=bearer(OPS),
                               json={"outcome": "not_done", "reason": "x"})
    assert absent.status == 404


@pytest.mark.broker
async def test_abort_through_the_api_is_journaled_and_shown_with_who_called_it_off(
        operated: tuple[Cluster, Any]) -> None:
    c, client = operated
    task_id = f"api-abort-{uuid.uuid4().hex[:8]}"
    response = await client.post("/api/tasks", json=start_body(task_id), headers=bearer(OPS))
    assert response.status == 202, await response.text()
    await until_unknown(c, task_id)

    refused = await client.post(f"/api/tasks/{task_id}/abort", headers=bearer(READER),
                                json={"reason": "the customer cancelled"})
    assert refused.status == 403
    response = await client.post(f"/api/tasks/{task_id}/abort", headers=bearer(OPS),
                                 json={"reason": "the customer cancelled"})
    assert response.status == 202, await response.text()
    assert (await response.json())["by"] == "api:ops"

    aborted = await c.journal.first(lambda e: isinstance(e, TaskAborted)
                                    and e.task_id == task_id, "task.aborted")
    assert (aborted.by, aborted.reason) == ("api:ops", "the customer cancelled")
    task = await until_shown(client, task_id, lambda t: t["aborted_by"] is not None)
    assert (task["aborted_by"], task["aborted_reason"]) == ("api:ops", "the customer cancelled")
    # The step in flight is never abandoned: it stays unknown until it settles.
    assert task["steps"][0]["status"] == "unknown"
    assert fold(c.journal.of(task_id), task_id).step(1).outcome is Outcome.UNKNOWN

    again = await client.post(f"/api/tasks/{task_id}/abort", headers=bearer(OPS),
                              json={"reason": "twice"})
    assert again.status == 409
    assert "already called off by api:ops" in (await again.json())["error"]
    absent = await client.post("/api/tasks/never-started/abort", headers=bearer(OPS),
                               json={"reason": "x"})
    assert absent.status == 404
