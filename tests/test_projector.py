"""The projector: rows as a pure function of a fold; the live read model equals a rebuild.

The broker tests each use a topic prefix and PostgreSQL schemas of their own (`t_<hex>`), so
they never touch the live `halfway` schema, and they drop what they made.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from pathlib import Path

import asyncpg
import pytest

from halfway import loops
from halfway import settings as env
from halfway.contract import (
    CompensationPlan,
    Event,
    FinalState,
    Outcome,
    SettlementSource,
    TaskFinished,
)
from halfway.contract.events import TIME_MIN, SagaRole
from halfway.contract.topics import ALL_TOPICS, JOURNAL
from halfway.core.fold import fold
from halfway.journal import JournalWriter, ensure_topics, replay
from halfway.journal.admin import delete_topics
from halfway.journal.records import record_headers, record_key, record_value
from halfway.projector import store
from halfway.projector.rebuild import compare, rebuild
from halfway.projector.rows import COLUMNS, TABLES, rows_of, table_rows
from halfway.projector.service import Projector, journal_end_offsets
from halfway.settings import KafkaSettings
from tests.factories import Stamper
from tests.processes import Proc, kill9, stop

WAIT_S = 90.0  # bound for any wait on the projector (a restart waits out a dead member's session)
POLL_S = 0.02  # applied_offsets can only be polled
WRITERS_MAX = 200  # tasks written concurrently (each task's events in order)


# --- histories -----------------------------------------------------------------------------------


def history(task_id: str, shape: int) -> list[Event]:
    """A task as the services would journal it, in one of six shapes."""
    s = Stamper(task_id)
    match shape % 6:
        case 0:  # done at the first call
            return [s.started(), s.intended(1), s.attempted(1, 1),
                    s.settled(1, Outcome.DONE, attempt=1), s.finished()]
        case 1:  # unknown, checked, then done by a lookup
            return [s.started(), s.intended(1), s.attempted(1, 1),
                    s.settled(1, Outcome.UNKNOWN, attempt=1), s.checked(1),
                    s.settled(1, Outcome.DONE, source=SettlementSource.LOOKUP), s.finished()]
        case 2:  # unknown, and the harness gave up checking: escalated to an operator
            return [s.started(), s.intended(1), s.attempted(1, 1),
                    s.settled(1, Outcome.UNKNOWN, attempt=1), s.checked(1, next_in=None)]
        case 3:  # a saga: step 2 refused, step 1 compensated
            return [s.started(), saga_step(s, 1), s.attempted(1, 1),
                    s.settled(1, Outcome.DONE, attempt=1), s.intended(2), s.attempted(2, 1),
                    s.settled(2, Outcome.NOT_DONE, attempt=1), s.undo_intended(1),
                    s.undo_attempted(1, 1), s.undo_settled(1, Outcome.DONE, attempt=1),
                    s.finished(FinalState.COMPENSATED)]
        case 4:
            return [s.rejected()]
        case _:  # in flight: attempted, no outcome yet
            return [s.started(), s.intended(1), s.attempted(1, 1)]


def saga_step(s: Stamper, n: int) -> Event:
    return s.intended(n, saga_role=SagaRole.COMPENSABLE,
                      compensation=CompensationPlan(tool="refund_charge", args={"charge": "ch_1"}))


def histories(prefix: str, events_total: int) -> list[list[Event]]:
    """Tasks of every shape, `events_total` events in all (the last history cut short: any
    prefix of a history is one too), with redeliveries: every 7th task's last event twice."""
    out: list[list[Event]] = []
    count = 0
    for i in range(events_total):
        if count >= events_total:
            break
        events = history(f"{prefix}-{i}", i)
        if i % 7 == 0:
            events.append(events[-1])  # the same record sent again (same event_id)
        events = events[:events_total - count]
        out.append(events)
        count += len(events)
    return out


async def write_all(writer: JournalWriter, tasks: list[list[Event]]) -> None:
    """Each task's events in order; tasks concurrently (at most WRITERS_MAX at once)."""
    slots = asyncio.Semaphore(WRITERS_MAX)

    async def one(events: list[Event]) -> None:
        async with slots:
            for event in events:
                await writer.append(event)

    await asyncio.gather(*(one(events) for events in tasks))


