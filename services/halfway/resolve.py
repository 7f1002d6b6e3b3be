"""Operator resolution: a person settles a step the harness could not.

Also `halfway abort TASK --reason …`: a caller or operator calls a task off.

`halfway resolve STEP done --evidence charge_id=ch_… --by alice` or
`halfway resolve STEP not_done --reason "the bank confirmed no payment" --by alice` journals
`step.settled` with source `operator`; the decider then moves the task on. It refuses to settle
a step that is not in the journal, or one already settled (a second verdict would only be kept
as a contradiction: say `--force` to record one deliberately).
"""

from __future__ import annotations

from typing import Any

from halfway.contract import Outcome, SettlementSource, StepSettled, TaskAborted, parse_step_id
from halfway.journal import JournalWriter
from halfway.journal.records import stamp
from halfway.journal.replay import task_state
from halfway.settings import KafkaSettings


class ResolveRefused(Exception):
    """Why the resolution was not journaled, in words for the operator."""


async def resolve(settings: KafkaSettings, step_id: str, outcome: Outcome, *,
                  evidence: dict[str, Any] | None, reason: str | None, by: str,
                  force: bool = False) -> StepSettled:
    try:
        task_id, n = parse_step_id(step_id)
    except ValueError as exc:
        raise ResolveRefused(str(exc)) from None
    if outcome is Outcome.UNKNOWN:
        raise ResolveRefused("an operator settles a step done or not_done; it is unknown already")
    if outcome is Outcome.DONE and not evidence:
        raise ResolveRefused("done needs evidence: --evidence charge_id=ch_…")
    if outcome is Outcome.NOT_DONE and not reason:
        raise ResolveRefused("not_done needs a reason: --reason \"…\"")
    state = await task_state(settings, task_id)
    step = state.step(n)
    if step is None:
        raise ResolveRefused(f"step {step_id} is not in the journal")
    if step.outcome in (Outcome.DONE, Outcome.NOT_DONE) and not force:
        raise ResolveRefused(f"step {step_id} is already {step.outcome}; a second verdict would "
                             "be kept as a contradiction (use --force to record one)")
    event = StepSettled(
        **stamp(task_id), step_id=step_id, outcome=outcome, source=SettlementSource.OPERATOR,
        evidence={**evidence, "resolved_by": by} if evidence else None,
        reason=f"{reason} (resolved by {by})" if reason else None)
    async with JournalWriter(settings) as writer:
        await writer.append(event)
    return event


async def abort_task(settings: KafkaSettings, task_id: str, *, reason: str,
                     by: str) -> TaskAborted:
    """Journal `task.aborted`: no new step is decided; a saga undoes what is proven done."""
    state = await task_state(settings, task_id)
    if state.started is None:
        raise ResolveRefused(f"task {task_id} has not started (nothing in the journal)")
    if state.finished is not None:
        raise ResolveRefused(f"task {task_id} already finished {state.finished.state}")
    if state.aborted is not None:
        raise ResolveRefused(f"task {task_id} was already called off by {state.aborted.by}: "
                             f"{state.aborted.reason}")
    event = TaskAborted(**stamp(task_id), reason=reason, by=by)
    async with JournalWriter(settings) as writer:
        await writer.append(event)
    return event
