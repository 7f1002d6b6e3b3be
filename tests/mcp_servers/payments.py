"""A payments-like MCP server for tests, written with the `mcp` SDK's MCPServer.

Run it over stdio (the default) or streamable HTTP:

    python tests/mcp_servers/payments.py --db LEDGER.sqlite
    python tests/mcp_servers/payments.py --db LEDGER.sqlite --http --port 0
        # prints "listening on http://127.0.0.1:PORT/mcp" once it accepts connections

Its ledger is a SQLite file (`--db`) shared by every copy of the server: over stdio each client
process starts its own copy (as an MCP adapter in front of one payments backend would), and
the test reads the same file. `Ledger(path)` below is the test's handle on it.

Tools:

- `create_payment(invoice_id, amount_cents, currency="usd", idempotencyKey=None)`, no
  annotations (so a client that trusts nothing treats it as unkeyed). It honours an idempotency
  key: `_meta["io.halfway/idempotency-key"]` first, else the `idempotencyKey` argument. The
  same key returns the saved payment (`"replayed": true`); a request whose key is still being
  processed by an earlier request gets a JSON-RPC error (code CONFLICT, like HTTP 409). Returns
  `{"payment_id", "invoice_id", "amount_cents", "currency", "key", "replayed"}`.
- `find_payment(invoice_id=None, idempotencyKey=None)`, `readOnlyHint`: the payment made with
  the key (`_meta` first, then the argument), else the latest payment for the invoice, else
  null.
- `send_receipt(invoice_id, email)`, no annotations and no key: records one receipt per call.
- `get_balance()`, `readOnlyHint`: `{"balance_cents": ...}`, the sum of the payments.

Every call is logged (`Ledger.requests()`: tool, the key in `_meta`, the key argument, the step
id in `_meta`), before any fault acts.

Fault switches, armed by the test (`Ledger.arm(tool, kind, times=1, seconds=0.0)`), each used
by the next `times` calls of that tool, in every copy of the server:

- `slow`: wait `seconds`, then commit and answer (the commit happens even if the client gave
  up and cancelled the request: a provider that finishes what it started);
- `drop`: commit, then exit the process without answering (over stdio: the session drops);
- `error`: answer `isError` ("card_declined: ...") without committing anything.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import sqlite3
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError
from mcp_types import ToolAnnotations

KEY_META = "io.halfway/idempotency-key"
STEP_META = "io.halfway/step-id"
CONFLICT = -32009  # a JSON-RPC error code of ours: the key is in flight (HTTP 409's meaning)
BUSY_TIMEOUT_S = 10.0  # SQLite waits this long for another copy's write lock
DROP_EXIT_CODE = 3

SCHEMA = """
create table if not exists payments (
    key text primary key, payment_id text, invoice_id text not null, amount_cents integer not null,
    currency text not null, status text not null, created_at real not null);
create table if not exists requests (
    id integer primary key autoincrement, tool text not null, meta_key text, arg_key text,
    step_id text, args text not null, at real not null);
create table if not exists receipts (
    id integer primary key autoincrement, invoice_id text not null, email text not null);
create table if not exists faults (
    id integer primary key autoincrement, tool text not null, kind text not null,
    remaining integer not null, seconds real not null);
