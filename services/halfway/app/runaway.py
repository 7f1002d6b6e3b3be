"""Tool calls that outlive their timeout: waited for, never abandoned as settled.

A tool's timeout cancels it. An app's async function that swallows the cancellation (`except
BaseException`, a loop that catches everything) runs on, and a plain function's thread cannot
be stopped at all: either may still send its request, long after the timeout. Settled unknown
then, its step could be "proven" not done by a lookup that found nothing before the late
request landed (an outside probe charged twice that way). So a call's code is watched
(`Watch`): after its timeout, the call is over only once its code has ended (`until_ended`);
until then its step stays in flight, which is the truth. One that has not stopped
CANCEL_GRACE_S after its cancellation is logged and counted (`left`), and a process that stops
with such calls exits without waiting for them (`halfway.eventloop.run`), as after kill -9.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from halfway import log

CANCEL_GRACE_S = 1.0  # a cancelled tool's time to end before it is said to run on
KEPT_MAX = 10_000  # tool tasks referenced at once (more run, uncounted: an executor has 1,000)

_tasks: set[asyncio.Future[Any]] = set()  # app tools' tasks now running
_threads = 0  # plain functions running on worker threads now
_threads_lock = threading.Lock()


@dataclass(eq=False, slots=True)
class Watch:
    """One call's code: `ended` is set once it has ended (its task, or its thread)."""

    ended: asyncio.Event = field(default_factory=asyncio.Event)
    loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.get_running_loop)

    def end(self) -> None:
        """From the code's thread or task: it has ended."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self.loop.call_soon_threadsafe(self.ended.set)


async def in_task(coro: Coroutine[Any, Any, Any], watch: Watch) -> Any:
    """Await `coro` in a task of its own, so that a cancellation reaches it while the caller
    stops waiting at once; `watch` says when it has ended."""
    task = asyncio.ensure_future(_boxed(coro))
    task.add_done_callback(lambda _: watch.ended.set())
    if len(_tasks) < KEPT_MAX:
        _tasks.add(task)
        task.add_done_callback(_tasks.discard)
    try:
        returned, value = await asyncio.shield(task)
    except asyncio.CancelledError:
        task.cancel()  # our timeout, or a shutdown: a tool that cooperates stops here
        raise
    if not returned:
        raise value  # here, in the caller's frames: what the tool raised, whatever it is
    return value


async def _boxed(coro: Coroutine[Any, Any, Any]) -> tuple[bool, Any]:
    """`coro`'s value, or what it raised, as a value: raised out of a task, a SystemExit or
    a KeyboardInterrupt would stop the event loop (a tool never stops the process)."""
    try:
        return True, await coro
    except asyncio.CancelledError:
        raise
    except BaseException as exc:
        return False, exc


def in_thread(watch: Watch, fn: Callable[..., Any], *args: Any) -> Any:
    """Run `fn(*args)` on this worker thread, counted while it runs (`left`); `watch` is told
    when it has ended, however long after its caller stopped waiting."""
    global _threads
    with _threads_lock:
        _threads += 1
    try:
        return fn(*args)
    finally:
        with _threads_lock:
            _threads -= 1
        watch.end()


async def until_ended(watch: Watch, name: str) -> None:
    """Return once the call's code has ended. One still running CANCEL_GRACE_S on is logged
    (it holds its step in flight, and an executor slot) and counted until it ends."""
    if watch.ended.is_set():
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(CANCEL_GRACE_S):
            await watch.ended.wait()
            return
    log.get("halfway.tools").error(
        "a tool call runs on past its timeout (it would not stop when cancelled, or runs on a "
        "thread): its step stays in flight until it ends, as it may still send",
        tool=name[:200], running=left())
    await watch.ended.wait()


def left() -> int:
    """App tool calls running now (tasks and threads): what a stopping process would wait
    for, for ever if one will not end."""
    return len(_tasks) + _threads
