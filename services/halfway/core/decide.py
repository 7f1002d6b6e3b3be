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

A proposal blocked by a subject another step holds (the subject guard: another task's charge of
the same invoice is in flight or unknown) is journaled as a refusal that names the holder, and
the task waits (`WaitFor`) until the holder releases the subject, bounded by the task's
deadline (or BLOCKED_WAIT_S_MAX); then the model is asked again and reads what happened. Such a
refusal does not count toward REFUSALS_MAX: waiting is not the model's mistake. A proposal
blocked for good (a once-per-subject effect already done) is a refusal like any other.

A question the model could not answer (an error, a timeout) is journaled as `model.failed`
by the decider, and the fold counts them per step. A permanent failure (a refused key, an
unknown model: asking again cannot help) ends the task `failed` at once; a transient one is
asked again at `model_retry_at` (exponential backoff from the journal, jitter drawn from the
failure's event id, never sooner than the endpoint's Retry-After), at most MODEL_FAILURES_MAX
times for one step, then the task ends `needs_attention`. So the model requests of one task
are bounded: per step, at most REFUSALS_MAX + 1 answers that count and MODEL_FAILURES_MAX
failures (plus refusals while waiting for a held subject, bounded by the deadline).

A saga (`halfway.core.saga`) adds two things: `accept_call` refuses a step that breaks the
order of saga roles, and a failing saga is undone instead of asking further: `Compensate`
journals the undo of each done step (last first), and the task finishes `compensated` once
every undo is done, or `needs_attention` if one cannot be. A task that is aborted decides no
new step; its steps in flight settle first.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel, ValidationError

from halfway.contract import (
    CompensationPlan,
    EffectClass,
    FinalState,
    ModelFailed,
    Outcome,
    SagaRole,
    SubjectHeld,
    mint_key,
    step_id,
)
from halfway.contract.events import SUBJECT_CHARS_MAX
from halfway.core import saga
from halfway.core.args import parse_args
from halfway.core.fold import StepStatus, TaskState, TaskStatus

REFUSALS_MAX = 3  # refused proposals for one step before the task gives up
# Failed model questions for one step (model.failed) before the task ends needs_attention;
# between them the decider waits MODEL_BACKOFF_S_BASE * 2**k (at most MODEL_BACKOFF_S_MAX, with
# jitter), or longer if the endpoint asked (Retry-After, at most MODEL_RETRY_AFTER_S_MAX).
MODEL_FAILURES_MAX = 5
MODEL_BACKOFF_S_BASE = 1.0
MODEL_BACKOFF_S_MAX = 60.0
MODEL_RETRY_AFTER_S_MAX = 600.0
# How long a task waits for a subject another step holds, when its policy has no deadline.
BLOCKED_WAIT_S_MAX = 86_400.0
# The model's arguments, as JSON: a step and its refusal must fit a journal record with room.
ARGS_BYTES_MAX = 64 * 1024


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
    """Journal `compensation.intended` for these steps, in this order: (n, tool, args, and
    which of the step's undo keys: 1, or a successor's)."""

    undos: tuple[tuple[int, str, dict[str, Any], int], ...]
    why: str


@dataclass(frozen=True, slots=True)
class Hold:
    """Nothing to decide until something settles; `reason` says what."""

    reason: str


@dataclass(frozen=True, slots=True)
class WaitFor:
    """The proposal for the next step was blocked by a subject another step holds: nothing to
    decide until that step releases it (the shell wakes the task then), or until `until`."""

    held: SubjectHeld
    until: datetime


@dataclass(frozen=True, slots=True)
class RetryAt:
    """The model failed to answer for the next step: ask again at `at` (the shell wakes the
    task then), not before."""

    at: datetime
    why: str


@dataclass(frozen=True, slots=True)
class Idle:
    """Nothing to do: not started, rejected or finished."""


TaskMove = Start | Reject | Ask | Abort | Compensate | Finish | Hold | WaitFor | RetryAt | Idle


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


def _never_held(_held: SubjectHeld) -> bool:
    return False


# A rejection names the unknown tools, within bounds: a request may list thousands, and its
# reason is journaled for good (a megabyte of names made a megabyte of journal).
UNKNOWN_TOOLS_NAMED_MAX = 10
TOOL_NAME_CHARS_MAX = 64


