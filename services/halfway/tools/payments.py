"""charge_customer: charge a customer for an invoice through a Stripe-like API (v1 charges).

The adapter speaks to paysim (`halfway.simulators.payments`) or anything with Stripe's v1
charge and search endpoints. It sends our key twice, because each place serves a different
reader: as `Idempotency-Key`, so the provider dedupes our retries while it remembers the key,
and as `metadata[halfway_key]`, so a lookup can find the effect by our name for it, also after
the provider forgot the key.

It reports what it saw and never raises for a provider or network failure; the pure core
(`halfway.core.classify`) decides what that means. How each failure maps, and why, is listed in
`halfway.tools.http` (a non-2xx answer is Replied with Stripe's error code, or type, and
message).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator

from halfway.contract import EffectClass, Outcome, SagaRole
from halfway.contract.webhooks import WebhookReceived
from halfway.core.reconcile import WebhookReport
from halfway.tools.http import (
    HttpAdapter,
    attempt_budget_s,
    call_result,
    error_text,
    httpx_timeout,
)
from halfway.tools.spec import (
    CallContext,
    CallResult,
    Found,
    LookupFailed,
    LookupResult,
    NotFound,
    ToolSpec,
)

TOOL_NAME = "charge_customer"
PROVIDER = "paysim"
SUCCEEDED_EVENT = "charge.succeeded"
FAILED_EVENT = "charge.failed"
METADATA_KEY = "halfway_key"  # the metadata entry that carries our idempotency key
SEARCH_LIMIT = 10  # one key names one effect; more than a few charges under it is a finding
AMOUNT_CENTS_MAX = 99_999_999  # Stripe's largest amount


class ChargeArgs(BaseModel):
    """What the model decides. `amount_cents` is strict: "49.00" is refused, never coerced."""

    model_config = ConfigDict(extra="forbid")

    invoice: str = Field(min_length=1, max_length=200, description="the invoice id, e.g. INV-2291")
    customer: str = Field(min_length=1, max_length=255, description="the customer id, e.g. cus_1")
    amount_cents: int = Field(gt=0, le=AMOUNT_CENTS_MAX, strict=True,
                              description="an integer number of cents: 4900 for $49.00")
    currency: str = Field(default="usd", pattern=r"^[a-z]{3}$",
                          description="ISO 4217 currency code, e.g. usd")

    @field_validator("currency", mode="before")
    @classmethod
    def _lower_case(cls, value: Any) -> Any:
        # Stripe's currency codes are lower case; "USD" means the same and is not worth a refusal.
        return value.lower() if isinstance(value, str) else value


def charge_subject(args: BaseModel) -> str:
    return f"invoice:{_charge_args(args).invoice}"


def charge_customer_spec(timeout_s: float = 5.0, key_ttl_s: float = 86_400.0,
                         completes_within_s: float | None = None) -> ToolSpec:
    """The spec; `key_ttl_s` must not exceed what the provider keeps (Stripe v1: 24 h).
    `completes_within_s`: only for a provider whose search shows every charge at once and
    that finishes every request within that bound (paysim: its longest fault delay); never
    for Stripe, whose search lags."""
    return ToolSpec(
        name=TOOL_NAME,
        description=("Charge a customer for an invoice, in cents. amount_cents is an integer "
                     "number of cents (4900 for $49.00), never a decimal string."),
        args_model=ChargeArgs,
        effect_class=EffectClass.KEYED,
        timeout_s=timeout_s,
        subject=charge_subject,
        key_ttl_s=key_ttl_s,
        has_lookup=True,
        # In a saga the charge is the point of no return (a refund is a new effect, not an
        # undo), and an invoice is paid once: a done charge is never repeated, by any task.
        saga_role=SagaRole.PIVOT,
        once_per_subject=True,
        evidence_id="charge_id",
        completes_within_s=completes_within_s,
    )


class PaymentsAdapter(HttpAdapter):
    """charge_customer's call and lookup; the client and its lifecycle are `HttpAdapter`'s."""

    async def call(self, args: BaseModel, ctx: CallContext) -> CallResult:
        charge = _charge_args(args)
        form = {
            "amount": str(charge.amount_cents),
            "currency": charge.currency,
            "customer": charge.customer,
            "description": f"invoice {charge.invoice}",
            f"metadata[{METADATA_KEY}]": ctx.key,
            "metadata[invoice]": charge.invoice,
        }
        response = await self._request("POST", "/v1/charges", ctx.timeout_s, data=form,
                                       headers={"Idempotency-Key": ctx.key})
        if not isinstance(response, httpx.Response):
            return response
        return call_result(response, "succeeded", _evidence)

    async def lookup(self, args: BaseModel, ctx: CallContext) -> LookupResult:
        """Find the charge named by our key. Stripe's search can lag writes (up to a minute,
        an hour in outages), so NotFound is never proof on its own; paysim has no lag."""
        charge = _charge_args(args)
        query = f"metadata['{METADATA_KEY}']:{_search_literal(ctx.key)}"
        try:
            async with asyncio.timeout(attempt_budget_s(ctx.timeout_s)):
                response = await self._http().get(
                    "/v1/charges/search", params={"query": query, "limit": SEARCH_LIMIT},
                    timeout=httpx_timeout(ctx.timeout_s))
            if response.status_code != 200:
                return LookupFailed(f"search answered HTTP {response.status_code}: "
                                    f"{error_text(response)}")
            body = response.json()
            charges = body["data"]
            if not isinstance(charges, list):
                raise TypeError("data is not a list")
        except Exception as exc:
            return LookupFailed(f"search failed: {type(exc).__name__}: {exc}")
        return _settle(charges, charge, ctx.key)


    def read_webhook(self, args: BaseModel, hook: WebhookReceived) -> WebhookReport | None:
        """What a `charge.succeeded` / `charge.failed` event says about this step's charge."""
        kind = hook.provider_event_type
        if kind not in (SUCCEEDED_EVENT, FAILED_EVENT):
            return None
        charge = _charge_args(args)
        data = hook.payload.get("data")
        obj = data.get("object") if isinstance(data, dict) else None
        if not isinstance(obj, dict):
            return None
        seen = (obj.get("amount"), obj.get("currency"), obj.get("customer"))
        asked = (charge.amount_cents, charge.currency, charge.customer)
        mismatch = None
        if seen != asked:
            mismatch = (f"it charges {seen[0]} {seen[1]} to {seen[2]}, the step asked for "
                        f"{asked[0]} {asked[1]} to {asked[2]}")
        if kind == SUCCEEDED_EVENT:
            evidence = {"charge_id": hook.object_id, "amount_cents": obj.get("amount"),
                        "currency": obj.get("currency"), "provider": PROVIDER}
            return WebhookReport(Outcome.DONE, hook.object_id, evidence=evidence,
                                 mismatch=mismatch)
        reason = " ".join(str(p) for p in (obj.get("failure_code"), obj.get("failure_message"))
                          if p) or None
        return WebhookReport(Outcome.NOT_DONE, hook.object_id, reason=reason, mismatch=mismatch)


