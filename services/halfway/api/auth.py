"""Who may use the HTTP API: bearer tokens with names and scopes, and the names it answers to.

Tokens. Each has a name (journaled as who acted: `api:NAME`) and scopes:

- `read`: the tasks, one task, the live stream;
- `start`: ask for a task (`POST /api/tasks`);
- `operate`: call a task off, settle a step by hand (`.../abort`, `.../resolve`).

No scope implies another: a token that operates and reads lists both. Tokens come from
`HALFWAY_API_TOKENS` (short form, comma-separated `NAME:SCOPE+SCOPE:TOKEN`) and from the file
`HALFWAY_API_TOKENS_FILE` (JSON Lines, or TOML when the name ends in `.toml`: an array of tables
`[[token]]`), each entry `{name, scopes, token}` or `{name, scopes, token_sha256}` (the hex
SHA-256 of the token: the file then holds no secret). Only digests are kept in memory; a
presented token is hashed and compared with every digest by `hmac.compare_digest`, all of them,
so the time taken says nothing about which (or whether one) matched.

With no token configured the API is read-only (reads open, as it binds loopback by default):
the write endpoints answer 403 until tokens are configured, unless `HALFWAY_API_DEV=1` lets
every request do everything as `api:dev` (local development). `serve_api` refuses to listen
beyond loopback with no tokens (outside dev mode): the read model is customer data.

Host names (DNS rebinding): a page on evil.example whose name is made to resolve to 127.0.0.1
could otherwise read (or, in dev mode, drive) a local API from the victim's browser. The `Host`
header must name this API: `HALFWAY_API_ALLOWED_HOSTS`, or by default the loopback names and
the address it listens on; anything else is answered 421 with the reason.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import re
import stat
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

Scope = Literal["read", "start", "operate"]
SCOPES: tuple[Scope, ...] = ("read", "start", "operate")
# Shorter is guessable. A good one: python -c "import secrets; print(secrets.token_urlsafe())"
TOKEN_CHARS_MIN = 16
TOKEN_CHARS_MAX = 512
TOKENS_MAX = 1000  # entries, all sources together
TOKENS_FILE_BYTES_MAX = 1024 * 1024
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._@-]{0,63}"
SHA256_PATTERN = r"[0-9a-f]{64}"
HOST_CHARS_MAX = 255
PORT_MAX = 65535
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
ANY_HOST = "*"
DEV_NAME = "dev"
ANONYMOUS_NAME = "anonymous"
REALM = "halfway"


class TokenConfigError(ValueError):
    """The token configuration cannot be used; the message says where and why (never the
    token itself)."""


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request acts for."""

    name: str
    scopes: frozenset[str]
    authenticated: bool  # by a token (not anonymous, not dev mode)

    @property
    def by(self) -> str:
        """What the journal keeps as who acted."""
        return f"api:{self.name}"


DEV = Principal(DEV_NAME, frozenset(SCOPES), authenticated=False)
ANONYMOUS_READER = Principal(ANONYMOUS_NAME, frozenset({"read"}), authenticated=False)


