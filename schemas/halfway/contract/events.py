"""The event contract: every fact halfway records, as pydantic models.

These models are the source of truth; `schemas/json/*.schema.json` is generated from them
(`python -m halfway.contract.jsonschema`) and committed, so callers in any language can publish
`task.requested`, subscribe to outcomes and replay the journal.

Rules every event follows:
- `type` names the event and discriminates the union `Event`;
- `event_id` is unique per fact: a producer that retries a send re-sends the same event_id, so a
  redelivered record is recognisable; a second actor writing "the same" fact writes a new id,
  and the fold's first-in-log rule decides between them;
- `task_id` is the partition key of every record on the journal, so one task's events are
  totally ordered;
- `at` is when the writer observed the fact (UTC); log order, not `at`, decides;
- `schema_version` is 1 for everything here; a change that old readers cannot ignore bumps it.

Unknown fields are refused (`extra="forbid"`): a typo in a hand-written event lands on the
dead-letter topic with the reason, instead of being half-understood.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated, Any, Literal, Self

from pydantic import (
    AwareDatetime,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    model_serializer,
    model_validator,
)

from halfway.contract.ids import (
    KEY_PATTERN,
    STEP_ID_PATTERN,
    STEP_N_MAX,
    TASK_ID_PATTERN,
    UNDO_KEYS_MAX,
    mint_key,
    mint_undo_key,
    parse_step_id,
    parse_undo_key,
)

SCHEMA_VERSION = 1
SUBJECT_CHARS_MAX = 500  # a subject names one business object: `invoice:INV-2291`
TOKENS_PER_QUESTION_MAX = 1_000_000_000

TaskId = Annotated[str, Field(pattern=TASK_ID_PATTERN, description="Named by the caller.")]
StepId = Annotated[str, Field(pattern=STEP_ID_PATTERN, description="`{task_id}:{n}`")]
Key = Annotated[
    str, Field(pattern=KEY_PATTERN, description="Idempotency key, minted by the harness.")
]
JsonObject = dict[str, JsonValue]

# Every time in the contract lies within these years: the services add days and backoffs to
# journaled times (sealing, checks, deadlines), and a record dated 9999-12-31 would overflow
# that arithmetic in every process that folds it. Out of range, a record is a dead letter.
TIME_MIN = datetime(1970, 1, 1, tzinfo=UTC)
TIME_MAX = datetime(9000, 1, 1, tzinfo=UTC)
Instant = Annotated[AwareDatetime, Field(
    ge=TIME_MIN, lt=TIME_MAX, json_schema_extra={  # the keywords ajv-formats checks
        "formatMinimum": "1970-01-01T00:00:00Z", "formatExclusiveMaximum": "9000-01-01T00:00:00Z"})]


# ---------------------------------------------------------------------------------------------
# Vocabulary (DESIGN.md): the words used in code, docs and messages.


class Outcome(StrEnum):
    """Three outcomes, never two."""

    DONE = "done"  # it happened; evidence says so (charge id, message id, booking ref)
    NOT_DONE = "not_done"  # it did not happen; proof says so (a refusal, or never sent)
    UNKNOWN = "unknown"  # it may have happened: timeout, reset after sending, 5xx, 409, 429, crash


class EffectClass(StrEnum):
    READ = "read"  # no effect: bounded retries, never unknown
    IDEMPOTENT = "idempotent"  # naturally safe to repeat
    KEYED = "keyed"  # the provider dedupes by our key for the key's lifetime
    UNKEYED = "unkeyed"  # no key: at most once, never blindly retried


class SagaRole(StrEnum):
    COMPENSABLE = "compensable"  # declares its undo before it runs
    PIVOT = "pivot"  # irreversible; at most one per saga
    RETRIABLE = "retriable"  # after the pivot; must eventually succeed


class SettlementSource(StrEnum):
    CALL = "call"  # the reply (or its absence) to our own request
    LOOKUP = "lookup"  # we asked the provider what happened
    WEBHOOK = "webhook"  # the provider told us, signature verified
    OPERATOR = "operator"  # a person resolved it


class OnUnknown(StrEnum):
    WAIT = "wait"  # the task does not move on until the step is settled (default)
    COMPENSATE = "compensate"  # a saga gives up: undo what is proven done, once it is known


class FinalState(StrEnum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    COMPENSATED = "compensated"
    NEEDS_ATTENTION = "needs_attention"


# ---------------------------------------------------------------------------------------------
# Parts carried inside events.


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TaskPolicy(_Part):
    saga: bool = Field(False, description="Run the task's steps as a saga (undo on failure).")
    max_steps: int = Field(20, ge=1, le=STEP_N_MAX)
    deadline: Instant | None = Field(None, description="After it, no new step is decided.")
    on_unknown: OnUnknown = OnUnknown.WAIT


class CompensationPlan(_Part):
    """How to undo a step, declared before the step runs. A string argument `"$args.NAME"` or
    `"$result.NAME"` is replaced, when the undo is intended, by that field of the step's
    frozen arguments or of the evidence its `done` settlement carries."""

    tool: str = Field(min_length=1)
    args: JsonObject = Field(default_factory=dict)


class SubjectHeld(_Part):
    """Who holds the subject a proposal was blocked on (the subject guard's verdict)."""

    subject: str = Field(min_length=1, max_length=SUBJECT_CHARS_MAX)
    tool: str = Field(min_length=1)
    holder: StepId = Field(description="The step whose claim holds the subject")


class Usage(_Part):
    """What one model question cost, as the model's endpoint reported it."""

    # Bounded so no record can overflow a sum (the read model's bigint): no real question costs
    # anywhere near a billion tokens.
    input_tokens: int = Field(0, ge=0, le=TOKENS_PER_QUESTION_MAX)
    output_tokens: int = Field(0, ge=0, le=TOKENS_PER_QUESTION_MAX)


class DecidedBy(_Part):
    """Which model decided a step: the journal says who chose, not just what."""

    model: str = Field(min_length=1)
    version: str | None = None
    usage: Usage | None = Field(None, description="The tokens the question for this decision "
                                                  "cost, when the model reports them")
    app: str | None = Field(None, max_length=200,
                            description="The app that decided it: `name@fingerprint` of its "
                                        "tools")


class ProposedCall(_Part):
    """A tool call the model proposed in the same answer as a step's, not run (one step at a
    time: each is decided once the one before it settled)."""

    tool: str = Field(min_length=1, max_length=200)
    args: JsonObject = Field(default_factory=dict)


# ---------------------------------------------------------------------------------------------
# Events.


# A UUID4's version and variant bits, as `uuid.uuid4()` sets them.
_UUID4_CLEAR = ~((0xF000 << 64) | (0xC000 << 48))
_UUID4_SET = (0x4000 << 64) | (0x8000 << 48)


def new_event_id() -> str:
    """A random UUID4 as 32 hex digits, the same as `uuid.uuid4().hex` at half its cost
    (several are minted per step)."""
    return f"{int.from_bytes(os.urandom(16), 'big') & _UUID4_CLEAR | _UUID4_SET:032x}"


def utc_now() -> datetime:
    return datetime.now(UTC)


def _type_is_required(schema: dict[str, Any]) -> None:
    # `type` has a default so Python code need not repeat it, but on the wire it is required:
    # it is what tells a reader which event it holds.
    schema["required"] = ["type", *[r for r in schema.get("required", []) if r != "type"]]


class _Event(BaseModel):
    """The envelope. `event_id` and `at` have no defaults on purpose: the writer stamps them
    once, before the first send, so a retried send and a replay see the same values (a pure
    core never reads the clock or draws ids itself)."""

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=_type_is_required)

    event_id: str = Field(min_length=1, max_length=64)
    task_id: TaskId
    at: Instant
    schema_version: Literal[1] = SCHEMA_VERSION


