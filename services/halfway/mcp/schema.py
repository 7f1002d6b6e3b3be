"""An MCP tool's input schema as the argument model of a halfway tool.

The server's JSON Schema is the truth about its arguments, so it is used as it is: the model
reads it (`model_json_schema()` returns it), and the decider validates the model's arguments
against it with `jsonschema` before a step is placed (a string is never an integer). Arguments
the harness sets itself (`idempotencyKey`) are removed from what the model sees and refused if
the model sends them: the model never chooses the key.

The schema is a third party's, so it is checked as far as it can be before it is used: it
must be a valid JSON Schema whose every `$ref` resolves inside itself. Nothing is ever fetched
(jsonschema would fetch an `http` reference, on the event loop, wherever the server points).
A schema that still cannot check some arguments (a reference that recurses for ever) refuses
them, with the reason, instead of raising.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any, ClassVar

import jsonschema
import referencing
import referencing.exceptions
import referencing.jsonschema
from pydantic import BaseModel, ConfigDict, model_validator

ERRORS_SHOWN_MAX = 5  # validation problems named in one refusal the model reads


class UnusableSchema(ValueError):
    """The server's input schema for a tool cannot check its arguments."""


class McpArgs(BaseModel):
    """Arguments of a bridged tool: a JSON object that satisfies the server's schema."""

    model_config = ConfigDict(extra="allow", frozen=True)
    json_schema: ClassVar[dict[str, Any]] = {"type": "object"}
    hidden: ClassVar[frozenset[str]] = frozenset()
    validator: ClassVar[Any] = None

    @model_validator(mode="before")
    @classmethod
    def _against_schema(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            raise ValueError("the arguments must be a JSON object")
        set_by_us = sorted(cls.hidden & set(data))
        if set_by_us:
            raise ValueError(f"{', '.join(set_by_us)} is set by the harness, not by the caller")
        try:
            problems = sorted(cls.validator.iter_errors(data),
                              key=lambda e: list(e.absolute_path))
        except Exception as exc:  # a reference recursing for ever, say: the server's fault
            raise ValueError(f"the server's schema for this tool cannot check them: "
                             f"{type(exc).__name__}") from None
        if problems:
            words = "; ".join(f"{'.'.join(map(str, e.absolute_path)) or 'arguments'}: "
                              f"{e.message}" for e in problems[:ERRORS_SHOWN_MAX])
            raise ValueError(words)
        return data

    @classmethod
    def model_json_schema(cls, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return copy.deepcopy(cls.json_schema)

    @classmethod
    def properties(cls) -> set[str]:
        return set((cls.json_schema.get("properties") or {}).keys())


def args_model(tool: str, input_schema: dict[str, Any], hidden: Iterable[str] = ()
               ) -> type[McpArgs]:
    """The argument model of `tool`, without the `hidden` properties. Raises ValueError when
    the server's schema is not a valid JSON Schema for an object (UnusableSchema)."""
    hidden_set = frozenset(hidden)
    shown = copy.deepcopy(input_schema)
    if shown.get("type", "object") != "object":
        raise UnusableSchema(f"MCP tool {tool}: its input schema is not an object schema")
    properties = shown.get("properties") or {}
    for name in hidden_set:
        properties.pop(name, None)
    if "properties" in shown:
        shown["properties"] = properties
    if "required" in shown:
        shown["required"] = [r for r in shown["required"] if r not in hidden_set]
    checker = jsonschema.validators.validator_for(shown, default=jsonschema.Draft202012Validator)
    try:
        checker.check_schema(shown)
    except jsonschema.SchemaError as exc:
        raise UnusableSchema(f"MCP tool {tool}: its input schema is invalid: "
                             f"{exc.message}") from None
    unresolved = _unresolved_reference(shown)
    if unresolved is not None:
        raise UnusableSchema(f"MCP tool {tool}: its input schema refers to {unresolved[:200]!r}, "
                         "which is not inside it")
    # An empty registry: a reference is looked up in the schema itself, never fetched.
    validator = checker(shown, registry=referencing.Registry())
    try:
        next(validator.iter_errors({}), None)  # one try: a reference to itself, say
    except Exception as exc:
        raise UnusableSchema(f"MCP tool {tool}: its input schema cannot check arguments: "
                         f"{type(exc).__name__}") from None
    namespace = {"json_schema": shown, "hidden": hidden_set, "validator": validator,
                 "__module__": __name__}
    return type(f"{tool}_args", (McpArgs,), namespace)


def _unresolved_reference(schema: dict[str, Any]) -> str | None:
    """The first `$ref` (or `$dynamicRef`) of `schema` that does not resolve inside it."""
    spec = referencing.jsonschema.specification_with(
        str(schema.get("$schema", "")), default=referencing.jsonschema.DRAFT202012)
    root = referencing.Registry().resolver_with_root(spec.create_resource(schema))
    todo: list[tuple[Any, referencing.Resolver[Any]]] = [(schema, root)]
    while todo:
        node, resolver = todo.pop()
        if isinstance(node, list):
            todo.extend((item, resolver) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        if node is not schema and isinstance(node.get("$id"), str):
            resolver = resolver.in_subresource(spec.create_resource(node))  # a new base
        for keyword in ("$ref", "$dynamicRef"):
            ref = node.get(keyword)
            if isinstance(ref, str):
                try:
                    resolver.lookup(ref)
                except referencing.exceptions.Unresolvable:
                    return ref
        todo.extend((value, resolver) for value in node.values())
    return None
