"""The 3-step task as a Restate service, for `benchmarks/side_by_side.py`.

Runs in the Restate venv of the benchmark's cache (`restate-sdk`, `hypercorn`, `aiohttp`), never
in the project's:

    python restate_service.py PORT STUB_URL    # prints "listening on http://127.0.0.1:PORT"

`Bench/run` does three `ctx.run(...)` steps; each POSTs to the stub provider with a key made of
the invocation id and the step number as its `Idempotency-Key` (a retried step sends the same
key). Restate journals each step's result before the handler goes on.
"""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import Any

import aiohttp
import hypercorn.asyncio
import hypercorn.config
import restate

STUB_URL = sys.argv[2] if len(sys.argv) > 2 else "http://127.0.0.1:18099"

bench = restate.Service("Bench")
_session: aiohttp.ClientSession | None = None


def stub() -> aiohttp.ClientSession:
    global _session
    if _session is None:
        _session = aiohttp.ClientSession(base_url=STUB_URL,
                                         connector=aiohttp.TCPConnector(limit=1024))
    return _session


async def make_thing(n: int, key: str) -> str:
    async with stub().post("/things", json={"n": n}, headers={"Idempotency-Key": key},
                           timeout=aiohttp.ClientTimeout(total=5.0)) as response:
        response.raise_for_status()
        return str((await response.json())["id"])


@bench.handler()
async def run(ctx: restate.Context, request: dict[str, Any]) -> dict[str, Any]:
    invocation = ctx.request().id
    ids = []
    for n in (1, 2, 3):
        ids.append(await ctx.run_typed(f"make_thing_{n}", make_thing, restate.RunOptions(),
                                       n=n, key=f"{invocation}:{n}"))
    return {"ids": ids}


app = restate.app(services=[bench])


async def main(port: int) -> None:
    config = hypercorn.config.Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.loglevel = "WARNING"
    config.h2_max_concurrent_streams = 2**31 - 1
    config.keep_alive_max_requests = 2**31 - 1
    config.keep_alive_timeout = 3600
    config.graceful_timeout = 1.0
    shutdown = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, shutdown.set)
    served = asyncio.create_task(hypercorn.asyncio.serve(
        app, config, shutdown_trigger=shutdown.wait))  # type: ignore[arg-type]
    print(f"listening on http://127.0.0.1:{port}", flush=True)
    await served


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1])))
