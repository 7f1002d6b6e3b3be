"""The decider service: a thin loop around `halfway.core.decide`.

It follows the tasks topic and the journal (JournalFollower), and for each task whose state
changed asks `decide` for the next move: start or reject a requested task, ask the model for
the next step, finish. The model is asked only for a step that is not in the journal yet, and
at most once at a time per step in this process; `step.intended` is appended (acks=all) before
anything else can happen to it. Model calls run as their own tasks, so a slow model never
blocks other tasks on the same partition.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from halfway import log
from halfway.contract import (
    DecidedBy,
    Event,
    StepIntended,
    StepRefused,
    TaskFinished,
    TaskRejected,
    TaskStarted,
)
from halfway.contract.topics import TASKS
from halfway.core.decide import (
    Ask,
    Finish,
    Refused,
    Reject,
    Start,
    accept_call,
    decide,
    final_state_for,
)
from halfway.core.fold import TaskState, apply
from halfway.journal import JournalWriter
from halfway.journal.follower import JournalFollower
from halfway.journal.records import stamp
from halfway.models import Model, ProposeFinish, history_of
from halfway.settings import KafkaSettings
from halfway.tools.registry import Registry

MODEL_CALLS_MAX = 64  # questions in flight at once; more wait for a slot
MODEL_TIMEOUT_S = 120.0


class Decider:
    def __init__(self, settings: KafkaSettings, registry: Registry, model: Model,
                 writer: JournalWriter, *, group: str | None = None) -> None:
        self.registry = registry
        self.model = model
        self.writer = writer
        # One group per deployment (topic prefix): two deployments on one cluster must not
        # rebalance each other.
        group = group or f"{settings.topic_prefix}decider"
        self.follower = JournalFollower(settings, group=group, writer=writer,
                                        on_change=self._on_change, side=TASKS)
        self._asking: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._slots = asyncio.Semaphore(MODEL_CALLS_MAX)
        self._log = log.get("halfway.decider")

    async def run(self) -> None:
        await self.follower.start()
        try:
            await self.follower.run()
        finally:
            for task in self._asking.values():
                task.cancel()
            await self.follower.stop()

    def _state(self, task_id: str) -> TaskState:
        state = self.follower.states.get(task_id) or TaskState(task_id=task_id)
        request = self.follower.requests.get(task_id)
        return apply(state, request) if request is not None and state.request is None else state

    async def _on_change(self, task_ids: set[str]) -> None:
        for task_id in task_ids:
            with log.bound(task_id=task_id):
                await self._advance(task_id)

    async def _advance(self, task_id: str) -> None:
        state = self._state(task_id)
        move = decide(state, known_tools=self.registry.names(),
                      requested=task_id in self.follower.requests, now=datetime.now(UTC))
        match move:
            case Start():
                request = self.follower.requests[task_id]
                await self._write(TaskStarted(**stamp(task_id), input=request.input,
                                              allowed_tools=request.allowed_tools,
                                              policy=request.policy))
            case Reject(reason=reason):
                await self._write(TaskRejected(**stamp(task_id), reason=reason))
            case Finish(state=final, summary=summary):
                await self._write(TaskFinished(**stamp(task_id), state=final, summary=summary))
            case Ask(n=n) if (task_id, n) not in self._asking:
                self._asking[(task_id, n)] = asyncio.create_task(self._ask(task_id, n))
            case _:
                pass  # Hold, Idle, or a question already in flight

    async def _ask(self, task_id: str, n: int) -> None:
        with log.bound(task_id=task_id, step_id=f"{task_id}:{n}"):
            try:
                if not self.follower.owns(task_id):
                    return  # revoked between the change and this task starting
                async with self._slots, asyncio.timeout(MODEL_TIMEOUT_S):
                    history = history_of(self._state(task_id), n, self.registry.infos())
                    proposal = await self.model.decide(history)
                await self._place(task_id, n, proposal)
            except Exception:
                self._log.exception("asking the model failed; the step stays undecided")
            finally:
                del self._asking[(task_id, n)]
                self.follower.touch(task_id)

    async def _place(self, task_id: str, n: int, proposal: Any) -> None:
        if not self.follower.owns(task_id):
            self._log.info("the task moved to another decider while the model thought; "
                           "answer dropped")
            return
        state = self._state(task_id)
        if decide(state, known_tools=self.registry.names(), requested=True,
                  now=datetime.now(UTC)) != Ask(n):
            self._log.warning("the task moved on while the model thought; answer dropped")
            return
        if isinstance(proposal, ProposeFinish):
            await self._write(TaskFinished(**stamp(task_id), state=final_state_for(state),
                                           summary=proposal.summary))
            return
        tool = self.registry.get(proposal.tool)
        fields = accept_call(state, n, tool.spec.facts() if tool else None, proposal.tool,
                             proposal.args)
        decided_by = DecidedBy(model=self.model.name, version=self.model.version)
        if isinstance(fields, Refused):
            # Nothing is placed. The refusal is journaled so the model, asked again, reads why.
            await self._write(StepRefused(**stamp(task_id), n=n, tool=proposal.tool,
                                          args=proposal.args, reason=fields.reason,
                                          decided_by=decided_by))
            self._log.warning("proposal refused", reason=fields.reason)
            return
        intent = StepIntended(**stamp(task_id), **fields, decided_by=decided_by,
                              saga_role=tool.spec.saga_role if tool else None)
        await self._write(intent)
        self._log.info("step decided", tool=intent.tool, key=intent.key)

    async def _write(self, event: Event) -> None:
        meta = await self.writer.append(event)
        self.follower.note_write(event.task_id, meta.partition, meta.offset)
