"""The stub provider every system of `benchmarks/side_by_side.py` calls: one process of its own.

    python stub.py [--port 0]      # prints "listening on http://127.0.0.1:PORT" once it accepts

`POST /things` with a JSON body makes a thing; with an `Idempotency-Key` header a repeated key
returns the object the first request made (200 either way). `GET /things?key=K` is the lookup:
`{"data": [thing]}` or `{"data": []}`. It does no I/O but the socket: the figures measure the
systems around it, not the provider.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools

from aiohttp import web

_counter = itertools.count(1)
_by_key: dict[str, dict[str, object]] = {}


async def make_thing(request: web.Request) -> web.Response:
    body = await request.json()
    key = request.headers.get("Idempotency-Key")
    if key is not None and key in _by_key:
        return web.json_response(_by_key[key])
    thing = {"id": f"th_{next(_counter)}", "n": body.get("n"), "key": key}
    if key is not None:
        _by_key[key] = thing
    return web.json_response(thing)


async def find_things(request: web.Request) -> web.Response:
    thing = _by_key.get(request.query.get("key", ""))
    return web.json_response({"data": [thing] if thing is not None else []})


async def count(request: web.Request) -> web.Response:
    return web.json_response({"things": len(_by_key)})


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    app = web.Application()
    app.router.add_post("/things", make_thing)
    app.router.add_get("/things", find_things)
    app.router.add_get("/count", count)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port, backlog=1024)
    await site.start()
    port = runner.addresses[0][1]
    print(f"listening on http://127.0.0.1:{port}", flush=True)
    await asyncio.Event().wait()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
