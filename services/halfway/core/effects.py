"""effects: the effects the harness performs, steps and undos alike. Pure.

A compensation is a keyed effect of its own (`{task}:{n}:undo`), attempted, timed out, looked
up and reconciled exactly like a step: the same `EffectState` in the fold, the same
`next_action`. Only the events that record it differ (`compensation.*` instead of `step.*`).
`Effect` is that difference in one place, so the executor and the reconciler have one code
path for both.
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
    StepAttempted,
    StepChecked,
    StepSettled,
)
from halfway.core import saga
from halfway.core.fold import EffectState, TaskState


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

    @property
    def move_id(self) -> str:
        """Names the move in flight for this effect (at most one at a time)."""
        return f"{self.step_id}:undo" if self.undo else self.step_id

    def attempted(self, stamp: dict[str, Any], attempt: int,
                  started_at: datetime) -> StepAttempted | CompensationAttempted:
        if self.undo:
            return CompensationAttempted(**stamp, step_id=self.step_id, attempt=attempt,
                                         key=self.key, started_at=started_at)
        return StepAttempted(**stamp, step_id=self.step_id, attempt=attempt, key=self.key,
                             started_at=started_at, intent_id=self.intent_id)

    def settled(self, stamp: dict[str, Any], **fields: Any) -> StepSettled | CompensationSettled:
        kind = CompensationSettled if self.undo else StepSettled
        return kind(**stamp, step_id=self.step_id, **fields)

    def checked(self, stamp: dict[str, Any], found: str,
                next_check_at: datetime | None) -> StepChecked | CompensationChecked:
        kind = CompensationChecked if self.undo else StepChecked
        return kind(**stamp, step_id=self.step_id, found=found, next_check_at=next_check_at)


def effects_to_work(state: TaskState, now: datetime) -> list[Effect]:
    """Every effect of the task that the harness may move now: each step, and each undo whose
    turn has come (undos run last step first)."""
    out: list[Effect] = []
    for step in sorted(state.steps.values(), key=lambda s: s.n):
        intent = step.intent
        out.append(Effect(False, intent.task_id, step.step_id, intent.tool, intent.args,
                          intent.key, step.effect, saga.called_off(state, step),
                          intent.event_id))
        plan = step.compensation
        if plan is not None and saga.undo_may_run(state, step):
            out.append(Effect(True, intent.task_id, step.step_id, plan.tool, plan.args,
                              plan.key, step.undo))
    return out
