"""StepWorker: what the executor and the reconciler share.

Both follow the journal, and for each effect (a step or its undo) they own a move for (a
call, a lookup) run it as its own task, at most one per effect at a time, and set a timer
when `next_action` says to wait. This is that bookkeeping; the services decide which moves
are theirs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from datetime import datetime

from halfway import log
from halfway.core.effects import Effect
from halfway.journal.follower import JournalFollower


class StepWorker:
    follower: JournalFollower

    def __init__(self) -> None:
        self._moves: dict[str, asyncio.Task[None]] = {}  # effect's move id -> the move
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

    def busy(self, effect: Effect) -> bool:
        return effect.move_id in self._moves

    def start_move(self, effect: Effect, move: Awaitable[None]) -> None:
        """Run `move` for the effect; when it ends, the effect's task is looked at again."""
        async def run_then_release() -> None:
            try:
                await move
            except Exception:
                # Nothing was journaled past the failure; the effect is looked at again below.
                log.get("halfway.steps").exception("move failed", move=effect.move_id)
            finally:
                del self._moves[effect.move_id]
                self.follower.touch(effect.task_id)

        self._moves[effect.move_id] = asyncio.create_task(run_then_release())

    def wake_at(self, effect: Effect, until: datetime, now: datetime) -> None:
        """Look at the effect's task again at `until` (one timer per effect)."""
        if (old := self._timers.pop(effect.move_id, None)) is not None:
            old.cancel()
        delay_s = max(0.0, (until - now).total_seconds())
        self._timers[effect.move_id] = asyncio.get_running_loop().call_later(
            delay_s, self.follower.touch, effect.task_id)