class _StepEvent(_Event):
    step_id: StepId

    @model_validator(mode="after")
    def _step_belongs_to_task(self) -> Self:
        task_id, _ = parse_step_id(self.step_id)
        if task_id != self.task_id:
            raise ValueError(f"step {self.step_id} does not belong to task {self.task_id}")
        return self


class TaskRequested(_Event):
    """A caller asks for a task (tasks topic). Requesting the same task id twice starts it once."""

    type: Literal["task.requested"] = "task.requested"
    input: JsonObject = Field(default_factory=dict)
    allowed_tools: list[str] = Field(default_factory=list)
    policy: TaskPolicy = Field(default_factory=TaskPolicy)
    # Who asked, when the writer knows it (the HTTP API: `api:NAME` of the bearer token). A
    # caller writing the tasks topic directly says what it likes: its principal is the bound.
    requested_by: str | None = Field(default=None, max_length=200)


class TaskStarted(_Event):
    """The decider accepted a task; from here on the journal alone describes it."""

    type: Literal["task.started"] = "task.started"
    input: JsonObject = Field(default_factory=dict)
    allowed_tools: list[str] = Field(default_factory=list)
    policy: TaskPolicy = Field(default_factory=TaskPolicy)


class TaskRejected(_Event):
    type: Literal["task.rejected"] = "task.rejected"
    reason: str = Field(min_length=1)


