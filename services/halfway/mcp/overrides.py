"""What an app says about an MCP server's tool, and the effect class it ends up with. Pure.

The server describes its tools with annotations, which the protocol calls hints: a server may
be wrong or lie. So the mapping errs one way only. Without an override:

- `readOnlyHint: true` -> `read` (retried within bounds; never unknown);
- `idempotentHint: true` (and not read-only) -> `idempotent`;
- anything else, missing annotations included -> `unkeyed`: at most one request is ever sent,
  never blindly retried. Missing annotations are the unsafe case, never the safe one.

Only the app can say a server honours our key: `{"effect": "keyed", "key_ttl_s": ...}` in the
tool's override. An override's `effect` always wins over the hints.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from mcp_types import ToolAnnotations
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from halfway.app.app import UndoSpec, undo_plan
from halfway.contract import CompensationPlan, EffectClass, SagaRole


class ToolOverride(BaseModel):
    """Per-tool settings of `App.mcp(..., tools={"NAME": {...}})`; unknown keys are errors
    (a typo must not silently turn a protection off)."""

    model_config = ConfigDict(extra="forbid", frozen=True, arbitrary_types_allowed=True)

    effect: EffectClass | None = None
    key_ttl_s: float | None = None  # required with effect "keyed"
    key_ttl_margin_s: float | None = None
    timeout_s: float | None = None
    # "invoice:{invoice_id}" (names arguments of the tool) or a function of the arguments
    subject: str | Callable[[Any], str | None] | None = None
    # A read-only tool of the same server that finds the effect named by our key.
    lookup: str | None = None
    # What undoes the effect: {"tool": ..., "args": {...}} or (tool, args), as for app tools.
    undo: UndoSpec | None = None
    saga_role: SagaRole | None = None
    # isError results prove the effect did not happen (else they are unknown).
    errors_are_refusals: bool = False
    evidence_id: str | None = None
    once_per_subject: bool = False
    completes_within_s: float | None = None
    attempts: int = Field(default=10, ge=1)
    read_attempts: int = Field(default=3, ge=1)
    description: str | None = None  # what the model reads instead of the server's words

    @field_validator("timeout_s", "key_ttl_s", "completes_within_s")
    @classmethod
    def _positive(cls, value: float | None) -> float | None:
        if value is not None and value <= 0:
            raise ValueError("must be positive")
        return value

    def undo_plan(self) -> CompensationPlan | None:
        return undo_plan(self.undo)


def parse_overrides(server: str, tools: Mapping[str, Mapping[str, Any] | ToolOverride] | None
                    ) -> dict[str, ToolOverride]:
    """The overrides of one server, validated at declaration (a mistake shows at import)."""
    out: dict[str, ToolOverride] = {}
    for name, raw in (tools or {}).items():
        try:
            override = (raw if isinstance(raw, ToolOverride)
                        else ToolOverride.model_validate(dict(raw)))
        except ValidationError as exc:
            problems = "; ".join(
                f"unknown setting {'.'.join(map(str, e['loc']))!r}"
                if e["type"] == "extra_forbidden"
                else f"{'.'.join(map(str, e['loc']))}: {e['msg']}"
                for e in exc.errors(include_url=False))
            raise ValueError(f"MCP server {server}, tool {name}: {problems} (the settings: "
                             f"{', '.join(ToolOverride.model_fields)})") from None
        if override.effect is EffectClass.KEYED and not override.key_ttl_s:
            raise ValueError(f"MCP server {server}, tool {name}: a keyed tool must declare "
                             f"key_ttl_s (how long the server remembers a key)")
        out[name] = override
    return out


def effect_class_of(annotations: ToolAnnotations | None, override: ToolOverride | None
                    ) -> EffectClass:
    """The effect class of a tool (see the module docstring)."""
    if override is not None and override.effect is not None:
        return override.effect
    if annotations is not None and annotations.read_only_hint is True:
        return EffectClass.READ
    if annotations is not None and annotations.idempotent_hint is True:
        return EffectClass.IDEMPOTENT
    return EffectClass.UNKEYED