def _unknown_tools(names: list[str]) -> str:
    named = [n if len(n) <= TOOL_NAME_CHARS_MAX else f"{n[:TOOL_NAME_CHARS_MAX]}..."
             for n in names[:UNKNOWN_TOOLS_NAMED_MAX]]
    more = len(names) - len(named)
    return f"unknown tools: {', '.join(named)}" + (f" and {more} more" if more else "")


def decide(state: TaskState, *, known_tools: set[str], requested: bool, now: datetime,
           still_held: Callable[[SubjectHeld], bool] = _never_held) -> TaskMove:
    """The next move for a task. `still_held(h)`: whether the step that blocked a proposal
    still holds that subject (the subject guard's answer, passed in: this stays pure)."""
    if state.status in (TaskStatus.REJECTED, TaskStatus.FINISHED):
        return Idle()
    if state.started is None:
        if not requested:
            return Idle()
        assert state.request is not None
        if state.aborted is not None:  # called off while it waited to start: it never does
            return Reject(f"called off before it started, by {state.aborted.by}: "
                          f"{state.aborted.reason}")
        unknown = sorted(set(state.request.allowed_tools) - known_tools)
        if unknown:
            return Reject(_unknown_tools(unknown))
        return Start()

    failing = saga.failure(state, now)
    if failing is not None:
        return Abort(failing)
    undoing = saga.undoing(state)
    if undoing is not None:
        return _undo(state, undoing)
    for step in state.steps.values():
        if step.effect.needs_attention:
            return Hold(f"step {step.step_id} needs an operator: {step.effect.attention_why}")
        if step.status in (StepStatus.INTENDED, StepStatus.IN_FLIGHT, StepStatus.UNKNOWN):
            return Hold(f"step {step.step_id} is {step.status}")

    if state.aborted is not None:  # not a saga, or past its pivot: steps settle, then it ends
        return _called_off(state, f"aborted by {state.aborted.by}: {state.aborted.reason}")
    policy = state.started.policy
    n = state.next_step_n
    refused = state.refused(n)
    counted = [r for r in refused if r.blocked is None]  # waiting is not the model's mistake
    waiting = refused[-1].blocked if refused and still_held_by(refused[-1].blocked,
                                                                  still_held) else None
    give_up = None
    final = FinalState.FAILED
    failures, failed = state.model_failures.get(n, (0, None))
    if policy.deadline is not None and now >= policy.deadline:
        give_up = f"the deadline {policy.deadline:%Y-%m-%d %H:%M}Z passed"
        if waiting is not None:
            give_up += (f" while waiting for {waiting.subject}, which {waiting.holder} still "
                        f"holds")
    elif len(state.steps) >= policy.max_steps:
        give_up = f"reached the limit of {policy.max_steps} steps"
    elif len(counted) >= REFUSALS_MAX:
        give_up = (f"the model's proposals for step {n} were refused {len(counted)} times; "
                   f"the last: {counted[-1].reason}")
    elif waiting is not None:
        until = policy.deadline or refused[-1].at + timedelta(seconds=BLOCKED_WAIT_S_MAX)
        if now < until:
            return WaitFor(waiting, until)
        give_up = (f"waited for {waiting.subject} until {until:%Y-%m-%d %H:%M}Z; "
                   f"{waiting.holder} still holds it")
    elif failed is not None and not failed.transient:
        give_up = f"the model is unavailable: {failed.error} (asking again cannot help)"
    elif failed is not None and failures >= MODEL_FAILURES_MAX:
        give_up = (f"the model is unavailable: {failures} questions for step {n} failed; "
                   f"the last: {failed.error}")
        final = FinalState.NEEDS_ATTENTION
    elif failed is not None:
        at = model_retry_at(failures, failed)
        if now < at:
            return RetryAt(at, f"the model is unavailable ({failed.error}); asking again at "
                               f"{at:%H:%M:%S}Z, {failures} of {MODEL_FAILURES_MAX} failed")
    if give_up is not None:
        # A saga before its pivot is called off (and undone); anything else ends.
        if policy.saga and not saga.past_pivot(state):
            return Abort(give_up)
        return _end(state, final, give_up)
    return Ask(n)


def _end(state: TaskState, final: FinalState, why: str) -> Finish:
    """Finish as `final`, unless the task is a saga stranded past its pivot (`saga.stranded`)."""
    stranded = saga.stranded(state, why) if final is not FinalState.SUCCEEDED else None
    if stranded is not None:
        return Finish(FinalState.NEEDS_ATTENTION, stranded)
    return Finish(final, why)