class StepIntended(_StepEvent):
    """A decision, journaled before anything happens. Args are frozen as first decided."""

    type: Literal["step.intended"] = "step.intended"
    n: int = Field(ge=1, le=STEP_N_MAX)
    tool: str = Field(min_length=1)
    args: JsonObject = Field(default_factory=dict)
    key: Key
    subject: str | None = Field(None, description="Business object touched, e.g. invoice:INV-2291")
    effect_class: EffectClass
    saga_role: SagaRole | None = None
    compensation: CompensationPlan | None = None
    decided_by: DecidedBy
    also_proposed: list[ProposedCall] = Field(
        default_factory=list, max_length=16,
        description="Further tool calls of the same model answer (parallel tool calls): not "
                    "run; the model reads that and proposes them again as next steps if still "
                    "needed")
    claim_id: str | None = Field(
        None, min_length=1, max_length=64,
        description="The subject guard claim (the event id of its subject.claimed) this step "
                    "was placed on. A step whose claim was withdrawn (claim.withdrawn) earlier "
                    "in the log is never accepted: it was written by a decider that had lost "
                    "the task")

    @model_validator(mode="after")
    def _names_are_minted(self) -> Self:
        if self.step_id != f"{self.task_id}:{self.n}":
            raise ValueError(f"step_id {self.step_id} is not '{{task_id}}:{{n}}' for n={self.n}")
        if self.key != mint_key(self.step_id):
            raise ValueError(f"key {self.key!r} is not the key minted for step {self.step_id}")
        if self.saga_role is SagaRole.COMPENSABLE and self.compensation is None:
            raise ValueError("a compensable step must declare its compensation before it runs")
        return self


class StepRefused(_Event):
    """The decider refused the model's proposal for step `n` (not allowed, invalid arguments,
    against a guard). Nothing was placed; the model sees the reason and decides again."""

    type: Literal["step.refused"] = "step.refused"
    n: int = Field(ge=1, le=STEP_N_MAX)
    tool: str
    args: JsonObject = Field(default_factory=dict)
    reason: str = Field(min_length=1)
    decided_by: DecidedBy
    blocked: SubjectHeld | None = Field(
        None, description="Set when a subject held by another step blocked the proposal: the "
                          "task waits for that subject's release, then asks again; such a "
                          "refusal does not count toward the refusal limit")


class ModelFailed(_Event):
    """A question to the model for step `n` got no usable answer (an error, a timeout). The
    decider asks again after a backoff, a bounded number of times; a permanent failure (a
    refused key, an unknown model) ends the task instead."""

    type: Literal["model.failed"] = "model.failed"
    n: int = Field(ge=1, le=STEP_N_MAX)
    model: str = Field(min_length=1, max_length=200)
    error: str = Field(min_length=1, max_length=2000)
    status: int | None = Field(None, description="The endpoint's HTTP status, if it answered")
    transient: bool = Field(description="Worth asking again (timeouts, 429, 5xx); false for "
                                        "401, 403, 400, 404: asking again cannot help")
    retry_after_s: float | None = Field(None, ge=0, le=86_400,
                                        description="What the endpoint asked us to wait")


class StepUnserved(_StepEvent):
    """An executor met a step (or an undo) for a tool its app does not have: the step waits
    for an executor that serves it. Written once per step by each executor that meets it."""

    type: Literal["step.unserved"] = "step.unserved"
    tool: str = Field(min_length=1, max_length=200)
    app: str = Field(min_length=1, max_length=200, description="`name@fingerprint` it serves")
    undo: bool = False


class StepAttempted(_StepEvent):
    """Journaled by the executor before each request leaves."""

    type: Literal["step.attempted"] = "step.attempted"
    attempt: int = Field(ge=1)
    key: Key
    started_at: Instant
    intent_id: str | None = Field(
        None, min_length=1, max_length=64,
        description="The `event_id` of the `step.intended` this attempt carries out. It counts "
                    "only for that decision: an attempt journaled together with a decision "
                    "the log did not take (a paused worker's) is never an attempt of the step.")

    @model_validator(mode="after")
    def _key_is_the_steps(self) -> Self:
        if self.key != mint_key(self.step_id):
            raise ValueError(f"key {self.key!r} is not the key minted for step {self.step_id}")
        return self


