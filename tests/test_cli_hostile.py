"""Hostile input at the command line, the gateway's start and the scripted model: a bad
argument or setting is one line saying what is wrong (exit 2), never a traceback, and nothing
is sent or journaled because of it."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import uuid
from typing import Any

import pytest

from halfway.contract import FinalState, Outcome
from halfway.core.decide import Finish, decide, finish_for
from halfway.core.fold import fold
from halfway.journal import JournalWriter
from halfway.models import ModelUnavailable, ProposeFinish, ScriptedModel, history_of
from halfway.settings import KafkaSettings
from halfway.start import INPUT_DEPTH_MAX, BadInput, task_input
from halfway.webhooks.providers import PAYSIM, ProviderDeclaration, ProviderError, secrets_of
from tests.factories import Stamper

EXIT_WAIT_S = 30.0  # a command that got as far as the broker (there is none) waits longer
# Nothing listens here: a command that tried to send would not finish within EXIT_WAIT_S.
NO_BROKER = {"HALFWAY_KAFKA_BOOTSTRAP": "127.0.0.1:9"}


async def halfway(*args: str | bytes, env: dict[str, str] | None = None,
                  environ: dict[str, str] | None = None) -> tuple[int, str]:
    """`halfway ARGS` (bytes: an argument that is not UTF-8): (exit code, stderr). `env`: over
    this process's environment; `environ`: the whole environment instead."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "halfway", *args,
        env=environ if environ is not None else dict(os.environ) | (env or {}),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        _, err = await asyncio.wait_for(proc.communicate(), EXIT_WAIT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"halfway {args!r} did not exit: it went on") from None
    assert proc.returncode is not None
    return proc.returncode, err.decode(errors="replace")


def one_line(code: int, err: str, words: str, *, exit_code: int = 2) -> None:
    assert code == exit_code, err
    assert "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err
    assert words in err, err


# --- start --input --------------------------------------------------------------------------------


@pytest.mark.parametrize(("given", "words"), [
    ('{"n": ' + "9" * 5000 + "}", "a number of 5000 digits"),
    ('{"a":' * 20000, f"nests more than {INPUT_DEPTH_MAX} levels"),  # past json's recursion
    ('{"a": ' + "[" * 300 + "]" * 300 + "}", f"nests more than {INPUT_DEPTH_MAX} levels"),
    ('{"script": [], "x": NaN}', "NaN, which is not a JSON number"),
    ('{"x": -Infinity}', "-Infinity, which is not a JSON number"),
    ('{"x": 1e999}', "1e999, a number too large"),
    ('{"a": "\\ud800"}', "cannot be journaled"),  # a lone surrogate, escaped
    (b'{"a": "\xff"}', "cannot be journaled"),  # a byte that is not UTF-8
])
async def test_a_bad_input_is_one_line_and_nothing_is_sent(given: str | bytes,
                                                            words: str) -> None:
    code, err = await halfway("start", "t-hostile", "--input", given, env=NO_BROKER)
    one_line(code, err, words)
    assert err.startswith("halfway: --input "), err


def test_an_input_is_kept_exactly_as_given_up_to_its_bounds() -> None:
    given = '{"a": [1.5, -2, true, null, {"b": "\\u00e9"}], "n": ' + "9" * 4300 + "}"
    assert task_input("t-1", given) == {"a": [1.5, -2, True, None, {"b": "é"}],
                                        "n": int("9" * 4300)}
    deepest = INPUT_DEPTH_MAX - 1  # arrays inside the object
    assert task_input("t-1", '{"a": ' + "[" * deepest + "]" * deepest + "}")
    with pytest.raises(BadInput, match="nests more than"):
        task_input("t-1", '{"a": ' + "[" * (deepest + 1) + "]" * (deepest + 1) + "}")
    with pytest.raises(BadInput, match="must be a JSON object"):
        task_input("t-1", "[1]")


