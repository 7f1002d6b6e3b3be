"""Operator resolution: a person settles a step the harness could not.

Also `halfway abort TASK --reason …`: a caller or operator calls a task off.

`halfway resolve STEP done --evidence charge_id=ch_…` or
`halfway resolve STEP not_done --reason "the bank confirmed no payment"` journals
`step.settled` with source `operator`; the decider then moves the task on. It refuses to settle
a step that is not in the journal, or one already settled (a second verdict would only be kept
as a contradiction: say `--force` to record one deliberately).

Who acted is journaled, never left blank: the command line records the OS user it runs as
(`os:alice`), after the name `--by` gives when one is given (`the CFO (os:alice)`); the HTTP API
records the name of the token (`api:ops`). The same functions serve both, and the API passes
its one journal writer.
"""

from __future__ import annotations

import contextlib
import getpass
import os
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from pydantic import ValidationError

from halfway import tracing
from halfway.contract import (
    Outcome,
    SettlementSource,
    StepSettled,
    TaskAborted,
    encode_event,
    parse_step_id,
)
from halfway.contract.ids import is_task_id
from halfway.journal import JournalWriter
from halfway.journal.records import describe, stamp
from halfway.journal.replay import task_state
from halfway.settings import KafkaSettings

BY_CHARS_MAX = 200
REASON_CHARS_MAX = 2000  # an operator's reason, here and in the API (halfway.api.bodies)
E = TypeVar("E", StepSettled, TaskAborted)


class ResolveRefused(Exception):
    """Why the resolution was not journaled, in words for the operator."""


class NotInJournal(ResolveRefused):
    """The step or task it names is not in the journal."""


class AlreadyDecided(ResolveRefused):
    """The step is settled, or the task is over or called off, already."""


def os_user() -> str:
    """The user this process runs as (a uid when the system has no name for it)."""
    try:
        return getpass.getuser()
    except (OSError, KeyError):  # no LOGNAME/USER and no passwd entry (a bare container)
        return f"uid{os.getuid()}"


def operator_identity(by: str | None, user: str | None = None) -> str:
    """Who acted, as the command line journals it: always the OS user, after the name `--by`
    gives (free text, so it is never all the journal knows)."""
    user = user or os_user()
    if by is None:
        return f"os:{user}"
    by = " ".join(by.split())
    if not by:
        raise ResolveRefused("--by must name who acts (it is empty); leave it out to record "
                             f"the OS user, os:{user}")
    return by if by == f"os:{user}" else f"{by} (os:{user})"


def _checked_by(by: str) -> str:
    if not by or not by.strip():
        raise ResolveRefused("who acts must be named (`by` is empty)")
    if len(by) > BY_CHARS_MAX:
        raise ResolveRefused(f"`by` is {len(by)} characters; at most {BY_CHARS_MAX}")
    return by


def _checked_reason(reason: str) -> str:
    if not reason.strip():
        raise ResolveRefused("the reason must say why (it is empty)")
    if len(reason) > REASON_CHARS_MAX:
        raise ResolveRefused(f"the reason is {len(reason)} characters; at most "
                             f"{REASON_CHARS_MAX}")
    return reason


def _journalable(kind: type[E], **fields: Any) -> E:
    """The event, or ResolveRefused saying why the journal cannot keep it: text from a command
    line may hold bytes that are not UTF-8 (lone surrogates), which the contract refuses and no
    JSON encoder writes."""
    try:
        event = kind(**fields)
        encode_event(event)
    except ValidationError as exc:
        raise ResolveRefused(describe(exc, "it cannot be journaled: ")) from None
    except ValueError as exc:  # not valid text, found only when encoded
        raise ResolveRefused(f"it cannot be journaled: {exc}") from None
    return event


@contextlib.asynccontextmanager
async def _writer(settings: KafkaSettings, given: JournalWriter | None,
                  ) -> AsyncIterator[JournalWriter]:
    if given is not None:
        yield given
        return
    async with JournalWriter(settings) as writer:
        yield writer


async def resolve(settings: KafkaSettings, step_id: str, outcome: Outcome, *,
                  evidence: dict[str, Any] | None, reason: str | None, by: str,
                  force: bool = False, writer: JournalWriter | None = None) -> StepSettled:
    by = _checked_by(by)
    try:
        task_id, n = parse_step_id(step_id)
    except ValueError as exc:
        raise ResolveRefused(str(exc)) from None
    if outcome is Outcome.UNKNOWN:
        raise ResolveRefused("an operator settles a step done or not_done; it is unknown already")
    if outcome is Outcome.DONE and not evidence:
        raise ResolveRefused("done needs evidence: --evidence charge_id=ch_…")
    if outcome is Outcome.NOT_DONE and reason is None:
        raise ResolveRefused("not_done needs a reason: --reason \"…\"")
    if reason is not None:
        reason = _checked_reason(reason)
    with tracing.span("halfway.settlement", task_id, step_id, source="operator", by=by):
        state = await task_state(settings, task_id)
        step = state.step(n)
        if step is None:
            raise NotInJournal(f"step {step_id} is not in the journal")
        if step.outcome in (Outcome.DONE, Outcome.NOT_DONE) and not force:
            raise AlreadyDecided(f"step {step_id} is already {step.outcome}; a second verdict "
                                 "would be kept as a contradiction (use --force to record one)")
        event = _journalable(
            StepSettled, **stamp(task_id), step_id=step_id, outcome=outcome,
            source=SettlementSource.OPERATOR,
            evidence={**evidence, "resolved_by": by} if evidence else None,
            reason=f"{reason} (resolved by {by})" if reason else None)
        async with _writer(settings, writer) as journal:
            await journal.append(event)
        tracing.record(event)
    return event


async def abort_task(settings: KafkaSettings, task_id: str, *, reason: str, by: str,
                     writer: JournalWriter | None = None) -> TaskAborted:
    """Journal `task.aborted`: no new step is decided; a saga undoes what is proven done."""
    by = _checked_by(by)
    reason = _checked_reason(reason)
    if not is_task_id(task_id):
        raise ResolveRefused(f"{task_id[:60]!r} is not a task id")
    state = await task_state(settings, task_id)
    if state.started is None:
        raise NotInJournal(f"task {task_id} has not started (nothing in the journal)")
    if state.finished is not None:
        raise AlreadyDecided(f"task {task_id} already finished {state.finished.state}")
    if state.aborted is not None:
        raise AlreadyDecided(f"task {task_id} was already called off by {state.aborted.by}: "
                             f"{state.aborted.reason}")
    event = _journalable(TaskAborted, **stamp(task_id), reason=reason, by=by)
    async with _writer(settings, writer) as journal:
        await journal.append(event)
    return event
