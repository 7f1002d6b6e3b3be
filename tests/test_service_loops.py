"""A service's loops run together until the service is stopped (`run_until_cancelled`): one
that ends by itself stops the service loudly, never leaves it running without that loop (beside
a main part too: `run_beside`); and a fold's loop that is stuck stops its service (`LoopWatch`,
in the followers and the projector)."""

from __future__ import annotations

import asyncio
import time

import pytest

from halfway import loops as loops_module
from halfway.journal import JournalWriter
from halfway.journal.follower import JournalFollower
from halfway.loops import LoopEnded, LoopStalled, LoopWatch, run_beside, run_until_cancelled
from halfway.settings import KafkaSettings

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


# --- a main part with loops beside it ------------------------------------------------------------


async def test_beside_a_main_part_its_result_is_returned_and_the_loops_stop() -> None:
    loops = Loops()

    async def main() -> str:
        async with asyncio.timeout(WAIT_S):
            await loops.both.wait()
        return "served"

    result = await run_beside(main(), loops.forever("fold"), loops.forever("sender"))
    assert result == "served"
    assert loops.cleaned == {"fold", "sender"}


async def test_a_loop_that_ends_before_the_main_part_stops_it_with_an_error() -> None:
    """The MCP server would go on taking calls with nobody to decide or perform them."""
    loops = Loops()
    main_stopped = asyncio.Event()

    async def main() -> str:
        try:
            await asyncio.Event().wait()
        finally:
            main_stopped.set()
        return "never"

    service = asyncio.create_task(run_beside(main(), loops.forever("fold"),
                                             loops.forever("sender")))
    async with asyncio.timeout(WAIT_S):
        await loops.both.wait()
    loops.started["sender"].cancel()
    async with asyncio.timeout(WAIT_S):
        with pytest.raises(LoopEnded, match=r"Loops\.forever was cancelled"):
            await service
    assert main_stopped.is_set()
    assert loops.cleaned == {"fold", "sender"}


# --- a fold's loop that is stuck stops its service -----------------------------------------------


@pytest.fixture
def short_stall(monkeypatch: pytest.MonkeyPatch) -> float:
    monkeypatch.setattr(loops_module, "LOOP_WATCH_TICK_S", 0.05)
    monkeypatch.setattr(loops_module, "LOOP_STALL_S", 0.5)
    return 0.5


@pytest.mark.broker
async def test_a_fold_whose_loop_is_stuck_stops_its_service(
        own_deployment: KafkaSettings, short_stall: float) -> None:
    """Its consumer would go on heartbeating and keep the partitions: aiokafka's own check of
    the poll interval never fires for a consumer whose fetches a wake cancels."""
    stuck = asyncio.Event()

    async def hold() -> None:  # the loop's first await, and it never returns
        stuck.set()
        await asyncio.Event().wait()

    async with JournalWriter(own_deployment) as writer:
        follower = JournalFollower(own_deployment, group=f"{own_deployment.topic_prefix}stall",
                                   writer=writer, on_change=nothing, hold=hold)
        await follower.start()
        try:
            async with asyncio.timeout(WAIT_S):
                with pytest.raises(LoopStalled, match=f"not turned for {short_stall:g} s"):
                    await follower.run()
            assert stuck.is_set()
        finally:
            await follower.stop()


async def test_a_pause_longer_than_the_limit_is_not_a_stuck_loop(short_stall: float) -> None:
    """A process stopped (SIGSTOP) or a VM stalled wakes up with its clock far ahead: the watch
    counts its own ticks, not the time, so a pause is not taken for a loop that is stuck."""
    watch = asyncio.create_task(LoopWatch("fold").watch())
    await asyncio.sleep(0.1)  # two ticks of ten
    time.sleep(2 * short_stall)  # noqa: ASYNC251 -- the whole process paused, the watch too
    await asyncio.sleep(0.1)  # the late tick and two more: five of ten
    assert not watch.done()
    watch.cancel()
    with pytest.raises(asyncio.CancelledError):
        await watch


async def nothing(_tasks: set[str]) -> None:
    return None
