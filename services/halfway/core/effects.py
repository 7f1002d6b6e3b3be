"""effects: the effects the harness performs, steps and undos alike. Pure.

A compensation is a keyed effect of its own (`{task}:{n}:undo`, or a successor key once a
lookup proved the last one did nothing), attempted, timed out, looked up and reconciled
exactly like a step: the same `EffectState` in the fold, the same
`next_action`. Only the events that record it differ (`compensation.*` instead of `step.*`).
`Effect` is that difference in one place, so the executor and the reconciler have one code
path for both.

Some effects must happen once begun (`must_happen`): an undo, and a saga's step past its pivot
(a `retriable` one). A saga cannot be left half undone, nor stop short past its point of no
return, over a request that never reached the provider; such a request is retried with its key
(`classify`), and only the provider's refusal ends it `not_done`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from halfway.contract import (
    CompensationAttempted,
    CompensationChecked,
    CompensationSettled,
    EffectClass,
    Outcome,
    SagaRole,
    StepAttempted,
    StepChecked,
    StepSettled,
    parse_step_id,
)
from halfway.core import saga
from halfway.core.fold import Attempt, EffectState, TaskState


@dataclass(frozen=True, slots=True)
class Effect:
    undo: bool  # False: the step itself; True: its compensation
    task_id: str
    step_id: str
    tool: str
    args: Mapping[str, Any]
    key: str
    state: EffectState
    # A step never sent that must not be sent any more (its task was aborted or its saga is
    # being undone), and why; settled `not_done` instead of called.
    called_off: str | None = None
    intent_id: str | None = None  # a step's: the decision its attempts carry out
    must_happen: bool = False  # an undo, or a saga's retriable step (module docstring)
    generation: int = 1  # an undo's: which of the step's undo keys `key` is
    effect_class: EffectClass | None = None  # a step's, as its decision journaled it

    @property
    def move_id(self) -> str:
        """Names the move in flight for this effect (at most one at a time)."""
        return self.key if self.undo else self.step_id

    def attempted(self, stamp: dict[str, Any], attempt: int,
                  started_at: datetime) -> StepAttempted | CompensationAttempted:
        if self.undo:
            return CompensationAttempted(**stamp, step_id=self.step_id, attempt=attempt,
                                         key=self.key, started_at=started_at)
        return StepAttempted(**stamp, step_id=self.step_id, attempt=attempt, key=self.key,
                             started_at=started_at, intent_id=self.intent_id)

    def settled(self, stamp: dict[str, Any], **fields: Any) -> StepSettled | CompensationSettled:
        if self.undo:
            return CompensationSettled(**stamp, step_id=self.step_id,
                                       generation=self.generation, **fields)
        return StepSettled(**stamp, step_id=self.step_id, **fields)

    def checked(self, stamp: dict[str, Any], found: str,
                next_check_at: datetime | None) -> StepChecked | CompensationChecked:
        if self.undo:
            return CompensationChecked(**stamp, step_id=self.step_id, found=found,
                                       next_check_at=next_check_at, generation=self.generation)
        return StepChecked(**stamp, step_id=self.step_id, found=found,
                           next_check_at=next_check_at)


def effects_to_work(state: TaskState, now: datetime) -> list[Effect]:
    """Every effect of the task that the harness may move now: each step, and each undo whose
    turn has come (undos run last step first)."""
    out: list[Effect] = []
    is_saga = state.started is not None and state.started.policy.saga
    for step in sorted(state.steps.values(), key=lambda s: s.n):
        intent = step.intent
        out.append(Effect(False, intent.task_id, step.step_id, intent.tool, intent.args,
                          intent.key, step.effect, saga.called_off(state, step),
                          intent.event_id,
                          must_happen=is_saga and intent.saga_role is SagaRole.RETRIABLE,
                          effect_class=intent.effect_class))
        plan = step.compensation
        if plan is not None and saga.undo_may_run(state, step):
            out.append(Effect(True, intent.task_id, step.step_id, plan.tool, plan.args,
                              plan.key, step.undo, must_happen=True,
                              generation=plan.generation))
    return out


def why_not_send(state: TaskState | None, effect: Effect, attempted: Attempt,
                 placed_intent: str | None = None) -> tuple[str, bool] | None:
    """Whether an attempt this executor journaled may go out, asked of its fold once that has
    read the attempt back: None if so, else why not, and whether this executor's record is
    the only one of the attempt that could be sent (then it is settled as never sent).

    It may go only while the effect is still open for it at its place in the log: its
    record is the first of its attempt number, nothing settled the effect for good (`done`,
    `not_done`), and for a step's first attempt, its task was neither aborted nor over. The
    attempt was decided on the executor's own fold, which a pause can leave stale; the log
    is the arbiter. A key does not cover that: after a successor's request never reached the
    provider (settled `not_done`), a late copy would be the first request under the key.
    Nothing at all dedupes an `unkeyed` one. (`placed_intent`: the decision journaled with
    the attempt, which the log must have taken as the step's: a worker paused before its
    append may find the task finished, or the step decided by another.)"""
    _, n = parse_step_id(effect.step_id)
    step = None if state is None else state.step(n)
    if placed_intent is not None and (step is None or step.intent.event_id != placed_intent):
        return "the log did not take the decision journaled with it", False
    if effect.undo and step is not None and step.undo_generation != effect.generation:
        return f"the undo is intended under another key than {effect.key} now", False
    known = None if step is None else (step.undo if effect.undo else step.effect)
    first = next((a for a in (known.attempts if known else ())
                  if a.attempt == attempted.attempt), None)
    if first is None or first.event_id != attempted.event_id:
        return "another executor's attempt came first in the log", False
    if known is not None and known.outcome in (Outcome.DONE, Outcome.NOT_DONE):
        return f"the effect was settled {known.outcome.value} meanwhile", False
    if not effect.undo and attempted.attempt == 1 and state is not None and \
            (state.aborted is not None or state.finished is not None):
        # A step not sent before its task was called off is never sent (`saga.called_off`).
        # Its first attempt is this record, so no other copy of it goes out. (A later
        # attempt is a retry of one that may have happened: it goes on as for any step.)
        return "the task was called off before its first attempt went out", True
    return None
