"""decide: the decider's next move for one task. Pure.

Theory of operation
-------------------
The decider asks the model only for a step that has not been decided yet, and only when
nothing blocks the task: every decided step is settled (`done` or `not_done`). A step that is
intended, in flight or unknown holds the task (the default `on_unknown=wait`): moving on while
a charge may have happened is how customers pay twice. A step that needs an operator holds the
task until one resolves it.

Once the model answers, `accept_call` turns its proposal into the fields of `step.intended`:
the tool must be allowed for the task and known, the arguments must validate against the
tool's argument model (strictly: `"49.00"` is not an amount in cents), and the key is minted by
the harness from the step id. The model never names the key. A proposal that fails is refused
with a reason the model can read: the decider journals `step.refused`, the model sees it and
decides again, at most REFUSALS_MAX times for one step; then the task fails with the reason.

A saga (`halfway.core.saga`) adds two things: `accept_call` refuses a step that breaks the
order of saga roles, and a failing saga is undone instead of asking further: `Compensate`
journals the undo of each done step (last first), and the task finishes `compensated` once
every undo is done, or `needs_attention` if one cannot be. A task that is aborted decides no
new step; its steps in flight settle first.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from pydantic import BaseModel, ValidationError

from halfway.contract import (
    CompensationPlan,
    EffectClass,
    FinalState,
    Outcome,
    SagaRole,
    mint_key,
    step_id,
)
from halfway.core import saga
from halfway.core.fold import StepStatus, TaskState, TaskStatus

REFUSALS_MAX = 3  # refused proposals for one step before the task gives up


@dataclass(frozen=True, slots=True)
class Start:
    pass


@dataclass(frozen=True, slots=True)
class Reject:
    reason: str


@dataclass(frozen=True, slots=True)
class Ask:
    """Ask the model for step `n`."""

    n: int


@dataclass(frozen=True, slots=True)
class Finish:
    state: FinalState
    summary: str


@dataclass(frozen=True, slots=True)
class Abort:
    """Call the task off (`task.aborted` by halfway): its saga failed before the pivot."""

    reason: str


@dataclass(frozen=True, slots=True)
class Compensate:
    """Journal `compensation.intended` for these steps, in this order: (n, tool, args)."""

    undos: tuple[tuple[int, str, dict[str, Any]], ...]
    why: str


@dataclass(frozen=True, slots=True)
class Hold:
    """Nothing to decide until something settles; `reason` says what."""

    reason: str


@dataclass(frozen=True, slots=True)
class Idle:
    """Nothing to do: not started, rejected or finished."""


TaskMove = Start | Reject | Ask | Abort | Compensate | Finish | Hold | Idle


@dataclass(frozen=True, slots=True)
class ToolFacts:
    """What the decider needs to know of a tool to place a step (from its ToolSpec)."""

    name: str
    args_model: type[BaseModel]
    effect_class: EffectClass
    subject_of: Any  # Callable[[BaseModel], str | None]
    saga_role: SagaRole | None = None
    undo: CompensationPlan | None = None
    once_per_subject: bool = False


def decide(state: TaskState, *, known_tools: set[str], requested: bool,
           now: datetime) -> TaskMove:
    if state.status in (TaskStatus.REJECTED, TaskStatus.FINISHED):
        return Idle()
    if state.started is None:
        if not requested:
            return Idle()
        assert state.request is not None
        unknown = sorted(set(state.request.allowed_tools) - known_tools)
        if unknown:
            return Reject(f"unknown tools: {', '.join(unknown)}")
        return Start()

    failing = saga.failure(state, now)
    if failing is not None:
        return Abort(failing)
    undoing = saga.undoing(state)
    if undoing is not None:
        return _undo(state, undoing)
    for step in state.steps.values():
        if step.effect.needs_attention:
            return Hold(f"step {step.step_id} is unknown and needs an operator")
        if step.status in (StepStatus.INTENDED, StepStatus.IN_FLIGHT, StepStatus.UNKNOWN):
            return Hold(f"step {step.step_id} is {step.status}")

    if state.aborted is not None:  # not a saga, or past its pivot: steps settle, then it ends
        return Finish(FinalState.FAILED,
                      f"aborted by {state.aborted.by}: {state.aborted.reason}")
    policy = state.started.policy
    n = state.next_step_n
    refused = state.refused(n)
    give_up = None
    if policy.deadline is not None and now >= policy.deadline:
        give_up = f"the deadline {policy.deadline:%Y-%m-%d %H:%M}Z passed"
    elif len(state.steps) >= policy.max_steps:
        give_up = f"reached the limit of {policy.max_steps} steps"
    elif len(refused) >= REFUSALS_MAX:
        give_up = (f"the model's proposals for step {n} were refused {len(refused)} times; "
                   f"the last: {refused[-1].reason}")
    if give_up is not None:
        # A saga before its pivot is called off (and undone); anything else just fails.
        if policy.saga and not saga.past_pivot(state):
            return Abort(give_up)
        return Finish(FinalState.FAILED, give_up)
    return Ask(n)


def _undo(state: TaskState, why: str) -> TaskMove:
    """The next move of a saga being undone."""
    steps = sorted(state.steps.values(), key=lambda s: -s.n)
    for step in steps:
        if step.effect.needs_attention:
            return Finish(FinalState.NEEDS_ATTENTION,
                          f"{why}; step {step.step_id} ({step.intent.tool}) is unknown and no "
                          f"check is left: an operator must say whether it happened, then undo "
                          f"it and the steps before it")
    undos: list[tuple[int, str, dict[str, Any]]] = []
    for step in saga.undo_plan(state):
        plan, settlement = step.intent.compensation, step.effect.settlement
        assert settlement is not None
        args = None if plan is None else saga.undo_args(plan, dict(step.intent.args),
                                                         settlement.evidence)
        if plan is None or isinstance(args, str):
            cause = args if isinstance(args, str) else "it declared no undo"
            return Finish(FinalState.NEEDS_ATTENTION,
                          f"{why}; step {step.step_id} ({step.intent.tool}) is done but cannot "
                          f"be undone: {cause}")
        undos.append((step.n, plan.tool, args))
    if undos:
        return Compensate(tuple(undos), why)
    for step in steps:
        undo = step.undo
        if step.compensation is not None and (undo.outcome is Outcome.NOT_DONE
                                              or undo.needs_attention):
            reason = undo.settlement.reason if undo.settlement else None
            if undo.needs_attention and undo.last_check is not None:
                reason = undo.last_check.found
            return Finish(FinalState.NEEDS_ATTENTION,
                          f"{why}; the undo of step {step.step_id} ({step.compensation.tool}) "
                          f"could not be done ({reason}): an operator must undo it"
                          + _remaining(state, step.n))
    for step in steps:
        if step.status in saga.UNSETTLED:
            return Hold(f"undoing the saga; step {step.step_id} is {step.status}: it is "
                        f"undone once proven done")
        if step.compensation is not None and step.undo.outcome is not Outcome.DONE:
            return Hold(f"undoing the saga; the undo of step {step.step_id} is "
                        f"{step.undo.status}")
    undone = [s for s in steps if s.compensation is not None]
    if not undone:
        return Finish(FinalState.FAILED, f"{why}; nothing was done, so nothing needed undoing")
    done = ", ".join(f"{s.step_id} {s.intent.tool} by {s.compensation.tool}"
                     for s in undone if s.compensation is not None)
    return Finish(FinalState.COMPENSATED, f"{why}; undone, last first: {done}")


def _remaining(state: TaskState, n: int) -> str:
    before = [s.step_id for s in state.steps.values()
              if s.n < n and s.outcome is Outcome.DONE and s.undo.outcome is not Outcome.DONE]
    return f"; not undone yet, waiting behind it: {', '.join(before)}" if before else ""


def final_state_for(state: TaskState) -> FinalState:
    """What a task the model says is finished ends as."""
    last = state.steps[max(state.steps)] if state.steps else None
    if last is not None and last.outcome is Outcome.NOT_DONE:
        return FinalState.FAILED
    return FinalState.SUCCEEDED


@dataclass(frozen=True, slots=True)
class Refused:
    reason: str


def accept_call(state: TaskState, n: int, tool: ToolFacts | None, tool_name: str,
                args: dict[str, Any]) -> dict[str, Any] | Refused:
    """The fields of `step.intended` for the model's proposal, or why it is refused."""
    assert state.started is not None
    if tool_name not in state.started.allowed_tools:
        return Refused(f"refused: {tool_name} is not allowed for this task")
    if tool is None:
        return Refused(f"refused: there is no tool named {tool_name}")
    try:
        parsed = tool.args_model.model_validate(args)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                             for e in exc.errors(include_url=False))
        return Refused(f"refused: arguments for {tool_name} are invalid: {problems}")
    refusal = saga.saga_refusal(state, tool_name, tool.saga_role, tool.undo)
    if refusal is not None:
        return Refused(refusal)
    sid = step_id(state.task_id, n)
    return {
        "step_id": sid,
        "n": n,
        "tool": tool_name,
        "args": parsed.model_dump(mode="json"),  # frozen as first decided, normalised
        "key": mint_key(sid),
        "subject": tool.subject_of(parsed),
        "effect_class": tool.effect_class,
        "saga_role": tool.saga_role,
        "compensation": tool.undo,  # declared before the step runs
    }
