"""modelsim, the OpenAI-compatible chat-completions simulator, served on the test's own loop.

Raw requests (httpx) check what the official client relies on: OpenAI's answer and error
shapes, the script it follows from the conversation alone, its faults and its counts. The
official `openai` client is pointed at it too. Each test uses its own task ids and starts from
a reset simulator; nothing waits by sleeping and nothing asserts on elapsed time.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest

from halfway.simulators import modelsim
from halfway.simulators.modelsim import ModelSim, serving

KEY = "sk-test-modelsim-0123456789abcdef"
MODEL = "gpt-4o-mini"
OTHER = "tiny-model"
HTTP_TIMEOUT_S = 30.0  # the test's own client never times out
SIM_START_TIMEOUT_S = 30.0
SIM_STOP_TIMEOUT_S = 10.0

SCRIPT = [
    {"tool": "lookup_invoice", "args": {"invoice": "INV-1"}},
    {"tool": "charge_customer", "args": {"invoice": "INV-1", "amount_cents": 4900}},
]


@pytest.fixture(scope="module")
async def served() -> AsyncIterator[tuple[str, ModelSim]]:
    async with serving(api_key=KEY, models=(MODEL, OTHER)) as pair:
        yield pair


@pytest.fixture
def sim(served: tuple[str, ModelSim]) -> ModelSim:
    served[1].reset()
    return served[1]


@pytest.fixture
async def http(served: tuple[str, ModelSim], sim: ModelSim) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=served[0], timeout=HTTP_TIMEOUT_S,
                                 headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client


@pytest.fixture
def task() -> str:
    return f"task-{uuid.uuid4().hex[:12]}"


def user(context: dict[str, Any], prompt: str = "Renew the subscription.") -> dict[str, Any]:
    return {"role": "user",
            "content": f"{prompt}\n\nContext (JSON):\n{json.dumps(context, sort_keys=True)}"}


def called(call_id: str, tool: str, args: dict[str, Any], result: str,
           *others: tuple[str, str]) -> list[dict[str, Any]]:
    """An assistant answer (a call, and `others` as (id, tool) calls not run) and its results."""
    calls = [{"id": call_id, "type": "function",
              "function": {"name": tool, "arguments": json.dumps(args)}}]
    calls += [{"id": i, "type": "function", "function": {"name": t, "arguments": "{}"}}
              for i, t in others]
    return [{"role": "assistant", "content": None, "tool_calls": calls},
            {"role": "tool", "tool_call_id": call_id, "content": result},
            *({"role": "tool", "tool_call_id": i, "content": "not run: one at a time"}
              for i, _ in others)]


async def chat(http: httpx.AsyncClient, messages: list[dict[str, Any]], task: str | None = None,
               **extra: Any) -> httpx.Response:
    headers = {modelsim.TASK_HEADER: task} if task else {}
    return await http.post("/v1/chat/completions", headers=headers,
                           json={"model": MODEL, "messages": messages, **extra})


def first_call(response: httpx.Response) -> tuple[str, dict[str, Any]]:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    function = choice["message"]["tool_calls"][0]["function"]
    return function["name"], json.loads(function["arguments"])


def final_text(response: httpx.Response) -> str:
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert "tool_calls" not in choice["message"]
    return choice["message"]["content"]


# --- answers -------------------------------------------------------------------------------------


async def test_an_answer_has_openai_shape_and_counts_tokens(http: httpx.AsyncClient,
                                                            task: str) -> None:
    messages = [{"role": "system", "content": "Be brief."}, user({"script": SCRIPT})]
    response = await chat(http, messages, task)

    assert response.status_code == 200
    assert response.headers["x-request-id"].startswith("req_")
    body = response.json()
    assert body["id"].startswith("chatcmpl-")
    assert (body["object"], body["model"]) == ("chat.completion", MODEL)
    assert isinstance(body["created"], int)
    message = body["choices"][0]["message"]
    assert (message["role"], message["content"]) == ("assistant", None)
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_")
    assert len(call["id"]) <= 40
    assert call["type"] == "function"
    assert call["function"]["name"] == "lookup_invoice"
    assert isinstance(call["function"]["arguments"], str)
    assert json.loads(call["function"]["arguments"]) == {"invoice": "INV-1"}
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(json.dumps(messages, separators=(",", ":"))) // 4
    assert usage["completion_tokens"] >= 1
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


async def test_the_official_client_reads_answers_and_lists_models(
        served: tuple[str, ModelSim], sim: ModelSim, task: str) -> None:
    assert sim.openai_base_url == f"{served[0]}/v1"
    client = openai.AsyncOpenAI(base_url=sim.openai_base_url, api_key=KEY, max_retries=0)
    try:
        answer = await client.chat.completions.create(
            model=OTHER, messages=[user({"script": SCRIPT})],  # type: ignore[list-item]
            extra_headers={modelsim.TASK_HEADER: task})
        models = await client.models.list()
        one = await client.models.retrieve(OTHER)
    finally:
        await client.close()

    assert answer.choices[0].finish_reason == "tool_calls"
    calls = answer.choices[0].message.tool_calls
    assert calls is not None
    assert calls[0].function.name == "lookup_invoice"
    assert answer.model == OTHER
    assert answer.usage is not None
    assert answer.usage.prompt_tokens >= 1
    assert [m.id for m in models.data] == [MODEL, OTHER]
    assert one.id == OTHER
    assert sim.requests_of(task) == 1


async def test_steps_are_counted_from_results_of_first_calls_not_refusals(
        http: httpx.AsyncClient, task: str) -> None:
    script = [*SCRIPT, {"tool": "send_receipt", "args": {"to": "ada@example.com"}}]
    conversation = [user({"script": script})]
    assert first_call(await chat(http, conversation, task)) == ("lookup_invoice",
                                                                {"invoice": "INV-1"})

    # Step 1 done, with a second call of the same answer that was not run: one step decided.
    conversation += called("c1", "lookup_invoice", {"invoice": "INV-1"},
                           "done: lookup_invoice (reference k1)", ("c1b", "charge_customer"))
    assert first_call(await chat(http, conversation, task))[0] == "charge_customer"

    # A refusal is not a step: the same step is proposed again.
    conversation += called("r2", "charge_customer", {"amount_cents": "49.00"},
                           "refused: arguments for charge_customer are invalid")
    assert first_call(await chat(http, conversation, task)) == (
        "charge_customer", {"invoice": "INV-1", "amount_cents": 4900})

    # Unknown and not-done results are decided steps too.
    conversation += called("c2", "charge_customer", {}, "unknown, being checked: ...")
    assert first_call(await chat(http, conversation, task))[0] == "send_receipt"
    conversation += called("c3", "send_receipt", {}, "not done, safe to try again: bounced")
    assert final_text(await chat(http, conversation, task)) == "done"


async def test_after_the_script_it_answers_the_summary(http: httpx.AsyncClient,
                                                       task: str) -> None:
    context = {"script": SCRIPT[:1], "summary": "Invoice INV-1 looked up."}
    conversation = [user(context), *called("c1", "lookup_invoice", {}, "done: found")]
    assert final_text(await chat(http, conversation, task)) == "Invoice INV-1 looked up."
    # No context at all: a model that has nothing to do finishes.
    assert final_text(await chat(http, [{"role": "user", "content": "hello"}], task)) == "done"


async def test_a_step_can_answer_parallel_calls(http: httpx.AsyncClient, task: str) -> None:
    script = [{"tool": "hold_flight", "args": {"flight": "LH454"},
               "parallel": [{"tool": "book_hotel", "args": {"hotel": "HTL-1"}},
                            {"tool": "send_email"}]}]
    response = await chat(http, [user({"script": script})], task)

    calls = response.json()["choices"][0]["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("hold_flight", {"flight": "LH454"}), ("book_hotel", {"hotel": "HTL-1"}),
        ("send_email", {})]
    assert len({c["id"] for c in calls}) == 3


async def test_a_malformed_step_is_valid_once_refused(http: httpx.AsyncClient, task: str) -> None:
    script = [{"tool": "charge_customer", "args": {"amount_cents": 4900}, "malformed": True}]
    conversation = [user({"script": script})]
    first = (await chat(http, conversation, task)).json()["choices"][0]["message"]
    arguments = first["tool_calls"][0]["function"]["arguments"]
    with pytest.raises(json.JSONDecodeError):
        json.loads(arguments)

    conversation += called("r1", "charge_customer", {}, "refused: the arguments of "
                           "charge_customer are not a JSON object")
    assert first_call(await chat(http, conversation, task)) == ("charge_customer",
                                                                {"amount_cents": 4900})


# --- errors --------------------------------------------------------------------------------------


@pytest.mark.parametrize("authorization", [None, "Bearer sk-wrong-key-000000000000",
                                           f"Basic {KEY}"])
async def test_a_wrong_or_missing_key_is_401(served: tuple[str, ModelSim], sim: ModelSim,
                                             authorization: str | None) -> None:
    headers = {"Authorization": authorization} if authorization else {}
    async with httpx.AsyncClient(base_url=served[0], timeout=HTTP_TIMEOUT_S) as client:
        response = await client.post("/v1/chat/completions", headers=headers,
                                     json={"model": MODEL, "messages": [user({})]})
        listed = await client.get("/v1/models", headers=headers)

    assert response.status_code == listed.status_code == 401
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None,
                                                              "invalid_api_key")
    assert "sk-wrong-key-000000000000" not in error["message"]
    assert KEY not in error["message"]


async def test_an_unknown_model_is_404(http: httpx.AsyncClient) -> None:
    response = await http.post("/v1/chat/completions",
                               json={"model": "gpt-nope", "messages": [user({})]})
    retrieved = await http.get("/v1/models/gpt-nope")

    assert response.status_code == retrieved.status_code == 404
    assert response.json()["error"]["code"] == "model_not_found"
    assert "gpt-nope" in response.json()["error"]["message"]


def _call(call_id: str) -> list[dict[str, Any]]:
    return [user({}), *called(call_id, "lookup_invoice", {}, "done")]


@pytest.mark.parametrize(("body", "param"), [
    ({"model": MODEL}, "messages"),
    ({"model": MODEL, "messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "hi"}]}, "model"),
    ({"model": MODEL, "messages": [{"content": "hi"}]}, "messages[0].role"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}, "stream"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
      "tools": [{"type": "function", "function": {"name": "has.dot"}}]},
     "tools[0].function.name"),
    ({"model": MODEL, "messages": _call("x" * 41)}, "messages[1].tool_calls[0].id"),
    ({"model": MODEL, "messages": _call("c1")[:2]}, "messages"),  # a call never answered
    ({"model": MODEL, "messages": [*_call("c1")[:2], user({})]}, "messages[2].role"),
    ({"model": MODEL, "messages": [user({}), {"role": "tool", "tool_call_id": "c9",
                                              "content": "done"}]}, "messages[1].tool_call_id"),
    ({"model": MODEL, "messages": [user({"script": [{"args": {}}]})]}, "context.script[0]"),
    ({"model": MODEL, "messages": [user({"model_faults": [{"kind": "418"}]})]},
     "context.model_faults"),
])
async def test_an_invalid_request_is_400_naming_what_is_wrong(
        http: httpx.AsyncClient, body: dict[str, Any], param: str) -> None:
    response = await http.post("/v1/chat/completions", json=body)

    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["message"]


async def test_a_body_that_is_not_json_is_400(http: httpx.AsyncClient) -> None:
    response = await http.post("/v1/chat/completions", content=b"{not json",
                               headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    assert "JSON" in response.json()["error"]["message"]


# --- faults --------------------------------------------------------------------------------------


async def test_a_tasks_faults_are_consumed_in_order(http: httpx.AsyncClient, task: str) -> None:
    faults = [{"kind": "500", "times": 2}, {"kind": "garbage", "step": 2}, {"kind": "503"}]
    conversation = [user({"script": SCRIPT, "model_faults": faults})]

    statuses = [(await chat(http, conversation, task)).status_code for _ in range(4)]
    assert statuses == [500, 500, 503, 200]  # the garbage waits for step 2

    conversation += called("c1", "lookup_invoice", {}, "done: found")
    garbage = await chat(http, conversation, task)
    assert garbage.status_code == 200
    assert garbage.headers["Content-Type"].startswith("text/html")
    assert first_call(await chat(http, conversation, task))[0] == "charge_customer"

    # Another task with the same faults has its own uses.
    assert (await chat(http, conversation[:1], f"{task}-b")).status_code == 500


async def test_a_rate_limit_says_when_to_come_back(http: httpx.AsyncClient, task: str) -> None:
    faults = [{"kind": 429, "retry_after_s": 2.5}, {"kind": "429"}]
    conversation = [user({"script": SCRIPT, "model_faults": faults})]

    limited = await chat(http, conversation, task)
    assert limited.status_code == 429
    assert limited.json()["error"]["code"] == "rate_limit_exceeded"
    assert (limited.headers["retry-after"], limited.headers["retry-after-ms"]) == ("2.5", "2500")
    bare = await chat(http, conversation, task)
    assert bare.status_code == 429
    assert "retry-after" not in bare.headers
    assert (await chat(http, conversation, task)).status_code == 200


async def test_injected_401_and_400_and_a_slow_answer(http: httpx.AsyncClient,
                                                     task: str) -> None:
    faults = [{"kind": "401"}, {"kind": "400"}, {"kind": "slow", "delay_s": 0.01}]
    conversation = [user({"script": SCRIPT, "model_faults": faults})]

    denied = await chat(http, conversation, task)
    assert (denied.status_code, denied.json()["error"]["code"]) == (401, "invalid_api_key")
    assert (await chat(http, conversation, task)).status_code == 400
    assert first_call(await chat(http, conversation, task))[0] == "lookup_invoice"  # slow, then
    assert first_call(await chat(http, conversation, task))[0] == "lookup_invoice"


async def test_global_faults_are_set_shown_and_cleared(http: httpx.AsyncClient, sim: ModelSim,
                                                      task: str) -> None:
    set_ = await http.post("/control/faults", json=[{"kind": "503", "times": 2}])
    assert set_.status_code == 200
    assert set_.json()["faults"][0]["left"] == 2

    conversation = [user({"script": SCRIPT})]
    assert (await chat(http, conversation, task)).status_code == 503
    assert (await chat(http, conversation, f"{task}-b")).status_code == 503  # any task
    assert (await http.get("/control/faults")).json()["faults"][0]["left"] == 0
    assert (await chat(http, conversation, task)).status_code == 200

    await http.post("/control/faults", json={"faults": [{"kind": "500", "times": 5}]})
    assert (await http.delete("/control/faults")).json() == {"faults": []}
    assert (await chat(http, conversation, task)).status_code == 200

    sim.set_faults([{"kind": "garbage"}])
    assert (await chat(http, conversation, task)).headers["Content-Type"].startswith("text/html")


@pytest.mark.parametrize("body", [[{"kind": "teapot"}], [{"kind": "slow", "delay_s": 601}],
                                  [{"kind": "500", "times": 0}], {"rules": []},
                                  [{"kind": "500", "tims": 2}]])
async def test_a_bad_fault_list_is_refused(http: httpx.AsyncClient, sim: ModelSim,
                                           body: Any) -> None:
    response = await http.post("/control/faults", json=body)
    assert response.status_code == 400
    assert "fault" in response.json()["error"]["message"]
    assert sim.faults() == []


# --- counting ------------------------------------------------------------------------------------


async def test_requests_are_counted_per_task_failures_included(
        served: tuple[str, ModelSim], http: httpx.AsyncClient, sim: ModelSim,
        task: str) -> None:
    conversation = [user({"script": SCRIPT, "model_faults": [{"kind": "500"}]})]
    await chat(http, conversation, task)
    await chat(http, conversation, task)
    async with httpx.AsyncClient(base_url=served[0], timeout=HTTP_TIMEOUT_S) as anonymous:
        unauthorized = await anonymous.post(
            "/v1/chat/completions", headers={modelsim.TASK_HEADER: task},
            json={"model": MODEL, "messages": conversation})
    assert unauthorized.status_code == 401
    # Without the header a task is named by its first user message.
    await chat(http, [{"role": "user", "content": "no header"}])
    await chat(http, [{"role": "user", "content": "no header"}])

    counts = (await http.get("/control/requests")).json()
    assert counts["total"] == sim.requests_total == 5
    assert counts["by_task"][task] == sim.requests_of(task) == 3
    [(hashed, n)] = [(k, v) for k, v in counts["by_task"].items() if k != task]
    assert hashed.startswith("prompt-")
    assert n == 2

    assert (await http.post("/control/reset")).json() == {"reset": True}
    assert (await http.get("/control/requests")).json() == {"total": 0, "by_task": {}}


async def test_the_task_map_is_bounded(http: httpx.AsyncClient, sim: ModelSim,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(modelsim, "TASKS_MAX", 2)
    for name in ("t-1", "t-2", "t-1", "t-3"):
        await chat(http, [user({})], name)

    assert sim.requests_total == 4
    assert sim.requests_by_task == {"t-1": 2, "t-3": 1}  # t-2, asked least recently, forgotten


# --- serving -------------------------------------------------------------------------------------


async def test_without_a_key_any_client_is_served() -> None:
    async with serving(api_key=None) as (url, sim), httpx.AsyncClient(
            base_url=url, timeout=HTTP_TIMEOUT_S) as client:
        response = await client.post("/v1/chat/completions",
                                     json={"model": MODEL, "messages": [user({})]})
        assert response.status_code == 200
        assert sim.requests_total == 1


def test_a_simulator_needs_models() -> None:
    with pytest.raises(ValueError, match="models"):
        ModelSim(models=())


async def test_the_process_prints_one_line_and_serves() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "halfway.simulators.modelsim", "--port", "0", "--api-key", KEY,
        "--models", f"{OTHER},model-b", stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), SIM_START_TIMEOUT_S)).decode()
        assert line.startswith("listening on http://127.0.0.1:"), line
        url = line.strip().removeprefix("listening on ")
        client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)
        try:
            models = await client.models.list()
            answer = await client.chat.completions.create(
                model="model-b", messages=[user({"summary": "nothing to do"})])  # type: ignore[list-item]
        finally:
            await client.close()
        assert [m.id for m in models.data] == [OTHER, "model-b"]
        assert answer.choices[0].message.content == "nothing to do"
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), SIM_STOP_TIMEOUT_S)
