"""Stripe's webhook signatures: `Stripe-Signature: t=<unix s>,v1=<hex>[,v1=<hex>...]`.

The signature is HMAC-SHA256 over `f"{t}."` followed by the body, keyed by the endpoint secret
(research/providers.md §2.5). Whether a header signs a body is decided by the official `stripe`
library (`WebhookSignature.verify_header`, what `stripe.Webhook.construct_event` calls), so the
gateway accepts exactly the signatures Stripe's own verifier accepts: any `v1` may match (while
a secret is rolled the provider signs with the old and the new one), other schemes are ignored,
the first `t=` is the timestamp, and the body must be UTF-8 text. On top of the library:
several endpoint secrets, any of which verifies (our side of a roll); and the clock is passed in
(the library's own clock check is switched off and done here, with the same comparison), so
tests never wait for time to pass.

A timestamp in the future is accepted, as the library accepts it (only a holder of the secret
can make one). Such a signature stays "fresh" for as long as it is ahead, so the gateway
remembers it against replays until its timestamp is past the tolerance, not just for the
tolerance after it arrived.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Literal

from stripe import SignatureVerificationError, WebhookSignature

SCHEME = "v1"
HEADER = "Stripe-Signature"
TOLERANCE_S_DEFAULT = 300  # Stripe's DEFAULT_TOLERANCE
HEADER_CHARS_MAX = 8192  # longer is garbage, not a secret roll (aiohttp refuses 8190+ anyway)

Reason = Literal["missing", "garbled", "no_v1", "stale", "future", "mismatch"]

# The library's refusals, by the start of their message (pinned by tests/test_webhooks.py).
_LIBRARY_REFUSALS: tuple[tuple[str, Reason, str], ...] = (
    ("Unable to extract", "garbled",
     "garbled Stripe-Signature header: no timestamp (t=) and signatures could be read from it"),
    ("No signatures found with expected scheme", "no_v1",
     "no v1 signature in the Stripe-Signature header (other schemes are ignored)"),
    ("No signatures found matching", "mismatch",
     "no v1 signature matches the payload and the endpoint secret"),
)
_MISMATCH = "no v1 signature matches the payload and the endpoint secret"


class SignatureError(Exception):
    """The request does not prove the provider sent this body now. `kind` is for code and
    metrics, `reason` for people (and the 400 body); neither ever holds a secret."""

    def __init__(self, kind: Reason, reason: str) -> None:
        super().__init__(reason)
        self.kind: Reason = kind
        self.reason = reason


def signature(payload: bytes, secret: str, timestamp: int) -> str:
    """The hex v1 signature of `payload` signed at `timestamp` (unix seconds)."""
    signed = f"{timestamp}.".encode() + payload
    return hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()


def sign(payload: bytes, secret: str, timestamp: int) -> str:
    """The `Stripe-Signature` header value for `payload` signed with `secret` at `timestamp`."""
    return f"t={timestamp},{SCHEME}={signature(payload, secret, timestamp)}"


def _refusal(exc: Exception) -> SignatureError:
    if isinstance(exc, UnicodeDecodeError):
        return SignatureError("garbled", "the body is not UTF-8 text, which is what Stripe signs")
    if isinstance(exc, SignatureVerificationError):
        message = str(exc)
        for start, kind, reason in _LIBRARY_REFUSALS:
            if message.startswith(start):
                return SignatureError(kind, reason)
    # TypeError: a non-ASCII guess, which the library's compare cannot take: not a match.
    return SignatureError("mismatch", _MISMATCH)


def _timestamp(header: str) -> int:
    """t= as the library reads it (the first one), once the library accepted the header."""
    items = [item.split("=", 2) for item in header.split(",")]
    return int(next(item[1] for item in items if item[0] == "t"))


def verify(payload: bytes, header: str | None, secrets: str | Sequence[str], now_s: float,
           tolerance_s: float = TOLERANCE_S_DEFAULT) -> int:
    """Check that `header` signs `payload` with one of `secrets` within `tolerance_s` of
    `now_s`. Returns the signature's timestamp (unix seconds); raises SignatureError saying
    why not.

    The signature is checked before the timestamp, as Stripe does, so "stale" or "future" is
    only ever said of a genuine signature: a forger learns nothing about the clock check.
    """
    if header is None or not header.strip():
        raise SignatureError("missing", f"missing {HEADER} header")
    if len(header) > HEADER_CHARS_MAX:
        raise SignatureError("garbled", f"garbled {HEADER} header: longer than "
                             f"{HEADER_CHARS_MAX} characters")
    candidates = (secrets,) if isinstance(secrets, str) else tuple(secrets)
    if not candidates:
        raise ValueError("verify needs at least one endpoint secret")
    refusal: SignatureError | None = None
    for secret in candidates:
        try:
            # tolerance=None: the library skips its own clock check; ours, below, takes now_s.
            WebhookSignature.verify_header(payload, header, secret, tolerance=None)
        except (SignatureVerificationError, UnicodeDecodeError, TypeError, ValueError) as exc:
            refusal = _refusal(exc)
            continue
        break
    else:
        assert refusal is not None
        raise refusal
    timestamp = _timestamp(header)
    # Compared as the library compares (an int against a float): no overflow for any t.
    if timestamp < now_s - tolerance_s:
        raise SignatureError("stale", f"timestamp too old: signed {int(now_s) - timestamp} s "
                             f"ago, beyond the {tolerance_s:g} s tolerance")
    return timestamp
