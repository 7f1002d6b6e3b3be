"""StepWorker: what the executor and the reconciler share.

Both follow the journal, and for each effect (a step or its undo) they own a move for (a
call, a lookup) run it as its own task, at most one per effect at a time, and set a timer
when `next_action` says to wait. This is that bookkeeping; the services decide which moves
are theirs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from datetime import datetime

from halfway import log
from halfway.core.effects import Effect
from halfway.journal.follower import JournalFollower

# A move that failed is tried again after MOVE_RETRY_S_MIN, doubling up to MOVE_RETRY_S_MAX
# while it keeps failing (a lookup whose arguments no longer parse fails at once, every time:
# retried at the next change, it would spin). At most RESTING_MAX effects are remembered
# resting; past that the oldest is forgotten (and may be tried again sooner).
MOVE_RETRY_S_MIN = 0.5
MOVE_RETRY_S_MAX = 60.0
RESTING_MAX = 10_000


class MoveFailed(Exception):
    """A move that failed and has said why in the log: it is tried again after a rest."""


class StepWorker:
    follower: JournalFollower

    def __init__(self) -> None:
        self._moves: dict[str, asyncio.Task[None]] = {}  # effect's move id -> the move
        self._timers: dict[str, asyncio.TimerHandle] = {}
        # Effects whose last moves failed: move id -> (failures in a row, resting until).
        self._resting: dict[str, tuple[int, float]] = {}

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
        """A move of the effect is running, or resting after a failure."""
        if effect.move_id in self._moves:
            return True
        resting = self._resting.get(effect.move_id)
        return resting is not None and time.monotonic() < resting[1]

    def start_move(self, effect: Effect, move: Awaitable[None]) -> None:
        """Run `move` for the effect; when it ends, the effect's task is looked at again (at
        once, or after a rest that grows while its moves keep failing)."""
        async def run_then_release() -> None:
            failed = True
            try:
                await move
                failed = False
            except asyncio.CancelledError:
                failed = False  # stopping: nothing to rest from
                raise
            except MoveFailed:
                pass
            except Exception:
                # Nothing was journaled past the failure; the effect is looked at again below.
                log.get("halfway.steps").exception("move failed", move=effect.move_id)
            finally:
                del self._moves[effect.move_id]
                if failed:
                    self._rest(effect)
                else:
                    self._resting.pop(effect.move_id, None)
                    self.follower.touch(effect.task_id)

        task = self._moves[effect.move_id] = asyncio.create_task(run_then_release())
        if asyncio.iscoroutine(move):  # a move cancelled before it began is closed, not lost
            task.add_done_callback(lambda _: move.close())

    def _rest(self, effect: Effect) -> None:
        failures = self._resting.pop(effect.move_id, (0, 0.0))[0] + 1
        delay_s = min(MOVE_RETRY_S_MAX, MOVE_RETRY_S_MIN * 2 ** min(failures - 1, 16))
        while len(self._resting) >= RESTING_MAX:
            del self._resting[next(iter(self._resting))]
        self._resting[effect.move_id] = (failures, time.monotonic() + delay_s)
        self._wake_in(effect, delay_s, ends_rest=True)

    def wake_at(self, effect: Effect, until: datetime, now: datetime) -> None:
        """Look at the effect's task again at `until` (one timer per effect)."""
        self._wake_in(effect, max(0.0, (until - now).total_seconds()))

    def _wake_in(self, effect: Effect, delay_s: float, *, ends_rest: bool = False) -> None:
        # One timer per effect, and only while it waits: a timer that fired is forgotten, so
        # the map holds the effects waiting now, not every effect that ever waited.
        move_id, task_id = effect.move_id, effect.task_id
        if (old := self._timers.pop(move_id, None)) is not None:
            old.cancel()

        def fire() -> None:
            if self._timers.get(move_id) is timer:
                del self._timers[move_id]
            if ends_rest and (rest := self._resting.get(move_id)) is not None:
                # The rest is over when its timer fires. The loop's clock (uvloop's: whole
                # milliseconds, read once per turn) may fire it a little before
                # time.monotonic() reaches the deadline: `busy` would then see the effect
                # resting still, and nothing would look at it again.
                self._resting[move_id] = (rest[0], 0.0)
            self.follower.touch(task_id)

        timer = self._timers[move_id] = asyncio.get_running_loop().call_later(delay_s, fire)
