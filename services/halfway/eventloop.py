"""The event loop a long-running service runs on: uvloop where it is installed, else asyncio's.

Why uvloop: a step's CPU in a service is mostly the event loop's own work (socket reads and
writes, callbacks, timers) around aiokafka's produce and fetch, not our code, and uvloop does
that work in C (libuv). benchmarks/side_by_side.py measures the difference. Everything here
(aiokafka, asyncpg, aiohttp, httpx) supports it. HALFWAY_EVENT_LOOP=asyncio chooses the
standard loop (to compare, or to rule uvloop out when diagnosing); HALFWAY_EVENT_LOOP=uvloop
insists on uvloop and fails with a clear error when it is missing.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from halfway.settings import SettingsError

LOOPS = ("auto", "uvloop", "asyncio")
T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop factory HALFWAY_EVENT_LOOP asks for (None: asyncio's default)."""
    choice = os.environ.get("HALFWAY_EVENT_LOOP", "auto").strip().lower() or "auto"
    if choice not in LOOPS:
        raise SettingsError(f"HALFWAY_EVENT_LOOP={choice[:40]!r} is not one of "
                            f"{', '.join(LOOPS)}")
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise SettingsError("HALFWAY_EVENT_LOOP=uvloop but uvloop is not installed "
                                "(pip install uvloop; it has no Windows build)") from None
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the chosen loop."""
    try:
        factory = loop_factory()
    except SettingsError:
        main.close()  # never awaited: no "coroutine was never awaited" warning on top
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)
