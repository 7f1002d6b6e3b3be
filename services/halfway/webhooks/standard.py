"""Standard Webhooks signatures (standardwebhooks.com): three headers, `webhook-id`,
`webhook-timestamp` (unix seconds) and `webhook-signature` (`v1,<base64>` entries separated by
spaces), the HMAC-SHA256 of `f"{id}.{timestamp}.{body}"` keyed by the base64 secret after its
`whsec_` prefix.

Verified by the official `standardwebhooks` library (`Webhook.verify`), whatever it accepts and
nothing else: any `v1` entry may match (a provider rolling its secret signs with both), and the
timestamp must be within the library's five minutes of our clock, either way (the library reads
the clock itself). On top of it: several endpoint secrets, any of which verifies (our side of a
roll). The `webhook-id` is the message's id, the same on every retry: the event id the gateway
dedupes by unless the provider's mapping names another.
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from halfway.webhooks.signature import HEADER_CHARS_MAX, Reason, SignatureError

ID_HEADER = "webhook-id"
TIMESTAMP_HEADER = "webhook-timestamp"
SIGNATURE_HEADER = "webhook-signature"
HEADERS = (ID_HEADER, TIMESTAMP_HEADER, SIGNATURE_HEADER)
TOLERANCE_S = 300  # the library's window (five minutes, past and future); not configurable there
SECRET_PREFIX = "whsec_"

# The library's refusals, by the start of their message (pinned by tests).
_LIBRARY_REFUSALS: tuple[tuple[str, Reason, str], ...] = (
    ("Missing required headers", "missing", "missing webhook-id, webhook-timestamp or "
     "webhook-signature header"),
    ("Invalid Signature Headers", "garbled", "garbled webhook-timestamp header: not a time"),
    ("Message timestamp too old", "stale", f"timestamp too old: beyond the {TOLERANCE_S} s "
     "tolerance"),
    ("Message timestamp too new", "future", f"timestamp in the future: beyond the "
     f"{TOLERANCE_S} s tolerance"),
    ("No matching signature found", "mismatch", "no v1 signature matches the payload and the "
     "endpoint secret"),
)


@dataclass(frozen=True, slots=True)
class Verified:
    message_id: str  # webhook-id
    signed_at_s: int  # webhook-timestamp, as the library reads it (whole seconds)


def secret_problem(secret: str) -> str | None:
    """Why `secret` is not a Standard Webhooks secret (None: it is). Never quotes it."""
    raw = secret.removeprefix(SECRET_PREFIX)
    try:
        # Strictly: the library skips characters that are not base64, so a typo would silently
        # make another key. Padding may be left off, as the library allows.
        key = base64.b64decode(raw + "=" * (-len(raw) % 4), validate=True)
    except (binascii.Error, ValueError):
        return f"not base64 after its {SECRET_PREFIX} prefix"
    if not key:
        return "empty"
    return None


def sign(payload: bytes, secret: str, message_id: str, timestamp_s: int) -> dict[str, str]:
    """The three headers a Standard Webhooks sender puts on `payload` (made by the library)."""
    signed = Webhook(secret).sign(message_id, datetime.fromtimestamp(timestamp_s, UTC),
                                  payload.decode())
    return {ID_HEADER: message_id, TIMESTAMP_HEADER: str(timestamp_s), SIGNATURE_HEADER: signed}


def _refusal(exc: Exception) -> SignatureError:
    if isinstance(exc, UnicodeDecodeError):
        return SignatureError("garbled", "the body is not UTF-8 text, which is what Standard "
                              "Webhooks signs")
    if isinstance(exc, WebhookVerificationError):
        for start, kind, reason in _LIBRARY_REFUSALS:
            if str(exc).startswith(start):
                return SignatureError(kind, reason)
    # A signature entry that is not `version,base64`: the library cannot read it.
    return SignatureError("garbled", "garbled webhook-signature header: expected "
                          "space-separated v1,<base64> entries")


def verify(payload: bytes, headers: Mapping[str, str], secrets: Sequence[str]) -> Verified:
    """Check that the request's headers sign `payload` with one of `secrets`, now. Raises
    SignatureError saying why not. `headers` may be any case-insensitive mapping (aiohttp's)
    or one with the names in lower case."""
    if not secrets:
        raise ValueError("verify needs at least one endpoint secret")
    picked = {name: headers.get(name) or "" for name in HEADERS}
    if not all(picked.values()):
        absent = ", ".join(name for name, value in picked.items() if not value)
        raise SignatureError("missing", f"missing {absent} header")
    if any(len(value) > HEADER_CHARS_MAX for value in picked.values()):
        raise SignatureError("garbled", f"garbled Standard Webhooks header: longer than "
                             f"{HEADER_CHARS_MAX} characters")
    if not any("," in entry for entry in picked[SIGNATURE_HEADER].split(" ")):
        # Not one `version,base64` entry. Said here, not by the library: its versions differ
        # (1.1 raises on such an entry, 1.3 skips it and finds no match).
        raise _refusal(ValueError("no version,signature entry"))
    refusal: SignatureError | None = None
    for secret in secrets:
        try:
            Webhook(secret).verify(payload, picked, json_parse=False)
        except (WebhookVerificationError, ValueError, TypeError) as exc:  # binascii.Error,
            refusal = _refusal(exc)                                        # UnicodeDecodeError
            continue
        break
    else:
        assert refusal is not None
        raise refusal
    # As the library read it: a float, to a datetime (microseconds), signed in whole seconds.
    signed_at = datetime.fromtimestamp(float(picked[TIMESTAMP_HEADER]), UTC)
    return Verified(picked[ID_HEADER], math.floor(signed_at.timestamp()))
