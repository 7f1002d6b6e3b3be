"""The OpenAPI 3.1 document of the HTTP API, in this one module.

What is generated and what is written. The request bodies of the write endpoints, and their
answers, are pydantic models (`halfway.api.bodies`) that also validate every request; their
schemas here are generated from those classes (`models_json_schema`), so the document says
exactly what is checked. The read endpoints' answers are dicts shaped by `halfway.api.status`
(shared with `halfway status --json`); their schemas are written here by hand, and the tests
validate real answers against them and check that every route the app serves is described.

Why not a framework that generates it all (FastAPI is not a dependency; Starlette and uvicorn
are, through mcp): the API is aiohttp, which the gateway and the simulators use too, and its
server-sent events, shutdown and the page are tested and work. Moving to another framework
would rewrite working code for one generated document, while what drifts (bodies a client
sends) is generated already. The schemas are JSON Schema 2020-12 (OpenAPI 3.1's dialect).
"""

from __future__ import annotations

from typing import Any

from pydantic.json_schema import models_json_schema

from halfway.api.auth import SCOPES
from halfway.api.bodies import ANSWERS, REQUEST_BODIES
from halfway.api.operate import BODY_BYTES_MAX
from halfway.api.queries import (
    ATTEMPTS_PER_STEP_MAX,
    CHECKS_PER_STEP_MAX,
    LIMIT_DEFAULT,
    LIMIT_MAX,
    STEP_STATUSES,
    TASK_STATES,
)
from halfway.contract.ids import KEY_PATTERN, STEP_ID_PATTERN, TASK_ID_PATTERN


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(type_: str, **more: Any) -> dict[str, Any]:
    return {"type": [type_, "null"], **more}


_TIME = {"type": "string", "format": "date-time"}
_TIME_OR_NULL = _nullable("string", format="date-time")


