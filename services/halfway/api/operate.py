"""The API's write endpoints: start a task, call one off, settle a step (or its undo) by hand.

They write the same events the command line writes (`halfway start`, `abort`, `resolve`),
through the same functions (`halfway.resolve`), with the token's name journaled as who acted
(`api:NAME`). The journal writer is one per process, started on the first write (the API
starts, and reads, without a broker).

When Kafka does not answer, the answer is 503, never 500, and says what is known: the request
may or may not be in the journal, and repeating it is safe (a task id starts once; a second
call-off or resolution is refused once the first is in the journal). The broker's address is
never in an answer (it is in the log).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import TypeVar

from aiohttp import web
from aiokafka.errors import KafkaError, KafkaTimeoutError, RequestTimedOutError
from pydantic import BaseModel, ValidationError

from halfway import log
from halfway.api.bodies import (
    AbortTask,
    ResolveStep,
    StartTask,
    StepResolvedAnswer,
    TaskAbortedAnswer,
    TaskRequestedAnswer,
)
from halfway.api.http import error, json_ok, require
from halfway.contract import Outcome, TaskRequested
from halfway.contract.ids import is_task_id
from halfway.contract.topics import TASKS
from halfway.journal import JournalWriter
from halfway.journal.records import stamp
from halfway.resolve import (
    AlreadyDecided,
    NotInJournal,
    ResolveRefused,
    abort_task,
    parse_effect,
    resolve,
)
from halfway.settings import KafkaSettings

BODY_BYTES_MAX = 256 * 1024  # the decider's bound on a request it copies into the journal
BROKER_WAIT_S = 15.0  # for one write (or the read of the task's journal before it)
WRITER_STOP_S = 5.0
VALIDATION_ERRORS_SHOWN_MAX = 10

_UNREACHABLE = (KafkaError, OSError, TimeoutError)
M = TypeVar("M", bound=BaseModel)


class Journal:
    """The API's one journal writer, started on first use and again after a failed start."""

    def __init__(self, settings: KafkaSettings) -> None:
        self.settings = settings
        self._writer: JournalWriter | None = None
        self._lock = asyncio.Lock()

    async def writer(self) -> JournalWriter:
        async with self._lock:
            if self._writer is None:
                writer = JournalWriter(self.settings)
                try:
                    await writer.start()
                except BaseException:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(writer.stop(), WRITER_STOP_S)
                    raise
                self._writer = writer
            return self._writer

    async def stop(self) -> None:
        if self._writer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._writer.stop(), WRITER_STOP_S)
            self._writer = None


JOURNAL = web.AppKey("journal", Journal)


async def _body(request: web.Request, model: type[M]) -> M:
    """The request's JSON body as `model`: 415, 413, 400 or 422 with the reason if not."""
    if request.content_type != "application/json":
        raise error(web.HTTPUnsupportedMediaType,
                    f"send a JSON body (Content-Type: application/json), not "
                    f"{request.content_type[:60]!r}")
    try:
        raw = await request.read()  # bounded by the app's client_max_size
    except web.HTTPRequestEntityTooLarge:
        raise web.HTTPRequestEntityTooLarge(
            BODY_BYTES_MAX, content_type="application/json",
            text=json.dumps({"error": f"the body is larger than {BODY_BYTES_MAX} bytes"}),
        ) from None
    try:
        # strict: "yes" is no boolean and "3" no number (nested models too, e.g. the policy);
        # JSON's strict mode still reads enum values and ISO datetimes from strings.
        return model.model_validate_json(raw, strict=True)
    except ValidationError as exc:
        problems = exc.errors(include_input=False, include_url=False)
        if any(p["type"] == "json_invalid" for p in problems):
            raise error(web.HTTPBadRequest, "the body is not JSON") from None
        words = "; ".join(f"{'.'.join(map(str, p['loc'])) or 'body'}: {p['msg']}"
                          for p in problems[:VALIDATION_ERRORS_SHOWN_MAX])
        raise error(web.HTTPUnprocessableEntity, words) from None


