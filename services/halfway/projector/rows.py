"""The read model's rows: a pure function of one task's fold. No I/O, no clock.

Every value comes from the events the fold holds (times included: `updated_at` is the latest
`at` among them), never from the moment the projector ran. So a rebuild from the journal writes
exactly the rows the live projector wrote, and a redelivered or duplicate event (which leaves
the fold unchanged) rewrites identical rows.

The `checks` table holds, per step, the last check the fold keeps (`EffectState.last_check`):
the fold counts earlier checks (`steps.checks`) but does not keep them, and a row must be a
function of the fold.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from datetime import datetime
from typing import Any

from halfway.contract.events import TIME_MIN, DecidedBy
from halfway.core.fold import EffectState, StepState, StepStatus, TaskState
from halfway.render import attention_words

Row = dict[str, Any]

# Each table's primary key, in the order rows are sorted for comparisons (snapshot order).
PRIMARY_KEYS: dict[str, tuple[str, ...]] = {
    "tasks": ("task_id",),
    "steps": ("step_id",),
    "attempts": ("step_id", "attempt"),
    "checks": ("event_id",),
    "compensations": ("step_id",),
}
# The columns of each table, in schema.sql's order.
COLUMNS: dict[str, tuple[str, ...]] = {
    "tasks": ("task_id", "status", "final_state", "needs_attention", "input", "allowed_tools",
              "summary", "steps", "started_at", "finished_at", "updated_at", "aborted_by",
              "aborted_reason", "attention", "not_accepted", "model_questions", "tokens_in",
              "tokens_out", "model_unavailable"),
    "steps": ("step_id", "task_id", "n", "tool", "args", "key", "subject", "effect_class",
              "decided_by", "status", "outcome", "evidence", "reason", "source", "attempts",
              "unknowns", "checks", "last_check", "next_check_at", "needs_attention",
              "contradictions", "intended_at", "settled_at", "updated_at", "attention",
              "waiting"),
    "attempts": ("step_id", "attempt", "key", "started_at"),
    "checks": ("event_id", "step_id", "at", "found", "next_check_at"),
    "compensations": ("step_id", "task_id", "tool", "args", "key", "status", "outcome",
                      "evidence", "reason", "attempts", "updated_at", "last_check",
                      "next_check_at", "needs_attention"),
}
JSON_COLUMNS: dict[str, frozenset[str]] = {
    "tasks": frozenset({"input", "allowed_tools", "not_accepted"}),
    "steps": frozenset({"args", "evidence"}),
    "attempts": frozenset(),
    "checks": frozenset(),
    "compensations": frozenset({"args", "evidence"}),
}
TABLES: tuple[str, ...] = tuple(COLUMNS)


def task_row(state: TaskState) -> Row:
    # The journal's own record of what was accepted (task.started) wins over the request,
    # which normally lives on the tasks topic and not in the journal at all.
    accepted = state.started or state.request
    summary = (state.finished.summary if state.finished is not None
               else state.rejected.reason if state.rejected is not None else None)
    # No time at all: only events the fold keeps no time of (a claim withdrawn by a writer
    # for a task that never started); the row is as old as the contract allows.
    updated_at = _latest(_task_times(state)) or TIME_MIN
    return {
        "task_id": state.task_id,
        # None only when the journal holds step events but no task event (a buggy writer);
        # the fold applies what it can, and so do we: the task is under way.
        "status": str(state.status) if state.status is not None else "running",
        "final_state": _str(state.final_state),
        "needs_attention": state.needs_attention,
        "input": None if accepted is None else accepted.input,
        "allowed_tools": None if accepted is None else accepted.allowed_tools,
        "summary": summary,
        "steps": len(state.steps),
        "started_at": None if state.started is None else state.started.at,
        "finished_at": None if state.finished is None else state.finished.at,
        "updated_at": updated_at,
        "aborted_by": None if state.aborted is None else state.aborted.by,
        "aborted_reason": None if state.aborted is None else state.aborted.reason,
        "attention": attention_words(state),
        # Decisions the log refused (a paused decider's late writes): shown, never executed.
        "not_accepted": [{"type": n.event.type, "step_id": n.event.step_id,
                          "tool": getattr(n.event, "tool", None), "reason": n.reason}
                         for n in state.not_accepted],
        # What the model cost, and why it is not answering (the next step's last failure).
        "model_questions": state.usage.questions,
        "tokens_in": state.usage.input_tokens,
        "tokens_out": state.usage.output_tokens,
        "model_unavailable": _model_unavailable(state),
    }


def _model_unavailable(state: TaskState) -> str | None:
    failing = state.model_failures.get(state.next_step_n)
    if failing is None or state.finished is not None or state.rejected is not None:
        return None
    count, last = failing
    status = f"HTTP {last.status}: " if last.status is not None else ""
    return f"{status}{last.error} ({count} failed question(s) for step {last.n})"


def step_rows(state: TaskState) -> list[Row]:
    return [_step_row(state.task_id, step) for _, step in sorted(state.steps.items())]


def _step_row(task_id: str, step: StepState) -> Row:
    intent, effect = step.intent, step.effect
    settlement = effect.settlement
    check = effect.last_check
    open_ = step.status in (StepStatus.UNKNOWN, StepStatus.IN_FLIGHT)
    return {
        "step_id": intent.step_id,
        "task_id": task_id,
        "n": intent.n,
        "tool": intent.tool,
        "args": intent.args,
        "key": intent.key,
        "subject": intent.subject,
        "effect_class": str(intent.effect_class),
        "decided_by": decided_by_text(intent.decided_by),
        "status": str(step.status),
        "outcome": _str(effect.outcome),
        "evidence": None if settlement is None else settlement.evidence,
        "reason": None if settlement is None else settlement.reason,
        "source": None if settlement is None else str(settlement.source),
        "attempts": len(effect.attempts),
        "unknowns": len(effect.unknowns),
        "checks": effect.checks,
        "last_check": None if check is None else check.found,
        # Only an open step is checked again; a settled one keeps its last check as history.
        "next_check_at": check.next_check_at if open_ and check is not None else None,
        "needs_attention": effect.needs_attention,
        "contradictions": len(effect.contradictions),
        "intended_at": intent.at,
        "settled_at": None if settlement is None else settlement.at,
        "updated_at": _latest(_effect_times(effect, intent.at)),
        "attention": effect.attention_why or None,
        "waiting": (f"no executor here serves tool {step.unserved.tool} (an executor of app "
                    f"{step.unserved.app} met it)"
                    if step.unserved is not None and step.status is StepStatus.INTENDED
                    else None),
    }


def attempt_rows(state: TaskState) -> list[Row]:
    # The step's own attempts; a compensation's attempts share its step id (and would share the
    # primary key), so they are counted on the compensation's row instead.
    return [{"step_id": a.step_id, "attempt": a.attempt, "key": a.key, "started_at": a.started_at}
            for _, step in sorted(state.steps.items()) for a in step.effect.attempts]


def check_rows(state: TaskState) -> list[Row]:
    out = []
    for _, step in sorted(state.steps.items()):
        check = step.effect.last_check
        if check is not None:
            out.append({"event_id": check.event_id, "step_id": check.step_id, "at": check.at,
                        "found": check.found, "next_check_at": check.next_check_at})
    return out


def compensation_rows(state: TaskState) -> list[Row]:
    out = []
    for _, step in sorted(state.steps.items()):
        plan = step.compensation
        if plan is None:
            continue  # undo events without a compensation.intended stay anomalies of the fold
        undo = step.undo
        settlement = undo.settlement
        check = undo.last_check
        open_ = undo.status in (StepStatus.UNKNOWN, StepStatus.IN_FLIGHT)
        out.append({
            "step_id": plan.step_id,
            "task_id": state.task_id,
            "tool": plan.tool,
            "args": plan.args,
            "key": plan.key,
            "status": str(undo.status),
            "outcome": _str(undo.outcome),
            "evidence": None if settlement is None else settlement.evidence,
            "reason": None if settlement is None else settlement.reason,
            "attempts": len(undo.attempts),
            "updated_at": _latest(_effect_times(undo, plan.at)),
            "last_check": None if check is None else check.found,
            "next_check_at": check.next_check_at if open_ and check is not None else None,
            "needs_attention": step.undo_needs_attention,
        })
    return out


def rows_of(state: TaskState) -> dict[str, list[Row]]:
    """Every row of one task, by table."""
    return {
        "tasks": [task_row(state)],
        "steps": step_rows(state),
        "attempts": attempt_rows(state),
        "checks": check_rows(state),
        "compensations": compensation_rows(state),
    }


def table_rows(states: Iterable[TaskState]) -> dict[str, list[Row]]:
    """Every row of many tasks, by table, sorted by primary key: the shape of a snapshot."""
    out: dict[str, list[Row]] = {table: [] for table in TABLES}
    for state in states:
        for table, rows in rows_of(state).items():
            out[table].extend(rows)
    for table, rows in out.items():
        rows.sort(key=lambda row, t=table: sort_key(t, row))
    return out


def sort_key(table: str, row: Row) -> tuple[Any, ...]:
    return tuple(row[c] for c in PRIMARY_KEYS[table])


def decided_by_text(who: DecidedBy) -> str:
    return who.model if who.version is None else f"{who.model}@{who.version}"


def _str(value: object | None) -> str | None:
    return None if value is None else str(value)


def _latest(times: Iterable[datetime]) -> datetime | None:
    return max(times, default=None)


def _effect_times(effect: EffectState, since: datetime) -> Iterator[datetime]:
    yield since
    for attempt in effect.attempts:
        yield attempt.at
    for settlement in (effect.settlement, *effect.unknowns, *effect.contradictions):
        if settlement is not None:
            yield settlement.at
    if effect.last_check is not None:
        yield effect.last_check.at


def _task_times(state: TaskState) -> Iterator[datetime]:
    """The `at` of every event the fold keeps for this task."""
    for event in (state.request, state.started, state.rejected, state.aborted, state.finished):
        if event is not None:
            yield event.at
    for refused in state.not_accepted:
        yield refused.event.at
    for _, failed in state.model_failures.values():
        yield failed.at
    for step in state.steps.values():
        yield from _effect_times(step.effect, step.intent.at)
        if step.compensation is not None:
            yield from _effect_times(step.undo, step.compensation.at)
        else:
            yield from _effect_times(step.undo, step.intent.at)
    for event in (*state.refusals, *state.orphans):
        yield event.at
