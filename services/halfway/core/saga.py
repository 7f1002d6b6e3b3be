"""saga: the order rules of a saga, and how it is undone. Pure: the caller passes the clock.

Theory of operation
-------------------
A saga is a task whose steps only make sense as a set (hold a flight, book a hotel, charge the
card, email the itinerary). Its steps stand in a fixed order of saga roles:

    compensable* → pivot? → retriable*

Every step before the pivot can be undone, and says how before it runs (its undo is journaled
with it). The pivot is the point of no return (at most one). After it come only steps that
must eventually succeed, retried with their key. `saga_refusal` refuses, with a reason the
model can read, a step that breaks this order.

A saga fails while its pivot is not done: a step ends `not_done`, the deadline passes, or
(with `on_unknown=compensate`) a step is unknown (`failure`). The decider then calls the task
off in the journal (`task.aborted` by halfway, with the reason), so the decision sticks when
the cause goes away (the unknown step is proven done); a caller or operator may abort it too.
From then on no step is decided; `undo_plan` names the done steps whose undo must be
journaled (again, under the next key, once a lookup proved the last key did nothing), and the
executor runs the undos in reverse order (`undo_may_run`): the undo of
step k only once every later step is proven not done or undone. A step still unknown is
undone only once it is proven done; one proven not done needs no undo. An undo unknown with no
further check waits for an operator's verdict (`undo_awaits_operator`): done, and the undos
go on; not done, and the saga needs attention, as for an undo the provider refused. Once the
pivot is done the saga only goes forward; one that cannot (a step after the pivot ends
`not_done` and the model finishes, it gives up, or it is called off) ends `needs_attention`
(`stranded`), never `failed`: what is done stands and cannot be undone (the customer was
charged), and "failed" would read as "nothing happened, safe to try again".
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from halfway.contract import CompensationPlan, EffectClass, OnUnknown, Outcome, SagaRole
from halfway.core.fold import StepState, StepStatus, TaskState, successor_due

UNSETTLED = (StepStatus.INTENDED, StepStatus.IN_FLIGHT, StepStatus.UNKNOWN)


def pivot_of(state: TaskState) -> StepState | None:
    return next((s for s in state.steps.values() if s.intent.saga_role is SagaRole.PIVOT), None)


def saga_refusal(state: TaskState, tool: str, role: SagaRole | None,
                 undo: CompensationPlan | None,
                 effect_class: EffectClass | None = None) -> str | None:
    """Why a saga cannot place a step of `tool` next, in words the model can read; None if
    it can (or the task is not a saga). A read has nothing to take back: it goes anywhere."""
    assert state.started is not None
    if not state.started.policy.saga or effect_class is EffectClass.READ:
        return None
    pivot = pivot_of(state)
    if role is None or (role is SagaRole.COMPENSABLE and undo is None):
        return (f"refused: {tool} declares no undo and is not the pivot, so this saga could "
                f"not take it back; a saga places undoable steps, then one pivot, then "
                f"retriable steps")
    if role is SagaRole.PIVOT and pivot is not None:
        return (f"refused: this saga already has its pivot, {pivot.step_id} "
                f"({pivot.intent.tool}); a second step that cannot be undone is not allowed")
    if role is SagaRole.COMPENSABLE and pivot is not None:
        return (f"refused: {tool} would come after the pivot {pivot.step_id} "
                f"({pivot.intent.tool}); nothing that may need undoing can follow the point "
                f"of no return")
    if role is SagaRole.RETRIABLE and pivot is None:
        return (f"refused: {tool} cannot be undone and is not the pivot; place it after "
                f"the pivot")
    return None


HARNESS = "halfway"  # who calls off a saga that failed


def past_pivot(state: TaskState) -> bool:
    pivot = pivot_of(state)
    return pivot is not None and pivot.outcome is Outcome.DONE


def stranded(state: TaskState, why: str) -> str | None:
    """Why a saga that ends now, past its pivot, without going all the way forward needs a
    person (`why`: what stopped it); None if the task is not a saga past its pivot."""
    if state.started is None or not state.started.policy.saga or not past_pivot(state):
        return None
    pivot = pivot_of(state)
    assert pivot is not None
    return (f"{why}; this saga is past its pivot ({pivot.step_id} {pivot.intent.tool} is done "
            f"and cannot be undone), so what is done stands: an operator must finish it")


def undoing(state: TaskState) -> str | None:
    """Why this saga is being undone (it was called off before its pivot was done), or None."""
    if state.started is None or not state.started.policy.saga or state.aborted is None:
        return None
    if past_pivot(state):
        return None  # past the point of no return: forward only
    if state.aborted.by == HARNESS:
        return state.aborted.reason
    return f"aborted by {state.aborted.by}: {state.aborted.reason}"


def failure(state: TaskState, now: datetime) -> str | None:
    """Why this saga must be called off now, or None: not a saga, already called off, past its
    pivot, or going well."""
    if state.started is None or not state.started.policy.saga or state.aborted is not None:
        return None
    if past_pivot(state):
        return None  # past the point of no return: forward only
    for step in state.steps.values():
        if step.outcome is Outcome.NOT_DONE:
            reason = step.effect.settlement.reason if step.effect.settlement else None
            return f"step {step.step_id} ({step.intent.tool}) was not done: {reason}"
    policy = state.started.policy
    if policy.on_unknown is OnUnknown.COMPENSATE:
        for step in state.steps.values():
            if step.status is StepStatus.UNKNOWN:
                return (f"step {step.step_id} ({step.intent.tool}) is unknown, and the policy "
                        f"gives up on unknowns")
    if policy.deadline is not None and now >= policy.deadline:
        return f"the deadline {policy.deadline:%Y-%m-%d %H:%M}Z passed"
    return None


def undo_plan(state: TaskState) -> list[StepState]:
    """Done steps whose undo is to be journaled, last step first: not journaled yet, or to
    be journaled again under its next key (`fold.successor_due`: a lookup proved the latest
    key did nothing, as when the provider saved a 5xx under it and replays it to every retry)."""
    return [s for s in sorted(state.steps.values(), key=lambda s: -s.n)
            if s.outcome is Outcome.DONE and not is_read(s)
            and (s.compensation is None or successor_due(s))]


def is_read(step: StepState) -> bool:
    """A step with no effect (a lookup of the world): nothing to undo."""
    return step.intent.effect_class is EffectClass.READ


def undo_may_run(state: TaskState, step: StepState) -> bool:
    """Undos run in reverse order: step k's only once every later step is proven not done or
    its undo is done."""
    for later in state.steps.values():
        if later.n <= step.n or is_read(later):
            continue
        if later.outcome is Outcome.NOT_DONE:
            continue
        if later.outcome is Outcome.DONE and later.undo.outcome is Outcome.DONE:
            continue
        return False
    return True


def undo_awaits_operator(step: StepState) -> bool:
    """The step's undo is unknown and no further check is planned, and no report about it
    contradicts another: only a person can say whether it happened (`halfway resolve
    STEP:undo`), and the saga goes on from that verdict, so it waits for one instead of
    ending (as a task waits for an operator to settle its step)."""
    return (step.compensation is not None and step.undo.escalated
            and not step.undo.contradicted
            and not any(p.state.needs_attention for p in step.past_undos))


def undo_args(plan: CompensationPlan, args: dict[str, Any],
              evidence: dict[str, Any] | None) -> dict[str, Any] | str:
    """The undo's arguments, with `$args.NAME` / `$result.NAME` filled in; or why not."""
    sources = {"args": args, "result": evidence or {}}
    out: dict[str, Any] = {}
    for name, value in plan.args.items():
        if isinstance(value, str) and value.startswith("$") and "." in value:
            source, _, field = value[1:].partition(".")
            if source not in sources:
                return f"the undo argument {name}={value!r} names no known source"
            if field not in sources[source]:
                return f"the step's {source} has no {field!r} for the undo argument {name}"
            out[name] = sources[source][field]
        else:
            out[name] = value
    return out


def called_off(state: TaskState, step: StepState) -> str | None:
    """Why a step that was never sent must not be sent any more (the task was called off), or
    None. A step with an attempt is never called off: it may have
    happened, so it is settled like any other."""
    if step.effect.attempts or step.outcome is not None:
        return None
    if state.aborted is not None:
        return f"the task was called off before this step was sent: {state.aborted.reason}"
    return None
