"""OpenAIModel, the decider's adapter for OpenAI-compatible endpoints, through the official
`openai` client against modelsim served on the test's own loop.

The histories are built by hand (what `history_of` makes from a journal), so each test says
exactly what the model is shown. The pure parts (`messages_of`, `proposal_of`, `failure_of`)
are tested alone too. Nothing waits by sleeping and nothing asserts on elapsed time.
"""

from __future__ import annotations

import email.utils
import json
import socket
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx2
import openai
import pytest
from openai.types.chat import ChatCompletion

from halfway.models import (
    CallView,
    History,
    ModelUnavailable,
    ProposeCall,
    ProposeFinish,
    RefusalView,
    StepView,
    ToolInfo,
    Usage,
)
from halfway.models.openai_chat import (
    ALSO_MAX,
    CONTEXT_MARKER,
    HARNESS_RULES,
    NOT_RUN,
    RETRY_AFTER_S_MAX,
    SUMMARY_CHARS_MAX,
    OpenAIModel,
    call_id_of,
    failure_of,
    messages_of,
    proposal_of,
    retry_after_of,
    tools_of,
)
from halfway.simulators.modelsim import ModelSim, serving

KEY = "sk-test-openai-model-0123456789abcdef"
MODEL = "gpt-4o-mini"
TIMEOUT_S = 30.0  # questions that should be answered

TOOLS = [
    ToolInfo("lookup_invoice", "Look up an invoice.",
             {"type": "object", "properties": {"invoice": {"type": "string"}},
              "required": ["invoice"]}),
    ToolInfo("charge_customer", "Charge a customer for an invoice.",
             {"type": "object", "properties": {"invoice": {"type": "string"},
                                               "amount_cents": {"type": "integer"}}}),
]
SCRIPT = [
    {"tool": "lookup_invoice", "args": {"invoice": "INV-1"}},
    {"tool": "charge_customer", "args": {"invoice": "INV-1", "amount_cents": 4900}},
]


@pytest.fixture(scope="module")
async def served() -> AsyncIterator[tuple[str, ModelSim]]:
    async with serving(api_key=KEY, models=(MODEL,)) as pair:
        yield pair


@pytest.fixture
def sim(served: tuple[str, ModelSim]) -> ModelSim:
    served[1].reset()
    return served[1]


@pytest.fixture
async def client(sim: ModelSim) -> AsyncIterator[openai.AsyncOpenAI]:
    c = openai.AsyncOpenAI(base_url=sim.openai_base_url, api_key=KEY, max_retries=0)
    yield c
    await c.close()


@pytest.fixture
def model(client: openai.AsyncOpenAI) -> OpenAIModel:
    return OpenAIModel(MODEL, client=client, timeout_s=TIMEOUT_S)


