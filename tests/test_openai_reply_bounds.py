"""The size of a model's answer is bounded: OpenAIModel, through the official `openai` client it
builds itself (from the environment), reads at most MODEL_REPLY_BYTES_MAX bytes of an answer.

The endpoint is an aiohttp server of this test's own, on port 0, that answers what the task id
(its `X-Halfway-Task` header) names: a small chat completion, one far over the bound declared
by its `Content-Length` or sent chunked without one, or a compressed one. Of an answer over the
bound the server says how far it got: an answer refused unread ends with the client closing the
connection while the server is still sending it (its total far exceeds what the sockets'
buffers hold), where reading it whole would let the server finish. The tests await that, never
sleep, and assert nothing on time.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from halfway.models import History, ModelUnavailable, ProposeFinish
from halfway.models.openai_chat import MODEL_REPLY_BYTES_MAX, SUMMARY_CHARS_MAX, OpenAIModel

KEY = "sk-test-reply-bounds-0123456789abcdef"
MODEL = "gpt-4o-mini"
TIMEOUT_S = 60.0  # a question that should be answered, or refused, well before
GUARD_S = 60.0  # waiting for the server to say how an answer ended: a hang guard, not a measure
CHUNK = 64 * 1024
HUGE = 16 * MODEL_REPLY_BYTES_MAX  # 64 MiB: far more than both sockets' buffers hold
TASK_HEADER = "X-Halfway-Task"


def completion_parts() -> tuple[bytes, bytes]:
    """A chat completion with a final text, as the bytes before and after that text."""
    prefix = ('{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"' + MODEL +
              '","choices":[{"index":0,"finish_reason":"stop","message":{"role":"assistant",'
              '"content":"')
    suffix = '"}}]}'
    return prefix.encode(), suffix.encode()


def small_completion(text: str) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": MODEL,
            "choices": [{"index": 0, "finish_reason": "stop",
                         "message": {"role": "assistant", "content": text}}]}


@dataclass
class Sending:
    """One large answer as the server sends it."""

    total: int
    sent: int = 0
    ended: asyncio.Future[str] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future())


@dataclass
class Endpoint:
    """An OpenAI-compatible endpoint answering by the task id's first word."""

    base_url: str = ""
    sendings: dict[str, Sending] = field(default_factory=dict)
    # Per question, in order: the task, its connection (the transport object, kept alive so
    # that `is` tells connections apart) and the Accept-Encoding it asked.
    questions: list[tuple[str, Any, str | None]] = field(default_factory=list)

    def connection_of(self, task: str) -> Any:
        return next(conn for t, conn, _ in self.questions if t == task)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.read()
        task = request.headers.get(TASK_HEADER, "")
        self.questions.append((task, request.transport, request.headers.get("Accept-Encoding")))
        kind, _, rest = task.partition("-")
        if kind == "small":
            return web.json_response(small_completion("Renewed INV-1."))
        if kind == "gzip":
            body = gzip.compress(json.dumps(small_completion("Renewed INV-1.")).encode())
            return web.Response(body=body, content_type="application/json",
                                headers={"Content-Encoding": "gzip"})
        # "declared-<status>-<size>-..." or "chunked-<status>-<size>-...": a completion of
        # <size> bytes in all, with a Content-Length or chunked.
        status, size = (int(word) for word in rest.split("-")[:2])
        return await self.send_large(request, task, status, size, declared=kind == "declared")

    async def send_large(self, request: web.Request, task: str, status: int, size: int, *,
                         declared: bool) -> web.StreamResponse:
        prefix, suffix = completion_parts()
        filler = size - len(prefix) - len(suffix)
        sending = self.sendings[task] = Sending(size)
        response = web.StreamResponse(status=status,
                                      headers={"Content-Type": "application/json"})
        if declared:
            response.content_length = size
        else:
            response.enable_chunked_encoding()
        ended = "closed by the client"
        try:
            await response.prepare(request)
            await response.write(prefix)
            sending.sent += len(prefix)
            chunk = b"x" * CHUNK
            while filler > 0:
                part = chunk if filler >= CHUNK else chunk[:filler]
                await response.write(part)
                sending.sent += len(part)
                filler -= len(part)
            await response.write(suffix)
            sending.sent += len(suffix)
            await response.write_eof()
            ended = "finished"
        except ConnectionError:  # aiohttp's ClientConnectionResetError among them
            pass
        finally:  # cancelled (the client went away) is closed by the client too
            sending.ended.set_result(ended)
        return response

    async def ended(self, task: str) -> str:
        async with asyncio.timeout(GUARD_S):
            return await self.sendings[task].ended


