"""smtpsim: an SMTP relay (aiosmtpd) that records what it accepts, and an HTTP side to ask it.

Run it as its own process: `python -m halfway.simulators.smtpsim --port 0 --http-port 0` prints
exactly one line once both sides accept connections:

    listening on smtp://127.0.0.1:SMTP_PORT http://127.0.0.1:HTTP_PORT

In tests, `async with running() as sim:` serves both on the running event loop instead.

What it models. A mail relay (a submission server or smarthost) that answers as RFC 5321 says:
a message is accepted, and the relay takes responsibility for it (§6.1), only by a 2yz reply
to the end of its content (`<CRLF>.<CRLF>`). A 4yz or 5yz reply there, or to anything before
it, means it was not accepted (§4.2.1: "the requested action did not occur"; §4.2.5: after a
4yz or 5yz at the end of data the server MUST NOT deliver it). SMTP has no idempotency key
(research/providers.md §3); the relay keeps every message it accepted in a ledger searchable
by Message-ID, as Mailgun's events API is, so a client that lost the reply can ask.

Theory of operation. Every transaction (a MAIL command to the end of its data) is numbered and
logged. At each of its three checkpoints, MAIL, RCPT and the end of data, the first fault rule
for that phase with uses left (and naming one of the transaction's recipients, if it names any)
is consumed, once. Rules (`POST /faults {"rules": [...]}`; `DELETE /faults` clears them):

    transient         reply `code` (4yz, default 451) at `phase`; nothing is recorded
    refuse            reply `code` (5yz, default 550 at MAIL/RCPT, 554 at data); nothing recorded
    slow              wait `delay_s` before the reply at `phase`; at data, the message is
                      recorded first (the relay queued it and is slow to say so)
    drop              close the connection instead of replying at `phase`; at data the message
                      is NOT recorded (the relay died before it queued it)
    accept_then_drop  data only: record the message, then close the connection before the 250

Each rule has `phase` (`mail`, `rcpt` or `data`, default `data`), `times` (default 1) and `to`
(an address: the rule matches only transactions to it; not at MAIL, where no recipient is
known yet).

At the end of data without a fault, the message's Message-ID, From, To and Subject are read and
the message is recorded (accepted) *before* the relay replies `250 2.0.0 Ok: queued as Q…`:
acceptance is recorded synchronously, so a lookup made after the reply, or after the client
gave up waiting for it, sees the message. A message without a Message-ID is given one
(`<hex@smtpsim.local>`), as Postfix does. With `dedupe_message_id` (`--dedupe-message-id`), a
message whose Message-ID is already in the ledger is answered 250 with the first copy's queue
id and not recorded again (the dedupe the Postal server proposes: a relay like it lets the send
tool be `keyed`, `halfway.tools.email_smtp`).

HTTP side (JSON):

    GET    /messages?message_id=M   the messages accepted under Message-ID M, oldest first
    GET    /messages                the ledger: every accepted message, oldest first
    GET    /transactions            every transaction: its envelope, fault, reply, outcome
    GET    /faults                  the rules with uses left
    POST   /faults                  {"rules": [...]}: replaces the rules
    DELETE /faults                  clears them

Bounds: at most `messages_max` (MESSAGES_MAX) messages and TRANSACTIONS_MAX logged
transactions; past either a new transaction is refused at MAIL with 452 4.3.1 (insufficient
system storage), never silently dropped, because the ledger is the ground truth tests compare
with. Messages of at most DATA_BYTES_MAX (552 beyond), RULES_MAX rules, delays of at most
DELAY_S_MAX, idle connections closed after IDLE_TIMEOUT_S.

Not modelled: delivery beyond the relay (bounces, DSNs), AUTH and TLS, greylisting, SMTPUTF8,
PIPELINING and CHUNKING, Resend's `Resend-Idempotency-Key` header, SES rewriting Message-IDs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import email
import email.policy
import re
import secrets
import signal
import sys
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from aiohttp import web
from aiosmtpd.smtp import SMTP, Envelope, Session
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from halfway.simulators import keyed

HOST = keyed.HOST
HOSTNAME = "smtpsim.local"  # the relay's name in its greeting, and of the ids it makes up
MESSAGES_MAX = 100_000
TRANSACTIONS_MAX = 100_000
DATA_BYTES_MAX = 1024 * 1024
RULES_MAX = 100
TIMES_MAX = 10_000
DELAY_S_MAX = 600.0
IDLE_TIMEOUT_S = 60.0  # an idle client connection is closed (RFC 5321 §4.5.3.2.7 allows 5 min)
DROP_WAIT_S = 5.0  # after closing a connection, how long a hook waits to be cancelled
HEADER_CHARS_MAX = 998  # RFC 5322 §2.1.1: a line is at most 998 characters
STOP_TIMEOUT_S = 2.0

Phase = Literal["mail", "rcpt", "data"]
Action = Literal["transient", "refuse", "slow", "drop", "accept_then_drop"]

REPLY_TEXT = {  # the text after the code, with an enhanced status code (RFC 3463)
    421: "4.3.2 Service not available, closing transmission channel",
    450: "4.2.1 Mailbox unavailable, try again later",
    451: "4.3.0 Local error in processing, try again later",
    452: "4.3.1 Insufficient system storage",
    550: "5.1.1 Mailbox unavailable",
    551: "5.1.6 User not local",
    552: "5.3.4 Message size exceeds fixed limit",
    553: "5.1.3 Mailbox name not allowed",
    554: "5.6.0 Transaction failed",
}
_FOLD = re.compile(r"\r?\n(?=[ \t])")
FULL = "452 4.3.1 Insufficient system storage: the simulator's ledger is full"


def reply(code: int) -> str:
    return f"{code} {REPLY_TEXT.get(code, 'Requested action not taken')}"


# --- fault rules ---------------------------------------------------------------------------------


class FaultRule(BaseModel):
    """One rule, consumed at the first transaction that reaches its phase (see the module)."""

    model_config = ConfigDict(extra="forbid")

    action: Action
    phase: Phase = "data"
    code: int | None = Field(default=None, ge=400, le=599)
    delay_s: float = Field(default=0.0, ge=0.0, le=DELAY_S_MAX)
    times: int = Field(default=1, ge=1, le=TIMES_MAX)
    to: str | None = Field(default=None, max_length=254)

    @model_validator(mode="after")
    def _consistent(self) -> FaultRule:
        if self.action == "transient" and self.code is not None and self.code >= 500:
            raise ValueError("a transient reply is a 4yz code")
        if self.action == "refuse" and self.code is not None and self.code < 500:
            raise ValueError("a refusal is a 5yz code")
        if self.action in ("slow", "drop", "accept_then_drop") and self.code is not None:
            raise ValueError(f"{self.action} takes no code")
        if self.action == "slow" and self.delay_s <= 0:
            raise ValueError("slow needs a positive delay_s")
        if self.action != "slow" and self.delay_s:
            raise ValueError("only slow takes delay_s")
        if self.action == "accept_then_drop" and self.phase != "data":
            raise ValueError("accept_then_drop happens at data only")
        if self.phase == "mail" and self.to is not None:
            raise ValueError("no recipient is known at MAIL: a rule with `to` needs rcpt or data")
        return self

    def reply_code(self) -> int:
        if self.code is not None:
            return self.code
        if self.action == "transient":
            return 451
        return 554 if self.phase == "data" else 550


class FaultRules(BaseModel):
    model_config = ConfigDict(extra="forbid")

    rules: list[FaultRule] = Field(max_length=RULES_MAX)


@dataclass
class _Live:
    rule: FaultRule
    left: int


# --- state ---------------------------------------------------------------------------------------


@dataclass
class Transaction:
    """One MAIL ... end of data, as the relay saw it."""

    number: int
    started_at: str
    mail_from: str
    rcpt_tos: list[str] = field(default_factory=list)
    message_id: str | None = None
    faults: list[str] = field(default_factory=list)  # "phase:action", in order
    reply: str | None = None  # the last reply that ended it (None: open, abandoned or dropped)
    accepted: bool = False
    dropped: bool = False  # the relay closed the connection instead of replying
    queue_id: str | None = None


@dataclass
class Relay:
    """Everything the simulator knows. Hooks and HTTP handlers share it on one event loop."""

    messages_max: int = MESSAGES_MAX
    dedupe_message_id: bool = False
    messages: list[dict[str, Any]] = field(default_factory=list)  # the ledger, oldest first
    by_message_id: dict[str, list[int]] = field(default_factory=dict)  # -> ledger indexes
    transactions: list[Transaction] = field(default_factory=list)
    rules: list[_Live] = field(default_factory=list)

    def full(self) -> bool:
        return (len(self.messages) >= self.messages_max
                or len(self.transactions) >= TRANSACTIONS_MAX)

    def begin(self, mail_from: str) -> Transaction:
        tx = Transaction(len(self.transactions) + 1, _now(), mail_from)
        self.transactions.append(tx)
        return tx

    def take(self, phase: Phase, recipients: Sequence[str]) -> FaultRule | None:
        """Consume the first live rule for this phase (and these recipients), if any."""
        wanted = {r.lower() for r in recipients}
        for live in self.rules:
            rule = live.rule
            if rule.phase != phase or (rule.to is not None and rule.to.lower() not in wanted):
                continue
            live.left -= 1
            if live.left <= 0:
                self.rules.remove(live)
            return rule
        return None

    def find(self, message_id: str) -> list[dict[str, Any]]:
        return [self.messages[i] for i in self.by_message_id.get(message_id.strip(), [])]

    def accept(self, tx: Transaction, headers: dict[str, str], size: int) -> dict[str, Any]:
        queue_id = "Q" + secrets.token_hex(6).upper()
        record = {"queue_id": queue_id, "message_id": tx.message_id, "mail_from": tx.mail_from,
                  "rcpt_tos": list(tx.rcpt_tos), **headers, "size": size,
                  "received_at": _now(), "transaction": tx.number}
        self.by_message_id.setdefault(str(tx.message_id), []).append(len(self.messages))
        self.messages.append(record)
        tx.accepted, tx.queue_id = True, queue_id
        return record


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _headers(content: bytes) -> tuple[str | None, dict[str, str]]:
    """The Message-ID as written (unfolded) and the From, To and Subject as decoded."""
    try:
        raw = email.message_from_bytes(content, policy=email.policy.compat32)
        parsed = email.message_from_bytes(content, policy=email.policy.default)
    except Exception:  # a relay takes what it is given; an unreadable header is just empty
        return None, {"from": "", "to": "", "subject": ""}

    def decoded(name: str) -> str:
        try:
            value = parsed.get(name)
            return "" if value is None else str(value)[:HEADER_CHARS_MAX]
        except Exception:
            return ""

    # As written, not as parsed: the parser cuts an invalid id short (`<trip-1:4@x>` → `<trip-1`).
    # Unfolded as RFC 5322 §2.2.3 says: a line break before whitespace is removed.
    message_id = _FOLD.sub("", str(raw.get("Message-ID") or "")).strip()[:HEADER_CHARS_MAX]
    return message_id or None, {"from": decoded("From"), "to": decoded("To"),
                                "subject": decoded("Subject")}


# --- the SMTP side -------------------------------------------------------------------------------


class _Handler:
    """aiosmtpd's hooks: each checkpoint consumes a fault rule, and the end of data records."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        # The transaction each envelope belongs to; an envelope dropped by aiosmtpd drops out.
        self.open: weakref.WeakKeyDictionary[Envelope, Transaction] = (
            weakref.WeakKeyDictionary())

    async def handle_MAIL(self, server: SMTP, session: Session, envelope: Envelope,
                          address: str, mail_options: list[str]) -> str:
        if self.relay.full():
            return FULL
        tx = self.relay.begin(address)
        self.open[envelope] = tx
        refused = await self._fault(server, tx, "mail", ())
        if refused is not None:
            return refused
        envelope.mail_from = address
        envelope.mail_options.extend(mail_options)
        return "250 2.1.0 Ok"

    async def handle_RCPT(self, server: SMTP, session: Session, envelope: Envelope,
                          address: str, rcpt_options: list[str]) -> str:
        tx = self.open.get(envelope) or self.relay.begin(envelope.mail_from or "")
        self.open[envelope] = tx
        refused = await self._fault(server, tx, "rcpt", (address,))
        if refused is not None:
            return refused
        envelope.rcpt_tos.append(address)
        envelope.rcpt_options.extend(rcpt_options)
        tx.rcpt_tos.append(address)
        tx.reply = None  # an earlier RCPT's refusal did not end the transaction
        return "250 2.1.5 Ok"

    async def handle_DATA(self, server: SMTP, session: Session, envelope: Envelope) -> str:
        tx = self.open.pop(envelope, None) or self.relay.begin(envelope.mail_from or "")
        content = envelope.original_content or b""
        message_id, headers = _headers(content)
        tx.message_id = message_id or f"<{secrets.token_hex(16)}@{HOSTNAME}>"
        rule = self.relay.take("data", tx.rcpt_tos)
        if rule is not None:
            tx.faults.append(f"data:{rule.action}")
            if rule.action in ("transient", "refuse"):
                tx.reply = reply(rule.reply_code())
                return tx.reply
            if rule.action == "drop":
                return await self._drop(server, tx)  # before it is recorded: lost
        if self.relay.full():
            tx.reply = FULL
            return tx.reply
        first = self.relay.find(tx.message_id) if self.relay.dedupe_message_id else []
        if first:
            tx.accepted, tx.queue_id = True, first[0]["queue_id"]
            tx.reply = f"250 2.0.0 Ok: duplicate of queued as {tx.queue_id}, not queued again"
            return tx.reply
        record = self.relay.accept(tx, headers, len(content))
        answer = f"250 2.0.0 Ok: queued as {record['queue_id']}"
        if rule is not None and rule.action == "accept_then_drop":
            return await self._drop(server, tx)
        if rule is not None and rule.action == "slow":
            tx.reply = answer  # recorded already; if the client gives up, it stays accepted
            await asyncio.sleep(rule.delay_s)
        tx.reply = answer
        return answer

    async def _fault(self, server: SMTP, tx: Transaction, phase: Phase,
                     recipients: Sequence[str]) -> str | None:
        """The reply a fault at MAIL or RCPT gives instead of 250 (None: go on)."""
        rule = self.relay.take(phase, recipients)
        if rule is None:
            return None
        tx.faults.append(f"{phase}:{rule.action}")
        if rule.action == "slow":
            await asyncio.sleep(rule.delay_s)
            return None
        if rule.action == "drop":
            return await self._drop(server, tx)
        tx.reply = reply(rule.reply_code())
        return tx.reply

    async def _drop(self, server: SMTP, tx: Transaction) -> str:
        """Close the connection instead of replying. Closing it cancels this hook (aiosmtpd's
        connection_lost); the reply below is never sent."""
        tx.dropped = True
        if server.transport is not None:
            server.transport.close()
        await asyncio.sleep(DROP_WAIT_S)
        return reply(421)


