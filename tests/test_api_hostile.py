"""The operator API against hostile or careless clients and settings: bytes that are not UTF-8,
numbers JSON has not, bodies that only look right, routes that do not exist, Host headers out
of range, streams that go away, and start-up settings it cannot use.

None of these needs the broker or PostgreSQL: the API answers them before either is touched
(the broker and the database are nowhere, as in tests/test_operator_api.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from aiohttp import web

import halfway.resolve
from halfway.api import app as api_app
from halfway.api import operate
from halfway.api.auth import host_name
from halfway.contract import Outcome
from tests.test_api import next_event
from tests.test_operator_api import NOWHERE_KAFKA, NOWHERE_PG, OPS, TOKENS, bearer, serving

WAIT_S = 60.0


async def raw_request(port: int, head: bytes, body: bytes = b"") -> tuple[int, dict[str, str],
                                                                          bytes]:
    """Send bytes as they are (no client library would send these) and read the whole answer:
    (status, headers, body)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head.replace(b"\n", b"\r\n") + b"Connection: close\r\n\r\n" + body)
        answer = await asyncio.wait_for(reader.read(), WAIT_S)
    finally:
        writer.close()
    top, _, content = answer.partition(b"\r\n\r\n")
    status_line, *lines = top.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines)
    return int(status_line.split()[1]), headers, content


# --- 1. a bearer token that is not UTF-8 ------------------------------------------------------


async def test_a_token_that_is_not_utf8_is_an_unknown_token_not_a_500() -> None:
    async with serving() as c:
        for path in (b"/api/tasks", b"/api/events"):
            status, headers, body = await raw_request(
                c.server.port, b"GET " + path + b" HTTP/1.1\nHost: 127.0.0.1\n"
                b"Authorization: Bearer \xff\xfe\xfdabcdefabcdefabcdef\n")
            assert status == 401, body
            assert headers["WWW-Authenticate"] == \
                'Bearer realm="halfway", error="invalid_token"'
            assert "not one this API knows" in json.loads(body)["error"]
        # Elsewhere such bytes are words in an answer, never a 500.
        status, _, body = await raw_request(
            c.server.port, b"GET /api/tasks HTTP/1.1\nHost: \xff\xfe\n")
        assert status == 421
        status, _, body = await raw_request(
            c.server.port, b"POST /api/tasks/t-1/abort HTTP/1.1\nHost: 127.0.0.1\n"
            b"Authorization: Bearer " + OPS.encode() + b"\nContent-Type: \xff/json\n"
            b"Content-Length: 2\n", b"{}")
        assert status == 415
        assert json.loads(body)["error"]


# --- 3. numbers JSON has not ------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/api/tasks", '{"task_id": "t-1", "allowed_tools": ["x"], "input": {"a": NaN}}', "input.a"),
    ("/api/tasks", '{"task_id": "t-1", "allowed_tools": ["x"], "input": {"a": Infinity}}',
     "input.a"),
    ("/api/tasks", '{"task_id": "t-1", "allowed_tools": ["x"], "input": {"a": -Infinity}}',
     "input.a"),
    ("/api/tasks", '{"task_id": "t-1", "allowed_tools": ["x"], "input": {"a": 1e999}}',
     "input.a"),
    ("/api/tasks", '{"task_id": "t-1", "allowed_tools": ["x"], '
     '"input": {"a": [1.5, {"b": NaN}]}}', "input.a: Value error, NaN, Infinity and numbers "
     "beyond ±1.8e308 are not JSON numbers (at [1].b)"),
    ("/api/steps/t-1:1/resolve", '{"outcome": "done", "evidence": {"amount": 1e999}}',
     "evidence.amount"),
])
async def test_nan_infinity_and_overflowing_numbers_are_refused_naming_the_field(
        path: str, body: str, field: str) -> None:
    async with serving() as c:
        response = await c.post(path, data=body, headers={
            **bearer(OPS), "Content-Type": "application/json"})
        assert response.status == 422, await response.text()
        words = (await response.json())["error"]
        assert field in words
        assert "not JSON numbers" in words


# --- 4. strict bodies -------------------------------------------------------------------------


