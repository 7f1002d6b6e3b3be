"""The outcomes topic: what users see, three states, never two.

Not an event of the journal: a message derived from it (rebuildable by replaying the journal),
one per visible change of a task, a step, or a step's compensation. A subscriber reads, for
each step: done with evidence; not done, safe to try again; or unknown, being checked, with
when the next check is due.

`message_id` is deterministic: `{task_id}/{about}/{seq}`, where `about` is `task`, the step id,
or the step's undo key, and `seq` counts that subject's changes in journal order (1, 2, ...).
A publisher that restarts and derives the same change again writes the same id, so delivery is
at-least-once and subscribers dedupe by `message_id` (equivalently: keep a message only if its
`seq` is higher than the last one seen for its subject).
"""

from __future__ import annotations

from typing import Literal, Self

from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator

from halfway.contract.events import SCHEMA_VERSION, Instant, StepId, TaskId, _type_is_required
from halfway.contract.ids import UNDO_SUFFIX, parse_step_id

# The visible states. Steps (and compensations) use the fold's step statuses; tasks their own.
StepVisibleState = Literal["intended", "in_flight", "done", "not_done", "unknown"]
TaskVisibleState = Literal[
    "requested", "running", "rejected", "succeeded", "failed", "compensated", "needs_attention"
]
STEP_STATES: frozenset[str] = frozenset(StepVisibleState.__args__)  # type: ignore[attr-defined]
TASK_STATES: frozenset[str] = frozenset(TaskVisibleState.__args__)  # type: ignore[attr-defined]
About = Literal["task", "step", "compensation"]


def about_key(task_id: str, subject: str, step_id: str | None) -> str:
    """The middle part of a message id: whose changes `seq` counts."""
    if subject == "task":
        return "task"
    if step_id is None:
        raise ValueError(f"a {subject} message needs a step id")
    return step_id + UNDO_SUFFIX if subject == "compensation" else step_id


def message_id_for(task_id: str, subject: str, step_id: str | None, seq: int) -> str:
    return f"{task_id}/{about_key(task_id, subject, step_id)}/{seq}"


class OutcomeChanged(BaseModel):
    """One visible change, as a user should read it."""

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=_type_is_required)

    type: Literal["outcome.changed"] = "outcome.changed"
    schema_version: Literal[1] = SCHEMA_VERSION
    message_id: str = Field(
        min_length=1, max_length=160,
        description="`{task_id}/{task | step id | undo key}/{seq}`: the same change always "
                    "carries the same id, so subscribers dedupe by it")
    seq: int = Field(ge=1, description="This subject's change number, 1, 2, ... in log order")
    task_id: TaskId
    step_id: StepId | None = Field(None, description="None for a task-level message")
    subject: About = Field(
        description="What changed: the task, a step, or the compensation (undo) of a step. "
                    "Not the business subject (e.g. invoice:INV-2291), which is in `words`.")
    state: StepVisibleState | TaskVisibleState = Field(
        description="steps and compensations: intended | in_flight | done | not_done | unknown; "
                    "tasks: requested | running | rejected | succeeded | failed | compensated | "
                    "needs_attention")
    words: str = Field(min_length=1, description="The state in a sentence nobody can misread")
    evidence: dict[str, JsonValue] | None = Field(None, description="What proves `done`")
    reason: str | None = Field(None, description="Why not done, why unknown, why rejected")
    reference: str | None = Field(
        None, description="The step's idempotency key: quote it when asking what happened")
    next_check_at: Instant | None = Field(
        None, description="For `unknown`: when the harness checks again (None: no check planned)")
    at: Instant = Field(description="The `at` of the journal event that made this change")
    finished: bool = Field(
        False, description="Task messages: the task is over (finished or rejected), so this "
                           "state is its last; `needs_attention` alone does not say that")

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.subject == "task":
            if self.step_id is not None:
                raise ValueError("a task-level message has no step_id")
            if self.state not in TASK_STATES:
                raise ValueError(f"{self.state!r} is not a task state")
        else:
            if self.step_id is None:
                raise ValueError(f"a {self.subject} message needs a step_id")
            if parse_step_id(self.step_id)[0] != self.task_id:
                raise ValueError(f"step {self.step_id} does not belong to task {self.task_id}")
            if self.state not in STEP_STATES:
                raise ValueError(f"{self.state!r} is not a step state")
            if self.finished:
                raise ValueError("only a task-level message says the task is finished")
        expected = message_id_for(self.task_id, self.subject, self.step_id, self.seq)
        if self.message_id != expected:
            raise ValueError(f"message_id {self.message_id!r} is not {expected!r}")
        return self

    @property
    def about(self) -> str:
        """Whose changes `seq` counts: `task`, the step id, or the undo key."""
        return about_key(self.task_id, self.subject, self.step_id)

    def record_key(self) -> bytes:
        # Keyed by task id, like the journal: one task's messages stay in order.
        return self.task_id.encode()


def parse_outcome(raw: bytes | str) -> OutcomeChanged:
    """Validate one JSON-encoded message. Raises pydantic.ValidationError with the reason."""
    return OutcomeChanged.model_validate_json(raw)