def _called_off(state: TaskState, why: str) -> Finish:
    """How a task called off ends once its steps settled: `failed` only if nothing it did
    stands ("failed" reads as "nothing happened, safe to try again"). A step done before the
    call-off stands (only a saga undoes its steps): a person must see it."""
    assert state.started is not None
    stands = [f"{s.step_id} ({s.intent.tool})" for s in sorted(state.steps.values(),
                                                             key=lambda s: s.n)
              if s.outcome is Outcome.DONE and not saga.is_read(s)]
    if not stands or state.started.policy.saga:  # a saga here is past its pivot: `_end` says
        return _end(state, FinalState.FAILED, why)
    return _end(state, FinalState.NEEDS_ATTENTION,
                f"{why}; done before it stopped, and not undone (this task is not a saga): "
                f"{', '.join(stands)}")


def model_retry_at(failures: int, last: ModelFailed) -> datetime:
    """When to ask the model again after `failures` failed questions, the last one `last`:
    exponential backoff with jitter drawn from the failure's event id (pure, and the same in
    every process), never sooner than the endpoint asked."""
    jitter = 0.5 + 0.5 * (zlib.crc32(last.event_id.encode()) / 0xFFFFFFFF)
    delay_s = min(MODEL_BACKOFF_S_MAX, MODEL_BACKOFF_S_BASE * 2 ** (failures - 1)) * jitter
    if last.retry_after_s is not None:
        delay_s = max(delay_s, min(last.retry_after_s, MODEL_RETRY_AFTER_S_MAX))
    return last.at + timedelta(seconds=delay_s)


def still_held_by(held: SubjectHeld | None, still_held: Callable[[SubjectHeld], bool]) -> bool:
    return held is not None and still_held(held)


def _undo(state: TaskState, why: str) -> TaskMove:
    """The next move of a saga being undone."""
    steps = sorted(state.steps.values(), key=lambda s: -s.n)
    for step in steps:
        if step.effect.needs_attention:
            return Finish(FinalState.NEEDS_ATTENTION,
                          f"{why}; step {step.step_id} ({step.intent.tool}): "
                          f"{step.effect.attention_why}: an operator must say whether it "
                          f"happened, then undo it and the steps before it")
    undos: list[tuple[int, str, dict[str, Any], int]] = []
    for step in saga.undo_plan(state):
        if step.compensation is not None:  # the same undo again, under its next key
            again = step.compensation
            undos.append((step.n, again.tool, dict(again.args), again.generation + 1))
            continue
        plan, settlement = step.intent.compensation, step.effect.settlement
        assert settlement is not None
        args = None if plan is None else saga.undo_args(plan, dict(step.intent.args),
                                                         settlement.evidence)
        if plan is None or isinstance(args, str):
            cause = args if isinstance(args, str) else "it declared no undo"
            return Finish(FinalState.NEEDS_ATTENTION,
                          f"{why}; step {step.step_id} ({step.intent.tool}) is done but cannot "
                          f"be undone: {cause}")
        undos.append((step.n, plan.tool, args, 1))
    if undos:
        return Compensate(tuple(undos), why)
    for step in steps:
        undo = step.undo
        if step.compensation is not None and saga.undo_awaits_operator(step):
            return Hold(f"undoing the saga; the undo of step {step.step_id} needs an "
                        f"operator: {undo.attention_why} (halfway resolve "
                        f"{step.compensation.key})")
        if step.compensation is not None and (undo.outcome is Outcome.NOT_DONE
                                              or step.undo_needs_attention):
            reason = undo.settlement.reason if undo.settlement else None
            if undo.needs_attention and undo.last_check is not None:
                reason = undo.last_check.found
            elif not undo.needs_attention and step.undo_needs_attention:
                past = next(p for p in step.past_undos if p.state.needs_attention)
                reason = (f"under {past.plan.key}, proven not done before "
                          f"{step.compensation.key} was sent: {past.state.attention_why}")
            keys = (f" under any of its keys ({', '.join(step.undo_keys)})"
                    if step.past_undos else "")
            return Finish(FinalState.NEEDS_ATTENTION,
                          f"{why}; the undo of step {step.step_id} ({step.compensation.tool}) "
                          f"could not be done{keys} ({reason}): an operator must undo it"
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
              if s.n < n and s.outcome is Outcome.DONE and not saga.is_read(s)
              and s.undo.outcome is not Outcome.DONE]
    return f"; not undone yet, waiting behind it: {', '.join(before)}" if before else ""


