"""Local simulators for demos and tests.

`payments` (paysim: Stripe's wire format, charges and PaymentIntents), `travel` (tripsim:
flights, hotels, email over HTTP), `smtpsim` (an SMTP relay, aiosmtpd) and `modelsim` (an
OpenAI-compatible chat-completions model) each run as their own process (`python -m
halfway.simulators.<name> --port 0`); `keyed` is the write path the HTTP providers share. Each
speaks its counterpart's protocol faithfully where the harness depends on it: idempotency keys
with a lifetime, lookups, and fault injection (slow past the client timeout, lost reply after
commit, 5xx before or after commit, 409 while a same-key request is in flight, 429). Each keeps
a ledger of every effect it made, the ground truth that tests compare the journal with.
"""
