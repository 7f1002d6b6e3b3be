"""Tool calls that will not stop, left to run on their own.

A tool's timeout cancels it. One that swallows the cancellation (`except BaseException`, a
`while True` that catches everything) would hold its step "in flight" for ever, and an
executor slot, and a process that stops would wait for it at its loop's close; a plain
function runs on a worker thread, which nothing can stop. So a tool runs in a task of its
own (`bounded`): cancelled, it is cancelled in turn and given CANCEL_GRACE_S to stop; one that
will not is left running, and the call goes on as timed out (its step unknown, settled by its
lookup). A process that stops with such calls left (`left`) exits without waiting for them
(`halfway.eventloop.run`).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from halfway import log

CANCEL_GRACE_S = 1.0  # a cancelled tool's time to return before it is left running
KEPT_MAX = 1_000  # runaway tasks referenced here (more still run; they are only counted)

_tasks: set[asyncio.Future[Any]] = set()
_threads = 0  # plain functions running on worker threads now
_threads_lock = threading.Lock()


async def bounded(coro: Coroutine[Any, Any, Any], name: str) -> Any:
    """Await `coro` in a task of its own. Cancelled (our timeout, a shutdown), the task is
    cancelled too; if it has not stopped CANCEL_GRACE_S later, it is left running and the
    cancellation goes on here all the same."""
    task = asyncio.ensure_future(_boxed(coro))
    try:
        returned, value = await asyncio.shield(task)
    except asyncio.CancelledError:
        task.cancel()
        try:
            await asyncio.wait({task}, timeout=CANCEL_GRACE_S)
        finally:
            if task.done():
                if not task.cancelled():
                    task.result()  # boxed, never raises: what it said on its way out is no proof
            else:
                _leave(task, name)
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


def _leave(task: asyncio.Future[Any], name: str) -> None:
    if len(_tasks) < KEPT_MAX:
        _tasks.add(task)
        task.add_done_callback(_tasks.discard)
    log.get("halfway.tools").error(
        "a tool call would not stop when cancelled: it is left running, and its step is "
        "settled as timed out", tool=name[:200], left=len(_tasks))


def in_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Run `fn(*args)` counted as a thread call in progress (`left`): call it on the thread."""
    global _threads
    with _threads_lock:
        _threads += 1
    try:
        return fn(*args)
    finally:
        with _threads_lock:
            _threads -= 1


def left() -> int:
    """Tool calls still running that nobody waits for (or on threads, which nothing stops)."""
    return sum(not t.done() for t in _tasks) + _threads
