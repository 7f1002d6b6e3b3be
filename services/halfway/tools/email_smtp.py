"""send_email over SMTP (aiosmtplib): what each reply of the relay proves, and the Message-ID
that names our effect.

    relay = SmtpRelay(host="smtp.example.com", port=587, sender="trips@example.com",
                      starttls=True, username="trips", password=...,
                      lookup_url=None)              # or a URL answering ?message_id=
    smtp_tools(app, relay, saga_role=SagaRole.RETRIABLE)   # adds send_email(to, subject, body)

Why an adapter class and not `@app.tool`. An app tool's exceptions are classified by type, and
the same exception means different things at different points of an SMTP conversation: a lost
connection at RCPT proves the message was never sent, the same loss after the final "." proves
nothing. The adapter drives the conversation one command at a time (`connect`, `ehlo`,
`starttls`, `login`, `mail`, `rcpt`, then DATA and the content by hand, because aiosmtplib's
`data()` does not say whether the content had left when it failed) and reports exactly what it
saw as a `CallFailure`; the pure core (`halfway.core.classify`) decides the outcome.

The rule (RFC 5321). A relay accepts a message, and takes responsibility for it (§6.1), only by
a 2yz reply to the end of its content (`<CRLF>.<CRLF>`). Before the content left us, nothing
can have been accepted, whatever went wrong; after it, only the reply tells. ("Left" is counted
from just before the content is handed to the transport: a failure there is unknown, never a
guess of not done.) So:

    what happened                                        reported as      outcome (attempt 1)
    ---------------------------------------------------  ---------------  -------------------
    connect refused, name not resolved, connect timeout  NotSent          not_done (never
      (SMTPConnectError, SMTPConnectTimeoutError)                           reached)
    4yz at the greeting, EHLO/HELO, STARTTLS, AUTH,      ToolRefused      not_done
      MAIL, RCPT or DATA (421, 450, 451, 452:
      SMTPResponseException and its .code)
    5yz there (550, 553, 554; SMTPSenderRefused,         ToolRefused      not_done
      SMTPRecipientRefused(s), SMTPDataError, ...)
    no reply, or the connection lost, before the         NotSent          not_done (RFC 5321
      content was sent (SMTPTimeoutError,                                   §3.8: as if 451)
      SMTPServerDisconnected); anything else before it
    2yz to the end of data (250)                         Succeeded        done
    4yz to the end of data (421, 451, 452)               ToolRefused      not_done (§4.2.5:
                                                                            the relay MUST NOT
                                                                            deliver it)
    5yz to the end of data (550, 552, 554)               ToolRefused      not_done
    no reply within timeout_s after the content left     TimedOut         unknown
    the connection lost after the content left           ConnectionLost   unknown
      (SMTPServerDisconnected, reset)
    anything else after it (a malformed reply)           Unexpected       unknown

A 4yz is transient for the *sender* (it may try again later), but it is still a refusal of this
transaction: "the command was not accepted, and the requested action did not occur" (§4.2.1),
and after the end of data the relay "MUST NOT make a subsequent attempt to deliver that
message" (§4.2.5, as corrected by RFC 2821 erratum 375). So it proves not done; whether to send
again is the model's decision, under a new step.

A refusal speaks for its own transaction only. On attempt 1 there is no other: `ToolRefused`.
On a later attempt (only a `keyed` tool has one, below) an earlier attempt may have been
accepted, so a refusal is reported as `NotSent` (this attempt never reached the queue), which
the core classifies `unknown`.

Effect class. SMTP has no idempotency key, and a relay that lost our connection after the "."
may have queued the message: sending it again could deliver it twice (the reason for KumoMTA's
`data_processing_timeout`). So the tool is `unkeyed` by default: at most one transaction, never
retried; an unknown is settled by the lookup, or by an operator. `dedupes_by_message_id=True`
declares a relay that drops a message whose Message-ID it already accepted, within
`dedupe_window_s` (the dedupe Postal proposes; smtpsim's `--dedupe-message-id`): then the tool
is `keyed` with `key_ttl_s = dedupe_window_s`, and the executor may retry an unknown with the
same Message-ID inside that window. Declare it only for a relay you know does that: a plain
relay would deliver the retry as a second copy.

Message-ID. RFC 5322 §3.6.4: `msg-id = "<" id-left "@" id-right ">"`, id-left a dot-atom-text
of atext characters. Our key (`trip-1:4`) has a ":", which atext does not allow
(`<trip-1:4@halfway.local>`, the travel tool's, parses with defects), so `message_id_for`
escapes it: letters, digits, "-" and "_" stay, every other byte of the key's UTF-8 is `=XX`
(uppercase hex; "=" is atext). `trip-1:4` becomes `<trip-1=3A4@example.com>`; id-left has no
dots, so it is always a valid atom (a long one is folded onto a line of its own, which the
CFWS before "<" allows); `key_from_message_id` reverses it, and accepts only what
`message_id_for` makes (one key, one Message-ID: the lookup compares them as strings). id-right
is `message_id_domain`, by default the sender's domain; the Message-ID is unique as long as
task ids are unique among the senders of that domain. The key also travels as `X-Halfway-Key`,
for relays that replace the Message-ID (SES does).

Lookup. With a `lookup_url`, the lookup asks the relay `GET lookup_url?message_id=<ours>`
(smtpsim's `/messages`; the relay answers `{"data": [records]}`, each with `message_id`,
`queue_id`, `rcpt_tos` and `subject`). What it proves:

- found (with our recipient and subject) → done: the relay accepted it, as a 250 would have
  said. Like the 250, it proves acceptance by the relay, not delivery to the mailbox. Found
  under our Message-ID but for another recipient or subject → LookupFailed (claiming either
  outcome would be a guess).
- not found → nothing, on its own: a real relay may have queued it and not indexed it yet, or
  keep its log elsewhere. Only with `completes_within_s`, for a relay that records acceptance
  synchronously before its 250 (smtpsim does), does nothing found that long after the attempt
  prove not done (the core's rule, `halfway.core.next_action.on_nothing_found`).
- the lookup failing (timeout, non-200, unreadable) → LookupFailed: it says nothing.

Without a `lookup_url` the tool has no lookup (`has_lookup=False`): an unknown send waits for an
operator.

Bounds: one connection per attempt, the whole attempt within `timeout_s`; QUIT after the answer
within QUIT_TIMEOUT_S (its failure changes nothing); replies and errors cut to ERROR_CHARS_MAX;
at most LOOKUP_RECORDS_MAX records read per lookup.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import string
from dataclasses import dataclass, field
from datetime import UTC, datetime
from email.message import EmailMessage
from email.policy import SMTP as SMTP_POLICY
from email.utils import format_datetime
from typing import TYPE_CHECKING, Any

import aiosmtplib
import httpx
from aiosmtplib import (
    SMTPConnectError,
    SMTPDataError,
    SMTPHeloError,
    SMTPResponse,
    SMTPResponseException,
    SMTPServerDisconnected,
)
from pydantic import BaseModel, ConfigDict, Field, field_validator

from halfway.contract import EffectClass, SagaRole
from halfway.core.classify import (
    CallFailure,
    ConnectionLost,
    NotSent,
    TimedOut,
    ToolRefused,
    Unexpected,
)
from halfway.tools.http import attempt_budget_s, httpx_timeout
from halfway.tools.spec import (
    CallContext,
    CallResult,
    Found,
    LookupFailed,
    LookupResult,
    NotFound,
    Succeeded,
    ToolSpec,
)

if TYPE_CHECKING:
    from halfway.app import App

SEND_EMAIL = "send_email"
PROVIDER = "smtp"
KEY_HEADER = "X-Halfway-Key"
TIMEOUT_S_DEFAULT = 10.0
QUIT_TIMEOUT_S = 1.0
ERROR_CHARS_MAX = 300
LOOKUP_RECORDS_MAX = 10  # one key names one message; more than a few under it is a finding
SUBJECT_CHARS_MAX = 300
BODY_CHARS_MAX = 20_000
ADDRESS_CHARS_MAX = 254  # RFC 5321 §4.5.3.1.3 (path 256, less the angle brackets)
LOCAL_PART_CHARS_MAX = 64  # RFC 5321 §4.5.3.1.1
MESSAGE_ID_CHARS_MAX = 998 - len("Message-ID: ")  # RFC 5322 §2.1.1: a line is ≤998 characters
DATA = b"DATA"
START_INPUT = 354  # "start mail input"
EHLO_UNKNOWN = frozenset({500, 502})  # EHLO not recognized or not implemented: try HELO

# RFC 5322 §3.2.3: atext, and dot-atom-text (atoms joined by single dots).
_ATEXT = r"[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]"
_DOT_ATOM = re.compile(rf"{_ATEXT}+(?:\.{_ATEXT}+)*")
# An ASCII addr-spec: a dot-atom local part at a host name with at least one dot.
_LABEL = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_ADDRESS = re.compile(rf"(?P<local>{_ATEXT}+(?:\.{_ATEXT}+)*)@(?P<domain>{_LABEL}(?:\.{_LABEL})+)")
_KEPT = frozenset(string.ascii_letters + string.digits + "-_")  # key characters kept as they are
_MESSAGE_ID = re.compile(r"<([A-Za-z0-9_=-]+)@([^<>@\s]+)>")
_ESCAPE = re.compile(r"=([0-9A-F]{2})")
_QUEUE_ID = re.compile(r"(?:queued as|\bid=)\s*([A-Za-z0-9._-]{1,64})", re.IGNORECASE)
_DOT_STUFF = re.compile(rb"(?m)^\.")
# Content in 7 bits (quoted-printable or base64 where needed): no relay needs 8BITMIME for it.
_POLICY = SMTP_POLICY.clone(cte_type="7bit")


# --- the Message-ID ------------------------------------------------------------------------------


def message_id_for(key: str, domain: str) -> str:
    """The RFC 5322 Message-ID that names `key`'s effect: `<escaped-key@domain>` (see the
    module docstring). ValueError for an empty key, a domain that is not dot-atom-text, or a
    result longer than a header line allows."""
    if not key:
        raise ValueError("an empty key names nothing")
    if _DOT_ATOM.fullmatch(domain) is None:
        raise ValueError(f"{domain!r} is not a valid Message-ID domain (dot-atom-text)")
    left = "".join(ch if ch in _KEPT else "".join(f"={b:02X}" for b in ch.encode("utf-8"))
                   for ch in key)
    message_id = f"<{left}@{domain}>"
    if len(message_id) > MESSAGE_ID_CHARS_MAX:
        raise ValueError(f"the key is too long for a Message-ID ({len(message_id)} characters)")
    return message_id


def key_from_message_id(message_id: str, domain: str | None = None) -> str:
    """The key a Message-ID made by `message_id_for` names (`domain`: also check id-right).
    ValueError for anything `message_id_for` would not have made."""
    match = _MESSAGE_ID.fullmatch(message_id.strip())
    if match is None:
        raise ValueError(f"not a Message-ID made by halfway: {message_id[:100]!r}")
    left, right = match.groups()
    if domain is not None and right.lower() != domain.lower():
        raise ValueError(f"Message-ID {message_id[:100]!r} is not of domain {domain!r}")
    raw = bytearray()
    at = 0
    for escape in _ESCAPE.finditer(left):
        raw += left[at:escape.start()].encode("ascii")
        raw.append(int(escape.group(1), 16))
        at = escape.end()
    raw += left[at:].encode("ascii")
    try:
        key = raw.decode("utf-8")
        canonical = message_id_for(key, right)
    except ValueError as exc:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"not a Message-ID made by halfway: {message_id[:100]!r}") from exc
    if canonical != match.group(0):
        # A stray "=", lowercase hex, or an escaped character that is kept as it is.
        raise ValueError(f"not a Message-ID made by halfway: {message_id[:100]!r}")
    return key


def is_address(text: str) -> bool:
    """An ASCII addr-spec (dot-atom local part, host name domain) within RFC 5321's limits."""
    match = _ADDRESS.fullmatch(text)
    return (match is not None and len(text) <= ADDRESS_CHARS_MAX
            and len(match.group("local")) <= LOCAL_PART_CHARS_MAX)