def _charge_args(args: BaseModel) -> ChargeArgs:
    if not isinstance(args, ChargeArgs):
        raise TypeError(f"{TOOL_NAME} takes ChargeArgs, got {type(args).__name__}")
    return args


def _search_literal(value: str) -> str:
    """A Search API string literal: single-quoted, with \\ and ' escaped."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _evidence(charge: dict[str, Any]) -> dict[str, Any]:
    return {"charge_id": charge["id"], "amount_cents": charge["amount"],
            "currency": charge["currency"], "provider": PROVIDER}


def _settle(charges: list[Any], args: ChargeArgs, key: str) -> LookupResult:
    """What the charges found under our key say about the effect."""
    mine = [c for c in charges
            if isinstance(c, dict) and (c.get("metadata") or {}).get(METADATA_KEY) == key]
    if not mine:
        return NotFound(f"no charge with metadata {METADATA_KEY}={key}")
    for charge in mine:
        if (charge.get("amount"), charge.get("currency"), charge.get("customer")) != \
                (args.amount_cents, args.currency, args.customer):
            # Our key on a different charge: something other than this step made it. Claiming
            # done or not done would both be guesses, so leave it to an operator.
            return LookupFailed(f"charge {charge.get('id')} carries key {key} but charges "
                                f"{charge.get('amount')} {charge.get('currency')} to "
                                f"{charge.get('customer')}, not what this step asked for")
    succeeded = [c for c in mine if c.get("status") == "succeeded"]
    if succeeded:
        # More than one: a key reused after the provider forgot it, the customer charged twice.
        return Found(evidence=_evidence(succeeded[0]), succeeded=True,
                     others=tuple(str(c.get("id")) for c in succeeded[1:]))
    failed = [c for c in mine if c.get("status") == "failed"]
    if failed:
        charge = failed[0]
        reason = " ".join(str(p) for p in (charge.get("failure_code"),
                                           charge.get("failure_message")) if p)
        return Found(evidence=_evidence(charge), succeeded=False,
                     reason=reason or "the charge failed")
    statuses = sorted({str(c.get("status")) for c in mine})
    return LookupFailed(f"charge {mine[0].get('id')} is not final yet ({', '.join(statuses)})")

