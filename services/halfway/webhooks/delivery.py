"""One delivery's proof, whatever its format: which format's verifier to ask, and what the
gateway keeps of a delivery it accepted."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import assert_never

from halfway.webhooks import standard
from halfway.webhooks.providers import Provider
from halfway.webhooks.signature import HEADER as STRIPE_HEADER
from halfway.webhooks.signature import verify as verify_stripe


@dataclass(frozen=True, slots=True)
class Delivery:
    signed_at_s: int  # the signature's timestamp
    # What this very request is: a captured copy re-sent has the same, whatever was added to
    # its signature header; the provider's own retry is signed afresh (another timestamp).
    replay_key: str
    delivery_id: str | None  # the id the format carries in a header (webhook-id), if any


def verify(provider: Provider, body: bytes, headers: Mapping[str, str], now_s: float,
           tolerance_s: float) -> Delivery:
    """The verified delivery; SignatureError saying why the request proves nothing."""
    digest = hashlib.sha256(body).hexdigest()
    match provider.format:
        case "stripe":
            signed_at_s = verify_stripe(body, headers.get(STRIPE_HEADER), provider.secrets,
                                        now_s, tolerance_s)
            return Delivery(signed_at_s, f"{signed_at_s}.{digest}", None)
        case "standardwebhooks":
            verified = standard.verify(body, headers, provider.secrets)
            return Delivery(verified.signed_at_s,
                            f"{verified.message_id}.{verified.signed_at_s}.{digest}",
                            verified.message_id)
        case unknown:
            assert_never(unknown)