# --- 1. rows, pure -------------------------------------------------------------------------------


def test_rows_of_a_typical_history() -> None:
    s = Stamper("renewal-1")
    started, step1 = s.started(), saga_step(s, 1)
    attempted1, unknown = s.attempted(1, 1), s.settled(1, Outcome.UNKNOWN, attempt=1)
    check = s.checked(1)
    done = s.settled(1, Outcome.DONE, source=SettlementSource.LOOKUP,
                     evidence={"charge_id": "ch_9"})
    step2, attempted2 = s.intended(2, args={"invoice": "INV-2"}), s.attempted(2, 1)
    unknown2, check2 = s.settled(2, Outcome.UNKNOWN, attempt=1), s.checked(2, next_in=None)
    undo, undo_attempt = s.undo_intended(1), s.undo_attempted(1, 1)
    undo_done = s.undo_settled(1, Outcome.DONE, attempt=1)
    events = [started, step1, attempted1, unknown, check, done, step2, attempted2, unknown2,
              check2, undo, undo_attempt, undo_done]
    rows = rows_of(fold(events))

    for table, table_rows_ in rows.items():
        for row in table_rows_:
            assert tuple(row) == COLUMNS[table]  # exactly the schema's columns, in order
    assert rows["tasks"] == [{
        "task_id": "renewal-1", "status": "running", "final_state": None,
        "needs_attention": True, "input": {"invoice": "INV-2291"},
        "allowed_tools": ["charge_customer"], "summary": None, "steps": 2,
        "started_at": started.at, "finished_at": None, "updated_at": undo_done.at,
        "aborted_by": None, "aborted_reason": None,
        "attention": "step renewal-1:2 (charge_customer, reference renewal-1:2): it is unknown "
                     "and no further check is planned",
        "not_accepted": [], "model_questions": 2, "tokens_in": 0, "tokens_out": 0,
        "model_unavailable": None}]
    first, second = rows["steps"]
    assert first == {
        "step_id": "renewal-1:1", "task_id": "renewal-1", "n": 1, "tool": "charge_customer",
        "args": {"invoice": "INV-2291", "amount_cents": 4900}, "key": "renewal-1:1",
        "subject": "invoice:INV-2291", "effect_class": "keyed", "decided_by": "scripted@1",
        "status": "done", "outcome": "done", "evidence": {"charge_id": "ch_9"}, "reason": None,
        "source": "lookup", "attempts": 1, "unknowns": 1, "checks": 1, "last_check": "nothing",
        "next_check_at": None,  # settled: nobody checks again
        "needs_attention": False, "contradictions": 0, "intended_at": step1.at,
        "settled_at": done.at, "updated_at": done.at, "attention": None, "waiting": None}
    # The escalated step: unknown, and no further check planned.
    assert (second["status"], second["outcome"], second["needs_attention"]) == (
        "unknown", "unknown", True)
    assert (second["next_check_at"], second["reason"], second["settled_at"]) == (
        None, "no reply within 5 s", unknown2.at)
    assert rows["attempts"] == [
        {"step_id": "renewal-1:1", "attempt": 1, "key": "renewal-1:1",
         "started_at": attempted1.started_at},
        {"step_id": "renewal-1:2", "attempt": 1, "key": "renewal-1:2",
         "started_at": attempted2.started_at}]
    assert rows["checks"] == [
        {"event_id": check.event_id, "step_id": "renewal-1:1", "at": check.at,
         "found": "nothing", "next_check_at": check.next_check_at},
        {"event_id": check2.event_id, "step_id": "renewal-1:2", "at": check2.at,
         "found": "nothing", "next_check_at": None}]
    assert rows["compensations"] == [{
        "step_id": "renewal-1:1", "task_id": "renewal-1", "tool": "refund_charge",
        "args": {"charge": "ch_1"}, "key": "renewal-1:1:undo", "status": "done",
        "outcome": "done", "evidence": {"charge_id": "ch_1"}, "reason": None, "attempts": 1,
        "updated_at": undo_done.at, "last_check": None, "next_check_at": None,
        "needs_attention": False}]


