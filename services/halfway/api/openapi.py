"""The OpenAPI 3.1 document of the HTTP API, written by hand, in this one module.

The schemas are JSON Schema 2020-12 (OpenAPI 3.1's dialect); the tests validate real responses
against them and check that every route the app serves is described here.
"""

from __future__ import annotations

from typing import Any

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
        "description": "The undo of a step, an effect of its own (key `{step_id}:undo`).",
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
            "503": _UNAVAILABLE,
        },
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
            "404": _error("No such task in the read model."),
            "503": _UNAVAILABLE,
        },
    }},
    "/api/events": {"get": {
        "summary": "Server-Sent Events: `ready` once connected, then `changed` whenever the "
                   "read model changes (checked every 500 ms); re-read what you show.",
        "operationId": "events",
        "responses": {
            "200": {"description": "An event stream; comments keep it alive.",
                    "content": {"text/event-stream": {"schema": {"type": "string"}}}},
            "503": _error("Too many live clients."),
        },
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
                "`key`, and see `next_check_at`). An unknown step is never reported as failed."),
        },
        "paths": PATHS,
        "components": {"schemas": SCHEMAS},
    }
