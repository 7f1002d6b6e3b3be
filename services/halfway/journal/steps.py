"""StepWorker: what the executor and the reconciler share.

Both follow the journal, and for each step they own a move for (a call, a lookup) run it as
its own task, at most one per step at a time, and set a timer when `next_action` says to wait.
This is that bookkeeping; the services decide which moves are theirs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from datetime import datetime

from halfway import log
from halfway.core.fold import StepState
from halfway.journal.follower import JournalFollower


class StepWorker:
    follower: JournalFollower

    def __init__(self) -> None:
        self._moves: dict[str, asyncio.Task[None]] = {}  # step id -> the move in flight
        self._timers: dict[str, asyncio.TimerHandle] = {}

    async def run(self) -> None:
        await self.follower.start()
        try:
            await self.follower.run()
        finally:
            for timer in self._timers.values():
                timer.cancel()
            for move in self._moves.values():
                move.cancel()
            await self.follower.stop()

    def busy(self, step: StepState) -> bool:
        return step.step_id in self._moves

    def start_move(self, step: StepState, move: Awaitable[None]) -> None:
        """Run `move` for the step; when it ends, the step's task is looked at again."""
        async def run_then_release() -> None:
            try:
                await move
            except Exception:
                # Nothing was journaled past the failure; the step is looked at again below.
                log.get("halfway.steps").exception("move failed", step_id=step.step_id)
            finally:
                del self._moves[step.step_id]
                self.follower.touch(step.intent.task_id)

        self._moves[step.step_id] = asyncio.create_task(run_then_release())

    def wake_at(self, step: StepState, until: datetime, now: datetime) -> None:
        """Look at the step's task again at `until` (one timer per step)."""
        if (old := self._timers.pop(step.step_id, None)) is not None:
            old.cancel()
        delay_s = max(0.0, (until - now).total_seconds())
        self._timers[step.step_id] = asyncio.get_running_loop().call_later(
            delay_s, self.follower.touch, step.intent.task_id)