class TokenEntry(BaseModel):
    """One configured token, as a file or the short form gives it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, Field(pattern=f"^{NAME_PATTERN}$")]
    scopes: list[Scope] = Field(min_length=1, max_length=len(SCOPES))
    token: str | None = Field(None, min_length=TOKEN_CHARS_MIN, max_length=TOKEN_CHARS_MAX,
                              repr=False)
    token_sha256: Annotated[str, Field(pattern=f"^{SHA256_PATTERN}$")] | None = None

    @model_validator(mode="after")
    def _one_secret(self) -> TokenEntry:
        if (self.token is None) == (self.token_sha256 is None):
            raise ValueError("give exactly one of token and token_sha256")
        if self.token is not None and (self.token != self.token.strip() or
                                       any(c.isspace() or c == "," for c in self.token)):
            raise ValueError("a token has no whitespace or commas")
        return self

    def digest(self) -> bytes:
        if self.token_sha256 is not None:
            return bytes.fromhex(self.token_sha256)
        assert self.token is not None
        return _sha256(self.token)


def _sha256(text: str) -> bytes:
    # surrogatepass: aiohttp decodes a header that is not UTF-8 with surrogateescape (and an
    # environment variable is decoded so too); such a token is just not one we know.
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def _reason(exc: ValidationError) -> str:
    # Never the input: it may be the token.
    return "; ".join(f"{'.'.join(map(str, e['loc'])) or 'entry'}: {e['msg']}"
                     for e in exc.errors(include_input=False, include_url=False)[:5])


class Tokens:
    """The configured tokens, as digests with the principal each stands for."""

    def __init__(self, entries: Iterable[TokenEntry] = ()) -> None:
        self._digests: list[tuple[bytes, Principal]] = []
        names: set[str] = set()
        digests: set[bytes] = set()
        for entry in entries:
            if entry.name in names:
                raise TokenConfigError(f"the token name {entry.name!r} is given twice")
            digest = entry.digest()
            if digest in digests:
                raise TokenConfigError(f"token {entry.name!r} is the same as another one")
            names.add(entry.name)
            digests.add(digest)
            self._digests.append((digest, Principal(entry.name, frozenset(entry.scopes),
                                                    authenticated=True)))
        if len(self._digests) > TOKENS_MAX:
            raise TokenConfigError(f"{len(self._digests)} tokens; at most {TOKENS_MAX}")

    @property
    def configured(self) -> bool:
        return bool(self._digests)

    @property
    def names(self) -> list[str]:
        return [p.name for _, p in self._digests]

    def authenticate(self, presented: str) -> Principal | None:
        """The principal whose token this is, or None. Every digest is compared, each in
        constant time, so timing tells nothing."""
        digest = _sha256(presented)
        found = None
        for known, principal in self._digests:
            if hmac.compare_digest(digest, known):
                found = principal
        return found

    @classmethod
    def load(cls, short_form: str = "", path: str | None = None) -> Tokens:
        """Tokens from the short form and the file (either may be empty); TokenConfigError
        names what is wrong."""
        entries = parse_short_form(short_form)
        if short_form.strip() and not entries:  # e.g. "," : set, yet it would leave reads open
            raise TokenConfigError("HALFWAY_API_TOKENS is set but gives no token: give one "
                                   "(NAME:SCOPE+SCOPE:TOKEN), or unset it")
        if path is not None:
            entries += parse_file(Path(path))
        return cls(entries)


def parse_short_form(text: str) -> list[TokenEntry]:
    """`NAME:SCOPE+SCOPE:TOKEN,NAME:SCOPE:TOKEN` (HALFWAY_API_TOKENS)."""
    entries = []
    for i, item in enumerate((p.strip() for p in text.split(",")), start=1):
        if not item:
            continue
        parts = item.split(":", 2)
        if len(parts) != 3:
            raise TokenConfigError(f"HALFWAY_API_TOKENS entry {i}: expected "
                                   "NAME:SCOPE+SCOPE:TOKEN")
        name, scopes, token = parts
        try:
            entries.append(TokenEntry(name=name, scopes=scopes.split("+"), token=token))
        except ValidationError as exc:
            raise TokenConfigError(f"HALFWAY_API_TOKENS entry {i} ({name[:64]!r}): "
                                   f"{_reason(exc)}") from None
    return entries


def parse_file(path: Path) -> list[TokenEntry]:
    """A JSON Lines file (one object per line; blank and `#` lines skipped), or TOML
    (`[[token]]` tables) when the name ends in `.toml`. A file that gives no token is refused:
    it was set to close the API, and would leave reads open."""
    text = _file_text(path)
    items: list[tuple[str, object]] = []
    if path.suffix == ".toml":
        try:
            doc = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise TokenConfigError(f"{path}: not TOML: {exc}") from None
        unknown = sorted(set(doc) - {"token"})
        if unknown:
            raise TokenConfigError(f"{path}: unknown key(s) {', '.join(unknown)}; tokens are "
                                   "[[token]] tables")
        tables = doc.get("token", [])
        if not isinstance(tables, list):
            raise TokenConfigError(f"{path}: tokens are [[token]] tables")
        items = [(f"{path} token {i}", t) for i, t in enumerate(tables, start=1)]
    else:
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                items.append((f"{path} line {number}", json.loads(line)))
            except json.JSONDecodeError as exc:
                raise TokenConfigError(f"{path} line {number}: not JSON: {exc.msg}") from None
    entries = []
    for where, item in items:
        try:
            entries.append(TokenEntry.model_validate(item))
        except ValidationError as exc:
            raise TokenConfigError(f"{where}: {_reason(exc)}") from None
    if not entries:
        raise TokenConfigError(f"HALFWAY_API_TOKENS_FILE: {path} gives no token (only blank "
                               "lines or comments): give one, or unset the variable")
    return entries


def _file_text(path: Path) -> str:
    """The file's text, read with a bound: only a regular file (a device such as /dev/zero
    never ends, and its size says 0; a FIFO's open waits for a writer, so it is opened
    without waiting), at most TOKENS_FILE_BYTES_MAX bytes, UTF-8."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise TokenConfigError(f"HALFWAY_API_TOKENS_FILE: {path} is not a regular file")
            with open(fd, "rb", closefd=False) as file:
                data = file.read(TOKENS_FILE_BYTES_MAX + 1)
        finally:
            os.close(fd)
    except OSError as exc:
        raise TokenConfigError(f"HALFWAY_API_TOKENS_FILE: cannot read {path}: "
                               f"{exc.strerror}") from None
    if len(data) > TOKENS_FILE_BYTES_MAX:
        raise TokenConfigError(f"{path}: larger than {TOKENS_FILE_BYTES_MAX} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        column = exc.start - data.rfind(b"\n", 0, exc.start)
        raise TokenConfigError(f"{path} line {line}: not UTF-8 (byte {column} of the line)"
                               ) from None


# --- the Host header ---------------------------------------------------------------------------


def host_name(header: str) -> str | None:
    """The name part of a Host header (`[::1]:8080` -> `::1`, `Example.COM.` -> `example.com`),
    or None when it is not one."""
    header = header.strip()
    if not header or len(header) > HOST_CHARS_MAX:
        return None
    if header.startswith("["):
        end = header.find("]")
        rest = header[end + 1:]
        if end < 0 or (rest and not (rest.startswith(":") and _is_port(rest[1:]))):
            return None
        return header[1:end].lower()
    name, _, port = header.partition(":")
    if port and not _is_port(port):
        return None
    name = name.lower().rstrip(".")
    return name if re.fullmatch(r"[a-z0-9_.-]+", name) else None


def _is_port(text: str) -> bool:
    return re.fullmatch(r"[0-9]{1,5}", text) is not None and int(text) <= PORT_MAX


def allowed_host_names(configured: Iterable[str] | None, bind_host: str | None) -> frozenset[str]:
    """What the API answers to: the configured names, or the loopback names and the bind
    address (not a wildcard one: 0.0.0.0 is no name a client uses)."""
    if configured is not None:
        names = set()
        for item in configured:
            name = item if item == ANY_HOST else host_name(item)
            if name is None:
                raise ValueError(f"HALFWAY_API_ALLOWED_HOSTS: {item[:80]!r} is not a host name")
            names.add(name)
        return frozenset(names)
    names = set(LOOPBACK_NAMES)
    if bind_host and not _is_wildcard(bind_host):
        names.add(bind_host.lower())
    return frozenset(names)


def _is_wildcard(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_unspecified
    except ValueError:
        return False


def is_loopback(address: str) -> bool:
    if address.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def host_allowed(header: str | None, allowed: frozenset[str]) -> bool:
    if ANY_HOST in allowed:
        return True
    name = host_name(header or "")
    return name is not None and name in allowed


# --- the Authorization header ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request may not go on: the status (401 or 403), the words, the challenge."""

    status: int
    reason: str
    challenge: str  # the WWW-Authenticate value; empty: none (no token could help)


def challenge(error: str | None = None, scope: str | None = None) -> str:
    """A `WWW-Authenticate` value (RFC 6750)."""
    parts = [f'Bearer realm="{REALM}"']
    if error is not None:
        parts.append(f'error="{error}"')
    if scope is not None:
        parts.append(f'scope="{scope}"')
    return ", ".join(parts)


def authorize(tokens: Tokens, authorization: str | None, scope: Scope, *,
              dev: bool) -> Principal | Refusal:
    """Who the request acts for, if it may do what `scope` allows; else why not."""
    if not tokens.configured:
        if dev:
            return DEV
        if scope == "read":
            return ANONYMOUS_READER
        return Refusal(403, "the write endpoints are off: no API tokens are configured "
                            "(HALFWAY_API_TOKENS or HALFWAY_API_TOKENS_FILE; see "
                            "docs/operator-api.md)", "")
    if authorization is None:
        return Refusal(401, f"this needs a bearer token with the {scope!r} scope "
                            "(Authorization: Bearer TOKEN)", challenge())
    kind, _, presented = authorization.strip().partition(" ")
    if kind.lower() != "bearer" or not presented.strip():
        return Refusal(401, "the Authorization header must be `Bearer TOKEN`",
                       challenge("invalid_request"))
    principal = tokens.authenticate(presented.strip())
    if principal is None:
        return Refusal(401, "the bearer token is not one this API knows",
                       challenge("invalid_token"))
    if scope not in principal.scopes:
        return Refusal(403, f"token {principal.name!r} lacks the {scope!r} scope (it has "
                            f"{', '.join(sorted(principal.scopes))})",
                       challenge("insufficient_scope", scope))
    return principal
