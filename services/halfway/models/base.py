"""The model interface: `decide(history) -> call | finish`, and what the model sees.

What the model sees of earlier steps comes from the journal (facts, not memory), rendered in
words it cannot misread: `unknown, being checked: ... do not start another one`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from halfway.contract import StepRefused
from halfway.core.fold import StepState, TaskState
from halfway.render import step_line


@dataclass(frozen=True, slots=True)
class ToolInfo:
    name: str
    description: str
    args_schema: dict[str, Any]


@dataclass(frozen=True, slots=True)
class CallView:
    """A tool call as the model made it: `call_id` is what its result answers to."""

    call_id: str
    tool: str
    args: dict[str, Any]


@dataclass(frozen=True, slots=True)
class StepView:
    """A decided step: the model's call (the step id is its call id) and the three-state line
    as its result. `also` are further calls of the same answer that were not run."""

    n: int
    tool: str
    args: dict[str, Any]
    status: str
    line: str  # the three-state words
    step_id: str = ""
    also: tuple[CallView, ...] = ()


@dataclass(frozen=True, slots=True)
class RefusalView:
    """A proposal the harness refused: the model's call and why, as its result."""

    n: int
    call_id: str
    tool: str
    args: dict[str, Any]
    reason: str  # the words the model reads


Turn = StepView | RefusalView


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
    instructions: str = ""  # the app's system prompt
    # Everything decided so far, in journal order (steps and refusals): the conversation.
    turns: list[Turn] = field(default_factory=list)

    @property
    def prompt(self) -> str:
        """The user's message: `input.prompt` (the rest of `input` is context)."""
        value = self.input.get("prompt")
        return value if isinstance(value, str) else ""

    @property
    def context(self) -> dict[str, Any]:
        return {k: v for k, v in self.input.items() if k != "prompt"}


@dataclass(frozen=True, slots=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True, slots=True)
class ProposeCall:
    tool: str
    args: dict[str, Any]
    usage: Usage | None = None
    # Set when the model's call could not be read (arguments that are not JSON): the decider
    # refuses it with these words, and the model reads them.
    malformed: str | None = None
    # Further calls of the same answer (parallel tool calls), in the model's order: not run,
    # journaled with the step so the model reads that they were not.
    also: tuple[tuple[str, dict[str, Any]], ...] = ()


@dataclass(frozen=True, slots=True)
class ProposeFinish:
    summary: str
    usage: Usage | None = None


Proposal = ProposeCall | ProposeFinish


class ModelUnavailable(Exception):
    """The model gave no usable answer. `transient`: worth asking again later (timeouts, 429,
    5xx, a dropped connection); False for what asking again cannot fix (401, 403, 400, an
    unknown model). `status`: the endpoint's HTTP status, if it answered."""

    def __init__(self, error: str, *, transient: bool, status: int | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(error)
        self.error = error
        self.transient = transient
        self.status = status
        self.retry_after_s = retry_after_s


class Model(Protocol):
    """Answers the question of a task's next step. A model that answers without I/O (a
    script: `ScriptedModel`) may also say `immediate = True`: a worker then asks it within the
    append of what came just before (a start, a settlement), not one round trip after."""

    name: str
    version: str | None

    async def decide(self, history: History) -> Proposal: ...


def history_of(state: TaskState, n: int, tools: list[ToolInfo],
               instructions: str = "") -> History:
    """What the model sees, from the journal alone: every step as the call the model made
    (the step id is its call id) with its three-state line as the result, every refusal as
    what it is, in the order they were decided."""
    assert state.started is not None
    steps = [_step_view(s) for s in sorted(state.steps.values(), key=lambda s: s.n)]
    turns: list[Turn] = []
    refusals = sorted(enumerate(state.refusals), key=lambda ir: ir[1].n)  # stable: log order
    by_n = {view.n: view for view in steps}
    shown: set[int] = set()
    for i, refusal in refusals:
        for m in sorted(k for k in by_n if k < refusal.n and k not in shown):
            turns.append(by_n[m])
            shown.add(m)
        turns.append(RefusalView(refusal.n, f"{state.task_id}:{refusal.n}/refused-{i + 1}",
                                 refusal.tool, dict(refusal.args), _refusal_words(refusal)))
    turns.extend(view for view in steps if view.n not in shown)
    return History(
        task_id=state.task_id,
        n=n,
        input=dict(state.started.input),
        tools=[t for t in tools if t.name in state.started.allowed_tools],
        steps=steps,
        refusals=[_refusal_words(r) for r in state.refused(n)],
        instructions=instructions,
        turns=turns,
    )


def _step_view(step: StepState) -> StepView:
    intent = step.intent
    also = tuple(CallView(f"{step.step_id}/also-{i + 1}", c.tool, dict(c.args))
                 for i, c in enumerate(intent.also_proposed))
    return StepView(step.n, intent.tool, dict(intent.args), step.status, step_line(step),
                    step_id=step.step_id, also=also)


def _refusal_words(refusal: StepRefused) -> str:
    if refusal.blocked is None:
        return refusal.reason
    # The model is asked again only once the holder released the subject (or the wait ended).
    return (f"{refusal.reason} (the harness waited until {refusal.blocked.holder} released "
            f"{refusal.blocked.subject}; it is free now, so you may propose it again)")
