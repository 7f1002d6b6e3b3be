"""A move that failed rests, then its effect is looked at again (`StepWorker`): the end of
the rest is the timer firing, whatever the clocks say."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from halfway.journal import steps
from halfway.journal.steps import MoveFailed, StepWorker

WAIT_S = 10.0


class Follower:
    def __init__(self) -> None:
        self.touched = asyncio.Event()

    def touch(self, task_id: str) -> None:
        self.touched.set()


async def failing() -> None:
    raise MoveFailed("the broker refused the settlement")


async def test_a_rest_whose_timer_fires_early_by_the_monotonic_clock_is_over(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """uvloop fires timers by its own millisecond clock, which can run behind time.monotonic:
    the effect must not look resting still when its timer has fired, or nothing would look at
    it again (it stayed "in flight" until an operator touched the task)."""
    monkeypatch.setattr(steps, "MOVE_RETRY_S_MIN", 0.05)
    # The deadline is set by a monotonic clock ahead of the loop's by far more than any real
    # skew (uvloop's: up to a millisecond), so the timer fires "early" by it.
    skew = {"ahead_s": 0.5}
    real = steps.time.monotonic
    monkeypatch.setattr(steps, "time",
                        SimpleNamespace(monotonic=lambda: real() + skew["ahead_s"]))
    worker = StepWorker()
    follower = Follower()
    worker.follower = follower  # type: ignore[assignment]
    effect: Any = SimpleNamespace(move_id="t-1:1", task_id="t-1")

    worker.start_move(effect, failing())
    async with asyncio.timeout(WAIT_S):
        await follower.touched.wait()  # the rest's timer fired
    skew["ahead_s"] = 0.0  # the monotonic clock has not reached the deadline it set
    assert not worker.busy(effect)  # so the task's next look moves the effect again
    assert worker._resting[effect.move_id][0] == 1  # the failures still count (doubling)
