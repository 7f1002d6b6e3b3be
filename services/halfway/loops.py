"""A service's loops, run together until the service is stopped."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class LoopEnded(RuntimeError):
    """A service's loop ended by itself: it returned, or was cancelled by someone other than
    the service's caller. Loops run until the service is stopped, so it stops loudly."""


class LoopStalled(RuntimeError):
    """A service's loop is stuck: it has not turned within its limit. The service stops, so a
    supervisor restarts it and its partitions go to another instance meanwhile."""


async def run_until_cancelled(*coros: Coroutine[Any, Any, None]) -> None:
    """Run a service's loops together until cancelled; the first to end stops them all. One
    that fails raises its error; one that returns or is cancelled from elsewhere raises
    LoopEnded. (A TaskGroup takes a child's cancellation for a normal end: the service would
    keep running without that loop, its partitions read by nobody.)"""
    tasks = [asyncio.create_task(coro) for coro in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)  # each loop's own cleanup has run when this returns
    ends = {t: None if t.cancelled() else t.exception() for t in tasks}  # each one retrieved
    errors = [ends[t] for t in done if ends[t] is not None]
    if errors:
        raise errors[0]
    ended = next(iter(done))
    how = "was cancelled" if ended.cancelled() else "returned"
    raise LoopEnded(f"{ended.get_coro().__qualname__} {how} while the service ran")
