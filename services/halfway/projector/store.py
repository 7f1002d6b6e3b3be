"""The read model's storage in PostgreSQL (asyncpg): migrate, write a batch, read it back.

A batch is written in one transaction: the rows of every task it changed, and the journal
offsets it covers (`applied_offsets`). A crash before the commit leaves neither; after it,
both. A task's rows are replaced whole (deleted, then copied in), because a row may disappear
from a fold's view (a step's last check is replaced by a newer one) and because rewriting the
same rows is what makes a redelivered batch harmless.

Writers of one schema fence each other through `applied_offsets`: a batch says which offsets it
expects to be stored (what its writer last read or wrote) and is refused, whole, with
`OffsetConflict` when another writer (a zombie after a rebalance, a rebuild swapped in) has
moved them. The writer then re-reads them and writes again from there.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import math
import re
import urllib.parse
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import asyncpg

from halfway.core.fold import TaskState
from halfway.projector.rows import COLUMNS, PRIMARY_KEYS, TABLES, Row, rows_of

SCHEMA_FILE = Path(__file__).with_name("schema.sql")
# Lower-case identifiers only: a schema name is spliced into SQL text (DDL takes no bind
# parameters), so it must never need quoting, and it must fit PostgreSQL's 63-byte limit.
SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")
SNAPSHOT_KEYS: dict[str, tuple[str, ...]] = {
    **PRIMARY_KEYS, "applied_offsets": ("topic", "partition")}
CONNECT_TIMEOUT_S = 10.0
# A service starting before PostgreSQL waits for it, as services wait for the broker
# (`journal.admin.ensure_topics_once_up`): doubling from the first to the second, forever.
WAIT_S_MIN = 0.5
WAIT_S_MAX = 10.0
# What waiting may mend: nothing listens or answers yet (refused, silent, a name that does not
# resolve yet), or the server is starting, stopping or full. Anything else it said is a refusal.
NOT_UP_YET = (OSError, TimeoutError, asyncpg.CannotConnectNowError,
              asyncpg.TooManyConnectionsError)
ERROR_CHARS_MAX = 300

TopicPartition = tuple[str, int]


class OffsetConflict(Exception):
    """Another writer moved the offsets of this schema: the batch was not written."""

    def __init__(self, stored: dict[TopicPartition, int]) -> None:
        super().__init__(f"applied offsets moved under us: now {stored}")
        self.stored = stored


class Unreachable(ConnectionError):
    """PostgreSQL took no connection. The message says where (never the password) and why;
    `passing` when waiting may mend it, not when it refused us (role, password, database) or
    the DSN cannot be used."""

    def __init__(self, message: str, *, passing: bool) -> None:
        super().__init__(message)
        self.passing = passing


def address(dsn: str) -> str:
    """Where `dsn` points, without its role or password: `host:port/database`."""
    try:
        parts = urllib.parse.urlsplit(dsn)
        return f"{parts.hostname}:{parts.port or 5432}{parts.path}"
    except ValueError:  # a port that is not a number: asyncpg will say so
        return "(the configured address)"


def _unreachable(dsn: str, exc: Exception) -> Unreachable:
    where, why = address(dsn), str(exc)[:ERROR_CHARS_MAX]
    if isinstance(exc, NOT_UP_YET):
        return Unreachable(f"the read model's PostgreSQL at {where} does not answer ({why}): is "
                           "it running (halfway up, or halfway dev)? HALFWAY_PG_DSN or "
                           "HALFWAY_PG_PORT say where", passing=True)
    return Unreachable(f"the read model's PostgreSQL at {where} cannot be used ({why}): "
                       "HALFWAY_PG_DSN says the role, password and database", passing=False)


def checked(schema: str) -> str:
    if SCHEMA_NAME.fullmatch(schema) is None:
        raise ValueError(f"schema name {schema!r} must match {SCHEMA_NAME.pattern}")
    return schema


# What PostgreSQL cannot hold, though the journal can: a NUL character (in text, and as \u0000
# in jsonb) and, in jsonb, a number that is not finite (a foreign writer's NaN; ours write
# null). The read model shows U+FFFD and null instead; the journal keeps the original.
NUL = "\x00"
NUL_SHOWN_AS = "\ufffd"
# What a row's values raise when PostgreSQL refuses one (data exceptions, constraints) or
# asyncpg cannot encode it (an integer out of its column's range): see `_replace_rows`.
UNSTORABLE = (asyncpg.DataError, asyncpg.IntegrityConstraintViolationError, ValueError,
              TypeError, OverflowError)
REASON_CHARS_MAX = 500


def storable_text(value: Any) -> Any:
    """`value`, with any NUL in a string replaced (the same value when it has none)."""
    if type(value) is str and NUL in value:
        return value.replace(NUL, NUL_SHOWN_AS)
    return value


def storable_json(value: Any) -> Any:
    """A JSON value PostgreSQL's jsonb takes: NUL in keys and strings replaced, numbers that
    are not finite as null."""
    if isinstance(value, str):
        return value.replace(NUL, NUL_SHOWN_AS)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k).replace(NUL, NUL_SHOWN_AS): storable_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [storable_json(v) for v in value]
    return value


def _encode_jsonb(value: Any) -> bytes:
    try:
        text = json.dumps(value, separators=(",", ":"), allow_nan=False)
    except ValueError:  # a number that is not finite
        text = json.dumps(storable_json(value), separators=(",", ":"))
    else:
        if "\\u0000" in text:  # a NUL, or (rarely) a backslash followed by "u0000"
            text = json.dumps(storable_json(value), separators=(",", ":"))
    return b"\x01" + text.encode()  # jsonb binary v1


def _decode_jsonb(data: bytes) -> Any:
    return json.loads(data[1:])


async def connect(dsn: str) -> asyncpg.Connection:
    """A connection that reads and writes jsonb as Python values (binary, so COPY works);
    Unreachable, saying where and why, if PostgreSQL takes none."""
    try:
        conn = await asyncpg.connect(dsn, timeout=CONNECT_TIMEOUT_S)
    # ValueError: a DSN asyncpg cannot parse; PostgresError: it answered, and refused.
    except (*NOT_UP_YET, asyncpg.PostgresError, ValueError) as exc:
        raise _unreachable(dsn, exc) from exc
    await conn.set_type_codec("jsonb", encoder=_encode_jsonb, decoder=_decode_jsonb,
                              schema="pg_catalog", format="binary")
    return conn


async def wait_until_up(dsn: str, logger: Any) -> None:
    """Return once PostgreSQL takes a connection, logging each wait (a service started before
    it waits instead of exiting in a loop). A refusal is not waited for: Unreachable."""
    delay_s = WAIT_S_MIN
    while True:
        try:
            conn = await connect(dsn)
        except Unreachable as exc:
            if not exc.passing:
                raise
            logger.warning("waiting for PostgreSQL", at=address(dsn),
                           error=str(exc.__cause__)[:ERROR_CHARS_MAX], retry_in_s=delay_s)
            await asyncio.sleep(delay_s)
            delay_s = min(WAIT_S_MAX, delay_s * 2)
            continue
        await conn.close()
        return


async def migrate(conn: asyncpg.Connection, schema: str) -> None:
    """Create the schema and its tables if missing (schema.sql is idempotent).

    A schema already at this script's version is left alone: `ALTER TABLE ... IF NOT EXISTS`
    still takes an exclusive lock, and a second projector starting while the first writes a
    batch would deadlock against it (the writer holds one table and wants the next).
    """
    script = SCHEMA_FILE.read_text()
    version = hashlib.sha256(script.encode()).hexdigest()
    name = checked(schema)
    async with conn.transaction():
        # Two projectors starting at once would race on CREATE ... IF NOT EXISTS (it is not
        # atomic against a concurrent create); serialise them per schema.
        await conn.execute("select pg_advisory_xact_lock(hashtext($1))", f"migrate {schema}")
        known = await conn.fetchval("select to_regclass($1)", f"{name}.schema_version")
        if known is not None and await conn.fetchval(
                f"select version from {name}.schema_version") == version:
            return
        await conn.execute(script.replace("{schema}", name))
        await conn.execute(f"create table if not exists {name}.schema_version (version text)")
        await conn.execute(f"delete from {name}.schema_version")
        await conn.execute(f"insert into {name}.schema_version values ($1)", version)


async def claim_source(conn: asyncpg.Connection, schema: str, cluster_id: str,
                       topic: str) -> bool:
    """Record which journal the schema's rows come from; False if it holds another's."""
    async with conn.transaction():
        await conn.execute("select pg_advisory_xact_lock(hashtext($1))", f"migrate {schema}")
        row = await conn.fetchrow(
            f"select kafka_cluster_id, topic from {checked(schema)}.journal_source")
        if row is None:
            if await conn.fetchval(f"select count(*) from {checked(schema)}.applied_offsets"):
                return False  # rows of a journal nobody recorded: their offsets mean nothing
            await conn.execute(
                f"insert into {checked(schema)}.journal_source (kafka_cluster_id, topic) "
                "values ($1, $2)", cluster_id, topic)
            return True
        return (row["kafka_cluster_id"], row["topic"]) == (cluster_id, topic)


async def schema_exists(conn: asyncpg.Connection, schema: str) -> bool:
    return bool(await conn.fetchval(
        "select 1 from pg_namespace where nspname = $1", checked(schema)))


async def drop_schema(conn: asyncpg.Connection, schema: str) -> None:
    await conn.execute(f"drop schema if exists {checked(schema)} cascade")


async def read_offsets(conn: asyncpg.Connection, schema: str, topic: str) -> dict[int, int]:
    """partition -> the first offset not yet applied, for every partition with any applied."""
    rows = await conn.fetch(f"select partition, next_offset from {checked(schema)}"
                            ".applied_offsets where topic = $1", topic)
    return {r["partition"]: r["next_offset"] for r in rows}


async def apply_batch(conn: asyncpg.Connection, schema: str, states_changed: Iterable[TaskState],
                      offsets: Mapping[TopicPartition, int], *,
                      expected: Mapping[TopicPartition, int] | None = None,
                      ) -> list[tuple[str, str]]:
    """Write the rows of `states_changed` and set `offsets`, in one transaction. Returns the
    tasks (id, reason) whose rows PostgreSQL refused: each is a placeholder row instead.

    `expected`: the offsets the caller believes are stored (0 where none is); if any differs,
    nothing is written and OffsetConflict carries what is stored.
    """
    schema = checked(schema)
    states = list(states_changed)
    refused: list[tuple[str, str]] = []
    async with conn.transaction():
        if expected is not None:
            await _fence(conn, schema, expected)
        if states:
            refused = await _replace_rows(conn, schema, states)
        if offsets:
            await conn.executemany(
                f"insert into {schema}.applied_offsets (topic, partition, next_offset) "
                "values ($1, $2, $3) on conflict (topic, partition) "
                "do update set next_offset = excluded.next_offset",
                [(topic, partition, offset) for (topic, partition), offset in offsets.items()])
    return refused


async def _fence(conn: asyncpg.Connection, schema: str,
                 expected: Mapping[TopicPartition, int]) -> None:
    # An advisory lock per (schema, topic, partition), taken in a fixed order, serialises the
    # writers of a partition even before its applied_offsets row exists (FOR UPDATE cannot lock
    # a row that is not there yet).
    for topic, partition in sorted(expected):
        await conn.execute("select pg_advisory_xact_lock(hashtext($1), $2)",
                           f"{schema}.applied_offsets/{topic}", partition)
    stored: dict[TopicPartition, int] = {}
    for topic in {t for t, _ in expected}:
        for partition, offset in (await read_offsets(conn, schema, topic)).items():
            stored[(topic, partition)] = offset
    moved = {tp: stored.get(tp, 0) for tp, offset in expected.items()
             if stored.get(tp, 0) != offset}
    if moved:
        raise OffsetConflict(moved)


async def _replace_rows(conn: asyncpg.Connection, schema: str,
                        states: list[TaskState]) -> list[tuple[str, str]]:
    try:
        async with conn.transaction():  # a savepoint: a refusal leaves the batch's usable
            await _replace(conn, schema, states)
        return []
    except UNSTORABLE:
        pass
    # A value PostgreSQL refuses (beyond those `storable_*` mend) must not stop the read
    # model: each task alone, and a task refused is written as a placeholder saying why.
    refused: list[tuple[str, str]] = []
    for state in states:
        try:
            async with conn.transaction():
                await _replace(conn, schema, [state])
        except UNSTORABLE as exc:
            reason = f"{type(exc).__name__}: {exc}"[:REASON_CHARS_MAX]
            refused.append((state.task_id, reason))
            with contextlib.suppress(*UNSTORABLE):  # else its rows stay as they were
                async with conn.transaction():
                    await _replace(conn, schema, [state], refused=reason)
    return refused


async def _replace(conn: asyncpg.Connection, schema: str, states: list[TaskState], *,
                   refused: str | None = None) -> None:
    """Delete the rows of `states`, then write their rows (or, `refused`, placeholders)."""
    rows = [rows_of(state) for state in states]
    task_ids = [state.task_id for state in states]
    # A fold never loses a step, so the steps of the new states cover every old row.
    step_ids = [row["step_id"] for task in rows for row in task["steps"]]
    await conn.execute(f"delete from {schema}.tasks where task_id = any($1::text[])", task_ids)
    for table in ("steps", "attempts", "checks", "compensations"):
        await conn.execute(f"delete from {schema}.{table} where step_id = any($1::text[])",
                           step_ids)
    if refused is not None:
        rows = [placeholder_rows(task, refused) for task in rows]
    for table in TABLES:
        records = [tuple(storable_text(row[c]) for c in COLUMNS[table])
                   for task in rows for row in task[table]]
        if records:
            await conn.copy_records_to_table(table, schema_name=schema,
                                             columns=list(COLUMNS[table]), records=records)


def placeholder_rows(rows: dict[str, list[Row]], reason: str) -> dict[str, list[Row]]:
    """The rows of a task PostgreSQL refused: its task row without the values that may hold
    what was refused, saying why, and no step rows (`halfway replay --task` shows it whole,
    from the journal)."""
    task = rows["tasks"][0] | {
        column: None for column in ("input", "allowed_tools", "not_accepted", "aborted_by",
                                    "aborted_reason", "attention", "model_unavailable")}
    task["summary"] = f"(its rows could not be stored: {reason}; see halfway replay --task)"
    return {table: [task] if table == "tasks" else [] for table in TABLES}


async def snapshot(conn: asyncpg.Connection, schema: str) -> dict[str, list[Row]]:
    """Every row of every table, sorted by primary key: for comparing two copies."""
    schema = checked(schema)
    out = {}
    for table, key in SNAPSHOT_KEYS.items():
        rows = [dict(r) for r in await conn.fetch(f"select * from {schema}.{table}")]
        # Sorted here, not by ORDER BY: the database's collation need not be code-point order,
        # and snapshots are compared with rows sorted in Python (rows.table_rows).
        rows.sort(key=lambda row, key=key: tuple(row[c] for c in key))
        out[table] = rows
    return out


async def swap(conn: asyncpg.Connection, *, live: str, rebuilt: str, old: str) -> None:
    """Make `rebuilt` the live schema in one transaction; the former live one is dropped."""
    live, rebuilt, old = checked(live), checked(rebuilt), checked(old)
    async with conn.transaction():
        if await schema_exists(conn, live):
            # Waits for a running projector's batch to commit; its next batch then finds the
            # rebuilt offsets, not its own, and writes again from those (OffsetConflict).
            await conn.execute(f"lock table {live}.applied_offsets in access exclusive mode")
            await conn.execute(f"drop schema if exists {old} cascade")
            await conn.execute(f"alter schema {live} rename to {old}")
        await conn.execute(f"alter schema {rebuilt} rename to {live}")
        await conn.execute(f"drop schema if exists {old} cascade")