@pytest.fixture
def task() -> str:
    return f"task-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def free_port() -> Iterator[int]:
    """A port that refuses connections: bound, never listening, held for the whole test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


def history(task: str, input: dict[str, Any], turns: list[StepView | RefusalView] | None = None,
            tools: list[ToolInfo] | None = None, instructions: str = "") -> History:
    turns = turns or []
    steps = [t for t in turns if isinstance(t, StepView)]
    return History(task_id=task, n=len(steps) + 1, input=input,
                   tools=TOOLS if tools is None else tools, steps=steps,
                   instructions=instructions, turns=turns)


def done(task: str, n: int, tool: str, args: dict[str, Any],
         also: tuple[CallView, ...] = ()) -> StepView:
    return StepView(n, tool, args, "done", f"done: {tool} (reference k{n}); evidence id=x{n}",
                    step_id=f"{task}:{n}", also=also)


async def unavailable(model: OpenAIModel, h: History) -> ModelUnavailable:
    with pytest.raises(ModelUnavailable) as caught:
        await model.decide(h)
    return caught.value


# --- following a script --------------------------------------------------------------------------


async def test_a_script_is_followed_step_by_step(model: OpenAIModel, sim: ModelSim) -> None:
    # A task id as long as allowed: its step ids are longer than a call id may be.
    task = f"renewal-{uuid.uuid4().hex}"[:48]
    script = [*SCRIPT, {"tool": "lookup_invoice", "args": {"invoice": "INV-2"}}]
    input = {"prompt": "Renew INV-1.", "script": script, "summary": "INV-1 renewed."}
    turns: list[StepView | RefusalView] = []

    first = await model.decide(history(task, input, turns))
    assert first == ProposeCall("lookup_invoice", {"invoice": "INV-1"}, usage=first.usage)
    turns.append(done(task, 1, "lookup_invoice", {"invoice": "INV-1"}))

    second = await model.decide(history(task, input, turns))
    assert isinstance(second, ProposeCall)
    assert (second.tool, second.args) == ("charge_customer", {"invoice": "INV-1",
                                                              "amount_cents": 4900})
    # The harness refused it (in words that do not start with "refused"): asked again, the
    # model proposes the same step, not the next one.
    turns.append(RefusalView(2, f"{task}:2/refused-1", "charge_customer", second.args,
                             "a compensable step must come first"))
    again = await model.decide(history(task, input, turns))
    assert isinstance(again, ProposeCall)
    assert again.tool == "charge_customer"
    turns.append(StepView(2, "charge_customer", again.args, "unknown",
                          "unknown, being checked: charge_customer; no reply; do not start "
                          "another one", step_id=f"{task}:2"))

    third = await model.decide(history(task, input, turns))
    assert isinstance(third, ProposeCall)
    assert third.args == {"invoice": "INV-2"}
    turns.append(done(task, 3, "lookup_invoice", third.args))

    finish = await model.decide(history(task, input, turns))
    assert isinstance(finish, ProposeFinish)
    assert finish.summary == "INV-1 renewed."
    assert sim.requests_of(task) == 5  # the task header names every question


async def test_usage_is_mapped(model: OpenAIModel, task: str) -> None:
    input = {"prompt": "Renew INV-1.", "script": SCRIPT}
    short = await model.decide(history(task, input))
    longer = await model.decide(history(task, input, [done(task, 1, "lookup_invoice", {})]))

    assert short.usage is not None
    assert longer.usage is not None
    assert short.usage.input_tokens >= 1
    assert short.usage.output_tokens >= 1
    assert longer.usage.input_tokens > short.usage.input_tokens


async def test_parallel_calls_go_to_also(model: OpenAIModel, task: str) -> None:
    script = [{"tool": "lookup_invoice", "args": {"invoice": "INV-1"},
               "parallel": [{"tool": "charge_customer", "args": {"amount_cents": 1}},
                            {"tool": "lookup_invoice", "args": {"invoice": "INV-2"}}]}]
    proposal = await model.decide(history(task, {"script": script}))

    assert isinstance(proposal, ProposeCall)
    assert (proposal.tool, proposal.args) == ("lookup_invoice", {"invoice": "INV-1"})
    assert proposal.also == (("charge_customer", {"amount_cents": 1}),
                             ("lookup_invoice", {"invoice": "INV-2"}))

    # Journaled with the step, the further calls are answered as not run, and the endpoint
    # accepts the conversation (every call answered, every id short enough).
    also = tuple(CallView(f"{task}:1/also-{i + 1}", tool, args)
                 for i, (tool, args) in enumerate(proposal.also))
    step = done(task, 1, "lookup_invoice", proposal.args, also)
    assert isinstance(await model.decide(history(task, {"script": script}, [step])),
                      ProposeFinish)


async def test_malformed_arguments_are_reported_then_corrected(model: OpenAIModel,
                                                               task: str) -> None:
    script = [{"tool": "charge_customer", "args": {"amount_cents": 4900}, "malformed": True}]
    proposal = await model.decide(history(task, {"script": script}))

    assert isinstance(proposal, ProposeCall)
    assert (proposal.tool, proposal.args) == ("charge_customer", {})
    assert proposal.malformed is not None
    assert proposal.malformed.startswith("the arguments of charge_customer are not a JSON object")

    refusal = RefusalView(1, f"{task}:1/refused-1", "charge_customer", {}, proposal.malformed)
    corrected = await model.decide(history(task, {"script": script}, [refusal]))
    assert isinstance(corrected, ProposeCall)
    assert corrected.args == {"amount_cents": 4900}
    assert corrected.malformed is None


async def test_a_question_without_tools_sends_no_tool_options(model: OpenAIModel,
                                                              task: str) -> None:
    # modelsim, like OpenAI, refuses `parallel_tool_calls` without `tools` with a 400.
    finish = await model.decide(history(task, {"prompt": "Say hi."}, tools=[]))
    assert isinstance(finish, ProposeFinish)
    assert finish.summary == "done"


async def test_questions_are_counted_per_task(model: OpenAIModel, sim: ModelSim,
                                              task: str) -> None:
    other = f"{task}-other"
    faulty = {"script": SCRIPT, "model_faults": [{"kind": "500"}]}
    await unavailable(model, history(task, faulty))
    await model.decide(history(task, faulty))
    await model.decide(history(other, {"script": SCRIPT}))

    assert sim.requests_by_task == {task: 2, other: 1}
    assert sim.requests_total == 3


# --- the conversation ----------------------------------------------------------------------------


def test_the_conversation_is_the_journal() -> None:
    task = "t-1"
    also = (CallView("t-1:1/also-1", "charge_customer", {"amount_cents": 1}),)
    turns: list[StepView | RefusalView] = [
        done(task, 1, "lookup_invoice", {"invoice": "INV-1"}, also),
        RefusalView(2, "t-1:2/refused-1", "charge_customer", {"amount_cents": "x"},
                    "refused: arguments for charge_customer are invalid"),
        RefusalView(2, "t-1:2/refused-2", "charge_customer", {}, "held by another step"),
    ]
    h = history(task, {"prompt": "Renew INV-1.", "customer": "cus_1", "amount": 4900}, turns,
                instructions="You renew subscriptions.")

    messages = messages_of(h)

    system, user = messages[0], messages[1]
    assert system["role"] == "system"
    assert system["content"].startswith("You renew subscriptions.")
    assert HARNESS_RULES in system["content"]
    assert "do not start another one" in system["content"]
    assert user == {"role": "user", "content": "Renew INV-1.\n\nContext (JSON):\n"
                                               '{"amount": 4900, "customer": "cus_1"}'}
    assert messages[2] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "t-1:1", "type": "function",
         "function": {"name": "lookup_invoice", "arguments": '{"invoice":"INV-1"}'}},
        {"id": "t-1:1/also-1", "type": "function",
         "function": {"name": "charge_customer", "arguments": '{"amount_cents":1}'}}]}
    assert messages[3] == {"role": "tool", "tool_call_id": "t-1:1",
                           "content": "done: lookup_invoice (reference k1); evidence id=x1"}
    assert messages[4] == {"role": "tool", "tool_call_id": "t-1:1/also-1", "content": NOT_RUN}
    assert messages[5]["tool_calls"][0]["id"] == "t-1:2/refused-1"
    assert messages[6] == {"role": "tool", "tool_call_id": "t-1:2/refused-1",
                           "content": "refused: arguments for charge_customer are invalid"}
    assert messages[8] == {"role": "tool", "tool_call_id": "t-1:2/refused-2",
                           "content": "refused: held by another step"}
    assert len(messages) == 9


def test_the_context_is_sent_without_a_prompt() -> None:
    only_context = messages_of(history("t-1", {"script": []}))[1]["content"]
    assert only_context == f'{CONTEXT_MARKER}\n{{"script": []}}'
    only_prompt = messages_of(history("t-1", {"prompt": "Hi."}))[1]["content"]
    assert only_prompt == "Hi."
    assert messages_of(history("t-1", {}))[1]["content"]  # never an empty message


def test_long_call_ids_are_shortened_stably() -> None:
    long = f"{'t' * 48}:12/also-3"
    assert call_id_of("t-1:1") == "t-1:1"
    assert len(call_id_of(long)) == 40
    assert call_id_of(long) == call_id_of(long)
    assert call_id_of(long) != call_id_of(long.replace("also-3", "also-4"))


def test_tools_are_built_once_per_list(model: OpenAIModel) -> None:
    built = model.tools_for(TOOLS)
    assert built == tools_of(TOOLS)
    assert built[0] == {"type": "function", "function": {
        "name": "lookup_invoice", "description": "Look up an invoice.",
        "parameters": TOOLS[0].args_schema}}
    assert model.tools_for(list(TOOLS)) is built  # the same ToolInfo objects, another list
    copies = [ToolInfo(t.name, t.description, dict(t.args_schema)) for t in TOOLS]
    assert model.tools_for(copies) is not built
    assert model.tools_for(TOOLS[:1]) == built[:1]


# --- failures, through the endpoint --------------------------------------------------------------


async def test_a_wrong_key_is_permanent(sim: ModelSim, task: str) -> None:
    wrong = "sk-wrong-key-abcdefghijklmnop"
    client = openai.AsyncOpenAI(base_url=sim.openai_base_url, api_key=wrong, max_retries=0)
    async with OpenAIModel(MODEL, client=client, timeout_s=TIMEOUT_S) as model:
        failure = await unavailable(model, history(task, {"script": SCRIPT}))
    await client.close()

    assert (failure.transient, failure.status) == (False, 401)
    assert failure.error.startswith("HTTP 401 invalid_api_key: Incorrect API key provided")
    assert wrong not in failure.error


async def test_an_unknown_model_is_permanent(client: openai.AsyncOpenAI, task: str) -> None:
    model = OpenAIModel("gpt-nope", client=client, timeout_s=TIMEOUT_S)
    failure = await unavailable(model, history(task, {"script": SCRIPT}))

    assert (failure.transient, failure.status) == (False, 404)
    assert "model_not_found" in failure.error


@pytest.mark.parametrize(("kind", "status", "transient"), [
    ("500", 500, True), ("503", 503, True), ("400", 400, False), ("401", 401, False)])
async def test_an_injected_status_is_mapped(model: OpenAIModel, task: str, kind: str,
                                            status: int, transient: bool) -> None:
    failure = await unavailable(model, history(task, {"script": SCRIPT,
                                                      "model_faults": [{"kind": kind}]}))
    assert (failure.status, failure.transient) == (status, transient)
    assert failure.error.startswith(f"HTTP {status}")
    assert failure.retry_after_s is None


async def test_a_rate_limit_is_transient_with_retry_after(model: OpenAIModel,
                                                          task: str) -> None:
    input = {"script": SCRIPT, "model_faults": [{"kind": "429", "retry_after_s": 2.5}]}
    failure = await unavailable(model, history(task, input))

    assert (failure.transient, failure.status, failure.retry_after_s) == (True, 429, 2.5)
    assert "rate_limit_exceeded" in failure.error
    assert isinstance(await model.decide(history(task, input)), ProposeCall)  # asked again


async def test_a_slow_answer_past_the_timeout_is_transient(client: openai.AsyncOpenAI,
                                                           task: str) -> None:
    model = OpenAIModel(MODEL, client=client, timeout_s=0.5)
    input = {"script": SCRIPT, "model_faults": [{"kind": "slow", "delay_s": 2}]}
    failure = await unavailable(model, history(task, input))

    assert (failure.transient, failure.status) == (True, None)
    assert failure.error == "no answer within 0.5 s"


async def test_garbage_is_transient(model: OpenAIModel, task: str) -> None:
    input = {"script": SCRIPT, "model_faults": [{"kind": "garbage"}]}
    failure = await unavailable(model, history(task, input))

    assert (failure.transient, failure.status) == (True, None)
    assert "not a chat completion" in failure.error


async def test_a_refused_connection_is_transient(free_port: int, task: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{free_port}/v1", api_key=KEY,
                                max_retries=0)
    async with OpenAIModel(MODEL, client=client, timeout_s=TIMEOUT_S) as model:
        failure = await unavailable(model, history(task, {"prompt": "hi"}))
    await client.close()

    assert (failure.transient, failure.status) == (True, None)
    assert failure.error.startswith("no connection")


# --- the client ----------------------------------------------------------------------------------


def test_a_missing_key_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_ADMIN_KEY", raising=False)
    with pytest.raises(ValueError, match="set OPENAI_API_KEY"):
        OpenAIModel(MODEL)


async def test_the_environment_configures_the_client(monkeypatch: pytest.MonkeyPatch,
                                                     sim: ModelSim, task: str) -> None:
    monkeypatch.setenv("OPENAI_BASE_URL", sim.openai_base_url)
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    model = OpenAIModel(MODEL)
    assert (model.name, model.version) == (MODEL, None)
    assert model.client.max_retries == 0
    try:
        assert isinstance(await model.decide(history(task, {"script": SCRIPT})), ProposeCall)
    finally:
        await model.aclose()
    assert model.client.is_closed()


async def test_aclose_leaves_a_client_passed_in_open(model: OpenAIModel,
                                                     client: openai.AsyncOpenAI) -> None:
    await model.aclose()
    assert not client.is_closed()


# --- the answer, alone ---------------------------------------------------------------------------


def completion(message: dict[str, Any], finish_reason: str = "stop",
               usage: dict[str, int] | None = None) -> ChatCompletion:
    return ChatCompletion.model_validate({
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": MODEL,
        "choices": [{"index": 0, "finish_reason": finish_reason,
                     "message": {"role": "assistant", **message}}],
        **({"usage": usage} if usage else {})})


def tool_call(name: str, arguments: str, i: int = 0) -> dict[str, Any]:
    return {"id": f"call_{i}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def test_a_final_text_is_the_summary() -> None:
    usage = {"prompt_tokens": 12, "completion_tokens": 3, "total_tokens": 15}
    assert proposal_of(completion({"content": "  Renewed.  "}, usage=usage)) == ProposeFinish(
        "Renewed.", Usage(12, 3))
    # Text without a finish reason (some compatible servers): the final answer still.
    unsaid = completion({"content": "Renewed."})
    unsaid.choices[0].finish_reason = None  # type: ignore[assignment]  # as the client reads it
    assert proposal_of(unsaid) == ProposeFinish("Renewed.")
    # No text is no decision: never a task "succeeded" on an answer that holds nothing.
    for empty in ({"content": " "}, {"content": None}, {}):
        with pytest.raises(ModelUnavailable, match="neither a tool call nor a final text"):
            proposal_of(completion(empty))
    long = proposal_of(completion({"content": "x" * 5000}))
    assert isinstance(long, ProposeFinish)
    assert len(long.summary) == SUMMARY_CHARS_MAX


@pytest.mark.parametrize(("arguments", "args", "malformed"), [
    ('{"a": 1}', {"a": 1}, False), ("", {}, False), ("[1, 2]", {}, True),
    ('{"a": 1', {}, True), ('"text"', {}, True)])
def test_arguments_that_are_not_an_object_are_malformed(arguments: str, args: dict[str, Any],
                                                        malformed: bool) -> None:
    proposal = proposal_of(completion({"content": None,
                                       "tool_calls": [tool_call("f", arguments)]},
                                      "tool_calls"))
    assert isinstance(proposal, ProposeCall)
    assert (proposal.tool, proposal.args) == ("f", args)
    assert (proposal.malformed is not None) == malformed
    assert proposal.usage is None


def test_further_calls_are_bounded() -> None:
    calls = [tool_call("first", "{}"), tool_call("bad", "{oops", 1),
             *(tool_call(f"t{i}", json.dumps({"i": i}), i + 2) for i in range(30))]
    proposal = proposal_of(completion({"content": None, "tool_calls": calls}, "tool_calls"))

    assert isinstance(proposal, ProposeCall)
    assert proposal.malformed is None
    assert len(proposal.also) == ALSO_MAX
    assert proposal.also[0] == ("bad", {})
    assert proposal.also[1] == ("t0", {"i": 0})


@pytest.mark.parametrize(("message", "finish_reason", "words"), [
    ({"content": "Renewed and"}, "length", "finish_reason length"),
    ({"content": None}, "content_filter", "finish_reason content_filter"),
    ({"content": None, "refusal": "I can't help with that."}, "stop", "refused"),
    ({"content": None}, "tool_calls", "neither a tool call nor a final text"),
])
def test_an_answer_without_a_decision_is_transient(message: dict[str, Any], finish_reason: str,
                                                   words: str) -> None:
    with pytest.raises(ModelUnavailable, match=words) as caught:
        proposal_of(completion(message, finish_reason))
    assert caught.value.transient


@pytest.mark.parametrize("response", [
    "<html>nginx</html>", None,
    ChatCompletion.model_construct(id="x", choices=[], created=1, model=MODEL,
                                   object="chat.completion")])
def test_no_choices_is_transient(response: Any) -> None:
    with pytest.raises(ModelUnavailable, match="not a chat completion") as caught:
        proposal_of(response)
    assert caught.value.transient


# --- failures, alone -----------------------------------------------------------------------------


def status_error(status: int, headers: dict[str, str] | None = None,
                 body: Any = None) -> openai.APIStatusError:
    request = httpx2.Request("POST", "http://model.test/v1/chat/completions")
    response = httpx2.Response(status, headers=headers or {}, request=request)
    return openai.APIStatusError(f"Error code: {status}", response=response, body=body)


@pytest.mark.parametrize(("status", "transient"), [
    (408, True), (409, True), (429, True), (500, True), (502, True), (529, True),
    (400, False), (401, False), (403, False), (404, False), (418, False), (422, False)])
def test_statuses_are_transient_or_permanent(status: int, transient: bool) -> None:
    failure = failure_of(status_error(status, body={"message": "no", "code": "why"}))
    assert (failure.status, failure.transient) == (status, transient)
    assert failure.error == f"HTTP {status} why: no"


def test_retry_after_is_read_and_bounded() -> None:
    def retry_after(headers: dict[str, str]) -> float | None:
        return failure_of(status_error(429, headers)).retry_after_s

    assert retry_after({"retry-after": "7"}) == 7.0
    assert retry_after({"retry-after-ms": "1500", "retry-after": "7"}) == 1.5
    assert retry_after({"retry-after": "86400"}) == RETRY_AFTER_S_MAX
    assert retry_after({"retry-after": "soon"}) is None
    assert retry_after({}) is None
    assert retry_after({"retry-after": email.utils.formatdate(0, usegmt=True)}) == 0.0  # past
    at = email.utils.formatdate(1_700_000_030, usegmt=True)
    assert retry_after_of({"retry-after": at}, now_s=1_700_000_000) == 30.0


def test_the_key_never_shows_in_an_error() -> None:
    secret = "sk-proj-abcdefghijklmnopqrstuvwxyz"
    failure = failure_of(status_error(401, body={
        "message": f"Incorrect API key provided: {secret}", "code": "invalid_api_key"}),
        secret=secret)
    assert secret not in failure.error
    assert failure.error.startswith("HTTP 401 invalid_api_key: Incorrect API key provided")

    unknown = failure_of(RuntimeError(f"Authorization: Bearer {secret} was refused"))
    assert secret not in unknown.error
    assert unknown.transient


def test_other_failures_are_transient_and_bounded() -> None:
    request = httpx2.Request("POST", "http://model.test/v1/chat/completions")
    timeout = failure_of(openai.APITimeoutError(request), timeout_s=2.5)
    assert (timeout.error, timeout.transient, timeout.status) == ("no answer within 2.5 s",
                                                                  True, None)
    lost = failure_of(openai.APIConnectionError(request=request))
    assert (lost.transient, lost.status) == (True, None)
    huge = failure_of(ValueError("x" * 5000))
    assert huge.transient
    assert len(huge.error) == 1000
