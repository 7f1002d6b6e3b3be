"""helpdesk: a tiny support-ticket provider for the tickets example (in memory, one process).

    python examples/tickets/helpdesk.py --port 18082     # --port 0 picks a free port

It speaks the way real providers do where halfway depends on it:

    POST /tickets {ref, title, body?}   create; send an `Idempotency-Key` header. The same key
                                        within 24 h returns the same ticket (header
                                        `Idempotent-Replayed: true`); with other params, a 400.
                                        A bad `ref` (not like ACME-42) is a 422: a refusal.
    GET  /tickets?key=K                 {"data": [the tickets created with key K]}: the lookup
    GET  /tickets[?ref=R]               {"data": [every ticket (for ref R)]}: the ledger
    POST /tickets/{id}/close            close a ticket (closing twice is the same as once)
    POST /faults {"slow_first_s": 8}    the next create stores its ticket, then answers 8 s
                                        late: the caller times out, yet the ticket exists.

Errors are `{"error": {"message": ..., "code": ...}}`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import time
from typing import Any

from aiohttp import web

REF = re.compile(r"^[A-Z]+-[0-9]+$")
KEY_TTL_S = 86_400.0  # how long a key is remembered, like Stripe's 24 h
TICKETS_MAX = 100_000  # every map here is bounded: keys <= tickets <= this
SLOW_S_MAX = 60.0  # every sleep is bounded
KEY_CHARS_MAX = 255
TITLE_CHARS_MAX = 200
BODY_CHARS_MAX = 5_000


class Helpdesk:
    def __init__(self) -> None:
        self.tickets: dict[str, dict[str, Any]] = {}  # id -> ticket, in creation order
        self.keys: dict[str, tuple[str, str, float]] = {}  # key -> (id, params, created at)
        self.slow_next_s = 0.0

    def routes(self) -> list[web.RouteDef]:
        return [web.post("/tickets", self.create), web.get("/tickets", self.list_tickets),
                web.post("/tickets/{id}/close", self.close), web.post("/faults", self.faults)]

    async def create(self, request: web.Request) -> web.Response:
        key = request.headers.get("Idempotency-Key")
        if key is not None and not 0 < len(key) <= KEY_CHARS_MAX:
            return error(400, f"Idempotency-Key must be 1 to {KEY_CHARS_MAX} characters")
        body = await json_body(request)
        if body is None:
            return error(400, "the body must be a JSON object")
        params = json.dumps([body.get("ref"), body.get("title"), body.get("body") or ""])
        # A key seen within its lifetime: replay the same ticket, or refuse other params.
        # (No await between this check and storing below, so concurrent repeats cannot race.)
        if key is not None and key in self.keys:
            ticket_id, seen_params, created_at = self.keys[key]
            if time.time() - created_at < KEY_TTL_S:
                if seen_params != params:
                    return error(400, "this Idempotency-Key was used with other parameters",
                                 "idempotency_error")
                return web.json_response(self.tickets[ticket_id],
                                         headers={"Idempotent-Replayed": "true"})
        problem = invalid(body)
        if problem:
            return error(422, problem, "invalid_request")
        if len(self.tickets) >= TICKETS_MAX:
            return error(507, f"the helpdesk is full ({TICKETS_MAX} tickets)", "store_full")
        ticket = {"id": f"T-{len(self.tickets) + 1:06d}", "ref": body["ref"],
                  "title": body["title"], "body": body.get("body") or "", "status": "open",
                  "created_at": round(time.time(), 3), "idempotency_key": key}
        self.tickets[ticket["id"]] = ticket
        if key is not None:
            self.keys[key] = (ticket["id"], params, time.time())
        # The fault: the ticket exists now, but the answer comes late.
        slow_s, self.slow_next_s = self.slow_next_s, 0.0
        if slow_s:
            await asyncio.sleep(slow_s)
        return web.json_response(ticket, status=201)

    async def list_tickets(self, request: web.Request) -> web.Response:
        key, ref = request.query.get("key"), request.query.get("ref")
        data = [t for t in self.tickets.values()
                if (key is None or t["idempotency_key"] == key)
                and (ref is None or t["ref"] == ref)]
        return web.json_response({"data": data})

    async def close(self, request: web.Request) -> web.Response:
        ticket = self.tickets.get(request.match_info["id"])
        if ticket is None:
            return error(404, f"no ticket {request.match_info['id']}", "not_found")
        ticket["status"] = "closed"
        return web.json_response(ticket)

    async def faults(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        slow = None if body is None else body.get("slow_first_s", 0)
        if not isinstance(slow, int | float) or isinstance(slow, bool) \
                or not 0 <= slow <= SLOW_S_MAX:
            return error(400, f'send {{"slow_first_s": 0 to {SLOW_S_MAX:g}}}')
        self.slow_next_s = float(slow)
        return web.json_response({"slow_first_s": self.slow_next_s})


def invalid(body: dict[str, Any]) -> str | None:
    """What is wrong with a create request, in words for the caller; None if nothing."""
    ref, title, text = body.get("ref"), body.get("title"), body.get("body", "")
    if not isinstance(ref, str) or not REF.fullmatch(ref):
        return f"ref must look like ACME-42 (got {str(ref)[:40]!r})"
    if not isinstance(title, str) or not 0 < len(title) <= TITLE_CHARS_MAX:
        return f"title must be 1 to {TITLE_CHARS_MAX} characters"
    if text is not None and (not isinstance(text, str) or len(text) > BODY_CHARS_MAX):
        return f"body must be text of at most {BODY_CHARS_MAX} characters"
    return None


async def json_body(request: web.Request) -> dict[str, Any] | None:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError):
        return None
    return body if isinstance(body, dict) else None


def error(status: int, message: str, code: str = "bad_request") -> web.Response:
    return web.json_response({"error": {"message": message, "code": code}}, status=status)


async def serve(host: str, port: int) -> None:
    app = web.Application(client_max_size=64 * 1024)
    app.add_routes(Helpdesk().routes())
    runner = web.AppRunner(app, shutdown_timeout=0.1)  # exit without waiting for a slow reply
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    print(f"listening on http://{host}:{runner.addresses[0][1]}", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="a tiny support-ticket provider")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=18082)
    args = parser.parse_args()
    asyncio.run(serve(args.host, args.port))
