"""Local provider simulators for demos and tests.

`payments` (paysim, Stripe-like) and `travel` (tripsim: flights, hotels, email) each run as
their own process (`python -m halfway.simulators.<name> --port 0`); `keyed` is the write path
they share. Each speaks
its provider's API faithfully where the harness depends on it: idempotency keys with a
lifetime, lookups, and fault injection (slow past the client timeout, lost reply after commit,
5xx before or after commit, 409 while a same-key request is in flight, 429). Each keeps a
ledger of every effect it made, the ground truth that tests compare the journal with.
"""
