"""Reads of the read model (PostgreSQL, `projector/schema.sql`): plain dicts, nothing else.

Each task gets one derived `state`, the word operators filter by. Its order matters: a task with
an unknown step is never shown as anything else ("failed" included) until the step is settled,
because that is what a person must know first:
- `needs_attention`: a step is unknown and nobody will check it again, or reports about it
  contradict each other (an operator must resolve);
- `unknown`: a step is unknown and the harness is checking it;
- else the final state (`succeeded`, `failed`, `compensated`), or the status (`requested`,
  `running`, `rejected`).

jsonb columns are read as text and parsed here, so the results do not depend on the type codecs
of the connection that reads them.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from typing import Any

import asyncpg

TASK_STATES = ("needs_attention", "unknown", "requested", "running", "rejected", "succeeded",
               "failed", "compensated")
STEP_STATUSES = ("done", "not_done", "unknown", "in_flight", "intended")
LIMIT_DEFAULT = 100
LIMIT_MAX = 1000
STEPS_MAX = 10_000  # the contract's step numbers stop at 9999
# Per step, the most recent ones; the totals are on the step row (`attempts`, `checks`).
ATTEMPTS_PER_STEP_MAX = 50
CHECKS_PER_STEP_MAX = 20

# Schema names are put into SQL text (they cannot be bind parameters), so only plain ones.
# A connection, or one lent by a pool.
Conn = asyncpg.Connection | asyncpg.pool.PoolConnectionProxy

SCHEMA_PATTERN = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def checked_schema(schema: str) -> str:
    """`schema`, if it is a plain lower-case identifier; ValueError otherwise."""
    if SCHEMA_PATTERN.fullmatch(schema) is None:
        raise ValueError(f"invalid schema name {schema!r}: must match {SCHEMA_PATTERN.pattern}")
    return schema


_STATE = """
    CASE WHEN t.needs_attention THEN 'needs_attention'
         WHEN coalesce(c.unknown, 0) > 0 THEN 'unknown'
         WHEN t.final_state IS NOT NULL THEN t.final_state
         ELSE t.status END
"""

_TASKS = """
SELECT * FROM (
    SELECT t.task_id, {state} AS state, t.status, t.final_state, t.needs_attention, t.summary,
           t.steps AS step_count, t.started_at, t.finished_at, t.updated_at, t.aborted_by,
           t.aborted_reason, t.attention, t.not_accepted::text AS not_accepted,
           t.model_questions, t.tokens_in, t.tokens_out, t.model_unavailable,
           coalesce(c.done, 0) AS done, coalesce(c.not_done, 0) AS not_done,
           coalesce(c.unknown, 0) AS unknown, coalesce(c.in_flight, 0) AS in_flight,
           coalesce(c.intended, 0) AS intended, coalesce(c.contradictions, 0) AS contradictions,
           c.next_check_at {extra}
    FROM {schema}.tasks t
    LEFT JOIN LATERAL (
        SELECT count(*) FILTER (WHERE s.status = 'done') AS done,
               count(*) FILTER (WHERE s.status = 'not_done') AS not_done,
               count(*) FILTER (WHERE s.status = 'unknown') AS unknown,
               count(*) FILTER (WHERE s.status = 'in_flight') AS in_flight,
               count(*) FILTER (WHERE s.status = 'intended') AS intended,
               sum(s.contradictions) AS contradictions,
               min(s.next_check_at) FILTER (WHERE s.status = 'unknown') AS next_check_at
        FROM {schema}.steps s WHERE s.task_id = t.task_id
    ) c ON true
) task
"""

_STEPS = """
SELECT step_id, n, tool, args::text AS args, key, subject, effect_class, decided_by, status,
       outcome, evidence::text AS evidence, reason, source, attempts, unknowns, checks,
       last_check, next_check_at, needs_attention, contradictions, intended_at, settled_at,
       updated_at, attention, waiting
FROM {schema}.steps WHERE task_id = $1 ORDER BY n LIMIT $2
"""

_ATTEMPTS = """
SELECT step_id, attempt, key, started_at FROM (
    SELECT *, row_number() OVER (PARTITION BY step_id ORDER BY attempt DESC) AS recent
    FROM {schema}.attempts WHERE step_id = ANY($1::text[])
) a WHERE recent <= $2 ORDER BY step_id, attempt
"""

_CHECKS = """
SELECT step_id, event_id, at, found, next_check_at FROM (
    SELECT *, row_number() OVER (PARTITION BY step_id ORDER BY at DESC, event_id) AS recent
    FROM {schema}.checks WHERE step_id = ANY($1::text[])
) c WHERE recent <= $2 ORDER BY step_id, at, event_id
"""

_COMPENSATIONS = """
SELECT step_id, tool, args::text AS args, key, status, outcome, evidence::text AS evidence,
       reason, attempts, updated_at, last_check, next_check_at, needs_attention
