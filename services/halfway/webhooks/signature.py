"""Stripe-style webhook signatures: `Stripe-Signature: t=<unix s>,v1=<hex>[,v1=<hex>...]`.

The signature is HMAC-SHA256 over `f"{t}."` followed by the raw body, keyed by the endpoint
secret (research/providers.md §2.5, `stripe.Webhook.construct_event`). Like Stripe's verifier we
ignore every scheme but `v1` (test mode adds a fake `v0`) and accept the header if any `v1`
matches: while a secret is rolled the provider signs with the old and the new one.

Unlike Stripe we also refuse timestamps too far in the future: a clock that far ahead, or a
forger who found a way to pick `t`, should not get a signature that stays "fresh" for days.

Pure functions: the caller passes the clock, so tests never wait for time to pass.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Literal

SCHEME = "v1"
TOLERANCE_S_DEFAULT = 300  # Stripe's DEFAULT_TOLERANCE
HEADER_CHARS_MAX = 8192  # a header longer than this is garbage, not a secret roll
SIGNATURES_MAX = 16  # v1 entries we compare; bounds the work a garbage header can cause
# Digits of t=: unix seconds have 10 until the year 2286; more is garbage (and a few thousand
# digits would not even convert to an int).
TIMESTAMP_DIGITS_MAX = 12

Reason = Literal["missing", "garbled", "no_v1", "stale", "future", "mismatch"]


class SignatureError(Exception):
    """The header does not prove the provider sent this body now. `kind` is for code and
    metrics, `reason` for people (and the 400 body)."""

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


def _parse(header: str | None) -> tuple[int, list[str]]:
    """(timestamp, v1 signatures) of a header; SignatureError if there is no usable one."""
    if header is None or not header.strip():
        raise SignatureError("missing", "missing Stripe-Signature header")
    if len(header) > HEADER_CHARS_MAX:
        raise SignatureError("garbled", f"garbled Stripe-Signature header: longer than "
                             f"{HEADER_CHARS_MAX} characters")
    timestamp: int | None = None
    v1: list[str] = []
    for item in header.split(","):
        name, sep, value = item.strip().partition("=")
        if not sep or not name or not value:
            raise SignatureError("garbled", "garbled Stripe-Signature header: expected "
                                 "comma-separated name=value pairs")
        if name == "t":
            if timestamp is not None:
                raise SignatureError("garbled", "garbled Stripe-Signature header: more than "
                                     "one timestamp (t=)")
            if not value.isascii() or not value.isdigit():
                raise SignatureError("garbled", "garbled Stripe-Signature header: the "
                                     "timestamp (t=) is not a whole number of seconds")
            if len(value) > TIMESTAMP_DIGITS_MAX:
                raise SignatureError("garbled", "garbled Stripe-Signature header: the "
                                     f"timestamp (t=) has more than {TIMESTAMP_DIGITS_MAX} "
                                     "digits")
            timestamp = int(value)
        elif name == SCHEME:
            v1.append(value)
    if timestamp is None:
        raise SignatureError("garbled", "garbled Stripe-Signature header: no timestamp (t=)")
    if not v1:
        raise SignatureError("no_v1", "no v1 signature in the Stripe-Signature header "
                             "(other schemes are ignored)")
    if len(v1) > SIGNATURES_MAX:
        raise SignatureError("garbled", f"garbled Stripe-Signature header: more than "
                             f"{SIGNATURES_MAX} v1 signatures")
    return timestamp, v1


def verify(payload: bytes, header: str | None, secret: str, now_s: float,
           tolerance_s: float = TOLERANCE_S_DEFAULT) -> int:
    """Check that `header` signs `payload` with `secret` within `tolerance_s` of `now_s`.

    Returns the signature's timestamp (unix seconds); raises SignatureError saying why not.
    The signature is checked before the timestamp, as Stripe does, so "stale" or "future" is
    only ever said of a genuine signature: a forger learns nothing about the clock check.
    """
    timestamp, candidates = _parse(header)
    expected = signature(payload, secret, timestamp).encode()
    # Compare every candidate (no early exit) in constant time per candidate: how long this
    # takes must not tell a forger how many leading characters of a guess were right.
    matched = False
    for candidate in candidates:
        # As bytes: compare_digest raises on a non-ASCII str, and a header may carry anything;
        # such a guess must compare unequal, never raise.
        matched |= hmac.compare_digest(expected, candidate.encode("utf-8", "replace"))
    if not matched:
        raise SignatureError("mismatch", "no v1 signature matches the payload and the "
                             "endpoint secret")
    if now_s - timestamp > tolerance_s:
        raise SignatureError("stale", f"timestamp too old: signed {now_s - timestamp:.0f} s "
                             f"ago, beyond the {tolerance_s:g} s tolerance")
    if timestamp - now_s > tolerance_s:
        raise SignatureError("future", f"timestamp in the future: signed "
                             f"{timestamp - now_s:.0f} s ahead, beyond the {tolerance_s:g} s "
                             "tolerance")
    return timestamp