def test_rows_of_a_called_off_saga_with_an_undo_being_checked() -> None:
    s = Stamper("trip-1")
    events = [s.started(), saga_step(s, 1), s.attempted(1, 1),
              s.settled(1, Outcome.DONE, attempt=1), s.aborted("the customer cancelled"),
              s.undo_intended(1), s.undo_attempted(1, 1),
              s.undo_settled(1, Outcome.UNKNOWN, attempt=1)]
    check = s.undo_checked(1)
    rows = rows_of(fold([*events, check]))
    (task,) = rows["tasks"]
    assert (task["aborted_by"], task["aborted_reason"]) == ("operator", "the customer cancelled")
    (undo,) = rows["compensations"]
    assert (undo["status"], undo["last_check"], undo["next_check_at"],
            undo["needs_attention"]) == ("unknown", "nothing", check.next_check_at, False)
    escalated = rows_of(fold([*events, s.undo_checked(1, next_in=None)]))["compensations"][0]
    assert (escalated["next_check_at"], escalated["needs_attention"]) == (None, True)
    assert rows["checks"] == []  # undo checks live on the compensation's row

    finished = s.finished(FinalState.COMPENSATED)
    task = rows_of(fold([*events, finished]))["tasks"][0]
    assert (task["status"], task["final_state"], task["summary"]) == (
        "finished", "compensated", "task compensated")
    assert (task["finished_at"], task["updated_at"]) == (finished.at, finished.at)


def test_an_open_step_shows_when_it_is_checked_next() -> None:
    s = Stamper("renewal-2")
    events = [s.started(), s.intended(1), s.attempted(1, 1),
              s.settled(1, Outcome.UNKNOWN, attempt=1), s.checked(1, timedelta(seconds=30))]
    step = rows_of(fold(events))["steps"][0]
    assert step["status"] == "unknown"
    assert step["next_check_at"] == events[-1].next_check_at  # type: ignore[union-attr]
    assert not step["needs_attention"]


def test_a_redelivered_or_duplicate_event_changes_no_row() -> None:
    for shape in range(6):
        events = history(f"task-{shape}", shape)
        before = rows_of(fold(events))
        for event in events:  # every record delivered twice, anywhere in the history
            assert rows_of(fold([*events, event])) == before
        # A zombie's copy of a fact (new id, later time) loses to the first in the log.
        s = Stamper(f"task-{shape}", now=events[-1].at)
        late = [s.started(), s.intended(1, args={"other": 1}), s.attempted(1, 1)]
        if shape == 4:  # rejected: nothing was ever decided
            late = [s.rejected("another reason")]
        if shape in (0, 1, 3):
            late.append(s.settled(1, Outcome.DONE, source=SettlementSource.WEBHOOK))
        for copy in late:
            assert rows_of(fold([*events, copy])) == before, (shape, copy.type)


def test_a_contradiction_is_surfaced_on_the_step() -> None:
    s = Stamper("renewal-3")
    events = [s.started(), s.intended(1), s.attempted(1, 1),
              s.settled(1, Outcome.DONE, attempt=1)]
    refusal = s.settled(1, Outcome.NOT_DONE, source=SettlementSource.WEBHOOK)
    step = rows_of(fold([*events, refusal]))["steps"][0]
    assert (step["status"], step["contradictions"], step["updated_at"]) == (
        "done", 1, refusal.at)



def test_a_task_known_only_by_what_a_writer_called_off_or_withdrew_has_a_row() -> None:
    """A `task.aborted` or `claim.withdrawn` for a task that never started (a mistyped id, by a
    writer of the journal): a row, not an error at every restart of the projector."""
    s = Stamper("never-started-1")
    aborted = s.aborted("a mistyped id")
    task = rows_of(fold([aborted]))["tasks"][0]
    assert (task["aborted_reason"], task["updated_at"]) == ("a mistyped id", aborted.at)
    withdrawn = rows_of(fold([s.withdrawn(1, "c-1")]))["tasks"][0]
    assert withdrawn["updated_at"] == TIME_MIN  # no time the fold keeps: as old as can be

# --- fixtures for the broker tests --------------------------------------------------------------