# --- the HTTP side -------------------------------------------------------------------------------

RELAY = web.AppKey("smtpsim", Relay)


def _listed(data: list[dict[str, Any]]) -> web.Response:
    return web.json_response({"object": "list", "data": data, "count": len(data)})


async def _messages(request: web.Request) -> web.Response:
    relay = request.app[RELAY]
    message_id = request.query.get("message_id")
    return _listed(relay.find(message_id) if message_id is not None else list(relay.messages))


async def _transactions(request: web.Request) -> web.Response:
    return _listed([asdict(tx) for tx in request.app[RELAY].transactions])


def _rules(relay: Relay) -> web.Response:
    return web.json_response({"rules": [{**live.rule.model_dump(), "times_left": live.left}
                                        for live in relay.rules]})


async def _get_faults(request: web.Request) -> web.Response:
    return _rules(request.app[RELAY])


async def _set_faults(request: web.Request) -> web.Response:
    try:
        rules = FaultRules.model_validate_json(await request.read())
    except ValidationError as exc:
        return keyed.bad_control(str(exc))
    relay = request.app[RELAY]
    relay.rules = [_Live(rule, rule.times) for rule in rules.rules]
    return _rules(relay)


async def _clear_faults(request: web.Request) -> web.Response:
    relay = request.app[RELAY]
    relay.rules = []
    return _rules(relay)


