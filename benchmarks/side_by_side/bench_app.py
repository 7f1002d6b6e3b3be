"""bench: the 3-step task of `benchmarks/side_by_side.py` as a halfway app (`--app bench_app:app`).

One keyed tool, `make_thing`, POSTs to the stub provider (STUB_URL) with the step's key as its
`Idempotency-Key`; its lookup asks the stub for the thing named by that key. The task's script
(the scripted model) calls it three times.

The HTTP client is aiohttp, as in the peers' apps and the direct loop: httpx's connection pool
slows down badly with hundreds of requests in flight on one client (seconds per request at a
few hundred), which would measure the client, not the systems around it.
"""

from __future__ import annotations

import os
from typing import Any

import aiohttp

from halfway import App, CallContext

STUB_URL = os.environ.get("STUB_URL", "http://127.0.0.1:18099")

app = App(name="bench", instructions="You make things at the stub provider.")

_session: aiohttp.ClientSession | None = None


def stub() -> aiohttp.ClientSession:
    """One HTTP session per process, made on first use inside the running loop (it keeps
    connections open)."""
    global _session
    if _session is None:
        _session = aiohttp.ClientSession(base_url=STUB_URL,
                                         connector=aiohttp.TCPConnector(limit=1024))
    return _session


@app.tool(effect="keyed", key_ttl_s=86_400, timeout_s=5.0, evidence_id="thing_id")
async def make_thing(n: int, *, ctx: CallContext) -> dict[str, Any]:
    """Make a thing numbered n at the stub provider. Returns its id."""
    async with stub().post("/things", json={"n": n}, headers={"Idempotency-Key": ctx.key},
                           timeout=aiohttp.ClientTimeout(total=ctx.timeout_s)) as response:
        response.raise_for_status()  # the stub never refuses: anything but 2xx is unknown
        return {"thing_id": (await response.json())["id"]}


@make_thing.lookup
async def find_thing(n: int, *, ctx: CallContext) -> dict[str, Any] | None:
    async with stub().get("/things", params={"key": ctx.key},
                          timeout=aiohttp.ClientTimeout(total=ctx.timeout_s)) as response:
        response.raise_for_status()
        found = (await response.json())["data"]
    return {"thing_id": found[0]["id"]} if found else None


@app.on_shutdown
async def _close_session() -> None:
    """Close the shared session when a service stops, not in a garbage collector's warning."""
    global _session
    if _session is not None:
        await _session.close()
        _session = None
