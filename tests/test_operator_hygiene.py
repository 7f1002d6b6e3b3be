"""What an operator's terminal and the API's start-up are given: text from outside shows its
control characters instead of obeying them; a tokens setting that gives no token, or a tokens
file that is not a plain file, stops the API; and the read model's commands say in one line
what is wrong with PostgreSQL or its schema, where a service waits for it as for the broker."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import urllib.parse
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import pytest

from halfway import settings as env
from halfway.api import status as tables
from halfway.api.auth import TokenConfigError, Tokens
from halfway.contract import FinalState, Outcome
from halfway.contract.topics import ALL_TOPICS
from halfway.core.fold import fold
from halfway.journal import JournalWriter, ensure_topics
from halfway.journal.admin import delete_topics
from halfway.projector import store
from halfway.render import printable
from halfway.settings import KafkaSettings
from tests.factories import Stamper
from tests.test_api_hostile import one_line as api_line
from tests.test_api_hostile import run_api
from tests.test_cli_hostile import NO_BROKER, halfway, one_line
from tests.test_startup_errors import logged

# What a terminal obeys: C0 controls (the newline is ours), DEL and C1 (0x9b is CSI).
CONTROLS = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f]")
CLEAR_AND_RETITLE = "all good\x1b[2J\x1b[H\x1b]0;pwned\x07\r\nfake line\x9b31m"
RED_SUBJECT = "invoice:INV-esc\x1b[31mRED"
EVIDENCE = {"charge_id": "ch_1\x1b[8m", "note": "a\x08b"}
NOTHING_LISTENS_PG = "postgresql://alice:secret@127.0.0.1:9/halfway"
RUN_WAIT_S = 120.0  # a generous bound on a command that reads the journal, as a test timeout


# --- 1. text from outside, as a terminal shows it ------------------------------------------------


def test_printable_shows_every_control_character_and_keeps_lines_and_other_text() -> None:
    assert printable("a\x1b[2J\x07\x9b\x7f\r\tb\nc é ✓") == \
        "a\\x1b[2J\\x07\\x9b\\x7f\\x0d\\x09b\nc é ✓"
    assert printable(printable("\x1b")) == "\\x1b"  # twice is once


def hostile_task(task_id: str) -> dict[str, object]:
    """A read model's task (as `queries.get_task` returns it) whose every text holds controls."""
    now = datetime(2026, 12, 2, 9, 0, tzinfo=UTC)
    step = {"n": 1, "tool": "charge_customer", "subject": RED_SUBJECT, "key": f"{task_id}:1",
            "status": "done", "attempts": 1, "evidence": EVIDENCE, "next_check_at": None,
            "waiting": "a subject\x1b[H held", "contradictions": 0,
            "compensation": {"status": "not_done", "key": f"{task_id}:1:undo",
                             "reason": "refused\r\nfake: done"}}
    return {"task_id": task_id, "state": "failed", "started_at": now, "updated_at": now,
            "finished_at": None, "aborted_by": "api:ops\x1b]0;x\x07",
            "aborted_reason": "stop\nnow", "summary": CLEAR_AND_RETITLE,
            "attention": "look\x1b[5m", "model_unavailable": "HTTP 500\x1b[2K",
            "not_accepted": [{"type": "step.settled", "step_id": f"{task_id}:1",
                              "tool": "x", "reason": "no\x9b2J"}],
            "steps": [step]}


def test_status_and_tasks_tables_show_controls_and_keep_their_lines() -> None:
    task = hostile_task("t-esc")
    text = tables.status_table(task)
    assert CONTROLS.search(text) is None, repr(text)
    assert "summary: all good\\x1b[2J\\x1b[H\\x1b]0;pwned\\x07 fake line\\x9b31m" in text
    assert "invoice:INV-esc\\x1b[31mRED" in text
    assert "charge_id=ch_1\\x1b[8m" in text
    # Each line is one the table made: a newline in the data starts none (no "fake" line).
    assert not [line for line in text.splitlines() if line.startswith(("fake", "now"))], text
    rows = [{**task, "step_counts": {"done": 1, "not_done": 0, "unknown": 0},
             "task_id": "t\x1b[2Jx"}]
    assert CONTROLS.search(tables.tasks_table(rows)) is None


def test_a_table_lines_up_as_shown_when_a_cell_holds_controls() -> None:
    text = tables.table(["A", "B"], [["\x1b[31mRED", "x"], ["plain", "y"]])
    # Measured as shown: the escape's four characters pad the column, not the one ESC.
    assert text.splitlines()[1:] == ["\\x1b[31mRED  x", "plain        y"], text