def make_http_app(relay: Relay) -> web.Application:
    app = web.Application()
    app[RELAY] = relay
    app.router.add_get("/messages", _messages)
    app.router.add_get("/transactions", _transactions)
    app.router.add_get("/faults", _get_faults)
    app.router.add_post("/faults", _set_faults)
    app.router.add_delete("/faults", _clear_faults)
    return app


# --- serving -------------------------------------------------------------------------------------


@dataclass
class SmtpSim:
    """A running simulator: where its two sides listen, and its state (for in-process tests)."""

    host: str
    smtp_port: int
    http_url: str
    relay: Relay

    @property
    def lookup_url(self) -> str:
        """What `halfway.tools.email_smtp` asks: `GET lookup_url?message_id=...`."""
        return f"{self.http_url}/messages"

    @property
    def line(self) -> str:
        return f"listening on smtp://{self.host}:{self.smtp_port} {self.http_url}"


@contextlib.asynccontextmanager
async def running(*, host: str = HOST, port: int = 0, http_port: int = 0,
                  messages_max: int = MESSAGES_MAX,
                  dedupe_message_id: bool = False) -> AsyncIterator[SmtpSim]:
    """Serve both sides on this event loop (port 0: any free port) until the block ends."""
    if not 1 <= messages_max <= MESSAGES_MAX:
        raise ValueError(f"messages_max must be 1..{MESSAGES_MAX}")
    relay = Relay(messages_max=messages_max, dedupe_message_id=dedupe_message_id)
    handler = _Handler(relay)
    loop = asyncio.get_running_loop()
    sessions: weakref.WeakSet[SMTP] = weakref.WeakSet()

    def session() -> SMTP:
        smtp = SMTP(handler, hostname=HOSTNAME, data_size_limit=DATA_BYTES_MAX,
                    timeout=IDLE_TIMEOUT_S, loop=loop)
        sessions.add(smtp)
        return smtp

    server = await loop.create_server(session, host, port, backlog=keyed.BACKLOG)
    try:
        http_url, runner = await keyed.start(make_http_app(relay), host, http_port)
        try:
            yield SmtpSim(host, server.sockets[0].getsockname()[1], http_url, relay)
        finally:
            await runner.cleanup()
    finally:
        server.close()
        # Open connections outlive server.close(): close them, which cancels their hooks.
        for smtp in list(sessions):
            if smtp.transport is not None:
                smtp.transport.close()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(STOP_TIMEOUT_S):
                await server.wait_closed()


async def _serve(args: argparse.Namespace) -> None:
    async with running(host=args.host, port=args.port, http_port=args.http_port,
                       messages_max=args.messages_max,
                       dedupe_message_id=args.dedupe_message_id) as sim:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        print(sim.line, flush=True)  # the one line a parent process reads
        await stop.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m halfway.simulators.smtpsim",
        description="An SMTP relay simulator (smtpsim) with an HTTP side to look messages up.")
    parser.add_argument("--host", default=HOST)
    parser.add_argument("--port", type=int, default=0, help="the SMTP port; 0: any free port")
    parser.add_argument("--http-port", type=int, default=0,
                        help="the HTTP port (lookups, ledger, faults); 0: any free port")
    parser.add_argument("--messages-max", type=int, default=MESSAGES_MAX,
                        help="messages kept; past it MAIL is refused with 452")
    parser.add_argument("--dedupe-message-id", action="store_true",
                        help="answer a message whose Message-ID is already accepted with 250, "
                             "without recording it again")
    args = parser.parse_args(argv)
    if not 1 <= args.messages_max <= MESSAGES_MAX:
        parser.error(f"--messages-max must be 1..{MESSAGES_MAX}")
    asyncio.run(_serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