def _error(description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": _ref("Error")}}}


_STEP_COUNTS = {
    "type": "object",
    "description": "How many of the task's steps are in each state.",
    "properties": {s: {"type": "integer", "minimum": 0} for s in STEP_STATUSES},
    "required": list(STEP_STATUSES),
}

_TASK_FIELDS: dict[str, Any] = {
    "task_id": {"type": "string", "pattern": TASK_ID_PATTERN},
    "state": {"enum": list(TASK_STATES), "description": (
        "The one word to filter by. `needs_attention`: a step is unknown and no further check is "
        "planned; `unknown`: a step is unknown and being checked (a task with an unknown step "
        "is never shown as failed); else the final state, or the status.")},
    "state_words": {"type": "string", "description": "`state` in words."},
    "status": {"enum": ["requested", "running", "rejected", "finished"]},
    "final_state": {"enum": ["succeeded", "failed", "compensated", "needs_attention", None]},
    "needs_attention": {"type": "boolean"},
    "summary": _nullable("string"),
    "step_count": {"type": "integer", "minimum": 0},
    "step_counts": _STEP_COUNTS,
    "contradictions": {"type": "integer", "minimum": 0},
    "next_check_at": {**_TIME_OR_NULL,
                      "description": "The earliest next check of its unknown steps."},
    "started_at": _TIME_OR_NULL,
    "finished_at": _TIME_OR_NULL,
    "updated_at": _TIME,
    "aborted_by": {**_nullable("string"), "description": "Who called the task off, if anyone."},
    "aborted_reason": {**_nullable("string"), "description": "Why it was called off."},
}

SCHEMAS: dict[str, Any] = {
    "Error": {
        "type": "object",
        "properties": {"error": {"type": "string"}},
        "required": ["error"],
    },
    "TaskSummary": {
        "type": "object",
        "properties": _TASK_FIELDS,
        "required": list(_TASK_FIELDS),
    },
    "TaskList": {
        "type": "object",
        "properties": {
            "tasks": {"type": "array", "items": _ref("TaskSummary"), "maxItems": LIMIT_MAX},
            "count": {"type": "integer", "minimum": 0},
            "state": {"enum": [*TASK_STATES, None]},
            "limit": {"type": "integer", "minimum": 1, "maximum": LIMIT_MAX},
        },
        "required": ["tasks", "count", "state", "limit"],
    },
    "Attempt": {
        "type": "object",
        "properties": {"attempt": {"type": "integer", "minimum": 1},
                       "key": {"type": "string", "pattern": KEY_PATTERN},
                       "started_at": _TIME},
        "required": ["attempt", "key", "started_at"],
    },
    "Check": {
        "type": "object",
        "description": "A lookup that found nothing yet.",
        "properties": {"event_id": {"type": "string"}, "at": _TIME,
                       "found": {"type": "string"}, "next_check_at": _TIME_OR_NULL},
        "required": ["event_id", "at", "found", "next_check_at"],
    },
    "Compensation": {
        "type": "object",
        "description": "The undo of a step, an effect of its own (key `{step_id}:undo`; "
                       "`{step_id}:undo2`, `:undo3` once a lookup proved the key before did "
                       "nothing).",
        "properties": {
            "tool": {"type": "string"}, "args": {"type": "object"},
            "key": {"type": "string", "pattern": KEY_PATTERN},
            "status": {"enum": list(STEP_STATUSES)},
            "outcome": {"enum": ["done", "not_done", "unknown", None]},
            "evidence": _nullable("object"), "reason": _nullable("string"),
            "attempts": {"type": "integer", "minimum": 0}, "updated_at": _TIME,
            "last_check": _nullable("string"), "next_check_at": _TIME_OR_NULL,
            "needs_attention": {"type": "boolean"},
        },
        "required": ["tool", "args", "key", "status", "outcome", "evidence", "reason",
                     "attempts", "updated_at", "last_check", "next_check_at",
                     "needs_attention"],
    },
    "Step": {
        "type": "object",
        "properties": {
            "step_id": {"type": "string", "pattern": STEP_ID_PATTERN},
            "n": {"type": "integer", "minimum": 1},
            "tool": {"type": "string"},
            "args": {"type": "object"},
            "key": {"type": "string", "pattern": KEY_PATTERN,
                    "description": "The idempotency key: the reference to quote to a provider."},
            "subject": _nullable("string"),
            "effect_class": {"enum": ["read", "idempotent", "keyed", "unkeyed"]},
            "decided_by": {"type": "string"},
            "status": {"enum": list(STEP_STATUSES), "description": (
                "done (with evidence), not_done (safe to try again, with a reason), unknown "
                "(being checked: see next_check_at), in_flight, intended.")},
            "state_words": {"type": "string", "description": "`status` in words."},
            "says": {"type": "string", "description": "The whole step in one line."},
            "outcome": {"enum": ["done", "not_done", "unknown", None]},
            "evidence": _nullable("object"),
            "reason": _nullable("string"),
            "source": {"enum": ["call", "lookup", "webhook", "operator", None]},
            "attempts": {"type": "integer", "minimum": 0},
            "unknowns": {"type": "integer", "minimum": 0},
            "checks": {"type": "integer", "minimum": 0},
            "last_check": _nullable("string"),
            "next_check_at": {**_TIME_OR_NULL,
                              "description": "When the harness checks again; null: it will not."},
            "needs_attention": {"type": "boolean"},
            "contradictions": {"type": "integer", "minimum": 0, "description": (
                "Later settlements that disagree with the outcome; kept and surfaced.")},
            "intended_at": _TIME,
            "settled_at": _TIME_OR_NULL,
            "updated_at": _TIME,
            "attempt_log": {"type": "array", "items": _ref("Attempt"),
                            "maxItems": ATTEMPTS_PER_STEP_MAX,
                            "description": "The most recent attempts, oldest first."},
            "check_log": {"type": "array", "items": _ref("Check"),
                          "maxItems": CHECKS_PER_STEP_MAX,
                          "description": "The most recent checks, oldest first."},
            "compensation": {"oneOf": [_ref("Compensation"), {"type": "null"}]},
        },
        "required": ["step_id", "n", "tool", "args", "key", "status", "state_words", "says",
                     "attempts", "next_check_at", "contradictions", "attempt_log", "check_log",
                     "compensation"],
    },
    "Task": {
        "type": "object",
        "properties": {
            **_TASK_FIELDS,
            "input": {"description": "What the caller asked for."},
            "allowed_tools": {"type": ["array", "null"]},
            "steps": {"type": "array", "items": _ref("Step")},
        },
        "required": [*_TASK_FIELDS, "steps"],
    },
}

_UNAVAILABLE = _error("The read model cannot be read (not created yet, or PostgreSQL is down).")


def _generated() -> dict[str, Any]:
    """The schemas of the request bodies and answers, from the pydantic models (with the
    models they use, e.g. TaskPolicy)."""
    _, defs = models_json_schema(
        [(m, "validation") for m in REQUEST_BODIES] + [(m, "serialization") for m in ANSWERS],
        ref_template="#/components/schemas/{model}")
    return defs["$defs"]


SCHEMAS.update(_generated())

_READ = [{"bearer": ["read"]}]  # required once tokens are configured; see the description
_UNAUTHENTICATED = {
    "description": "No token, or one this API does not know (a `WWW-Authenticate: Bearer` "
                   "challenge comes with it).",
    "content": {"application/json": {"schema": _ref("Error")}}}
_FORBIDDEN = _error("The token lacks the scope (`WWW-Authenticate` says which), or no tokens "
                    "are configured at all (the write endpoints are then off).")
_MISDIRECTED = _error("The Host header is not a name of this API (HALFWAY_API_ALLOWED_HOSTS).")
_BROKER_DOWN = _error("The journal (Kafka) did not answer: whether the request is journaled is "
                      "unknown; repeating it is safe.")
_INVALID = _error("The body does not validate (the reason names the field).")


def _body(name: str) -> dict[str, Any]:
    return {"required": True,
            "content": {"application/json": {"schema": _ref(name)}},
            "description": f"JSON, at most {BODY_BYTES_MAX} bytes."}


def _accepted(name: str, description: str) -> dict[str, Any]:
    return {"description": description,
            "content": {"application/json": {"schema": _ref(name)}}}


def _write_errors(*, not_found: str | None = None,
                  conflict: str | None = None) -> dict[str, Any]:
    out = {"400": _error("Not JSON, or a malformed id in the path."),
           "401": _UNAUTHENTICATED, "403": _FORBIDDEN,
           "413": _error(f"The body is larger than {BODY_BYTES_MAX} bytes."),
           "415": _error("The body is not application/json."),
           "422": _INVALID, "503": _BROKER_DOWN}
    if not_found:
        out["404"] = _error(not_found)
    if conflict:
        out["409"] = _error(conflict)
    return dict(sorted(out.items()))

PATHS: dict[str, Any] = {
    "/": {"get": {
        "summary": "The web page: every task and step in three states, updated live.",
        "operationId": "page",
        "responses": {"200": {"description": "HTML", "content": {"text/html": {
            "schema": {"type": "string"}}}}},
    }},
    "/api/tasks": {"get": {
        "summary": "Tasks, most recently updated first.",
        "operationId": "listTasks",
        "parameters": [
            {"name": "state", "in": "query", "required": False,
             "schema": {"enum": list(TASK_STATES)}, "description": "Only tasks in this state."},
            {"name": "limit", "in": "query", "required": False,
             "schema": {"type": "integer", "minimum": 1, "maximum": LIMIT_MAX,
                        "default": LIMIT_DEFAULT}},
        ],
        "responses": {
            "200": {"description": "The tasks.",
                    "content": {"application/json": {"schema": _ref("TaskList")}}},
            "400": _error("A query parameter is unknown or out of range."),
            "401": _UNAUTHENTICATED, "403": _FORBIDDEN,
            "503": _UNAVAILABLE,
        },
        "security": _READ,
    }, "post": {
        "summary": "Start a task: `task.requested` on the tasks topic (scope `start`). The "
                   "same task id asked for again starts once.",
        "operationId": "startTask",
        "requestBody": _body("StartTask"),
        "responses": {
            "202": _accepted("TaskRequestedAnswer",
                             "The request is in the tasks topic; the decider starts it."),
            **_write_errors(),
        },
        "security": [{"bearer": ["start"]}],
    }},
    "/api/tasks/{task_id}/abort": {"post": {
        "summary": "Call a task off: `task.aborted`, by `api:TOKEN_NAME` (scope `operate`). "
                   "No new step is decided; steps in flight settle; a saga undoes what is done.",
        "operationId": "abortTask",
        "parameters": [{"name": "task_id", "in": "path", "required": True,
                        "schema": {"type": "string", "pattern": TASK_ID_PATTERN}}],
        "requestBody": _body("AbortTask"),
        "responses": {
            "202": _accepted("TaskAbortedAnswer", "`task.aborted` is in the journal."),
            **_write_errors(not_found="The task was never requested (nothing in the journal "
                                      "or on the tasks topic).",
                            conflict="The task is finished, rejected, or called off already."),
        },
        "security": [{"bearer": ["operate"]}],
    }},
    "/api/steps/{step_id}/resolve": {"post": {
        "summary": "Settle a step by hand: `step.settled` with source `operator`, resolved by "
                   "`api:TOKEN_NAME` (scope `operate`); or, named by its undo key "
                   "(`{step_id}:undo`, `:undo2`, `:undo3`), the step's undo: "
                   "`compensation.settled`.",
        "operationId": "resolveStep",
        "parameters": [{"name": "step_id", "in": "path", "required": True,
                        "description": "A step id, or the key of the step's undo.",
                        "schema": {"type": "string", "pattern": KEY_PATTERN}}],
        "requestBody": _body("ResolveStep"),
        "responses": {
            "202": _accepted("StepResolvedAnswer", "The settlement is in the journal."),
            **_write_errors(not_found="The step (or the undo) is not in the journal.",
                            conflict="Settled already (send force to record a second verdict, "
                                     "kept as a contradiction), or another verdict reached "
                                     "the journal first (named in the error)."),
        },
        "security": [{"bearer": ["operate"]}],
    }},
    "/api/tasks/{task_id}": {"get": {
        "summary": "One task with every step, its attempts, checks and compensation.",
        "operationId": "getTask",
        "parameters": [{"name": "task_id", "in": "path", "required": True,
                        "schema": {"type": "string", "pattern": TASK_ID_PATTERN}}],
        "responses": {
            "200": {"description": "The task.",
                    "content": {"application/json": {"schema": _ref("Task")}}},
            "400": _error("Not a task id."),
            "401": _UNAUTHENTICATED, "403": _FORBIDDEN,
            "404": _error("No such task in the read model."),
            "503": _UNAVAILABLE,
        },
        "security": _READ,
    }},
    "/api/events": {"get": {
        "summary": "Server-Sent Events: `ready` once connected, then `changed` whenever the "
                   "read model changes (checked every 500 ms); re-read what you show.",
        "operationId": "events",
        "responses": {
            "200": {"description": "An event stream; comments keep it alive.",
                    "content": {"text/event-stream": {"schema": {"type": "string"}}}},
            "401": _UNAUTHENTICATED, "403": _FORBIDDEN,
            "429": _error("This client (token, or address without one) has too many streams "
                          "open."),
            "503": _error("Too many live clients."),
        },
        "security": _READ,
    }},
    "/api/openapi.json": {"get": {
        "summary": "This document.",
        "operationId": "openapi",
        "responses": {"200": {"description": "OpenAPI 3.1",
                              "content": {"application/json": {"schema": {"type": "object"}}}}},
    }},
}


def document() -> dict[str, Any]:
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "halfway",
            "version": "0.1.0",
            "description": (
                "The read model of halfway, a journaled effects harness for AI agents. Every "
                "step is in one of three states: done (with evidence), not done (safe to try "
                "again, with the reason), or unknown (being checked: quote the reference, "
                "`key`, and see `next_check_at`). An unknown step is never reported as failed. "
                "Operators start tasks, call them off and resolve steps with bearer tokens; "
                "every answer is checked against the Host names of the API (421 otherwise)."),
        },
        "paths": PATHS,
        "components": {"schemas": SCHEMAS, "securitySchemes": {"bearer": {
            "type": "http", "scheme": "bearer", "description": (
                "A token from HALFWAY_API_TOKENS or HALFWAY_API_TOKENS_FILE, with scopes ("
                + ", ".join(SCOPES) + "): `read` for the tasks and the live stream, `start` to "
                "start a task, `operate` to call one off or resolve a step. Its name is "
                "journaled as who acted (`api:NAME`). With no tokens configured the reads are "
                "open and the writes refused (unless the API runs in dev mode).")}}},
    }
