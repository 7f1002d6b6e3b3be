"""A service's loops, run together until the service is stopped, and a watch on a loop that
must keep turning."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# A loop that has not turned for this long is stuck: its service stops (LoopStalled), and its
# partitions go to another instance. Kafka's max.poll.interval.ms (5 min by default) would do
# it, but aiokafka's check never fires for us: each fetch a wake cancels leaves its "a fetch is
# under way" count raised. Counted in ticks of the watch's own, so a process paused (SIGSTOP, a
# VM stall) is not taken for a stuck loop when it wakes.
LOOP_STALL_S = 300.0
LOOP_WATCH_TICK_S = 1.0


class LoopEnded(RuntimeError):
    """A service's loop ended by itself: it returned, or was cancelled by someone other than
    the service's caller. Loops run until the service is stopped, so it stops loudly."""


class LoopStalled(RuntimeError):
    """A service's loop is stuck: it has not turned within its limit. The service stops, so a
    supervisor restarts it and its partitions go to another instance meanwhile."""


class LoopWatch:
    """Counts a loop's turns; `watch()`, run beside the loop, raises LoopStalled when it has
    not turned for LOOP_STALL_S."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.turns = 0

    def turned(self) -> None:
        self.turns += 1

    async def watch(self) -> None:
        seen, ticks = self.turns, 0
        while True:
            await asyncio.sleep(LOOP_WATCH_TICK_S)
            if self.turns != seen:
                seen, ticks = self.turns, 0
                continue
            ticks += 1
            if ticks * LOOP_WATCH_TICK_S >= LOOP_STALL_S:
                raise LoopStalled(f"the {self.what} has not turned for {LOOP_STALL_S:g} s")


async def run_until_cancelled(*loops: Coroutine[Any, Any, None]) -> None:
    """Run a service's loops together until cancelled; the first to end stops them all. One
    that fails raises its error; one that returns or is cancelled from elsewhere raises
    LoopEnded. (A TaskGroup takes a child's cancellation for a normal end: the service would
    keep running without that loop, its partitions read by nobody.)"""
    await _run(None, loops)


async def run_beside(main: Coroutine[Any, Any, T], *loops: Coroutine[Any, Any, None]) -> T:
    """Run `main` with `loops` beside it, and return what `main` returns: the loops stop then.
    A loop that ends first stops `main` and raises, as in `run_until_cancelled`."""
    return await _run(main, loops)


async def _run(main: Coroutine[Any, Any, T] | None,
               loops: tuple[Coroutine[Any, Any, None], ...]) -> T:
    head = None if main is None else asyncio.create_task(main)
    tasks = [asyncio.create_task(coro) for coro in loops]
    every = tasks if head is None else [head, *tasks]
    try:
        done, _ = await asyncio.wait(every, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in every:
            task.cancel()
        await asyncio.wait(every)  # each one's own cleanup has run when this returns
    ends = {t: None if t.cancelled() else t.exception() for t in every}  # each one retrieved
    errors = [ends[t] for t in every if t in done and ends[t] is not None]
    if errors:
        raise errors[0]
    if head is not None and head in done and not head.cancelled():
        return head.result()
    ended = next(t for t in every if t in done)
    how = "was cancelled" if ended.cancelled() else "returned"
    raise LoopEnded(f"{ended.get_coro().__qualname__} {how} while the service ran")
