"""Provider webhooks: signature formats (Stripe's, Standard Webhooks), providers declared as
data, and what their events mean to us. Shared by the gateway and the simulators."""

from halfway.webhooks.signature import SignatureError, sign, signature, verify

__all__ = ["SignatureError", "sign", "signature", "verify"]