@pytest.mark.parametrize(("path", "body", "words"), [
    ("/api/steps/t-1:1/resolve", {"outcome": "not_done", "reason": "x", "force": "yes"},
     "force: Input should be a valid boolean"),
    ("/api/steps/t-1:1/resolve", {"outcome": "not_done", "reason": "x", "force": 1},
     "force: Input should be a valid boolean"),
    ("/api/tasks", {"task_id": "t-1", "allowed_tools": ["x"], "policy": {"saga": "yes"}},
     "policy.saga: Input should be a valid boolean"),
    ("/api/tasks", {"task_id": "t-1", "allowed_tools": ["x"], "policy": {"max_steps": "3"}},
     "policy.max_steps: Input should be a valid integer"),
    ("/api/tasks", {"task_id": "t-1", "allowed_tools": ["x"], "policy": {"max_steps": 3.0}},
     "policy.max_steps: Input should be a valid integer"),
    ("/api/tasks/t-1/abort", {"reason": 7}, "reason: Input should be a valid string"),
])
async def test_a_body_that_only_looks_right_is_refused_not_coerced(
        path: str, body: dict[str, Any], words: str) -> None:
    async with serving() as c:
        response = await c.post(path, json=body, headers=bearer(OPS))
        assert response.status == 422, await response.text()
        assert words in (await response.json())["error"]


@pytest.mark.parametrize(("path", "body"), [
    ("/api/tasks", {"task_id": "t-1", "input": {"prompt": "renew", "amount": 42.5},
                    "allowed_tools": ["charge_customer"],
                    "policy": {"saga": True, "max_steps": 3, "deadline": "2030-01-01T00:00:00Z",
                               "on_unknown": "compensate"}}),
    ("/api/steps/t-1:1/resolve", {"outcome": "done", "evidence": {"charge_id": "ch_1"},
                                  "force": True}),
    ("/api/steps/t-1:1/resolve", {"outcome": "not_done", "reason": "declined"}),
])
async def test_the_documented_bodies_still_validate(path: str, body: dict[str, Any]) -> None:
    async with serving() as c:  # valid: it goes on to the journal, which is nowhere (503)
        response = await c.post(path, json=body, headers=bearer(OPS))
        assert response.status == 503, await response.text()
        assert "the journal (Kafka) could not be reached" in (await response.json())["error"]


# --- 5. a second verdict names the body field, not the command line's flag ---------------------


