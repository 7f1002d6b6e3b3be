"""What the proxy answers an agent's `tools/call`, from the journal alone. Pure.

Three states and nothing else, in words a model cannot misread (they open with `status:`), with
the same facts as structured content:

- `done`: the step's evidence (charge id, ticket id);
- `not done`: proof that nothing happened (a refusal by the provider, or by the harness before
  anything ran: invalid arguments, once per subject), safe to try again where the reason allows;
- `unknown`: it may have happened (a timeout, in flight, not placed yet, or another step holds
  the subject), being checked, with when, and always "do not start another". Never "error":
  an agent that reads "error" retries, and the customer pays twice.

Only `not done` is an MCP `isError` result: the tool call completed and reported a failure the
agent should take into account.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from halfway.contract import StepRefused, SubjectHeld
from halfway.core.fold import StepState, StepStatus, TaskState, TaskStatus
from halfway.render import effect_line, next_check_words

DONE, NOT_DONE, UNKNOWN = "done", "not_done", "unknown"


@dataclass(frozen=True, slots=True)
class Answer:
    status: str  # done | not_done | unknown
    text: str
    facts: dict[str, Any] = field(default_factory=dict)  # the structured content
    # Nothing further will happen to the call this answers (settled, refused, not run): the
    # proxy need not wait any longer.
    final: bool = True

    @property
    def is_error(self) -> bool:
        return self.status == NOT_DONE


def advice(tool: str, subject: str | None) -> str:
    return (f"do not start another {tool} for {subject}" if subject
            else f"do not start another {tool} call")


def step_answer(step: StepState, *, ran: bool = True) -> Answer:
    """A placed step, in three states. `ran`: False when the call answered is a retry the
    harness did not run (it is answered with the step it repeats)."""
    intent = step.intent
    what = f"{intent.tool} {intent.subject or ''}".strip() + f" (reference {intent.key})"
    words = advice(intent.tool, intent.subject)
    status = step.status
    facts: dict[str, Any] = {"step_id": step.step_id, "reference": intent.key,
                             "tool": intent.tool, "subject": intent.subject, "this_call_ran": ran}
    settlement = step.effect.settlement
    match status:
        case StepStatus.DONE | StepStatus.NOT_DONE:
            assert settlement is not None
            line = effect_line(step.effect, what, unknown_advice=words)
            state = DONE if status is StepStatus.DONE else NOT_DONE
            facts |= {"status": state, "evidence": settlement.evidence,
                      "reason": settlement.reason}
            final = True
        case StepStatus.UNKNOWN:
            line = effect_line(step.effect, what, unknown_advice=words)
            state, final = UNKNOWN, False
            check = step.effect.last_check
            facts |= {"status": UNKNOWN, "reason": settlement.reason if settlement else None,
                      "next_check_at": (check.next_check_at.isoformat()
                                        if check and check.next_check_at else None)}
        case _:  # intended or in flight: no reply yet, so it may happen
            doing = ("in flight" if status is StepStatus.IN_FLIGHT
                     else "decided and about to be attempted")
            line = (f"unknown, being checked: {what} is {doing}; its result has not come back "
                    f"yet; {next_check_words(step.effect)}; {words}")
            state, final = UNKNOWN, False
            facts |= {"status": UNKNOWN, "reason": f"{status.value.replace('_', ' ')}"}
    if step.effect.needs_attention:
        facts["needs_attention"] = step.effect.attention_why
    text = f"status: {line}"
    if not ran:
        text += " (this is an earlier call of this session; the harness did not run it again)"
    return Answer(state, text, facts, final=final)


def refusal_answer(refusal: StepRefused, subject: str | None, *, still_held: bool,
                   earlier: StepState | None = None) -> Answer:
    """A proposal the decider refused: nothing ran. Blocked by a step that still holds the
    subject, the subject's state is unknown; anything else is proof of not done."""
    facts: dict[str, Any] = {"tool": refusal.tool, "subject": subject, "this_call_ran": False,
                             "reason": refusal.reason}
    if refusal.blocked is not None and still_held:
        # Not final: once the holder releases the subject, a retry of this call may run.
        facts |= {"status": UNKNOWN, "held_by": refusal.blocked.holder}
        return Answer(UNKNOWN, f"status: unknown: {refusal.reason}; this call was not run; "
                               f"{advice(refusal.tool, subject)}", facts, final=False)
    text = f"status: not done, this call was refused and nothing ran: {refusal.reason}"
    if refusal.blocked is not None:
        text += f" (since then {refusal.blocked.holder} settled and released " \
                f"{refusal.blocked.subject})"
    facts["status"] = NOT_DONE
    if earlier is not None:
        prior = step_answer(earlier)
        text += f"; the earlier {earlier.intent.tool} on {earlier.intent.subject}: " \
                f"{prior.text.removeprefix('status: ')}"
        facts["earlier"] = prior.facts
    return Answer(NOT_DONE, text, facts)


def not_started_answer(tool: str, subject: str | None, why: str) -> Answer:
    """A call the harness never handed to the decider: nothing ran, safe to try again."""
    return Answer(NOT_DONE, f"status: not done, safe to try again: {tool} was not started: {why}",
                  {"status": NOT_DONE, "tool": tool, "subject": subject,
                   "this_call_ran": False, "reason": why})


def placing_answer(tool: str, subject: str | None) -> Answer:
    """A call handed to the decider whose step is not in the journal yet: it may still run."""
    why = "the harness is placing it (the subject guard, the journal); it may still run"
    return Answer(UNKNOWN, f"status: unknown, being checked: {tool} {subject or ''}".rstrip()
                  + f": {why}; {advice(tool, subject)}",
                  {"status": UNKNOWN, "tool": tool, "subject": subject, "reason": why},
                  final=False)


def handed_answer(state: TaskState, tool: str, subject: str | None, n: int, refused: int, *,
                  still_held: Callable[[SubjectHeld], bool]) -> Answer:
    """The answer to a call handed to the decider for step `n` after `refused` refusals of it
    (see `halfway.mcp.calls`): its refusal, its step, or that it is still being placed."""
    refusals = state.refused(n)
    if len(refusals) > refused:
        refusal = refusals[refused]
        held = refusal.blocked is not None and still_held(refusal.blocked)
        return refusal_answer(refusal, subject, still_held=held,
                              earlier=_done_before(state, tool, subject, n))
    step = state.step(n)
    if step is not None:
        return step_answer(step)
    if state.status in (TaskStatus.FINISHED, TaskStatus.REJECTED):
        why = (state.finished.summary if state.finished is not None
               else state.rejected.reason if state.rejected is not None else "it ended")
        return not_started_answer(tool, subject, f"the session's task ended: {why}")
    return placing_answer(tool, subject)


def _done_before(state: TaskState, tool: str, subject: str | None, n: int) -> StepState | None:
    """The latest done step of this task on the same tool and subject before step `n`."""
    if subject is None:
        return None
    for step in sorted(state.steps.values(), key=lambda s: -s.n):
        if step.n < n and step.intent.tool == tool and step.intent.subject == subject \
                and step.status is StepStatus.DONE:
            return step
    return None


def unsettled(step: StepState) -> bool:
    return step.status in (StepStatus.INTENDED, StepStatus.IN_FLIGHT, StepStatus.UNKNOWN)
