"""The truth for users: a step's state in words, three states, never two."""

from __future__ import annotations

from typing import Any

from halfway.core.fold import StepState, StepStatus, TaskState


def step_line(step: StepState) -> str:
    """One line a person (or a model) cannot misread."""
    intent, effect = step.intent, step.effect
    what = f"{intent.tool} {intent.subject or ''}".strip()
    ref = f"(reference {intent.key})"
    match step.status:
        case StepStatus.DONE:
            return f"done: {what} {ref}; evidence {_evidence(effect.settlement.evidence)}"
        case StepStatus.NOT_DONE:
            return f"not done, safe to try again: {what} {ref}; {effect.settlement.reason}"
        case StepStatus.UNKNOWN:
            check = effect.last_check
            if check is None:
                when = "the harness is checking"
            elif check.next_check_at is not None:
                when = f"next check at {check.next_check_at:%H:%M:%S}Z"
            else:
                when = "no further check is planned: an operator must resolve it"
            reason = effect.settlement.reason if effect.settlement else "no reply"
            return (f"unknown, being checked: {what} {ref}; {reason}; {when}; "
                    "do not start another one")
        case StepStatus.IN_FLIGHT:
            return f"in flight: {what} {ref}; attempt {effect.attempts[-1].attempt}"
        case StepStatus.INTENDED:
            return f"decided, not yet attempted: {what} {ref}"


def undo_line(step: StepState) -> str | None:
    """The compensation of a step, in the same three states; None if it has none."""
    plan, undo = step.compensation, step.undo
    if plan is None:
        return None
    what = f"undo of {step.step_id} by {plan.tool}"
    ref = f"(reference {plan.key})"
    match undo.status:
        case StepStatus.DONE:
            return f"undone: {what} {ref}; evidence {_evidence(undo.settlement.evidence)}"
        case StepStatus.NOT_DONE:
            return f"undo not done: {what} {ref}; {undo.settlement.reason}"
        case StepStatus.UNKNOWN:
            reason = undo.settlement.reason if undo.settlement else "no reply"
            return f"undo unknown, being checked: {what} {ref}; {reason}"
        case StepStatus.IN_FLIGHT:
            return f"undo in flight: {what} {ref}; attempt {undo.attempts[-1].attempt}"
        case StepStatus.INTENDED:
            return f"undo decided, not yet attempted: {what} {ref}"


def _evidence(evidence: dict[str, Any] | None) -> str:
    return ", ".join(f"{k}={v}" for k, v in (evidence or {}).items())


def task_summary(state: TaskState) -> dict[str, Any]:
    """A task as plain data, for `--json`."""
    return {
        "task_id": state.task_id,
        "status": state.status,
        "final_state": state.final_state,
        "needs_attention": state.needs_attention,
        "steps": [
            {
                "step_id": step.step_id,
                "tool": step.intent.tool,
                "key": step.intent.key,
                "status": step.status,
                "states": [u.outcome for u in step.effect.unknowns]
                + ([step.outcome] if step.outcome not in (None, "unknown") else []),
                "evidence": step.effect.settlement.evidence if step.effect.settlement else None,
                "reason": step.effect.settlement.reason if step.effect.settlement else None,
                "next_check_at": (step.effect.last_check.next_check_at.isoformat()
                                  if step.effect.last_check and step.effect.last_check.next_check_at
                                  else None),
                "contradictions": len(step.effect.contradictions),
            }
            for step in state.steps.values()
        ],
        "anomalies": list(state.anomalies),
    }