# --- the tool's arguments and configuration ------------------------------------------------------


class SmtpEmailArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    to: str = Field(max_length=ADDRESS_CHARS_MAX,
                    description="one e-mail address, e.g. ada@example.com")
    # No control characters: a CR or LF in a header would be header injection.
    subject: str = Field(min_length=1, max_length=SUBJECT_CHARS_MAX, pattern=r"^[^\x00-\x1f\x7f]*$")
    body: str = Field(max_length=BODY_CHARS_MAX, description="plain text")

    @field_validator("to")
    @classmethod
    def _address(cls, to: str) -> str:
        if not is_address(to):
            raise ValueError("must be one plain e-mail address, like ada@example.com")
        return to


def email_subject(args: BaseModel) -> str:
    mail = _as_email(args)
    return f"email:{mail.to}:{mail.subject}"


@dataclass(frozen=True)
class SmtpRelay:
    """Where and how the tool sends. `sender` is the envelope and From address;
    `message_id_domain` and `helo_name` default to its domain. `starttls` upgrades a plain
    connection (port 587), `use_tls` connects over TLS (port 465); `username` logs in after.
    `lookup_url`, `completes_within_s` and `dedupes_by_message_id` are explained in the module
    docstring: declare them only for a relay that does what they say."""

    host: str
    port: int
    sender: str
    lookup_url: str | None = None
    timeout_s: float = TIMEOUT_S_DEFAULT
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    starttls: bool = False
    use_tls: bool = False
    validate_certs: bool = True
    message_id_domain: str | None = None
    helo_name: str | None = None
    completes_within_s: float | None = None
    dedupes_by_message_id: bool = False
    dedupe_window_s: float | None = None

    def __post_init__(self) -> None:
        if not is_address(self.sender):
            raise ValueError(f"sender {self.sender!r} is not a plain e-mail address")
        if not 0 < self.port < 65_536:
            raise ValueError(f"port {self.port} is not a TCP port")
        if self.timeout_s <= 0:
            raise ValueError("timeout_s must be positive")
        if self.starttls and self.use_tls:
            raise ValueError("starttls upgrades a plain connection; use_tls starts with TLS: "
                             "choose one")
        if self.completes_within_s is not None and (self.lookup_url is None
                                                    or self.completes_within_s <= 0):
            raise ValueError("completes_within_s is a positive bound on what the lookup sees: "
                             "it needs a lookup_url")
        if self.dedupes_by_message_id and not (self.dedupe_window_s or 0) > 0:
            raise ValueError("a relay that dedupes by Message-ID does so for a window: "
                             "declare dedupe_window_s")
        if not self.dedupes_by_message_id and self.dedupe_window_s is not None:
            raise ValueError("dedupe_window_s is for a relay that dedupes_by_message_id")
        message_id_for("k", self.domain)  # the domain must make valid Message-IDs

    @property
    def domain(self) -> str:
        return self.message_id_domain or self.sender.rpartition("@")[2]

    @property
    def helo(self) -> str:
        # Named, so aiosmtplib never asks the resolver for our FQDN inside the timeout.
        return self.helo_name or self.sender.rpartition("@")[2]