class _Settlement(_StepEvent):
    outcome: Outcome
    evidence: JsonObject | None = Field(None, description="What proves `done`.")
    reason: str | None = Field(None, description="Why `not_done`, or why it is `unknown`.")
    source: SettlementSource
    attempt: int | None = Field(
        None, ge=1, description="The attempt this settles, if one. A `not_done` that names one "
                                "covers the attempts up to it: a later attempt before it in "
                                "the log is not covered, and the fold does not apply it.")
    effect_id: str | None = Field(
        None, min_length=1, max_length=255,
        description="The provider's name for the effect (a charge id, a booking ref). Two "
                    "done settlements that name different effects contradict each other: "
                    "the effect may have happened twice")
    contradiction: str | None = Field(
        None, min_length=1, max_length=2000,
        description="Set when this report cannot settle the effect (it names another object, "
                    "or other amounts than the step asked for): kept as a contradiction for an "
                    "operator, never taken as the outcome")
    replayed: bool = Field(
        False, description="The provider answered from its idempotency store: the answer to an "
                           "earlier attempt, which a retry with the same key would get again")

    @model_validator(mode="after")
    def _outcome_is_substantiated(self) -> Self:
        # Three outcomes, each with what it rests on: done has evidence, the others a reason.
        if self.outcome is Outcome.DONE and not self.evidence:
            raise ValueError("a done settlement must carry evidence")
        if self.outcome is not Outcome.DONE and not self.reason:
            raise ValueError(f"a {self.outcome} settlement must carry a reason")
        if self.contradiction is not None and self.outcome is Outcome.UNKNOWN:
            raise ValueError("a contradiction reports done or not_done, never unknown")
        return self


class StepSettled(_Settlement):
    type: Literal["step.settled"] = "step.settled"


class StepChecked(_StepEvent):
    """A lookup that found nothing yet: the step stays unknown, and says when it is checked next."""

    type: Literal["step.checked"] = "step.checked"
    found: str = Field("nothing", description="What the check found, in words.")
    next_check_at: Instant | None = Field(None, description="None: no further check planned.")


class ClaimWithdrawn(_StepEvent):
    """The decider that owns the task withdraws subject claims of step `step_id` that never
    became the step (a decider that claimed, then crashed or paused, or another proposal placed
    instead). It is journaled before the claims are released on the guards topic, so the log
    orders it against a late `step.intended` of a paused decider: a step that names one of
    these claims and comes after this record is never accepted. A withdrawal that comes after
    the step it would void is void itself (the step holds its claim until it settles)."""

    type: Literal["claim.withdrawn"] = "claim.withdrawn"
    claim_ids: list[str] = Field(min_length=1, max_length=64)
    subject: str = Field(min_length=1, max_length=SUBJECT_CHARS_MAX)
    tool: str = Field(min_length=1)
    reason: str = Field(min_length=1)


def _generation() -> Any:
    return Field(1, ge=1, le=UNDO_KEYS_MAX,
                 description="Which of the step's undo keys this is about: 1 for the first "
                             "(`{step_id}:undo`), g for the successor `{step_id}:undo{g}`, "
                             "intended only once the one before was proven not done. Absent "
                             "means 1.")


