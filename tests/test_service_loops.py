"""A service's loops run together until the service is stopped (`run_until_cancelled`): one
that ends by itself stops the service loudly, never leaves it running without that loop."""

from __future__ import annotations

import asyncio

import pytest

from halfway.loops import LoopEnded, run_until_cancelled

WAIT_S = 10.0


class Loops:
    """Two loops that run until cancelled and note that their cleanup ran."""

    def __init__(self) -> None:
        self.started: dict[str, asyncio.Task[None]] = {}
        self.cleaned: set[str] = set()
        self.both = asyncio.Event()

    async def forever(self, name: str) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.started[name] = task
        if len(self.started) == 2:
            self.both.set()
        try:
            await asyncio.Event().wait()
        finally:
            self.cleaned.add(name)


async def awaiting(future: asyncio.Future[None]) -> None:
    await future


async def running(loops: Loops, *extra: asyncio.Future[None]) -> asyncio.Task[None]:
    """The two loops, and a third for each of `extra` that ends as that future does."""
    service = asyncio.create_task(run_until_cancelled(
        loops.forever("fold"), loops.forever("sender"), *(awaiting(f) for f in extra)))
    async with asyncio.timeout(WAIT_S):
        await loops.both.wait()
    return service


async def test_a_loop_cancelled_by_someone_else_stops_the_service_with_an_error() -> None:
    """A TaskGroup takes a child's cancellation for a normal end and waits on for the others:
    the service would run on without its fold."""
    loops = Loops()
    service = await running(loops)
    loops.started["fold"].cancel()
    async with asyncio.timeout(WAIT_S):
        with pytest.raises(LoopEnded, match=r"Loops\.forever was cancelled"):
            await service
    assert loops.cleaned == {"fold", "sender"}


async def test_a_loop_that_returns_stops_the_service_with_an_error() -> None:
    loops = Loops()
    done = asyncio.get_running_loop().create_future()
    service = await running(loops, done)
    done.set_result(None)
    async with asyncio.timeout(WAIT_S):
        with pytest.raises(LoopEnded, match=r"awaiting returned"):
            await service
    assert loops.cleaned == {"fold", "sender"}


async def test_a_loop_that_fails_stops_the_others_and_its_error_is_raised() -> None:
    loops = Loops()
    failing = asyncio.get_running_loop().create_future()
    service = await running(loops, failing)
    failing.set_exception(ValueError("the broker is gone"))
    async with asyncio.timeout(WAIT_S):
        with pytest.raises(ValueError, match="the broker is gone"):
            await service
    assert loops.cleaned == {"fold", "sender"}


async def test_stopping_the_service_stops_every_loop_and_is_a_cancellation() -> None:
    loops = Loops()
    service = await running(loops)
    service.cancel()
    async with asyncio.timeout(WAIT_S):
        with pytest.raises(asyncio.CancelledError):
            await service
    assert service.cancelled()
    assert loops.cleaned == {"fold", "sender"}