@pytest.mark.parametrize(("args", "words"), [
    (["start", "t-1", "--timeout", "5"], "--timeout is how long --follow follows"),
    (["start", "t-1", "--follow", "--timeout", "nan"], "a positive number of seconds"),
    (["start", "t-1", "--follow", "--timeout", "-1"], "a positive number of seconds"),
    (["mcp", "serve", "--wait-s", "nan"], "must be positive numbers of seconds"),
    (["mcp", "serve", "--idle-s", "inf"], "must be positive numbers of seconds"),
])
async def test_a_number_the_command_cannot_use_is_refused_before_anything_runs(
        args: list[str], words: str) -> None:
    code, err = await halfway(*args, env=NO_BROKER)
    one_line(code, err, words)


@pytest.mark.parametrize("args", [["sim", "--port", "99999"], ["tripsim", "--port", "-1"],
                                  ["modelsim", "--port", "70000"],
                                  ["mcp", "serve", "--transport", "http", "--port", "99999"]])
async def test_a_port_out_of_range_is_a_usage_error(args: list[str]) -> None:
    code, err = await halfway(*args, env=NO_BROKER)
    assert code == 2, err  # click's usage error, as for --metrics-port
    assert "Invalid value for '--port'" in err
    assert "Traceback" not in err


# --- abort and resolve --------------------------------------------------------------------------


def operator_env(topics: KafkaSettings) -> dict[str, str]:
    return {"HALFWAY_TOPIC_PREFIX": topics.topic_prefix, "HALFWAY_LOG_FORMAT": "json"}


async def test_abort_refuses_a_blank_or_unkeepable_reason_and_journals_nothing(
        topics: KafkaSettings, writer: JournalWriter) -> None:
    task_id = f"hostile-{uuid.uuid4().hex[:8]}"
    await writer.append(Stamper(task_id).started())
    env = operator_env(topics)
    refused: list[tuple[list[str | bytes], str]] = [
        (["--reason", ""], "refused: the reason must say why"),
        (["--reason", " \t"], "refused: the reason must say why"),
        (["--reason", "x" * 2001], "refused: the reason is 2001 characters; at most 2000"),
        (["--reason", b"\xff"], "refused: it cannot be journaled"),
        (["--reason", "x", "--by", b"al\xffce"], "refused: it cannot be journaled"),
    ]
    for options, words in refused:
        code, err = await halfway("abort", task_id, *options, env=env)
        one_line(code, err, words)
    code, err = await halfway("abort", b"t-\xff", "--reason", "x", env=env)
    one_line(code, err, "is not a task id")
    # Still running: none of the above was journaled.
    code, err = await halfway("abort", task_id, "--reason", "the customer cancelled", env=env)
    assert code == 0, err


async def test_resolve_refuses_a_blank_or_unkeepable_reason_or_evidence(
        topics: KafkaSettings, writer: JournalWriter) -> None:
    s = Stamper(f"hostile-{uuid.uuid4().hex[:8]}")
    for event in (s.started(), s.intended(1)):
        await writer.append(event)
    step = f"{s.task_id}:1"
    env = operator_env(topics)
    refused: list[tuple[list[str | bytes], str]] = [
        (["not_done", "--reason", " "], "refused: the reason must say why"),
        (["done", "--evidence", "charge_id=ch_1", "--reason", ""],
         "refused: the reason must say why"),
        (["not_done", "--reason", b"no \xff"], "refused: it cannot be journaled"),
        (["done", "--evidence", b"charge_id=ch_\xff"], "refused: it cannot be journaled"),
    ]
    for options, words in refused:
        code, err = await halfway("resolve", step, *options, env=env)
        one_line(code, err, words)
    # Still unsettled: none of the above was journaled.
    code, err = await halfway("resolve", step, "not_done", "--reason", "the bank shows none",
                              env=env)
    assert code == 0, err


# --- tasks and replay ---------------------------------------------------------------------------


async def test_tasks_says_what_is_wrong_with_a_limit_or_a_state_once(
        infrastructure: None) -> None:
    code, err = await halfway("tasks", "--limit", "0")
    assert code == 2, err
    assert err == "halfway: limit 0 is outside 1..1000\n"  # the states are for a state
    code, err = await halfway("tasks", "--state", "bogus")
    one_line(code, err, "unknown state 'bogus'")
    assert err.count("needs_attention") == 1, err