async def test_a_second_verdict_is_refused_naming_the_force_field(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def settled(settings: Any, task_id: str) -> Any:  # the step is done already
        return SimpleNamespace(step=lambda n: SimpleNamespace(outcome=Outcome.DONE))

    async def no_writer(self: operate.Journal) -> None:  # refused before anything is written
        return None

    monkeypatch.setattr(halfway.resolve, "task_state", settled)
    monkeypatch.setattr(operate.Journal, "writer", no_writer)
    async with serving() as c:
        response = await c.post("/api/steps/t-1:1/resolve", headers=bearer(OPS),
                                json={"outcome": "not_done", "reason": "changed my mind"})
        assert response.status == 409, await response.text()
        words = (await response.json())["error"]
        assert "already done" in words
        assert '"force": true' in words
        assert "--force" not in words


# --- 6. routes and methods that do not exist --------------------------------------------------


async def test_unknown_routes_and_methods_under_api_answer_json() -> None:
    async with serving() as c:
        response = await c.get("/api/nosuch", headers=bearer(OPS))
        assert response.status == 404
        assert "/api/nosuch" in (await response.json())["error"]
        response = await c.delete("/api/tasks", headers=bearer(OPS))
        assert response.status == 405
        assert set(response.headers["Allow"].split(",")) == {"GET", "HEAD", "POST"}
        assert "DELETE is not allowed" in (await response.json())["error"]
        status, headers, body = await raw_request(
            c.server.port, b"GET /api/steps/../tasks/x HTTP/1.1\nHost: 127.0.0.1\n")
        assert status == 404
        assert headers["Content-Type"].startswith("application/json")
        assert json.loads(body)["error"]
        # The Host check still comes first.
        response = await c.get("/api/nosuch", headers={"Host": "evil.example"})
        assert response.status == 421


# --- 7. a Host header with a port out of range ------------------------------------------------


async def test_a_host_with_a_port_out_of_range_is_refused() -> None:
    assert [host_name(h) for h in ("127.0.0.1:65535", "127.0.0.1:65536", "127.0.0.1:99999",
                                   "[::1]:65535", "[::1]:99999", "[::1]x")] == [
        "127.0.0.1", None, None, "::1", None, None]
    async with serving() as c:
        response = await c.get("/api/openapi.json", headers={"Host": "127.0.0.1:99999"})
        assert response.status == 421
        assert "127.0.0.1:99999" in (await response.json())["error"]


# --- 8. a stream that went away gives its slot back -------------------------------------------


@contextlib.asynccontextmanager
async def served_as_in_production() -> AsyncIterator[str]:
    """The API as serve_api runs it: aiohttp's test server cancels a handler when its client
    goes, which `halfway run api` does not (so streams are watched by the API itself)."""
    runner = web.AppRunner(api_app.make_app(NOWHERE_PG, "halfway", kafka=NOWHERE_KAFKA,
                                            tokens=TOKENS))
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    try:
        await web.SockSite(runner, sock).start()
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await runner.cleanup()


async def test_a_closed_stream_frees_its_slot_at_once() -> None:
    async with served_as_in_production() as url, aiohttp.ClientSession() as session:
        for _ in range(2):  # twice: the slots freed are all usable again
            streams = [await session.get(f"{url}/api/events", headers=bearer(OPS))
                       for _ in range(api_app.SSE_CLIENTS_PER_CLIENT_MAX)]
            try:
                assert [s.status for s in streams] == [200] * len(streams)
                for stream in streams:
                    assert await next_event(stream) == "ready"
                extra = await session.get(f"{url}/api/events", headers=bearer(OPS))
                assert extra.status == 429
            finally:
                for stream in streams:
                    stream.close()
        # Another one right after they closed: their slots are free.
        again = await session.get(f"{url}/api/events", headers=bearer(OPS))
        try:
            assert again.status == 200, await again.text()
            assert await next_event(again) == "ready"
        finally:
            again.close()


# --- 2. settings `halfway run api` cannot use: one line, exit 2 --------------------------------


async def run_api(**environ: str) -> tuple[int | None, str, str]:
    """`halfway run api` with these settings: (exit code, stdout, stderr); stopped by SIGTERM
    once it says it listens."""
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith(("HALFWAY_API_", "HALFWAY_PG_SCHEMA"))}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "halfway", "run", "api",
        env={**clean, "HALFWAY_API_TOKENS": f"ops:read:{OPS}", "HALFWAY_API_PORT": "0",
             **environ},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(WAIT_S):
            line = (await proc.stdout.readline()).decode()
            if line.startswith("listening on "):
                url = line.removeprefix("listening on ").strip()
                async with aiohttp.ClientSession() as session:
                    response = await session.get(f"{url}/api/openapi.json")
                    assert response.status == 200, await response.text()
                proc.send_signal(signal.SIGTERM)
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return proc.returncode, line + out.decode(), err.decode()


def one_line(err: str) -> str:
    """The line a person reads (the JSON log lines aside)."""
    lines = [line for line in err.splitlines() if not line.startswith("{")]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


HOST_FIX = "; set HALFWAY_API_HOST to an address of this machine"


@pytest.mark.parametrize(("environ", "words", "fix"), [
    ({"HALFWAY_PG_SCHEMA": "x;drop"}, "HALFWAY_PG_SCHEMA: invalid schema name 'x;drop'", ""),
    ({"HALFWAY_API_HOST": "not.a.host"}, "cannot listen on not.a.host:", HOST_FIX),
    ({"HALFWAY_API_HOST": "a" * 300}, f"cannot listen on {'a' * 100}:", HOST_FIX),
])
async def test_a_setting_the_api_cannot_use_is_one_line_naming_it(
        environ: dict[str, str], words: str, fix: str) -> None:
    code, out, err = await run_api(**environ)
    assert code == 2
    assert "listening" not in out
    line = one_line(err)
    assert line.startswith(f"halfway api: {words}"), line
    assert line.endswith(fix), line


async def test_a_port_in_use_is_one_line_naming_the_address_and_the_variable() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, out, err = await run_api(HALFWAY_API_PORT=str(port))
    assert code == 2
    assert "listening" not in out
    line = one_line(err)
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in line
    assert "HALFWAY_API_PORT" in line


async def test_the_api_listens_on_an_ipv6_host() -> None:
    code, out, err = await run_api(HALFWAY_API_HOST="::1")
    assert re.match(r"listening on http://\[::1\]:\d+\n", out), (out, err)
    assert code == 0, err
