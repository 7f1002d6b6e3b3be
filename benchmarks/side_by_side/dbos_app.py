"""The 3-step task as a DBOS workflow, for `benchmarks/side_by_side.py`.

Runs in the DBOS venv of the benchmark's cache (`dbos`, `aiohttp`), never in the project's:

    python dbos_app.py PORT STUB_URL SYSTEM_DATABASE_URL   # prints "listening on http://..."

`POST /run/{id}` runs the workflow `three_things` under workflow id `id` and answers with its
result once it has finished: three `@DBOS.step()`s, each POSTing to the stub provider with the
workflow id and the step number as its `Idempotency-Key`. DBOS checkpoints each step's output to
its system database (PostgreSQL) before the workflow goes on. The HTTP front is how a DBOS app
is usually called (one hop, like Restate's ingress).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import aiohttp
from aiohttp import web
from dbos import DBOS, DBOSConfig, SetWorkflowID

PORT = int(sys.argv[1])
STUB_URL = sys.argv[2]
SYSTEM_DATABASE_URL = sys.argv[3]

_session: aiohttp.ClientSession | None = None


def stub() -> aiohttp.ClientSession:
    global _session
    if _session is None:
        _session = aiohttp.ClientSession(base_url=STUB_URL,
                                         connector=aiohttp.TCPConnector(limit=1024))
    return _session


@DBOS.step()
async def make_thing(n: int, key: str) -> str:
    async with stub().post("/things", json={"n": n}, headers={"Idempotency-Key": key},
                           timeout=aiohttp.ClientTimeout(total=5.0)) as response:
        response.raise_for_status()
        return str((await response.json())["id"])


@DBOS.workflow()
async def three_things() -> list[str]:
    workflow_id = DBOS.workflow_id
    return [await make_thing(n, f"{workflow_id}:{n}") for n in (1, 2, 3)]


async def run(request: web.Request) -> web.Response:
    with SetWorkflowID(request.match_info["id"]):
        ids = await three_things()
    return web.json_response({"ids": ids})


async def main() -> None:
    config: DBOSConfig = {"name": "halfway-bench", "system_database_url": SYSTEM_DATABASE_URL,
                          "log_level": "WARNING"}
    DBOS(config=config)
    DBOS.launch()
    app = web.Application()
    app.router.add_post("/run/{id}", run)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", PORT, backlog=1024).start()
    print(f"listening on http://127.0.0.1:{PORT}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    DBOS.destroy()


if __name__ == "__main__":
    logging.getLogger("aiohttp").setLevel(logging.WARNING)
    asyncio.run(main())
