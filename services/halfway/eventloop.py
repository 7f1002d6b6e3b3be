"""The event loop a long-running process runs on: uvloop's, unless HALFWAY_EVENT_LOOP=asyncio.

uvloop (libuv under a Cython event loop, by the authors of asyncpg) runs the same asyncio code
with less Python per callback, socket read and write. Measured with benchmarks/side_by_side.py
(four runs of `--skip halfway,restate,dbos --rounds 8 --tasks 100`, asyncio's loop as the
variant, 2 cores): a worker on uvloop served 5-12% more tasks per second with 8 callers and
1-15% more steps per second with 256 tasks in flight, at 2-7% less CPU per task; a sequential
step took 7% less to 3% more time (noise). The same A/B now:
`--variant asyncio:HALFWAY_EVENT_LOOP=asyncio`.
Short commands (`halfway start`, `status`, ...) keep asyncio's own loop: nothing to gain there.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from halfway import log, settings
from halfway.app import runaway

T = TypeVar("T")


def factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop factory HALFWAY_EVENT_LOOP names (None: asyncio's default)."""
    if settings.event_loop() == "asyncio":
        return None
    import uvloop

    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the chosen loop. A tool call that would not stop is not waited
    for once `main` is over (closing the loop would wait for it for ever): the process exits
    at once, as after kill -9, which the journal is made for."""
    make = factory()  # a wrong setting fails here, before the coroutine is scheduled
    runner = asyncio.Runner(loop_factory=make)
    try:
        return runner.run(main)
    finally:
        if runaway.left():
            _exit_leaving_them(failed=sys.exc_info()[0] is not None)
        runner.close()


def _exit_leaving_them(*, failed: bool) -> None:
    log.get("halfway").error("stopped with tool calls that would not stop still running: "
                             "exiting without waiting for them", left=runaway.left())
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(1 if failed else 0)
