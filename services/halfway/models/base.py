"""The model interface: `decide(history) -> call | finish`, and what the model sees.

What the model sees of earlier steps comes from the journal (facts, not memory), rendered in
words it cannot misread: `unknown, being checked: ... do not start another one`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from halfway.contract import StepRefused
from halfway.core.fold import TaskState
from halfway.render import step_line


@dataclass(frozen=True, slots=True)
class ToolInfo:
    name: str
    description: str
    args_schema: dict[str, Any]


@dataclass(frozen=True, slots=True)
class StepView:
    n: int
    tool: str
    args: dict[str, Any]
    status: str
    line: str  # the three-state words


@dataclass(frozen=True, slots=True)
class History:
    task_id: str
    n: int  # the step being decided
    input: dict[str, Any]
    tools: list[ToolInfo]
    steps: list[StepView] = field(default_factory=list)
    # Earlier proposals for step `n` the harness refused, with why: the model should not
    # propose the same thing again.
    refusals: list[str] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ProposeCall:
    tool: str
    args: dict[str, Any]


@dataclass(frozen=True, slots=True)
class ProposeFinish:
    summary: str


Proposal = ProposeCall | ProposeFinish


class Model(Protocol):
    name: str
    version: str | None

    async def decide(self, history: History) -> Proposal: ...


def history_of(state: TaskState, n: int, tools: list[ToolInfo]) -> History:
    assert state.started is not None
    return History(
        task_id=state.task_id,
        n=n,
        input=dict(state.started.input),
        tools=[t for t in tools if t.name in state.started.allowed_tools],
        steps=[StepView(s.n, s.intent.tool, dict(s.intent.args), s.status, step_line(s))
               for s in state.steps.values()],
        refusals=[_refusal_words(r) for r in state.refused(n)],
    )


def _refusal_words(refusal: StepRefused) -> str:
    if refusal.blocked is None:
        return refusal.reason
    # The model is asked again only once the holder released the subject (or the wait ended).
    return (f"{refusal.reason} (the harness waited until {refusal.blocked.holder} released "
            f"{refusal.blocked.subject}; it is free now, so you may propose it again)")