# --- the spec and the factories ------------------------------------------------------------------


def smtp_email_spec(relay: SmtpRelay, *, saga_role: SagaRole | None = None,
                    name: str = SEND_EMAIL) -> ToolSpec:
    """`unkeyed` (the default) or, for a relay that dedupes by Message-ID, `keyed` for its
    window; a lookup only with a `lookup_url`."""
    keyed = relay.dedupes_by_message_id
    return ToolSpec(
        name=name, args_model=SmtpEmailArgs, subject=email_subject,
        description=("Send a plain-text e-mail to one address. It cannot be taken back: in a "
                     "trip, send it only once everything is booked."),
        effect_class=EffectClass.KEYED if keyed else EffectClass.UNKEYED,
        key_ttl_s=relay.dedupe_window_s if keyed else None,
        timeout_s=relay.timeout_s, has_lookup=relay.lookup_url is not None,
        completes_within_s=relay.completes_within_s, saga_role=saga_role,
        evidence_id="queue_id")


def smtp_email_tool(relay: SmtpRelay, *, saga_role: SagaRole | None = None,
                    name: str = SEND_EMAIL) -> tuple[ToolSpec, SmtpEmailAdapter]:
    """The spec and its adapter, for a `Registry` (`Tool(spec, adapter)`)."""
    return smtp_email_spec(relay, saga_role=saga_role, name=name), SmtpEmailAdapter(relay)