async def test_replay_refuses_options_it_would_ignore() -> None:
    code, err = await halfway("replay", "--check", env=NO_BROKER)
    one_line(code, err, "--check compares a rebuilt read model")
    code, err = await halfway("replay", "--rebuild", "--task", "t-1", env=NO_BROKER)
    one_line(code, err, "--task and --json are for the replay without it")


async def test_replay_of_a_task_the_journal_does_not_have_says_so_like_status(
        topics: KafkaSettings) -> None:
    task_id = f"nosuch-{uuid.uuid4().hex[:8]}"
    code, err = await halfway("replay", "--task", task_id, env=operator_env(topics))
    assert code == 1, err  # as `halfway status` of a task the read model does not have
    assert f"no task {task_id} in the journal" in err
    assert "Traceback" not in err


# --- the gateway's start ------------------------------------------------------------------------


async def run_gateway(environ: dict[str, str]) -> tuple[int, str]:
    """`halfway run gateway` with a usable secret and exactly this configuration besides."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("HALFWAY_") or k in ("HALFWAY_HOME",)}
    return await halfway("run", "gateway", environ=base | NO_BROKER | {
        "HALFWAY_PAYSIM_WEBHOOK_SECRET": "whsec_hostile", "HALFWAY_LOG_FORMAT": "json"} | environ)


def plain_line(err: str) -> str:
    """The line for the person who ran it, beside the JSON log lines."""
    [line] = [raw for raw in err.splitlines() if not raw.startswith("{")]
    return line


async def test_the_gateway_names_a_port_in_use_and_the_variable_to_change() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = await run_gateway({"HALFWAY_GATEWAY_PORT": str(port)})
    assert code == 2, err
    assert "Traceback" not in err
    assert plain_line(err) == (f"halfway gateway: cannot listen on 127.0.0.1:{port}: Address "
                               "already in use; set HALFWAY_GATEWAY_PORT to a free port")


async def test_the_gateway_names_a_host_that_does_not_resolve() -> None:
    code, err = await run_gateway({"HALFWAY_GATEWAY_HOST": "not.a.host.invalid",
                                   "HALFWAY_GATEWAY_PORT": "0"})
    assert code == 2, err
    assert "Traceback" not in err
    line = plain_line(err)
    assert line.startswith("halfway gateway: cannot listen on not.a.host.invalid:0: "), line
    assert line.endswith("set HALFWAY_GATEWAY_HOST to an address of this machine"), line


@pytest.mark.parametrize("simulator", ["sim", "tripsim", "modelsim"])
async def test_a_simulator_names_the_option_to_change_when_it_cannot_listen(
        simulator: str) -> None:
    code, err = await halfway(simulator, "--host", "not.a.host.invalid", "--port", "0")
    assert code == 2, err
    assert err.startswith("cannot listen on not.a.host.invalid:0: "), err
    assert err.endswith("set --host to an address of this machine\n"), err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = await halfway(simulator, "--port", str(port))
    assert (code, err) == (2, f"cannot listen on 127.0.0.1:{port}: Address already in use; "
                              "set --port to a free port\n")


async def test_the_gateway_says_a_missing_secret_in_a_plain_line_too() -> None:
    code, err = await run_gateway({"HALFWAY_PAYSIM_WEBHOOK_SECRET": ""})
    assert code == 2, err
    assert plain_line(err).startswith("halfway gateway: no webhook provider to serve")


HOTELS = ProviderDeclaration.model_validate(
    {"name": "hotels", "format": "standardwebhooks", "secret_env": "HOTELS_SECRET",
     "mapping": {"events": {"booking.confirmed": "done"}, "key": "data.metadata.halfway_key",
                 "object_id": "data.id"}})


@pytest.mark.parametrize(("declaration", "secret", "why"), [
    (PAYSIM, "whsec_has space", "it contains whitespace"),
    (PAYSIM, "x" * 5000, "it is longer than"),
    (HOTELS, "whsec_@@", "it is not base64 after its whsec_ prefix"),
    (HOTELS, "whsec_", "it is empty"),
])
def test_an_unusable_secret_is_named_in_a_sentence(declaration: ProviderDeclaration,
                                                    secret: str, why: str) -> None:
    with pytest.raises(ProviderError) as refused:
        secrets_of(declaration, secret, dev=False)
    assert f"secret 1 of 1 for webhook provider {declaration.name} cannot be used: {why}" in \
        str(refused.value)


# --- the scripted model -------------------------------------------------------------------------


@pytest.mark.parametrize("script", [
    "abc", [1], [{"args": {}}], {"tool": "charge_customer"},
    [{"tool": "charge_customer", "args": "amount=1"}],
    [{"tool": "charge_customer", "args": {}, "reask_args": [1]}],
    [{"tool": "charge_customer", "args": {}, "second_ask_delay_s": "soon"}],
])
async def test_a_malformed_script_fails_the_task_at_once_saying_why(script: Any) -> None:
    s = Stamper("script-1")
    started = s.started(input={"script": script})
    with pytest.raises(ModelUnavailable, match=r"input\.script") as raised:
        await ScriptedModel().decide(history_of(fold([started]), 1, []))
    assert raised.value.transient is False
    # The decider journals it as it does a model's 400: the task ends failed, not asked again.
    failed = s.model_failed(1, raised.value.error, status=None, transient=False)
    move = decide(fold([started, failed]), known_tools={"charge_customer"}, requested=False,
                  now=s.now)
    assert isinstance(move, Finish)
    assert move.state is FinalState.FAILED
    assert "input.script" in move.summary


async def test_a_model_that_says_nothing_at_the_end_is_not_taken_to_say_done(
        ) -> None:
    """A finish without words (the scripted model without `input.summary`, a real model's
    empty text) is worded by the decider from the facts: never "done" for a failed task."""
    s = Stamper("script-2")
    step = {"tool": "charge_customer", "args": {"invoice": "INV-2291", "amount_cents": 4900}}
    log = [s.started(input={"script": [step]}), s.intended(1),
           s.settled(1, Outcome.NOT_DONE, reason="card declined")]
    finish = await ScriptedModel().decide(history_of(fold(log), 2, []))
    assert finish == ProposeFinish("")
    assert finish_for(fold(log), " \n") == Finish(
        FinalState.FAILED, "step script-2:1 (charge_customer) was not done: card declined")
    done = [*log[:2], s.settled(1, Outcome.DONE, evidence={"charge_id": "ch_1"})]
    assert finish_for(fold(done), "") == Finish(FinalState.SUCCEEDED, "done")


# --- a broker or a database that does not answer --------------------------------------------------

NOTHING_LISTENS = "127.0.0.1:9"


@pytest.mark.parametrize("args", [
    ("abort", "t-1", "--reason", "the customer cancelled"),
    ("resolve", "t-1:1", "not_done", "--reason", "the bank shows nothing"),
    ("replay", "--task", "t-1"),
])
async def test_a_broker_that_does_not_answer_is_one_line_saying_where(args: tuple[str, ...],
                                                                       ) -> None:
    code, err = await halfway(*args, env={"HALFWAY_KAFKA_BOOTSTRAP": NOTHING_LISTENS})
    assert code == 1, err
    assert "Traceback" not in err, err
    # Above it, aiokafka may log its own attempt: the last line is ours.
    assert f"halfway: no Kafka broker answers at {NOTHING_LISTENS}" in \
        err.strip().splitlines()[-1], err


@pytest.mark.parametrize("args", [("tasks",), ("status", "t-1")])
async def test_a_read_model_that_does_not_answer_is_one_line_saying_where(
        args: tuple[str, ...]) -> None:
    code, err = await halfway(*args, env={
        "HALFWAY_PG_DSN": f"postgresql://alice:secret@{NOTHING_LISTENS}/halfway"})
    one_line(code, err, f"PostgreSQL at {NOTHING_LISTENS}/halfway does not answer",
             exit_code=1)
    assert "secret" not in err  # the DSN's password is never shown