@pytest.fixture
async def journal(kafka_settings: KafkaSettings) -> AsyncIterator[KafkaSettings]:
    """A journal topic of this test's own (with the prefix's other topics and ACLs: a projector
    process connects as its own principal, which may not create the topics it expects)."""
    settings = kafka_settings.with_prefix(f"proj-{uuid.uuid4().hex[:8]}.")
    await ensure_topics(settings, ALL_TOPICS)
    yield settings
    await delete_topics(settings, ALL_TOPICS)


async def applied(pg: asyncpg.Connection, schema: str, settings: KafkaSettings) -> dict[int, int]:
    if not await store.schema_exists(pg, schema):
        return {}
    try:
        return await store.read_offsets(pg, schema, JOURNAL.name(settings.topic_prefix))
    except (asyncpg.UndefinedTableError, asyncpg.InvalidSchemaNameError):
        return {}  # dropped or being made again (a rebuild) between the check and the read


async def until_applied(pg: asyncpg.Connection, schema: str, settings: KafkaSettings,
                        ends: dict[int, int], alive: Callable[[], str | None]) -> None:
    """Poll applied_offsets until they reach `ends`; `alive` returns why the projector is gone."""
    wanted = {p: e for p, e in ends.items() if e > 0}
    try:
        async with asyncio.timeout(WAIT_S):
            while True:
                now = await applied(pg, schema, settings)
                if all(now.get(p, 0) >= e for p, e in wanted.items()):
                    return
                if (gone := alive()) is not None:
                    raise AssertionError(f"the projector stopped: {gone}")
                await asyncio.sleep(POLL_S)
    except TimeoutError:
        raise AssertionError(f"applied {await applied(pg, schema, settings)} did not reach "
                             f"{ends} within {WAIT_S:g} s") from None


def task_alive(task: asyncio.Task[None]) -> Callable[[], str | None]:
    def why() -> str | None:
        if not task.done():
            return None
        return repr(task.exception()) if not task.cancelled() else "cancelled"
    return why


