"""Provider webhooks: Stripe-style signatures, shared by the gateway and the simulators."""

from halfway.webhooks.signature import SignatureError, sign, signature, verify

__all__ = ["SignatureError", "sign", "signature", "verify"]
