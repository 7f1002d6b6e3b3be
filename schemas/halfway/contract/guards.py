"""The subject guard's records, on the guards topic (keyed by subject).

Not events of a task: claims on a business object (`invoice:INV-2291`) by a step of any task.
Keying by subject puts every claim on one subject in one partition, so the log orders them and
every reader folds them to the same answer (`halfway.core.guard`): the first live claim holds
the subject, a later claim by another step is blocked, whichever instance wrote it. The decider
claims before it journals `step.intended` and places the step only once its claim is confirmed
first in the log; it releases the claim when the step settles.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from halfway.contract.events import (
    SCHEMA_VERSION,
    SUBJECT_CHARS_MAX,
    Instant,
    StepId,
    TaskId,
    _type_is_required,
)


class Release(StrEnum):
    DONE = "done"  # the effect happened: a once-per-subject tool never repeats it
    NOT_DONE = "not_done"  # it did not: the subject is free again
    ABANDONED = "abandoned"  # the claim never became a step (a crash, another proposal)


class _GuardRecord(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=_type_is_required)

    event_id: str = Field(min_length=1, max_length=64)
    schema_version: Literal[1] = SCHEMA_VERSION
    at: Instant
    subject: str = Field(min_length=1, max_length=SUBJECT_CHARS_MAX)
    tool: str = Field(min_length=1)
    step_id: StepId
    task_id: TaskId

    def record_key(self) -> bytes:
        return self.subject.encode()


class SubjectClaimed(_GuardRecord):
    type: Literal["subject.claimed"] = "subject.claimed"
    once_per_subject: bool = Field(False, description="A done effect is never repeated.")


class SubjectReleased(_GuardRecord):
    type: Literal["subject.released"] = "subject.released"
    release: Release
    claim_id: str | None = Field(
        None, min_length=1, max_length=64,
        description="The claim released (its subject.claimed event id): a release frees the "
                    "subject only while that very claim holds it, so a late release of an old "
                    "claim never frees a newer one. None (older records): any claim of the step")


GuardRecord = Annotated[SubjectClaimed | SubjectReleased, Field(discriminator="type")]
GUARD_ADAPTER: TypeAdapter[GuardRecord] = TypeAdapter(GuardRecord)


def parse_guard_record(raw: bytes | str) -> GuardRecord:
    return GUARD_ADAPTER.validate_json(raw)