@pytest.fixture
async def endpoint() -> AsyncIterator[Endpoint]:
    found = Endpoint()
    app = web.Application()
    app.router.add_post("/v1/chat/completions", found.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    found.base_url = f"http://{host}:{port}/v1"
    try:
        yield found
    finally:
        await runner.cleanup()


@pytest.fixture
async def model(endpoint: Endpoint, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[OpenAIModel]:
    """The adapter as the decider makes it: its own client, configured by the environment."""
    monkeypatch.setenv("OPENAI_BASE_URL", endpoint.base_url)
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    async with OpenAIModel(MODEL, timeout_s=TIMEOUT_S) as made:
        yield made


def task_of(*words: object) -> str:
    return "-".join([*(str(w) for w in words), uuid.uuid4().hex[:8]])


def history(task: str) -> History:
    return History(task_id=task, n=1, input={"prompt": "Renew INV-1."}, tools=[])


async def unavailable(model: OpenAIModel, task: str) -> ModelUnavailable:
    with pytest.raises(ModelUnavailable) as caught:
        await model.decide(history(task))
    return caught.value


# --- answers over the bound ----------------------------------------------------------------------


async def test_an_answer_declared_over_the_bound_is_refused_unread(model: OpenAIModel,
                                                                   endpoint: Endpoint) -> None:
    task = task_of("declared", 200, HUGE)
    failure = await unavailable(model, task)

    assert (failure.transient, failure.status) == (True, None)
    assert "MODEL_REPLY_BYTES_MAX" in failure.error
    assert f"{MODEL_REPLY_BYTES_MAX} bytes" in failure.error
    assert f"is {HUGE} bytes" in failure.error
    assert KEY not in failure.error
    # The client closed the connection while the server was still sending the answer.
    assert await endpoint.ended(task) == "closed by the client"
    assert endpoint.sendings[task].sent < HUGE


@pytest.mark.parametrize("status", [200, 503])
async def test_an_answer_growing_past_the_bound_is_refused_unread(model: OpenAIModel,
                                                                  endpoint: Endpoint,
                                                                  status: int) -> None:
    # Chunked, without a Content-Length: only counting the bytes as they come can stop it. An
    # error's body (503) is read by the official client too, and bounded the same.
    task = task_of("chunked", status, HUGE)
    failure = await unavailable(model, task)

    assert (failure.transient, failure.status) == (True, None)
    assert failure.error.startswith(f"the endpoint's answer (HTTP {status}) is more than "
                                    f"MODEL_REPLY_BYTES_MAX ({MODEL_REPLY_BYTES_MAX} bytes)")
    assert await endpoint.ended(task) == "closed by the client"
    assert endpoint.sendings[task].sent < HUGE


async def test_a_compressed_answer_is_refused(model: OpenAIModel, endpoint: Endpoint) -> None:
    # Its size is unknown until decoded (a small gzip body can decode to gigabytes): the
    # adapter asks for answers uncompressed, and refuses one compressed nonetheless.
    task = task_of("gzip")
    failure = await unavailable(model, task)

    assert (failure.transient, failure.status) == (True, None)
    assert "is compressed (gzip)" in failure.error
    assert "MODEL_REPLY_BYTES_MAX" in failure.error
    assert endpoint.questions[-1][2] == "identity"


# --- answers within it ---------------------------------------------------------------------------


async def test_a_small_answer_is_read_on_a_reused_connection(model: OpenAIModel,
                                                             endpoint: Endpoint) -> None:
    first, second = task_of("small"), task_of("small")
    assert await model.decide(history(first)) == ProposeFinish("Renewed INV-1.")
    assert await model.decide(history(second)) == ProposeFinish("Renewed INV-1.")

    assert endpoint.connection_of(first) is endpoint.connection_of(second)
    assert [asked for _, _, asked in endpoint.questions] == ["identity", "identity"]


@pytest.mark.parametrize("kind", ["declared", "chunked"])
async def test_an_answer_of_exactly_the_bound_is_read(model: OpenAIModel, endpoint: Endpoint,
                                                      kind: str) -> None:
    task = task_of(kind, 200, MODEL_REPLY_BYTES_MAX)
    proposal = await model.decide(history(task))

    assert isinstance(proposal, ProposeFinish)
    assert proposal.summary == "x" * SUMMARY_CHARS_MAX
    assert await endpoint.ended(task) == "finished"


async def test_a_question_after_a_refused_answer_is_answered(model: OpenAIModel,
                                                             endpoint: Endpoint) -> None:
    refused, small = task_of("chunked", 200, HUGE), task_of("small")
    await unavailable(model, refused)
    assert await endpoint.ended(refused) == "closed by the client"

    assert await model.decide(history(small)) == ProposeFinish("Renewed INV-1.")
    # The refused answer's connection was closed, never reused for the rest of it.
    assert endpoint.connection_of(small) is not endpoint.connection_of(refused)
    assert endpoint.connection_of(refused).is_closing()