def smtp_tools(app: App, relay: SmtpRelay, *, saga_role: SagaRole | None = None,
               name: str = SEND_EMAIL) -> SmtpEmailAdapter:
    """Add `send_email` over `relay` to `app`; the adapter is returned (the app's registry
    closes it)."""
    spec, adapter = smtp_email_tool(relay, saga_role=saga_role, name=name)
    app.add(spec, adapter)
    return adapter


# --- the adapter ---------------------------------------------------------------------------------


@dataclass
class _Progress:
    """Where the conversation is: `sent` once the content and its final "." may have left."""

    phase: str = "connect and greeting"
    sent: bool = False


class SmtpEmailAdapter:
    """One SMTP connection per attempt; one lazily made httpx client for lookups (`aclose()`
    closes it; closing again is harmless)."""

    def __init__(self, relay: SmtpRelay) -> None:
        self.relay = relay
        self._client: httpx.AsyncClient | None = None

    async def aclose(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            await client.aclose()

    async def call(self, args: BaseModel, ctx: CallContext) -> CallResult:
        mail = _as_email(args)
        try:
            message_id = message_id_for(ctx.key, self.relay.domain)
            content = self.message(mail, message_id, ctx.key)
        except ValueError as exc:
            return _refused(f"the message could not be written: {exc}", ctx.attempt)
        progress = _Progress()
        smtp = aiosmtplib.SMTP(
            hostname=self.relay.host, port=self.relay.port, timeout=ctx.timeout_s,
            local_hostname=self.relay.helo, use_tls=self.relay.use_tls,
            start_tls=False,  # upgraded below, as its own phase, when configured
            validate_certs=self.relay.validate_certs)
        try:
            async with asyncio.timeout(ctx.timeout_s):
                end = await self._converse(smtp, mail, content, progress)
        except Exception as exc:
            smtp.close()
            return _failure(exc, progress, ctx)
        await _quit(smtp)
        answer = f"{end.code} {end.message}"[:ERROR_CHARS_MAX]
        if 200 <= end.code < 300:
            found = _QUEUE_ID.search(end.message)
            return Succeeded(evidence={
                "message_id": message_id, "accepted": [mail.to],
                "queue_id": found.group(1) if found else None, "reply": answer,
                "provider": PROVIDER})
        if 400 <= end.code < 600:
            return _refused(f"the relay refused the message at the end of data: {answer}",
                            ctx.attempt)
        return Unexpected(f"the relay answered the end of data with {answer}")

    async def _converse(self, smtp: aiosmtplib.SMTP, mail: SmtpEmailArgs, content: bytes,
                        progress: _Progress) -> SMTPResponse:
        """One transaction, command by command; returns the reply to the end of data. Raises
        whatever aiosmtplib raised; `progress` says how far it got."""
        relay = self.relay
        await smtp.connect()  # the TCP connection (and TLS, with use_tls) and the greeting
        progress.phase = "EHLO"
        try:
            await smtp.ehlo()
        except SMTPHeloError as exc:
            if exc.code not in EHLO_UNKNOWN:
                raise
            progress.phase = "HELO"  # a server without ESMTP (RFC 5321 §3.2)
            await smtp.helo()
        if relay.starttls:
            progress.phase = "STARTTLS"
            await smtp.starttls()
        if relay.username is not None:
            progress.phase = "AUTH"
            await smtp.login(relay.username, relay.password or "")
        progress.phase = "MAIL FROM"
        await smtp.mail(relay.sender)
        progress.phase = "RCPT TO"
        await smtp.rcpt(mail.to)
        progress.phase = "DATA"
        start = await smtp.execute_command(DATA)
        if start.code != START_INPUT:
            raise SMTPDataError(start.code, start.message)
        protocol = smtp.protocol
        if protocol is None or not protocol.is_connected:
            raise SMTPServerDisconnected("the connection closed before the content was sent")
        progress.phase, progress.sent = "the end of data", True
        # From this write on, the relay may have the whole message and may accept it.
        protocol.write(content)
        return await protocol.read_response(timeout=None)  # bounded by the attempt's timeout

    def message(self, mail: SmtpEmailArgs, message_id: str, key: str) -> bytes:
        """The content as it goes on the wire after DATA: CRLF lines, dot-stuffed (RFC 5321
        §4.5.2), ending with the final "."."""
        message = EmailMessage(policy=_POLICY)
        message["From"] = self.relay.sender
        message["To"] = mail.to
        message["Subject"] = mail.subject
        message["Date"] = format_datetime(datetime.now(UTC))
        message["Message-ID"] = message_id
        message[KEY_HEADER] = key
        message.set_content(mail.body)
        text = message.as_bytes()
        if not text.endswith(b"\r\n"):
            text += b"\r\n"
        return _DOT_STUFF.sub(b"..", text) + b".\r\n"

    async def lookup(self, args: BaseModel, ctx: CallContext) -> LookupResult:
        """Ask the relay for the message under our Message-ID (see the module docstring for
        what each answer proves)."""
        mail = _as_email(args)
        url = self.relay.lookup_url
        if url is None:
            return LookupFailed("this tool has no lookup (no lookup_url)")
        try:
            message_id = message_id_for(ctx.key, self.relay.domain)
        except ValueError as exc:
            return LookupFailed(f"no Message-ID for key {ctx.key[:100]!r}: {exc}")
        try:
            async with asyncio.timeout(attempt_budget_s(ctx.timeout_s)):
                response = await self._http().get(url, params={"message_id": message_id},
                                                  timeout=httpx_timeout(ctx.timeout_s))
        except Exception as exc:
            return LookupFailed(f"the lookup failed: {type(exc).__name__}: {exc}"
                                [:ERROR_CHARS_MAX])
        if response.status_code != 200:
            return LookupFailed(f"the lookup answered HTTP {response.status_code}: "
                                f"{response.text[:ERROR_CHARS_MAX]}")
        try:
            data = response.json()["data"]
            if not isinstance(data, list):
                raise TypeError("data is not a list")
            mine = [r for r in data[:LOOKUP_RECORDS_MAX]
                    if isinstance(r, dict) and r.get("message_id") == message_id]
            if not mine:
                return NotFound(f"the relay has no message {message_id}")
            for record in mine:
                if not _same(record, mail):
                    # Our Message-ID on another message: either outcome would be a guess.
                    return LookupFailed(f"message {message_id} (queued as "
                                        f"{record.get('queue_id')}) is not what this step "
                                        "asked for")
            first, *more = mine
            return Found(evidence=_found_evidence(first, message_id),
                         others=tuple(str(r.get("queue_id")) for r in more))
        except Exception as exc:
            return LookupFailed(f"unreadable lookup answer: {type(exc).__name__}: {exc}"
                                [:ERROR_CHARS_MAX])

    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient()
        return self._client


# --- what an exchange proves ---------------------------------------------------------------------


def _as_email(args: BaseModel) -> SmtpEmailArgs:
    if not isinstance(args, SmtpEmailArgs):
        raise TypeError(f"{SEND_EMAIL} over SMTP takes SmtpEmailArgs, got {type(args).__name__}")
    return args


def _refused(why: str, attempt: int) -> CallFailure:
    """A refusal proves this transaction did nothing; on a later attempt an earlier one may
    have been accepted, so it is only 'this attempt never reached the queue'."""
    return ToolRefused(why) if attempt == 1 else NotSent(why)


def _failure(exc: Exception, progress: _Progress, ctx: CallContext) -> CallFailure:
    """What an exception at `progress` proves (the table in the module docstring)."""
    words = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS_MAX]
    at = progress.phase
    if not progress.sent:
        # The content never left us: whatever happened, the relay cannot have accepted it.
        if isinstance(exc, SMTPResponseException) and 400 <= exc.code < 600:
            return _refused(f"the relay refused at {at}: {exc.code} {exc.message}"
                            [:ERROR_CHARS_MAX] + "; the message was not sent", ctx.attempt)
        if isinstance(exc, SMTPConnectError):  # refused, unresolvable, connect timeout
            return NotSent(words)
        if isinstance(exc, TimeoutError):
            return NotSent(f"no reply at {at} within {ctx.timeout_s:g} s; the message was "
                           "not sent")
        if isinstance(exc, ConnectionError | OSError):
            return NotSent(f"the connection was lost at {at} ({words}); the message was not "
                           "sent")
        return NotSent(f"{at} failed ({words}); the message was not sent")
    if isinstance(exc, TimeoutError):
        return TimedOut(ctx.timeout_s)
    if isinstance(exc, ConnectionError | OSError):  # SMTPServerDisconnected is one
        return ConnectionLost(f"after the message was sent: {words}")
    return Unexpected(f"after the message was sent: {words}")


async def _quit(smtp: aiosmtplib.SMTP) -> None:
    """Say goodbye, briefly: the outcome is already known, and QUIT changes nothing."""
    with contextlib.suppress(Exception):
        async with asyncio.timeout(QUIT_TIMEOUT_S):
            await smtp.quit()
    smtp.close()


def _same(record: dict[str, Any], mail: SmtpEmailArgs) -> bool:
    recipients = {str(r).lower() for r in record.get("rcpt_tos") or []}
    # Compared as a header parser returns them: without the whitespace around them.
    return (mail.to.lower() in recipients
            and str(record.get("subject") or "").strip() == mail.subject.strip())


def _found_evidence(record: dict[str, Any], message_id: str) -> dict[str, Any]:
    return {"message_id": message_id, "accepted": list(record.get("rcpt_tos") or []),
            "queue_id": record.get("queue_id"), "received_at": record.get("received_at"),
            "provider": PROVIDER}