def args_bytes(args: Any) -> int:
    """The size of a proposal's arguments as JSON (anything unencodable counts as too big)."""
    try:
        return len(json.dumps(args, separators=(",", ":"), default=str).encode())
    except (TypeError, ValueError, RecursionError, UnicodeEncodeError):
        return ARGS_BYTES_MAX + 1


def finish_for(state: TaskState, summary: str) -> Finish:
    """How a task the model says is finished (`summary`: the model's words) ends: as its last
    step went; a saga whose last step, past the pivot, was not done needs a person. A model
    that says nothing gets words from the facts: never "done" for a task that failed."""
    summary = summary.strip()
    last = state.steps[max(state.steps)] if state.steps else None
    if last is None or last.outcome is not Outcome.NOT_DONE:
        return Finish(FinalState.SUCCEEDED, summary or "done")
    settlement = last.effect.settlement
    not_done = (f"step {last.step_id} ({last.intent.tool}) was not done: "
                f"{settlement.reason if settlement else None}")
    stranded = saga.stranded(state, not_done)
    if stranded is not None:
        return Finish(FinalState.NEEDS_ATTENTION,
                      f"{stranded} (the model said: {summary})" if summary else stranded)
    return Finish(FinalState.FAILED, summary or not_done)


@dataclass(frozen=True, slots=True)
class Refused:
    reason: str


def _named(tool_name: str) -> str:
    """A proposed tool's name in a refusal: an empty one said so, not left blank."""
    return tool_name if tool_name.strip() else f"{tool_name!r} (no name)"


SUBJECT_ERROR_CHARS_MAX = 300  # of a subject function's exception, in the model's refusal


def _subject(tool: ToolFacts, tool_name: str, parsed: BaseModel) -> str | Refused | None:
    """The subject these arguments name, or a refusal the model reads: the subject is made
    from the model's arguments (`acct:{acct}`), so a bad one is the model's to mend, not a
    decision that cannot be placed."""
    try:
        subject = tool.subject_of(parsed)
    except Exception as exc:  # the app's subject function: anything may come
        try:
            words = f"{type(exc).__name__}: {exc}"[:SUBJECT_ERROR_CHARS_MAX]
        except Exception:  # an exception whose str() fails still has a name
            words = type(exc).__name__[:SUBJECT_ERROR_CHARS_MAX]
        return Refused(f"refused: no subject for {tool_name} from these arguments ({words})")
    if subject is not None and not 0 < len(subject) <= SUBJECT_CHARS_MAX:
        return Refused(f"refused: the subject for {tool_name} from these arguments is "
                       f"{len(subject)} characters; a subject has 1 to {SUBJECT_CHARS_MAX}")
    return subject


def accept_call(state: TaskState, n: int, tool: ToolFacts | None, tool_name: str,
                args: dict[str, Any]) -> dict[str, Any] | Refused:
    """The fields of `step.intended` for the model's proposal, or why it is refused."""
    assert state.started is not None
    if tool_name not in state.started.allowed_tools:
        return Refused(f"refused: {_named(tool_name)} is not allowed for this task")
    if tool is None:
        return Refused(f"refused: there is no tool named {_named(tool_name)}")
    size_bytes = args_bytes(args)
    if size_bytes > ARGS_BYTES_MAX:
        return Refused(f"refused: the arguments for {tool_name} are {size_bytes} bytes of "
                       f"JSON; at most {ARGS_BYTES_MAX} are accepted")
    try:
        parsed = parse_args(tool.args_model, args)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                             for e in exc.errors(include_url=False))
        return Refused(f"refused: arguments for {tool_name} are invalid: {problems}")
    refusal = saga.saga_refusal(state, tool_name, tool.saga_role, tool.undo, tool.effect_class)
    if refusal is not None:
        return Refused(refusal)
    subject = _subject(tool, tool_name, parsed)
    if isinstance(subject, Refused):
        return subject
    sid = step_id(state.task_id, n)
    return {
        "step_id": sid,
        "n": n,
        "tool": tool_name,
        "args": parsed.model_dump(mode="json"),  # frozen as first decided, normalised
        "key": mint_key(sid),
        "subject": subject,
        "effect_class": tool.effect_class,
        "saga_role": tool.saga_role,
        "compensation": tool.undo,  # declared before the step runs
    }
