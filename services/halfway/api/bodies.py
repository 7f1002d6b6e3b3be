"""What the API's write endpoints take and answer, as pydantic models.

They validate every request body (a wrong one is answered 400 or 422 with the reason, and
nothing is journaled), and the OpenAPI document's schemas for them are generated from these
same classes (`halfway.api.openapi`), so the document cannot drift from what is checked.
"""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, JsonValue, model_validator

from halfway.contract import TaskPolicy
from halfway.contract.events import Key, StepId, TaskId
from halfway.finite import refuse_non_finite
from halfway.resolve import REASON_CHARS_MAX  # the command line's bound, the same act

TOOL_NAME_CHARS_MAX = 200
ALLOWED_TOOLS_MAX = 100
EVIDENCE_FIELDS_MAX = 50

Reason = Annotated[str, Field(min_length=1, max_length=REASON_CHARS_MAX,
                              pattern=r"\S", description="In words the journal keeps.")]


FiniteJson = Annotated[JsonValue, AfterValidator(refuse_non_finite)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StartTask(_Body):
    """Ask for a task (`task.requested` on the tasks topic). Asking again with the same task
    id starts it once: the first request counts."""

    task_id: TaskId
    input: dict[str, FiniteJson] = Field(
        default_factory=dict, description='The task\'s input; its "prompt" is the user message.')
    allowed_tools: list[Annotated[str, Field(min_length=1, max_length=TOOL_NAME_CHARS_MAX)]] = \
        Field(min_length=1, max_length=ALLOWED_TOOLS_MAX,
              description="The tools the task may use (a tool no executor serves is refused "
                          "by the decider, with the reason in the task's status).")
    policy: TaskPolicy = Field(default_factory=TaskPolicy)


class AbortTask(_Body):
    """Call a started task off: no new step is decided, steps in flight settle, and a saga
    undoes what is proven done (last first)."""

    reason: Reason


class ResolveStep(_Body):
    """Settle a step, or its undo (`{step_id}:undo`), by hand (source `operator`): done with
    evidence, or not done with the reason. One already settled is refused unless `force` (a
    second verdict is kept as a contradiction, never silently)."""

    outcome: Literal["done", "not_done"]
    evidence: dict[str, FiniteJson] | None = Field(
        None, min_length=1, max_length=EVIDENCE_FIELDS_MAX,
        description="What proves `done`, e.g. {\"charge_id\": \"ch_...\"}.")
    reason: Reason | None = None
    force: bool = False

    @model_validator(mode="after")
    def _substantiated(self) -> Self:
        if self.outcome == "done" and not self.evidence:
            raise ValueError("done needs evidence, e.g. {\"charge_id\": \"ch_...\"}")
        if self.outcome == "not_done" and not self.reason:
            raise ValueError("not_done needs a reason")
        return self


class TaskRequestedAnswer(_Body):
    task_id: TaskId
    event_id: str
    requested_by: str = Field(description="Who asked (`api:TOKEN_NAME`), as journaled.")
    status_url: str = Field(description="Where the task shows, once the projector has it.")


class TaskAbortedAnswer(_Body):
    task_id: TaskId
    event_id: str
    by: str = Field(description="Who called it off, as journaled: `api:TOKEN_NAME`.")
    reason: str


class StepResolvedAnswer(_Body):
    task_id: TaskId
    step_id: StepId
    undo_key: Key | None = Field(None, description="Set when the verdict settles the step's "
                                 "undo under this key (`compensation.settled`).")
    event_id: str
    outcome: Literal["done", "not_done"]
    by: str = Field(description="Who resolved it, as journaled: `api:TOKEN_NAME`.")


REQUEST_BODIES: tuple[type[BaseModel], ...] = (StartTask, AbortTask, ResolveStep)
ANSWERS: tuple[type[BaseModel], ...] = (TaskRequestedAnswer, TaskAbortedAnswer,
                                        StepResolvedAnswer)