def _unreachable(what: str, exc: BaseException) -> web.HTTPException:
    log.get("halfway.api").warning("the journal cannot be reached", what=what,
                                   error=f"{type(exc).__name__}: {exc}")
    # Worded from what happened: a broker that refuses connections answers at once.
    timed_out = isinstance(exc, TimeoutError | KafkaTimeoutError | RequestTimedOutError)
    failed = f"did not answer within {BROKER_WAIT_S:g} s" if timed_out else "could not be reached"
    return error(web.HTTPServiceUnavailable,
                 f"the journal (Kafka) {failed}, so whether "
                 f"the {what} is journaled is unknown; repeating the request is safe (a task id "
                 "starts once; a second call-off or resolution is refused once the first is in "
                 "the journal)")


def _refused(exc: ResolveRefused) -> web.HTTPException:
    if isinstance(exc, NotInJournal):
        return error(web.HTTPNotFound, str(exc))
    if isinstance(exc, AlreadyDecided):
        # halfway.resolve words it for the command line; here the switch is a body field.
        return error(web.HTTPConflict, str(exc).replace("--force", '"force": true'))
    return error(web.HTTPUnprocessableEntity, str(exc))


async def start_task(request: web.Request) -> web.Response:
    principal = require(request, "start")
    body = await _body(request, StartTask)
    journal = request.app[JOURNAL]
    # Stamped once: a retried send carries the same event id and time (as HalfwayClient does).
    event = TaskRequested(**stamp(body.task_id), input=body.input,
                          allowed_tools=body.allowed_tools, policy=body.policy,
                          requested_by=principal.by)
    try:
        async with asyncio.timeout(BROKER_WAIT_S):
            writer = await journal.writer()
            await writer.append(event, TASKS)
    except _UNREACHABLE as exc:
        raise _unreachable("request", exc) from None
    log.get("halfway.api").info("task requested", task_id=body.task_id, by=principal.by,
                                event_id=event.event_id)
    return json_ok(TaskRequestedAnswer(
        task_id=body.task_id, event_id=event.event_id, requested_by=principal.by,
        status_url=f"/api/tasks/{body.task_id}").model_dump(mode="json"), status=202)


async def abort(request: web.Request) -> web.Response:
    principal = require(request, "operate")
    task_id = request.match_info["task_id"]
    if not is_task_id(task_id):
        raise error(web.HTTPBadRequest, f"{task_id[:60]!r} is not a task id")
    body = await _body(request, AbortTask)
    journal = request.app[JOURNAL]
    try:
        async with asyncio.timeout(BROKER_WAIT_S):
            event = await abort_task(journal.settings, task_id, reason=body.reason,
                                     by=principal.by, writer=await journal.writer())
    except ResolveRefused as exc:
        raise _refused(exc) from None
    except _UNREACHABLE as exc:
        raise _unreachable("call-off", exc) from None
    log.get("halfway.api").info("task called off", task_id=task_id, by=principal.by)
    return json_ok(TaskAbortedAnswer(task_id=task_id, event_id=event.event_id, by=event.by,
                                     reason=event.reason).model_dump(mode="json"), status=202)


async def resolve_step(request: web.Request) -> web.Response:
    """Settle a step (`{task_id}:{n}`) or its undo (`{task_id}:{n}:undo`, `:undo2`, …)."""
    principal = require(request, "operate")
    name = request.match_info["step_id"]
    try:
        effect = parse_effect(name)
    except ResolveRefused:
        raise error(web.HTTPBadRequest, f"{name[:60]!r} is not a step id ({{task_id}}:{{n}}) "
                    "or an undo's ({task_id}:{n}:undo)") from None
    body = await _body(request, ResolveStep)
    journal = request.app[JOURNAL]
    try:
        async with asyncio.timeout(BROKER_WAIT_S):
            event = await resolve(journal.settings, name, Outcome(body.outcome),
                                  evidence=body.evidence, reason=body.reason, by=principal.by,
                                  force=body.force, writer=await journal.writer())
    except ResolveRefused as exc:
        raise _refused(exc) from None
    except _UNREACHABLE as exc:
        raise _unreachable("resolution", exc) from None
    undo_key = name if effect.generation is not None else None
    log.get("halfway.api").info("step resolved", step_id=effect.step_id, undo_key=undo_key,
                                outcome=body.outcome, by=principal.by)
    return json_ok(StepResolvedAnswer(
        task_id=effect.task_id, step_id=effect.step_id, undo_key=undo_key,
        event_id=event.event_id, outcome=body.outcome, by=principal.by,
    ).model_dump(mode="json"), status=202)
