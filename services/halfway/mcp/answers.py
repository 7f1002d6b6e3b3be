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
class Holder:
    """What this process knows of the step that held the subject a call was blocked on."""

    holds: bool  # it still holds the subject
    step: StepState | None = None  # its step, if this process follows the holder's task
    seen: bool = False  # this process follows the holder's task (else `step` says nothing)


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


def refusal_answer(refusal: StepRefused, subject: str | None, *, holder: Holder | None = None,
                   earlier: StepState | None = None) -> Answer:
    """A proposal the decider refused: nothing ran. Blocked by a step that holds the subject,
    the subject is as that step is: unknown while it holds it or while this process cannot see
    how it ended; done by the other step (never "not done": the agent would do it twice);
    else, as any other refusal, proof of not done."""
    facts: dict[str, Any] = {"tool": refusal.tool, "subject": subject, "this_call_ran": False,
                             "reason": refusal.reason}
    blocked = refusal.blocked
    if blocked is not None and (holder is None or holder.holds):
        # Not final: once the holder releases the subject, a retry of this call may run.
        facts |= {"status": UNKNOWN, "held_by": blocked.holder}
        return Answer(UNKNOWN, f"status: unknown: {refusal.reason}; this call was not run; "
                               f"{advice(refusal.tool, subject)}", facts, final=False)
    step = None if holder is None else holder.step
    if blocked is not None and holder is not None and (
            not holder.seen or (step is not None and step.status is not StepStatus.NOT_DONE)):
        return _blocked_by_released(refusal, subject, blocked.holder, step, facts)
    text = f"status: not done, this call was refused and nothing ran: {refusal.reason}"
    if blocked is not None:
        text += f" (since then {blocked.holder} " + (
            "was not done" if step is not None else "was given up before it ran") + \
            f" and released {blocked.subject})"
    facts["status"] = NOT_DONE
    if earlier is not None:
        prior = step_answer(earlier)
        text += f"; the earlier {earlier.intent.tool} on {earlier.intent.subject}: " \
                f"{prior.text.removeprefix('status: ')}"
        facts["earlier"] = prior.facts
    return Answer(NOT_DONE, text, facts)


def _blocked_by_released(refusal: StepRefused, subject: str | None, holder_id: str,
                         step: StepState | None, facts: dict[str, Any]) -> Answer:
    """A call blocked by a step that has since released the subject, and did not prove itself
    not done: what that step did is this subject's truth."""
    not_run = "this call was not run"
    facts["held_by"] = holder_id
    if step is not None and step.status is StepStatus.DONE:
        settlement = step.effect.settlement
        assert settlement is not None
        facts |= {"status": DONE, "done_by": holder_id, "evidence": settlement.evidence}
        line = effect_line(step.effect, f"reference {step.intent.key}", unknown_advice="")
        return Answer(DONE, f"status: done by another call: {holder_id} did {step.intent.tool} "
                            f"on {subject} ({line}); {not_run}: call it again only if you mean "
                            f"a second {refusal.tool} for {subject}", facts)
    how = ("its outcome is not known to this process" if step is None
           else f"it is {step.status.value.replace('_', ' ')}")
    facts["status"] = UNKNOWN
    return Answer(UNKNOWN, f"status: unknown: {refusal.reason}; since then {holder_id} released "
                           f"{subject}, and {how}; {not_run}; {advice(refusal.tool, subject)}",
                  facts)


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
                  holder: Callable[[SubjectHeld], Holder]) -> Answer:
    """The answer to a call handed to the decider for step `n` after `refused` refusals of it
    (see `halfway.mcp.calls`): its refusal, its step, or that it is still being placed."""
    refusals = state.refused(n)
    if len(refusals) > refused:
        refusal = refusals[refused]
        return refusal_answer(refusal, subject,
                              holder=None if refusal.blocked is None else holder(refusal.blocked),
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