"""


class Ledger:
    """The server's ground truth, and the test's handle on it (one SQLite file)."""

    def __init__(self, path: str | Path) -> None:
        self.path = str(path)
        with self._db() as db:
            db.executescript(SCHEMA)

    @contextlib.contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        db = sqlite3.connect(self.path, timeout=BUSY_TIMEOUT_S, isolation_level=None)
        db.row_factory = sqlite3.Row
        try:
            yield db
        finally:
            db.close()

    # -- what the test reads and arms --------------------------------------------------------

    def payments(self) -> list[dict[str, Any]]:
        """Committed payments, oldest first."""
        with self._db() as db:
            return [dict(r) for r in db.execute(
                "select * from payments where status = 'succeeded' order by created_at")]

    def requests(self, tool: str | None = None) -> list[dict[str, Any]]:
        with self._db() as db:
            rows = db.execute("select * from requests order by id").fetchall()
        return [dict(r) for r in rows if tool is None or r["tool"] == tool]

    def receipts(self) -> list[dict[str, Any]]:
        with self._db() as db:
            return [dict(r) for r in db.execute("select * from receipts order by id")]

    def arm(self, tool: str, kind: str, *, times: int = 1, seconds: float = 0.0) -> None:
        if kind not in ("slow", "drop", "error"):
            raise ValueError(f"unknown fault {kind!r}: slow, drop or error")
        with self._db() as db:
            db.execute("insert into faults (tool, kind, remaining, seconds) values (?, ?, ?, ?)",
                       (tool, kind, times, seconds))

    # -- what the server does ----------------------------------------------------------------

    def log(self, tool: str, meta_key: str | None, arg_key: str | None, step_id: str | None,
            args: dict[str, Any]) -> None:
        with self._db() as db:
            db.execute("insert into requests (tool, meta_key, arg_key, step_id, args, at) "
                       "values (?, ?, ?, ?, ?, ?)",
                       (tool, meta_key, arg_key, step_id, json.dumps(args), time.time()))

    def take_fault(self, tool: str) -> tuple[str, float] | None:
        """The next armed fault for this tool, used up atomically across copies."""
        with self._db() as db:
            db.execute("begin immediate")
            row = db.execute("select * from faults where tool = ? and remaining > 0 "
                             "order by id limit 1", (tool,)).fetchone()
            if row is not None:
                db.execute("update faults set remaining = remaining - 1 where id = ?",
                           (row["id"],))
            db.execute("commit")
        return None if row is None else (row["kind"], row["seconds"])

    def reserve(self, key: str, invoice_id: str, amount_cents: int, currency: str
                ) -> dict[str, Any] | None:
        """Claim the key for a new payment; the saved row if the key is known."""
        with self._db() as db:
            db.execute("begin immediate")
            row = db.execute("select * from payments where key = ?", (key,)).fetchone()
            if row is None:
                db.execute("insert into payments (key, invoice_id, amount_cents, currency, "
                           "status, created_at) values (?, ?, ?, ?, 'processing', ?)",
                           (key, invoice_id, amount_cents, currency, time.time()))
            db.execute("commit")
        return None if row is None else dict(row)

    def commit(self, key: str) -> dict[str, Any]:
        with self._db() as db:
            db.execute("update payments set status = 'succeeded', payment_id = ?, "
                       "created_at = ? where key = ?", (f"pay_{uuid.uuid4().hex[:12]}",
                                                        time.time(), key))
            return dict(db.execute("select * from payments where key = ?", (key,)).fetchone())

    def find(self, key: str | None, invoice_id: str | None) -> dict[str, Any] | None:
        with self._db() as db:
            if key:
                row = db.execute("select * from payments where key = ? and "
                                 "status = 'succeeded'", (key,)).fetchone()
            elif invoice_id:
                row = db.execute("select * from payments where invoice_id = ? and status = "
                                 "'succeeded' order by created_at desc limit 1",
                                 (invoice_id,)).fetchone()
            else:
                row = None
        return None if row is None else dict(row)

    def add_receipt(self, invoice_id: str, email: str) -> int:
        with self._db() as db:
            return int(db.execute("insert into receipts (invoice_id, email) values (?, ?)",
                                  (invoice_id, email)).lastrowid or 0)


def _payment(row: dict[str, Any], *, replayed: bool) -> dict[str, Any]:
    return {"payment_id": row["payment_id"], "invoice_id": row["invoice_id"],
            "amount_cents": row["amount_cents"], "currency": row["currency"], "key": row["key"],
            "replayed": replayed}


def _meta(ctx: Context) -> dict[str, Any]:
    return dict(ctx.request_context.meta or {})


def build(ledger: Ledger) -> MCPServer:
    server = MCPServer("payments", instructions="A payments provider for tests.")

    @server.tool()
    async def create_payment(invoice_id: str, amount_cents: int, ctx: Context,
                             currency: str = "usd", idempotencyKey: str | None = None
                             ) -> dict[str, Any]:
        """Charge an invoice. Pass an idempotency key: the same key never charges twice."""
        meta = _meta(ctx)
        key = meta.get(KEY_META) or idempotencyKey
        ledger.log("create_payment", meta.get(KEY_META), idempotencyKey, meta.get(STEP_META),
                   {"invoice_id": invoice_id, "amount_cents": amount_cents})
        fault = ledger.take_fault("create_payment")
        if fault is not None and fault[0] == "error":
            raise ToolError(f"card_declined: the card for invoice {invoice_id} was declined")
        key = key or f"nokey_{uuid.uuid4().hex}"  # no key: every call is a new payment
        known = ledger.reserve(key, invoice_id, amount_cents, currency)
        if known is not None:
            if known["status"] != "succeeded":
                raise MCPError(CONFLICT, f"a request with key {key} is still being processed")
            return _payment(known, replayed=True)
        if fault is not None and fault[0] == "slow":
            # Shielded: a client that times out cancels the request; the provider finishes.
            with anyio.CancelScope(shield=True):
                await anyio.sleep(fault[1])
                row = ledger.commit(key)
            return _payment(row, replayed=False)
        row = ledger.commit(key)
        if fault is not None and fault[0] == "drop":
            os._exit(DROP_EXIT_CODE)  # committed; the answer never leaves
        return _payment(row, replayed=False)

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    async def find_payment(ctx: Context, invoice_id: str | None = None,
                           idempotencyKey: str | None = None
                           ) -> dict[str, Any] | None:
        """Find a payment by its idempotency key (or the latest for an invoice); null if none."""
        meta = _meta(ctx)
        key = meta.get(KEY_META) or idempotencyKey
        ledger.log("find_payment", meta.get(KEY_META), idempotencyKey, meta.get(STEP_META),
                   {"invoice_id": invoice_id})
        row = ledger.find(key, invoice_id)
        return None if row is None else _payment(row, replayed=False)

    @server.tool()
    async def send_receipt(invoice_id: str, email: str, ctx: Context) -> dict[str, Any]:
        """Email a receipt for an invoice."""
        meta = _meta(ctx)
        ledger.log("send_receipt", meta.get(KEY_META), None, meta.get(STEP_META),
                   {"invoice_id": invoice_id, "email": email})
        fault = ledger.take_fault("send_receipt")
        if fault is not None and fault[0] == "error":
            raise ToolError("mailbox unavailable")
        receipt = ledger.add_receipt(invoice_id, email)
        if fault is not None and fault[0] == "slow":
            with anyio.CancelScope(shield=True):
                await anyio.sleep(fault[1])
        if fault is not None and fault[0] == "drop":
            os._exit(DROP_EXIT_CODE)
        return {"receipt_id": f"rcpt_{receipt}", "invoice_id": invoice_id}

    @server.tool(annotations=ToolAnnotations(read_only_hint=True))
    async def get_balance(ctx: Context) -> dict[str, Any]:
        """The total of all payments, in cents."""
        meta = _meta(ctx)
        ledger.log("get_balance", meta.get(KEY_META), None, meta.get(STEP_META), {})
        fault = ledger.take_fault("get_balance")
        if fault is not None and fault[0] == "error":
            raise ToolError("the balance service is unavailable")
        if fault is not None and fault[0] == "slow":
            await anyio.sleep(fault[1])
        return {"balance_cents": sum(p["amount_cents"] for p in ledger.payments())}

    return server


async def serve_http(server: MCPServer, host: str, port: int) -> None:
    """Streamable HTTP on a socket bound here, so port 0 works and the URL is printed only
    once connections are accepted."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    app = server.streamable_http_app(host=host)
    config = uvicorn.Config(app, log_level="warning")
    web = uvicorn.Server(config)
    serving = asyncio.create_task(web.serve(sockets=[sock]))
    while not web.started:
        if serving.done():
            await serving  # it failed: show why
        await asyncio.sleep(0.01)
    print(f"listening on http://{host}:{sock.getsockname()[1]}/mcp", flush=True)
    await serving


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True, help="the ledger, a SQLite file")
    parser.add_argument("--http", action="store_true", help="streamable HTTP instead of stdio")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    options = parser.parse_args(argv)
    server = build(Ledger(options.db))
    if options.http:
        asyncio.run(serve_http(server, options.host, options.port))
    else:
        server.run("stdio")


if __name__ == "__main__":
    sys.exit(main())
