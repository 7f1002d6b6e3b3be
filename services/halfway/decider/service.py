"""The decider service: a thin loop around `halfway.core.decide`.

It follows the tasks topic and the journal (JournalFollower), and for each task whose state
changed asks `decide` for the next move: start or reject a requested task, ask the model for
the next step, finish. The model is asked only for a step that is not in the journal yet, and
at most once at a time per step in this process; `step.intended` is appended (acks=all) before
anything else can happen to it. Model calls run as their own tasks, so a slow model never
blocks other tasks on the same partition.

A step with a subject is placed only once the subject guard grants its claim (GuardView):
otherwise the proposal is refused with the guard's reason. Claims are released here too, when
their step settles (or never became a step). A failing saga's undos are journaled here
(`Compensate`); the executor performs them.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

from halfway import log
from halfway.contract import (
    CompensationIntended,
    DecidedBy,
    EffectClass,
    Event,
    StepIntended,
    StepRefused,
    TaskAborted,
    TaskFinished,
    TaskRejected,
    TaskStarted,
    mint_undo_key,
    step_id,
)
from halfway.contract.events import new_event_id
from halfway.contract.guards import SubjectClaimed
from halfway.contract.topics import TASKS
from halfway.core import saga
from halfway.core.decide import (
    Abort,
    Ask,
    Compensate,
    Finish,
    Refused,
    Reject,
    Start,
    accept_call,
    decide,
    final_state_for,
)
from halfway.core.fold import TaskState, apply
from halfway.core.guard import Blocked, stale_claims
from halfway.journal import JournalWriter
from halfway.journal.follower import JournalFollower, run_until_cancelled
from halfway.journal.guards import GuardView
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
        self.guards = GuardView(settings, writer)
        self._asking: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._released: set[str] = set()  # claims (event ids) this process released
        self._slots = asyncio.Semaphore(MODEL_CALLS_MAX)
        self._log = log.get("halfway.decider")

    async def run(self) -> None:
        await self.guards.start()
        await self.follower.start()
        try:
            # The guard must be read to its end before any task moves: a subject that looks
            # free on a half-read guard is not.
            await run_until_cancelled(self.guards.run(), self._follow_once_guarded())
        finally:
            for task in self._asking.values():
                task.cancel()
            await self.follower.stop()
            await self.guards.stop()

    async def _follow_once_guarded(self) -> None:
        await self.guards.caught_up()
        await self.follower.run()

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
        await self._release_claims(state)
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
            case Abort(reason=reason):
                await self._write(TaskAborted(**stamp(task_id), reason=reason, by=saga.HARNESS))
                self._log.info("the saga failed; it is called off", reason=reason)
            case Compensate(undos=undos, why=why):
                for n, tool, args in undos:  # last step first
                    sid = step_id(task_id, n)
                    await self._write(CompensationIntended(
                        **stamp(task_id), step_id=sid, tool=tool, args=args,
                        key=mint_undo_key(sid)))
                self._log.info("undoing the saga", why=why, steps=[n for n, *_ in undos])
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
            await self._refuse(task_id, n, proposal, fields.reason, decided_by)
            return
        if fields["subject"] is not None and fields["effect_class"] is not EffectClass.READ:
            assert tool is not None
            claim = SubjectClaimed(event_id=new_event_id(), at=datetime.now(UTC),
                                   subject=fields["subject"], tool=tool.spec.name,
                                   step_id=fields["step_id"], task_id=task_id,
                                   once_per_subject=tool.spec.once_per_subject)
            verdict = await self.guards.claim(claim)
            if isinstance(verdict, Blocked):  # the model reads why, and may wait or do otherwise
                await self._refuse(task_id, n, proposal, verdict.reason, decided_by)
                return
        intent = StepIntended(**stamp(task_id), **fields, decided_by=decided_by)
        await self._write(intent)
        self._log.info("step decided", tool=intent.tool, key=intent.key)

    async def _refuse(self, task_id: str, n: int, proposal: Any, reason: str,
                      decided_by: DecidedBy) -> None:
        """Nothing is placed. The refusal is journaled so the model, asked again, reads why."""
        await self._write(StepRefused(**stamp(task_id), n=n, tool=proposal.tool,
                                      args=proposal.args, reason=reason, decided_by=decided_by))
        self._log.warning("proposal refused", reason=reason)

    async def _release_claims(self, state: TaskState) -> None:
        """Release the guard claims of this task's steps that settled or never became steps."""
        held = self.guards.book.held_by(state.task_id).values()
        placing = {n for (task_id, n) in self._asking if task_id == state.task_id}
        for claim, release in stale_claims(held, state, placing):
            if claim.event_id not in self._released:
                await self.guards.release(claim, release)
                self._released.add(claim.event_id)

    async def _write(self, event: Event) -> None:
        meta = await self.writer.append(event)
        self.follower.note_write(event.task_id, meta.partition, meta.offset)
