"""JSON numbers only: NaN, Infinity and numbers past ±1.8e308 are not JSON, and pydantic would
journal each as null. The API's bodies and the client's requests refuse them with this check."""

from __future__ import annotations

import math

from pydantic import JsonValue

PATH_CHARS_MAX = 200  # where a bad number is, in a refusal (keys may be long)


def refuse_non_finite(value: JsonValue) -> JsonValue:
    """`value`, if no number in it is NaN or infinite; else ValueError naming where."""
    todo: list[tuple[str, JsonValue]] = [("", value)]
    while todo:
        path, item = todo.pop()
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError("NaN, Infinity and numbers beyond ±1.8e308 are not JSON numbers"
                             + (f" (at {path[:PATH_CHARS_MAX]})" if path else ""))
        if isinstance(item, dict):
            todo.extend((f"{path}.{k}" if path else k, v) for k, v in item.items())
        elif isinstance(item, list):
            todo.extend((f"{path}[{i}]", v) for i, v in enumerate(item))
    return value