def test_json_for_a_terminal_escapes_c1_and_keeps_every_value() -> None:
    task = hostile_task("t-json")
    text = tables.as_json(tables.task_json(task))
    assert CONTROLS.search(text.replace("\n", "")) is None, repr(text)
    back = json.loads(text)
    assert back["summary"] == CLEAR_AND_RETITLE
    assert back["steps"][0]["subject"] == RED_SUBJECT


@pytest.fixture
async def own_journal(kafka_settings: KafkaSettings) -> AsyncIterator[KafkaSettings]:
    settings = kafka_settings.with_prefix(f"hyg-{uuid.uuid4().hex[:8]}.")
    await ensure_topics(settings, ALL_TOPICS)
    yield settings
    await delete_topics(settings, ALL_TOPICS)


def hostile_history(task_id: str) -> list[object]:
    s = Stamper(task_id)
    finished = s.finished(FinalState.SUCCEEDED).model_copy(
        update={"summary": CLEAR_AND_RETITLE})
    return [s.requested(), s.started(), s.intended(1, subject=RED_SUBJECT),
            s.attempted(1, 1), s.settled(1, Outcome.DONE, attempt=1, evidence=EVIDENCE),
            finished]


async def run(*args: str, env_: dict[str, str]) -> tuple[int, str, str]:
    """`halfway ARGS` with this environment over ours: (exit code, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "halfway", *args, env=dict(os.environ) | env_,
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), RUN_WAIT_S)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@pytest.mark.broker
async def test_status_of_a_task_whose_text_holds_controls_prints_none(
        pg: asyncpg.Connection, schema: str) -> None:
    await store.migrate(pg, schema)
    await store.apply_batch(pg, schema, [fold(hostile_history("t-esc"))], {})
    for args in (("status", "t-esc"), ("status", "t-esc", "--json")):
        code, out, err = await run(*args, env_={"HALFWAY_PG_SCHEMA": schema})
        assert code == 0, err
        assert CONTROLS.search(out.replace("\n", "")) is None, repr(out)
        assert "\\x1b[31mRED" in out or "\\u001b[31mRED" in out, out


@pytest.mark.broker
async def test_replay_of_a_task_whose_text_holds_controls_prints_none(
        own_journal: KafkaSettings) -> None:
    async with JournalWriter(own_journal) as writer:
        for event in hostile_history("t-esc"):
            await writer.append(event)
    code, out, err = await run("replay", "--task", "t-esc",
                               env_={"HALFWAY_TOPIC_PREFIX": own_journal.topic_prefix})
    assert code == 0, err
    assert CONTROLS.search(out.replace("\n", "")) is None, repr(out)
    assert "invoice:INV-esc\\x1b[31mRED" in out, out


# --- 2, 3. tokens: a source that is set gives a token, read from a plain file with a bound -------


@pytest.mark.parametrize(("name", "text"), [
    ("tokens.jsonl", "# the operators, one day\n\n"),
    ("tokens.jsonl", ""),
    ("tokens.toml", "# no [[token]] tables yet\n"),
])
def test_a_tokens_file_that_gives_no_token_is_refused_naming_it(
        tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(TokenConfigError, match=f"{re.escape(str(path))} gives no token"):
        Tokens.load("", str(path))


def test_a_short_form_that_is_set_but_gives_no_token_is_refused_and_unset_is_open() -> None:
    with pytest.raises(TokenConfigError, match="HALFWAY_API_TOKENS is set but gives no token"):
        Tokens.load(" , ")
    assert not Tokens.load("").configured  # unset (or empty): read-only, as documented


def test_a_tokens_file_that_is_a_device_is_refused(tmp_path: Path) -> None:
    # /dev/null: its size says 0 as /dev/zero's does (which would be read without end).
    with pytest.raises(TokenConfigError, match="/dev/null is not a regular file"):
        Tokens.load("", "/dev/null")


def test_a_tokens_file_that_is_not_utf8_names_the_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "tokens.jsonl"
    path.write_bytes(b"# ok\n{\"name\": \"\xff\"}\n")
    with pytest.raises(TokenConfigError, match=re.escape(f"{path} line 2: not UTF-8 (byte 11")):
        Tokens.load("", str(path))


async def test_the_api_refuses_to_start_with_a_tokens_file_of_comments(tmp_path: Path) -> None:
    path = tmp_path / "tokens.jsonl"
    path.write_text("# nobody yet\n")
    code, out, err = await run_api(HALFWAY_API_TOKENS="", HALFWAY_API_TOKENS_FILE=str(path))
    assert (code, "listening" in out) == (2, False), (out, err)
    assert api_line(err).startswith(f"halfway api: HALFWAY_API_TOKENS_FILE: {path} gives no")


async def test_the_api_refuses_a_fifo_at_once_instead_of_waiting_for_a_writer(
        tmp_path: Path) -> None:
    fifo = tmp_path / "tokens.jsonl"
    os.mkfifo(fifo)
    code, out, err = await run_api(HALFWAY_API_TOKENS="", HALFWAY_API_TOKENS_FILE=str(fifo))
    assert (code, "listening" in out) == (2, False), (out, err)
    assert api_line(err) == f"halfway api: HALFWAY_API_TOKENS_FILE: {fifo} is not a regular file"


# --- 4. the read model's commands: one line for PostgreSQL down or a schema name it cannot use ---


@pytest.mark.parametrize("args", [("status", "t-1"), ("tasks",), ("replay", "--rebuild"),
                                  ("replay", "--rebuild", "--check"), ("run", "projector")])
async def test_a_schema_name_it_cannot_use_is_one_line_naming_the_variable(
        args: tuple[str, ...]) -> None:
    code, err = await halfway(*args, env={**NO_BROKER, "HALFWAY_PG_SCHEMA": "Bad"})
    one_line(code, err, "halfway: HALFWAY_PG_SCHEMA='Bad' cannot be used")


async def test_a_schema_name_that_leaves_no_room_for_a_rebuild_is_refused_before_it() -> None:
    code, err = await halfway("replay", "--rebuild",
                              env={**NO_BROKER, "HALFWAY_PG_SCHEMA": "a" * 60})
    one_line(code, err, f"'{'a' * 60}_rebuild' must match")


@pytest.mark.parametrize("check", [(), ("--check",)])
async def test_a_rebuild_with_postgresql_down_is_one_line_saying_where(
        check: tuple[str, ...]) -> None:
    code, err = await halfway("replay", "--rebuild", *check,
                              env={**NO_BROKER, "HALFWAY_PG_DSN": NOTHING_LISTENS_PG})
    one_line(code, err, "PostgreSQL at 127.0.0.1:9/halfway does not answer", exit_code=1)
    assert "secret" not in err


@pytest.mark.broker
async def test_a_role_postgresql_refuses_is_one_line_and_exit_2_not_down(
        kafka_settings: KafkaSettings) -> None:
    ours = urllib.parse.urlsplit(env.pg_dsn())
    role = f"no_such_role_{uuid.uuid4().hex[:6]}"
    dsn = ours._replace(netloc=f"{role}:hunter2@{ours.hostname}:{ours.port}").geturl()
    code, err = await halfway("tasks", env={"HALFWAY_PG_DSN": dsn})
    one_line(code, err, "cannot be used", exit_code=2)
    assert "hunter2" not in err


@pytest.mark.broker
async def test_a_check_with_no_live_read_model_says_so_and_fails(
        own_journal: KafkaSettings, schema: str) -> None:
    code, out, err = await run("replay", "--rebuild", "--check",
                               env_={"HALFWAY_TOPIC_PREFIX": own_journal.topic_prefix,
                                     "HALFWAY_PG_SCHEMA": schema})
    assert code == 1, (out, err)
    assert f"no live schema {schema} to compare with: the read model does not exist" in out


@pytest.mark.broker
async def test_the_projector_waits_for_postgresql_and_stops_on_sigterm_meanwhile(
        own_journal: KafkaSettings) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "halfway", "run", "projector",
        env=dict(os.environ) | {"HALFWAY_TOPIC_PREFIX": own_journal.topic_prefix,
                                "HALFWAY_PG_DSN": NOTHING_LISTENS_PG,
                                "HALFWAY_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1"},
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE)
    try:
        waited = await logged(proc, "waiting for PostgreSQL")
        assert "secret" not in waited, waited
        assert "Traceback" not in waited, waited
        proc.send_signal(signal.SIGTERM)
        _, rest = await asyncio.wait_for(proc.communicate(), RUN_WAIT_S)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, rest.decode()
    assert "stopped before serving" in rest.decode()