class _UndoKeyed:
    """Written without `generation` when it is 1: an undo under its first key is the same
    record as before successor keys existed (older readers, and other languages, refuse
    unknown fields)."""

    @model_serializer(mode="wrap")
    def _first_key_unsaid(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out: dict[str, Any] = handler(self)
        if out.get("generation") == 1:
            del out["generation"]
        return out


class CompensationIntended(_UndoKeyed, _StepEvent):
    """The undo of a done step; `step_id` names the step being undone. A successor (a
    `generation` past 1) is the same undo under a new key, after the one before it was proven
    not done by a lookup (`halfway.contract.ids`)."""

    type: Literal["compensation.intended"] = "compensation.intended"
    tool: str = Field(min_length=1)
    args: JsonObject = Field(default_factory=dict)
    key: Key
    generation: int = _generation()

    @model_validator(mode="after")
    def _key_is_the_undo_key(self) -> Self:
        if self.key != mint_undo_key(self.step_id, self.generation):
            raise ValueError(f"key {self.key!r} is not undo key {self.generation} of step "
                             f"{self.step_id}")
        return self


class CompensationChecked(_UndoKeyed, _StepEvent):
    """A lookup of an undo that found nothing yet (like `step.checked`, for the compensation)."""

    type: Literal["compensation.checked"] = "compensation.checked"
    found: str = Field("nothing", description="What the check found, in words.")
    next_check_at: Instant | None = Field(None, description="None: no further check planned.")
    generation: int = _generation()


class CompensationAttempted(_StepEvent):
    type: Literal["compensation.attempted"] = "compensation.attempted"
    attempt: int = Field(ge=1)
    key: Key
    started_at: Instant

    @model_validator(mode="after")
    def _key_is_an_undo_key(self) -> Self:
        undo = parse_undo_key(self.key)
        if undo is None or undo[0] != self.step_id:
            raise ValueError(f"key {self.key!r} is not an undo key of step {self.step_id}")
        return self

    @property
    def generation(self) -> int:
        undo = parse_undo_key(self.key)
        assert undo is not None  # the validator saw to it
        return undo[1]


class CompensationSettled(_UndoKeyed, _Settlement):
    type: Literal["compensation.settled"] = "compensation.settled"
    generation: int = _generation()


class TaskAborted(_Event):
    """A caller or operator calls the task off. No new step is decided; a saga undoes what is
    proven done. Steps already in flight are never abandoned: they settle first."""

    type: Literal["task.aborted"] = "task.aborted"
    reason: str = Field(min_length=1)
    by: str = Field("operator", min_length=1, description="Who called it off.")


class TaskFinished(_Event):
    type: Literal["task.finished"] = "task.finished"
    state: FinalState
    summary: str = Field(min_length=1)
    decided_by: DecidedBy | None = Field(None, description="Set when the model said finished")


Event = Annotated[
    TaskRequested
    | TaskStarted
    | TaskRejected
    | StepIntended
    | StepRefused
    | ModelFailed
    | StepUnserved
    | StepAttempted
    | StepSettled
    | StepChecked
    | ClaimWithdrawn
    | CompensationIntended
    | CompensationAttempted
    | CompensationSettled
    | CompensationChecked
    | TaskAborted
    | TaskFinished,
    Field(discriminator="type"),
]
EVENT_TYPES: tuple[type[BaseModel], ...] = (
    TaskRequested,
    TaskStarted,
    TaskRejected,
    StepIntended,
    StepRefused,
    ModelFailed,
    StepUnserved,
    StepAttempted,
    StepSettled,
    StepChecked,
    ClaimWithdrawn,
    CompensationIntended,
    CompensationAttempted,
    CompensationSettled,
    CompensationChecked,
    TaskAborted,
    TaskFinished,
)

EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


def event_type_name(model: type[BaseModel]) -> str:
    """The `type` string of an event class, e.g. 'step.settled'."""
    return model.model_fields["type"].default


def parse_event(raw: bytes | str) -> Event:
    """Validate one JSON-encoded event. Raises pydantic.ValidationError with the reason."""
    return EVENT_ADAPTER.validate_json(raw)


def parse_event_obj(obj: Any) -> Event:
    return EVENT_ADAPTER.validate_python(obj)


def encode_event(event: Event) -> bytes:
    return event.model_dump_json().encode()


# ---------------------------------------------------------------------------------------------
# The dead-letter record: not an event of a task, but part of the contract (callers read it).


class DeadLetter(BaseModel):
    """A record no service could apply, with the reason and where the original lives.

    The original stays where it is (topics keep everything), so the letter carries a bounded
    excerpt and a digest of it, never the whole value: a letter always fits the broker,
    whatever the size of the record it describes."""

    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=_type_is_required)

    type: Literal["dead_letter"] = "dead_letter"
    schema_version: Literal[1] = SCHEMA_VERSION
    reason: str = Field(max_length=2000)
    source_topic: str = Field(max_length=255)
    source_partition: int
    source_offset: int
    key: str | None = Field(None, max_length=1000,
                            description="The start of the record's key, as UTF-8 (replaced).")
    value: str = Field(description="The start of the record's value, decoded as UTF-8 with "
                                   "replacement: an excerpt of at most 2 KiB")
    value_b64: str | None = Field(None, description="The excerpt's raw bytes, base64, when they "
                                                    "are not valid UTF-8")
    value_bytes: int = Field(0, ge=0, description="The size of the whole value, in bytes")
    value_sha256: str | None = Field(None, description="sha256 of the whole value, hex")
    truncated: bool = Field(False, description="The excerpt is shorter than the value")
    headers: dict[str, str] = Field(default_factory=dict, description="At most 16, each cut "
                                                                      "to 200 characters")
    consumer_group: str | None = None
    at: Instant