FROM {schema}.compensations WHERE task_id = $1
"""

# What changes whenever the projector writes: the offsets it applied (same transaction as the
# rows), and the newest row times (rows written by anything else, e.g. a test).
_VERSION = """
SELECT (SELECT coalesce(sum(next_offset), 0) FROM {schema}.applied_offsets) AS offsets,
       (SELECT max(updated_at) FROM {schema}.tasks) AS tasks,
       (SELECT max(updated_at) FROM {schema}.steps) AS steps,
       (SELECT max(updated_at) FROM {schema}.compensations) AS compensations
"""

_JSON_COLUMNS = ("args", "evidence", "input", "allowed_tools", "not_accepted")


def _row(record: asyncpg.Record) -> dict[str, Any]:
    row = dict(record)
    for column in _JSON_COLUMNS:
        if isinstance(row.get(column), str):
            row[column] = json.loads(row[column])
    return row


def _task_row(record: asyncpg.Record) -> dict[str, Any]:
    row = _row(record)
    row["step_counts"] = {status: row.pop(status) for status in STEP_STATUSES}
    return row


async def list_tasks(conn: Conn, schema: str,
                     state: str | None = None, limit: int = LIMIT_DEFAULT,
                     ) -> list[dict[str, Any]]:
    """Tasks, most recently updated first, optionally only those in `state` (TASK_STATES)."""
    if state is not None and state not in TASK_STATES:
        raise ValueError(f"unknown state {state!r}: one of {', '.join(TASK_STATES)}")
    if not 1 <= limit <= LIMIT_MAX:
        raise ValueError(f"limit {limit} is outside 1..{LIMIT_MAX}")
    sql = _TASKS.format(state=_STATE, extra="", schema=checked_schema(schema)) + """
        WHERE ($1::text IS NULL OR task.state = $1) ORDER BY updated_at DESC, task_id LIMIT $2
    """
    return [_task_row(r) for r in await conn.fetch(sql, state, limit)]


async def get_task(conn: Conn, schema: str,
                   task_id: str) -> dict[str, Any] | None:
    """One task with its steps (by n), each with its recent attempts and checks and its
    compensation (or None); None if the read model has no such task."""
    schema = checked_schema(schema)
    extra = ", t.input::text AS input, t.allowed_tools::text AS allowed_tools"
    sql = _TASKS.format(state=_STATE, extra=extra, schema=schema) + " WHERE task.task_id = $1"
    # One snapshot for the five reads, so a projector write in between cannot mix two versions.
    async with conn.transaction(isolation="repeatable_read", readonly=True):
        record = await conn.fetchrow(sql, task_id)
        if record is None:
            return None
        task = _task_row(record)
        steps = [_row(r) for r in await conn.fetch(_STEPS.format(schema=schema), task_id,
                                                    STEPS_MAX)]
        ids = [step["step_id"] for step in steps]
        attempts = await conn.fetch(_ATTEMPTS.format(schema=schema), ids, ATTEMPTS_PER_STEP_MAX)
        checks = await conn.fetch(_CHECKS.format(schema=schema), ids, CHECKS_PER_STEP_MAX)
        undo = {r["step_id"]: _row(r)
                for r in await conn.fetch(_COMPENSATIONS.format(schema=schema), task_id)}
    by_step: dict[str, dict[str, list[dict[str, Any]]]] = {
        i: {"attempt_log": [], "check_log": []} for i in ids}
    for r in attempts:
        by_step[r["step_id"]]["attempt_log"].append(
            {k: v for k, v in dict(r).items() if k != "step_id"})
    for r in checks:
        by_step[r["step_id"]]["check_log"].append(
            {k: v for k, v in dict(r).items() if k != "step_id"})
    for step in steps:
        step.update(by_step[step["step_id"]])
        compensation = undo.get(step["step_id"])
        if compensation is not None:
            del compensation["step_id"]
        step["compensation"] = compensation
    task["steps"] = steps
    return task


async def version(conn: Conn,
                  schema: str) -> tuple[int, datetime | None, datetime | None, datetime | None]:
    """A value that changes whenever the read model does (for the page's live updates)."""
    r = await conn.fetchrow(_VERSION.format(schema=checked_schema(schema)))
    assert r is not None
    return int(r["offsets"]), r["tasks"], r["steps"], r["compensations"]