@contextlib.asynccontextmanager
async def projecting(settings: KafkaSettings, schema: str,
                     projector: Projector | None = None) -> AsyncIterator[asyncio.Task[None]]:
    """A Projector in this process, cancelled on the way out."""
    projector = projector or Projector(settings, env.pg_dsn(), schema=schema)
    task = asyncio.create_task(projector.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def replayed_rows(settings: KafkaSettings) -> dict[str, list[dict]]:
    return table_rows((await replay(settings)).states.values())


async def assert_equals_replay(pg: asyncpg.Connection, schema: str,
                               settings: KafkaSettings) -> None:
    snap = await store.snapshot(pg, schema)
    differences = compare({t: snap[t] for t in TABLES}, await replayed_rows(settings))
    assert not differences, [d.line() for d in differences] + [
        e for d in differences for e in d.examples]
    ends = await journal_end_offsets(settings)
    assert await applied(pg, schema, settings) == {p: e for p, e in ends.items() if e > 0}


# --- 2. live projection equals a replay ---------------------------------------------------------


@pytest.mark.broker
async def test_the_projector_equals_a_replay_row_for_row(
        journal: KafkaSettings, pg: asyncpg.Connection, schema: str) -> None:
    tasks = histories("proj", 400)
    async with JournalWriter(journal) as writer:
        await write_all(writer, tasks[: len(tasks) // 2])  # before it starts: replayed
        async with projecting(journal, schema) as task:
            await write_all(writer, tasks[len(tasks) // 2:])  # while it runs: followed
            ends = await journal_end_offsets(journal)
            assert sum(ends.values()) == 400
            await until_applied(pg, schema, journal, ends, task_alive(task))

    report = await rebuild(journal, env.pg_dsn(), check_only=True, live=schema)
    assert report.equal, "\n".join(report.lines())
    assert (report.events, report.tasks, report.swapped) == (400, len(tasks), False)
    assert not await store.schema_exists(pg, f"{schema}_rebuild")
    await assert_equals_replay(pg, schema, journal)
    snap = await store.snapshot(pg, schema)
    assert len(snap["tasks"]) == len(tasks)
    assert any(row["needs_attention"] for row in snap["steps"])  # the escalated shape
    assert any(row["status"] == "done" for row in snap["compensations"])  # the saga shape


@pytest.mark.broker
async def test_the_commands_exit_code_is_a_checks_answer_and_a_swaps_success(
        journal: KafkaSettings, pg: asyncpg.Connection, schema: str) -> None:
    """`replay --rebuild --check` exits 1 when the live copy differs; `replay --rebuild`
    swaps and exits 0 whatever the old copy held (a live projector lags: a script must not
    read the swap it asked for as a failure)."""
    async with JournalWriter(journal) as writer:
        await write_all(writer, histories("cli", 4))
    assert (await rebuild(journal, env.pg_dsn(), live=schema)).swapped
    await pg.execute(f"DELETE FROM {schema}.tasks WHERE task_id = "  # the live copy lags
                     f"(SELECT min(task_id) FROM {schema}.tasks)")
    environ = dict(os.environ) | {"HALFWAY_TOPIC_PREFIX": journal.topic_prefix,
                                  "HALFWAY_PG_SCHEMA": schema}

    async def replay(*args: str) -> tuple[int, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "halfway", "replay", "--rebuild", *args, env=environ,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT)
        out, _ = await asyncio.wait_for(proc.communicate(), 120)
        assert proc.returncode is not None
        return proc.returncode, out.decode()

    code, out = await replay("--check")
    assert (code, "differs" in out, "not swapped" in out) == (1, True, True), out
    code, out = await replay()
    assert (code, "differs" in out, f"swapped: {schema}_rebuild is now {schema}" in out) == \
        (0, True, True), out
    code, out = await replay("--check")
    assert (code, "equals" in out) == (0, True), out


@pytest.mark.broker
async def test_a_batch_whose_offsets_moved_writes_nothing(
        pg: asyncpg.Connection, schema: str) -> None:
    await store.migrate(pg, schema)
    state = fold(history("fenced", 0))
    await store.apply_batch(pg, schema, [], {("j", 0): 10}, expected={("j", 0): 0})
    with pytest.raises(store.OffsetConflict) as raised:
        await store.apply_batch(pg, schema, [state], {("j", 0): 20}, expected={("j", 0): 5})
    assert raised.value.stored == {("j", 0): 10}
    snap = await store.snapshot(pg, schema)
    assert snap["tasks"] == []
    assert snap["applied_offsets"] == [{"topic": "j", "partition": 0, "next_offset": 10}]
    # Written twice (a redelivered batch): the same rows, once.
    for _ in range(2):
        await store.apply_batch(pg, schema, [state], {("j", 0): 20})
    assert (await store.snapshot(pg, schema))["steps"] == rows_of(state)["steps"]


@pytest.mark.broker
async def test_a_projector_whose_round_is_stuck_stops_with_an_error(
        journal: KafkaSettings, schema: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """PostgreSQL that never answers, or a fetch that never returns: the consumer would go on
    heartbeating and keep the partitions while nothing is projected (aiokafka's own check of
    the poll interval does not fire). The projector stops, for its supervisor to restart."""
    monkeypatch.setattr(loops, "LOOP_WATCH_TICK_S", 0.05)
    monkeypatch.setattr(loops, "LOOP_STALL_S", 0.5)
    projector = Projector(journal, env.pg_dsn(), schema=schema)
    stuck = asyncio.Event()

    async def hold() -> None:  # the first round, and it never returns
        stuck.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(projector, "_round", hold)
    async with asyncio.timeout(WAIT_S):
        with pytest.raises(loops.LoopStalled, match=r"projector's loop has not turned for 0\.5 s"):
            await projector.run()
    assert stuck.is_set()


# --- values PostgreSQL cannot hold ----------------------------------------------------------------


def odd_history(task_id: str) -> list[Event]:
    """NULs where a model, a provider or a caller can put them: PostgreSQL's text and jsonb
    refuse the character, the journal does not."""
    s = Stamper(task_id)
    return [s.started(input={"note": "a\x00b", "k\x00": [1.5]}),
            s.intended(1, args={"invoice": "INV-\x00"}), s.attempted(1, 1),
            s.settled(1, Outcome.DONE, attempt=1, evidence={"charge_id": "ch_\x00nul"}),
            s.intended(2), s.attempted(2, 1),
            s.settled(2, Outcome.NOT_DONE, attempt=1, reason="declined \x00"),
            TaskFinished(**s.stamp(), state=FinalState.FAILED, summary="over \x00")]


async def write_with_a_foreign_nan(writer: JournalWriter, task_id: str) -> None:
    """A task started by a foreign writer whose input holds NaN (ours write null)."""
    started = Stamper(task_id).started(input={"x": 1.5})
    value = record_value(started).replace(b'"x":1.5', b'"x":NaN')
    await writer.append_raw(JOURNAL, value, key=record_key(started),
                            headers=record_headers(started))


@pytest.mark.broker
async def test_values_postgresql_cannot_hold_are_shown_mended_and_the_projector_goes_on(
        journal: KafkaSettings, pg: asyncpg.Connection, schema: str) -> None:
    """Before, the projector stopped at the first NUL, and again at every restart: the read
    model froze for every task."""
    async with JournalWriter(journal) as writer:
        await write_all(writer, [odd_history("odd-1"), history("odd-2", 0)])
        await write_with_a_foreign_nan(writer, "odd-3")
    ends = await journal_end_offsets(journal)
    async with projecting(journal, schema) as task:
        await until_applied(pg, schema, journal, ends, task_alive(task))
    snap = await store.snapshot(pg, schema)
    tasks = {row["task_id"]: row for row in snap["tasks"]}
    assert tasks["odd-1"]["input"] == {"note": "a\ufffdb", "k\ufffd": [1.5]}
    assert tasks["odd-1"]["summary"] == "over \ufffd"
    steps = {row["n"]: row for row in snap["steps"] if row["task_id"] == "odd-1"}
    assert steps[1]["args"]["invoice"] == "INV-\ufffd"
    assert steps[1]["evidence"]["charge_id"] == "ch_\ufffdnul"
    assert steps[2]["reason"] == "declined \ufffd"
    assert tasks["odd-3"]["input"] == {"x": None}
    assert tasks["odd-2"]["status"] == "finished"


@pytest.mark.broker
async def test_a_task_whose_rows_postgresql_refuses_is_a_placeholder_and_the_rest_is_written(
        journal: KafkaSettings, pg: asyncpg.Connection, schema: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever PostgreSQL refuses beyond what is mended (here: text NULs, no longer mended),
    the projector goes on: the task's row says why, its neighbours in the batch are whole."""
    monkeypatch.setattr(store, "storable_text", lambda value: value)
    async with JournalWriter(journal) as writer:
        await write_all(writer, [odd_history("odd-1"), history("fine-1", 0),
                                 history("fine-2", 3)])
    ends = await journal_end_offsets(journal)
    async with projecting(journal, schema) as task:
        await until_applied(pg, schema, journal, ends, task_alive(task))
    snap = await store.snapshot(pg, schema)
    tasks = {row["task_id"]: row for row in snap["tasks"]}
    assert tasks["odd-1"]["summary"].startswith(
        "(its rows could not be stored: CharacterNotInRepertoireError"), tasks["odd-1"]
    assert tasks["odd-1"]["status"] == "finished"
    assert tasks["odd-1"]["input"] is None
    assert not [row for row in snap["steps"] if row["task_id"] == "odd-1"]
    expected = table_rows([fold(history("fine-1", 0)), fold(history("fine-2", 3))])
    for table in TABLES:
        assert [row for row in snap[table] if row.get("task_id", "") != "odd-1"
                and not str(row.get("step_id", "")).startswith("odd-1")] == expected[table]


# --- 3. kill -9 in the middle of a burst ---------------------------------------------------------


async def spawn_projector(settings: KafkaSettings, schema: str, workdir: Path, name: str) -> Proc:
    environ = dict(os.environ) | {
        "HALFWAY_TOPIC_PREFIX": settings.topic_prefix, "HALFWAY_PG_SCHEMA": schema,
        "HALFWAY_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1"}
    if settings.bootstrap != env.kafka_bootstrap():
        environ["HALFWAY_KAFKA_BOOTSTRAP"] = settings.bootstrap
    log_path = workdir / f"{name}.log"
    with log_path.open("ab") as log_file:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "halfway.projector", env=environ,
            stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=log_file)
    return Proc(name, process, log_path)


def proc_alive(proc: Proc) -> Callable[[], str | None]:
    return lambda: None if proc.alive else proc.tail()


async def until(probe: Callable[[], Awaitable[bool]], what: str, alive: Callable[[], str | None],
                ) -> None:
    try:
        async with asyncio.timeout(WAIT_S):
            while not await probe():
                if (gone := alive()) is not None:
                    raise AssertionError(f"the projector stopped before {what}:\n{gone}")
                await asyncio.sleep(POLL_S)
    except TimeoutError:
        raise AssertionError(f"not {what} within {WAIT_S:g} s") from None


@pytest.mark.broker
@pytest.mark.load
async def test_kill_9_in_the_middle_of_a_burst_loses_and_doubles_nothing(
        journal: KafkaSettings, pg: asyncpg.Connection, schema: str, tmp_path: Path) -> None:
    burst = 10_000
    first = await spawn_projector(journal, schema, tmp_path, "projector-1")
    procs = [first]
    try:
        await first.until_logged("stored offsets read", timeout_s=WAIT_S)
        async with JournalWriter(journal) as writer:
            writing = asyncio.create_task(write_all(writer, histories("burst", burst)))

            async def some_applied() -> bool:
                return sum((await applied(pg, schema, journal)).values()) >= burst // 5

            await until(some_applied, "a fifth of the burst was applied", proc_alive(first))
            await kill9(first)
            at_kill = sum((await applied(pg, schema, journal)).values())
            assert 0 < at_kill < burst, f"{at_kill} applied when killed: not mid-burst"

            second = await spawn_projector(journal, schema, tmp_path, "projector-2")
            procs.append(second)
            await asyncio.wait_for(writing, WAIT_S)
        ends = await journal_end_offsets(journal)
        assert sum(ends.values()) == burst
        await until_applied(pg, schema, journal, ends, proc_alive(second))
        await assert_equals_replay(pg, schema, journal)
        assert await stop(second) == 0, second.tail()
    finally:
        for proc in procs:
            if proc.alive:
                await kill9(proc)


# --- 4. rebuild and swap -------------------------------------------------------------------------


@pytest.mark.broker
async def test_rebuild_detects_a_tampered_row_and_swaps_in_the_replay(
        journal: KafkaSettings, pg: asyncpg.Connection, schema: str) -> None:
    tasks = histories("swap", 300)
    async with JournalWriter(journal) as writer:
        await write_all(writer, tasks)
    ends = await journal_end_offsets(journal)
    async with projecting(journal, schema) as task:
        await until_applied(pg, schema, journal, ends, task_alive(task))
    report = await rebuild(journal, env.pg_dsn(), check_only=True, live=schema)
    assert report.equal, "\n".join(report.lines())

    # Tamper with the live copy: one step changed, one task gone.
    step_id = "swap-1:1"  # shape 1: unknown, then done
    await pg.execute(f"update {schema}.steps set status = 'not_done' where step_id = $1", step_id)
    await pg.execute(f"delete from {schema}.tasks where task_id = 'swap-0'")
    report = await rebuild(journal, env.pg_dsn(), check_only=True, live=schema)
    assert not report.equal
    diffs = {d.table: d for d in report.differences}
    assert set(diffs) == {"steps", "tasks"}
    assert (diffs["steps"].changed, diffs["steps"].only_live, diffs["steps"].only_rebuilt) == (
        1, 0, 0)
    assert step_id in diffs["steps"].examples[0]
    assert "not_done" in diffs["steps"].examples[0]
    assert (diffs["tasks"].only_rebuilt, diffs["tasks"].live_rows) == (1, len(tasks) - 1)

    progress: list[tuple[int, int]] = []
    report = await rebuild(journal, env.pg_dsn(), live=schema,
                           progress=lambda done, total: progress.append((done, total)))
    assert report.swapped
    assert not report.equal  # the report says what the swap replaced
    assert progress[-1] == (300, 300)
    assert report.events_per_s > 0
    for gone in (f"{schema}_rebuild", f"{schema}_old"):
        assert not await store.schema_exists(pg, gone)
    await assert_equals_replay(pg, schema, journal)
    assert (await rebuild(journal, env.pg_dsn(), check_only=True, live=schema)).equal


@pytest.mark.broker
async def test_a_projector_running_through_a_swap_goes_on_from_the_rebuilt_copy(
        journal: KafkaSettings, pg: asyncpg.Connection, schema: str) -> None:
    tasks = histories("through", 300)
    async with JournalWriter(journal) as writer:
        await write_all(writer, tasks[:20])
        async with projecting(journal, schema) as task:
            await until_applied(pg, schema, journal, await journal_end_offsets(journal),
                                task_alive(task))
            # The rebuild takes the live copy's place while the projector is idle; then the
            # journal moves on and the projector must write into the new copy.
            report = await rebuild(journal, env.pg_dsn(), live=schema)
            assert report.swapped
            assert report.equal
            # Moved offsets (as a rebuild that lags the projector leaves them): the projector
            # notices and writes again every task changed since.
            async with pg.transaction():  # at once: the projector verifies when idle
                await pg.execute(f"update {schema}.applied_offsets set next_offset = 0")
                await pg.execute(f"delete from {schema}.tasks")
            await write_all(writer, tasks[20:])
            await until_applied(pg, schema, journal, await journal_end_offsets(journal),
                                task_alive(task))
    await assert_equals_replay(pg, schema, journal)


@pytest.mark.broker
async def test_a_rebuild_swapped_in_while_the_projector_writes(
        journal: KafkaSettings, pg: asyncpg.Connection, schema: str) -> None:
    burst = 5000
    async with JournalWriter(journal) as writer, projecting(journal, schema) as task:
        writing = asyncio.create_task(write_all(writer, histories("busy", burst)))

        async def some_applied() -> bool:
            return sum((await applied(pg, schema, journal)).values()) >= burst // 5

        await until(some_applied, "a fifth was applied", task_alive(task))
        report = await rebuild(journal, env.pg_dsn(), live=schema)  # the live copy moves on
        assert report.swapped
        await asyncio.wait_for(writing, WAIT_S)
        await until_applied(pg, schema, journal, await journal_end_offsets(journal),
                            task_alive(task))
    await assert_equals_replay(pg, schema, journal)


@pytest.mark.broker
async def test_two_projectors_share_the_journal_and_one_leaves(
        journal: KafkaSettings, pg: asyncpg.Connection, schema: str) -> None:
    tasks = histories("pair", 1200)
    third = len(tasks) // 3
    one, two = (Projector(journal, env.pg_dsn(), schema=schema) for _ in range(2))

    async def split() -> bool:
        return bool(one.partitions) and bool(two.partitions)

    async with JournalWriter(journal) as writer, projecting(journal, schema, one) as first:
        await write_all(writer, tasks[:third])
        async with projecting(journal, schema, two) as second:
            await until(split, "the partitions were split", task_alive(second))
            assert one.partitions.isdisjoint(two.partitions)
            await write_all(writer, tasks[third:2 * third])
            await until_applied(pg, schema, journal, await journal_end_offsets(journal),
                                task_alive(second))
        # The second left: the first takes its partitions back and replays them.
        await write_all(writer, tasks[2 * third:])
        await until_applied(pg, schema, journal, await journal_end_offsets(journal),
                            task_alive(first))
        assert one.partitions == frozenset(range(JOURNAL.partitions))
    await assert_equals_replay(pg, schema, journal)


async def test_a_read_model_of_another_kafka_cluster_is_dropped_and_rebuilt(
        topics: KafkaSettings, pg: asyncpg.Connection, schema: str, writer: JournalWriter,
) -> None:
    # A new local broker (or a restored backup) under an old read model: the stored offsets
    # belong to another journal and would skip this one's first events.
    s = Stamper(f"source-{uuid.uuid4().hex[:6]}")
    await store.migrate(pg, schema)
    assert await store.claim_source(pg, schema, "another-cluster", "halfway.journal")
    await pg.execute(f"insert into {schema}.applied_offsets values ($1, 0, 1000000)",
                     JOURNAL.name(topics.topic_prefix))
    for event in (s.started(), s.intended(1)):
        await writer.append(event)
    async with projecting(topics, schema) as task:
        await until_applied(pg, schema, topics, await journal_end_offsets(topics),
                            task_alive(task))
        found = await pg.fetchval(f"select count(*) from {schema}.steps where task_id = $1",
                                  s.task_id)
    assert found == 1
    assert not await store.claim_source(pg, schema, "another-cluster", "halfway.journal")
