"""The truth for users: a step's state in words, three states, never two."""

from __future__ import annotations

from typing import Any

from halfway.core.fold import EffectState, StepState, StepStatus, TaskState

# Control characters but the newline: C0, DEL and C1 (0x9b is CSI to some terminals). Text from
# outside (a model's summary, a tool's arguments and evidence, a caller's reason) printed as it
# is could clear a terminal, move its cursor, retitle it, or fake a line of our output.
_CONTROLS = {c: f"\\x{c:02x}" for c in (*range(0x20), 0x7F, *range(0x80, 0xA0)) if c != 0x0A}


def printable(text: str) -> str:
    """`text` for a terminal to show, not obey: each control character as a visible `\\xNN`
    (newlines kept: they are the caller's lines). The one rule every printed text goes
    through; applying it twice changes nothing."""
    return text.translate(_CONTROLS)


def one_line(value: object) -> str:
    """`value` as one printable line: runs of whitespace (newlines too) as one space."""
    return printable(" ".join(str(value).split()))


def step_line(step: StepState) -> str:
    """One line a person (or a model) cannot misread."""
    intent = step.intent
    what = f"{intent.tool} {intent.subject or ''}".strip() + f" (reference {intent.key})"
    unserved = step.unserved
    if step.status is StepStatus.INTENDED and unserved is not None and not unserved.undo:
        return (f"decided, waiting: no executor here serves tool {unserved.tool} (an executor "
                f"of app {unserved.app} met it); {what}")
    return effect_line(step.effect, what, unknown_advice="do not start another one")


def undo_line(step: StepState) -> str | None:
    """The compensation of a step, in the same three states; None if it has none."""
    plan, intent = step.compensation, step.intent
    if plan is None:
        return None
    what = (f"undo of {intent.tool} {intent.subject or ''}".strip()
            + f" by {plan.tool} (reference {plan.key}")
    if step.past_undos:
        earlier = ", ".join(p.plan.key for p in step.past_undos)
        what += f"; sent again under a new reference: {earlier} proven to have done nothing"
    return effect_line(step.undo, what + ")", unknown_advice="do not undo it another way")


def effect_line(effect: EffectState, what: str, *, unknown_advice: str) -> str:
    """Any effect (a step, an undo) in words: done with evidence, not done with the reason,
    unknown with when it is checked next."""
    settlement = effect.settlement
    match effect.status:
        case StepStatus.DONE:
            assert settlement is not None
            return f"done: {what}; evidence {_evidence(settlement.evidence)}"
        case StepStatus.NOT_DONE:
            assert settlement is not None
            return f"not done, safe to try again: {what}; {settlement.reason}"
        case StepStatus.UNKNOWN:
            reason = (settlement.reason if settlement is not None else None) or "no reply"
            return (f"unknown, being checked: {what}; {reason}; {next_check_words(effect)}; "
                    f"{unknown_advice}")
        case StepStatus.IN_FLIGHT:
            return f"in flight: {what}; attempt {effect.attempts[-1].attempt}"
        case StepStatus.INTENDED:
            return f"decided, not yet attempted: {what}"


def attention_words(state: TaskState) -> str | None:
    """Why a person must look at the task (steps and undos that need one), or None."""
    parts = []
    for step in sorted(state.steps.values(), key=lambda s: s.n):
        if step.effect.needs_attention:
            parts.append(f"step {step.step_id} ({step.intent.tool}, reference "
                         f"{step.intent.key}): {step.effect.attention_why}")
        if step.compensation is not None and step.undo.needs_attention:
            parts.append(f"the undo of step {step.step_id} (reference {step.compensation.key}): "
                         f"{step.undo.attention_why}")
        for past in step.past_undos:
            if past.state.needs_attention:
                parts.append(f"the undo of step {step.step_id} under reference "
                             f"{past.plan.key}, proven to have done nothing before it was "
                             f"sent again: {past.state.attention_why}; it may have happened "
                             f"twice")
    return "; ".join(parts) if parts else None


def next_check_words(effect: EffectState) -> str:
    check = effect.last_check
    if check is None:
        return "the harness is checking"
    if check.next_check_at is not None:
        return f"next check at {check.next_check_at:%H:%M:%S}Z"
    return "no further check is planned: an operator must resolve it"


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
                "attention": step.effect.attention_why or None,
            }
            for step in state.steps.values()
        ],
        "not_accepted": [{"type": n.event.type, "step_id": n.event.step_id, "reason": n.reason}
                         for n in state.not_accepted],
        "anomalies": list(state.anomalies),
    }
