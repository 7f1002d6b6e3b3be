"""The agent's calls as the model's answers: how `halfway mcp serve` reuses the decider.

Theory of operation
-------------------
Behind the proxy the "model" is the MCP client's agent, whose loop we do not own: its next
move is the `tools/call` it just sent. The decider already does everything a call needs before
it may run (the tool allowed and known, arguments validated strictly, the key minted from the
step id, the subject guard claimed, once-per-subject kept, one step at a time while an earlier
one is unknown), so the proxy does not place steps itself: it queues the agent's call for its
task, and `AgentModel.decide(history)` answers the decider's question with it.

An agent is idle between calls, for minutes or for good. A model that waits for it would run
into the decider's question timeout (`MODEL_TIMEOUT_S`), be journaled as failing
(`model.failed`) and, after `MODEL_FAILURES_MAX` of those, end the task `needs_attention`. So
`GatedDecider` asks its model only when the agent has spoken: an `Ask` for a task with nothing
queued is held (like `Hold`), and queueing a call touches the task so the next batch asks at
once. `decide` then never waits.

Which journal event answers which call: a call handed out for step `n` while `r` proposals for
`n` had been refused is answered by the first `step.intended` of `n`, or by the (r+1)-th refusal
of `n`. A question for the same (n, r) asked again (the decider dropped its answer: the task
moved to another decider, or an older claim of the step still held the subject) is answered
with the same call again, so a call is never silently lost and never placed twice.

Tasks whose input is not an MCP session (`halfway start ...` on the same deployment) are asked
as before: `AgentModel` hands their questions to the app's own model.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from halfway.contract.guards import GuardRecord
from halfway.core.decide import Ask
from halfway.decider.service import Decider
from halfway.models import History, Model, Proposal, ProposeCall, ProposeFinish

# The marker in `task.requested.input` that makes a task an MCP session's.
SESSION_INPUT_KEY = "mcp"
# Calls of one task waiting for the decider; past this the agent is told to wait for answers.
QUEUED_CALLS_PER_TASK_MAX = 16


@dataclass(eq=False)
class Call:
    """One `tools/call` of the agent. `handed` is (n, refusals of n seen) once the decider took
    it: from then on the journal, not the proxy, says what became of it."""

    task_id: str
    tool: str
    args: dict[str, Any]
    subject: str | None  # from the tool's declaration, when the arguments allow it
    arrived_s: float = field(default_factory=time.monotonic)
    handed: tuple[int, int] | None = None
    # The agent has read how it ended (done, not done): a later call on its subject is a new
    # call, not a retry of this one.
    told: bool = False


def is_session_task(history_input: dict[str, Any]) -> bool:
    return isinstance(history_input.get(SESSION_INPUT_KEY), dict)


class CallQueues:
    """Per task: the agent's calls not yet taken by the decider (FIFO, bounded), the call handed
    for the open question, and whether the session asked to finish. All in one event loop, so
    each method is atomic with respect to the others."""

    def __init__(self, per_task_max: int = QUEUED_CALLS_PER_TASK_MAX) -> None:
        self.per_task_max = per_task_max
        self._queued: dict[str, deque[Call]] = {}
        self._handed: dict[str, Call] = {}
        self._finish: set[str] = set()
        self._finish_handed: set[str] = set()  # the decider took the finish: no way back
        # Tasks the decider was told to ask (`has_work` said yes): their first queued call is
        # promised to it and can no longer be withdrawn.
        self._promised: set[str] = set()

    def put(self, call: Call) -> bool:
        """Queue a call; False if the task has `per_task_max` waiting already."""
        queue = self._queued.setdefault(call.task_id, deque())
        if len(queue) >= self.per_task_max:
            return False
        queue.append(call)
        return True

    def withdraw(self, call: Call) -> bool:
        """Take back a call the decider has not taken (nor been promised); True if it was."""
        queue = self._queued.get(call.task_id)
        if queue is None or call not in queue:
            return False
        if call.task_id in self._promised and queue[0] is call:
            return False
        queue.remove(call)
        if not queue:
            del self._queued[call.task_id]
        return True

    def finish(self, task_id: str) -> None:
        """The session ended: once its queued calls are placed, the task finishes."""
        self._finish.add(task_id)

    def resume(self, task_id: str) -> bool:
        """The session came back before its task finished: it goes on, unless the finish was
        handed to the decider already (then the session needs its next task)."""
        if task_id in self._finish_handed:
            return False
        self._finish.discard(task_id)
        return True

    def has_work(self, task_id: str, n: int, refused: int) -> bool:
        """Whether the decider should ask for step `n` (with `refused` refusals of it so far)
        now, and if so, promise it the work."""
        handed = self._handed.get(task_id)
        work = bool(self._queued.get(task_id)) or task_id in self._finish \
            or (handed is not None and handed.handed == (n, refused))
        if work:
            self._promised.add(task_id)
        return work

    def forget(self, task_id: str) -> None:
        """The task is over: nothing of it is kept."""
        self._queued.pop(task_id, None)
        self._handed.pop(task_id, None)
        self._finish.discard(task_id)
        self._finish_handed.discard(task_id)
        self._promised.discard(task_id)

    def take(self, history: History) -> Proposal | None:
        """The answer to the decider's question for `history.n`: the call handed for the same
        question again, else the next queued call, else finish if the session ended."""
        task_id, n, refused = history.task_id, history.n, len(history.refusals)
        self._promised.discard(task_id)
        handed = self._handed.get(task_id)
        if handed is not None and handed.handed == (n, refused):
            return ProposeCall(handed.tool, dict(handed.args))
        queue = self._queued.get(task_id)
        if queue:
            call = queue.popleft()
            if not queue:
                del self._queued[task_id]
            call.handed = (n, refused)
            self._handed[task_id] = call
            return ProposeCall(call.tool, dict(call.args))
        self._handed.pop(task_id, None)
        if task_id in self._finish:
            self._finish_handed.add(task_id)
            return ProposeFinish("the MCP session ended")
        return None


class AgentModel:
    """The `Model` of an MCP session's task: its answer is the agent's queued call. Other
    tasks' questions go to `fallback` (the app's own model)."""

    name = "mcp-agent"
    version: str | None = None

    def __init__(self, queues: CallQueues, fallback: Model) -> None:
        self.queues = queues
        self.fallback = fallback

    async def decide(self, history: History) -> Proposal:
        if not is_session_task(history.input):
            return await self.fallback.decide(history)
        proposal = self.queues.take(history)
        if proposal is None:
            # Not reachable: the decider asks only when `has_work` said yes, and nothing but
            # `take` removes work that was promised. Refused with words if it ever happens.
            return ProposeCall("", {}, malformed="no call from the agent to place")
        return proposal

    async def aclose(self) -> None:
        close = getattr(self.fallback, "aclose", None)
        if close is not None:
            await close()


class GatedDecider(Decider):
    """The decider of a proxy: it asks the model for an MCP session's step only once the agent
    has sent a call (see the module's theory), and tells the proxy of every change it folds
    (`on_news`), so waiting calls look at the journal again."""

    def __init__(self, *args: Any, queues: CallQueues,
                 on_news: Callable[[set[str]], None], on_idle: Callable[[str], None],
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.queues = queues
        self.on_news = on_news
        self.on_idle = on_idle  # a session task the decider would ask for, with no call

    def is_session(self, task_id: str) -> bool:
        state = self.follower.states.get(task_id)
        started = state.started if state is not None else None
        request = self.follower.requests.get(task_id)
        source = started.input if started is not None else (request.input if request else {})
        return is_session_task(dict(source))

    async def _make(self, task_id: str, move: Any) -> None:
        if isinstance(move, Ask) and self.is_session(task_id):
            refused = len(self._state(task_id).refused(move.n))
            if not self.queues.has_work(task_id, move.n, refused):
                self.on_idle(task_id)
                return  # the agent has not called: an idle agent is not a failing model
        await super()._make(task_id, move)

    async def _on_change(self, task_ids: set[str]) -> None:
        await super()._on_change(task_ids)
        self.on_news(task_ids)

    def _on_guard_record(self, record: GuardRecord) -> None:
        super()._on_guard_record(record)
        self.on_news({record.task_id})
