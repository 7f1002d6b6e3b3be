"""charge_customer (and refund_payment) through Stripe's official client library, `stripe`.

    from halfway import App
    from halfway.tools.stripe_payments import stripe_tools

    app = App(name="billing", instructions="You collect renewals.")
    stripe_tools(app, api_key=os.environ["STRIPE_API_KEY"], api_base="https://api.stripe.com",
                 timeout_s=10.0)

or `--app halfway.tools.stripe_payments:app`, built from STRIPE_API_KEY and STRIPE_API_BASE
(default https://api.stripe.com; paysim's URL for demos and tests). The key is never logged,
journaled or shown.

Theory of operation
-------------------
`charge_customer` is the same tool as the hand-written `halfway.tools.payments` (same
arguments, subject `invoice:{invoice}`, keyed, the saga's pivot, once per subject), made with
the API Stripe recommends today: one PaymentIntent created and confirmed in one request
(`POST /v1/payment_intents`, `confirm=true`), sent with our key twice, because each place
serves a different reader: as the `Idempotency-Key` (`idempotency_key=ctx.key`), so Stripe
dedupes our retries while it remembers the key, and as `metadata[halfway_key]` (with
`metadata[halfway_step]`), so a lookup finds the effect by our name for it, also after Stripe
forgot the key. Every parameter derives from the step's frozen arguments and this tool's
configuration, never from the attempt: a retry must send the very same parameters, or Stripe
refuses it (400 `idempotency_error`).

The library's own retries are off (`max_network_retries=0`): stripe-python would retry
connection errors, 409s and 5xx with the same key, invisibly, inside one of our attempts. Our
executor retries instead, with the same key, and journals every attempt, so exactly one HTTP
request is sent per journaled attempt. The calls are the client's async API
(`v1.payment_intents.create_async`) on its httpx transport, bounded by the tool's timeout.

API generations. This tool uses API v1, where Stripe saves the first answer under a key (500s
included) and replays it for at least 24 hours: `key_ttl_s` may not exceed that. API v2
(`/v2/...`) differs: a retry with the same key may complete work that partly failed, and keys
are kept 30 days; a v2 tool would declare its own, longer lifetime.

What an attempt's answer proves (classified by `halfway.core.classify`; the adapter only
reports what the library raised, as a `CallFailure`):

    the library's answer                       reported as            outcome
    PaymentIntent `succeeded`                  Succeeded (evidence)   done (replayed: the
                                                                       Idempotent-Replayed header)
    PaymentIntent failed (`requires_payment_   ToolRefused            not done
      method` with `last_payment_error`, or
      `canceled`) in a 2xx
    PaymentIntent in any other status          Unexpected             unknown (not final yet:
      (`processing`, `requires_action`, ...)                           3-D Secure, async methods)
    CardError (402, a decline)                 Replied(402, code)     not done (saved and
                                                                       replayed by Stripe)
    InvalidRequestError (400, 404)             Replied(status, code)  not done: validation runs
                                                                       after the idempotency
                                                                       layer, so a retry's refusal
                                                                       speaks for the key
    IdempotencyError (400 idempotency_error)   Unexpected             unknown: our key is bound to
                                                                       another request (other
                                                                       parameters or endpoint);
                                                                       its outcome is not this
                                                                       answer's
    AuthenticationError (401),                 NotSent                not done on the first
      PermissionError (403), not replayed                              attempt, unknown later:
                                                                       Stripe checks keys before
                                                                       the idempotency layer, so
                                                                       this request never ran, but
                                                                       it says nothing about an
                                                                       earlier attempt
    RateLimitError (429, or 400 rate_limit)    Replied(429)           unknown (the limiter runs
                                                                       before the idempotency
                                                                       layer)
    APIError 409 (key in use)                  Replied(409)           unknown (retry later)
    APIError 424 (external dependency)         Unexpected             unknown
    APIError 5xx (saved 500s replayed)         Replied(5xx)           unknown: a lookup settles it
    APIConnectionError caused by a refused     NotSent                not done on attempt 1,
      connection, DNS failure, connect                                 unknown later
      timeout, no pooled connection
    APIConnectionError caused by a read/write  TimedOut /             unknown
      timeout, reset, EOF                        ConnectionLost
    no answer within `timeout_s`               TimedOut               unknown
    anything else                              Unexpected             unknown

The cause of an APIConnectionError is read from its exception chain (the library's httpx
transport raises it `from` httpx's own error), by the same rules as any function tool
(`halfway.app.functions.failure_of`).

The lookup asks Stripe for PaymentIntents carrying our key, two ways: the Search API
(`metadata['halfway_key']:'KEY'`), which lags writes (under a minute, up to an hour in
outages), and, when search finds nothing, the Events list (`type=payment_intent.*`, newest
first, at most `EVENT_PAGES_MAX` pages), whose `request.idempotency_key` names the request
that made each event. Each intent found is retrieved for its current state (a retrieve is
consistent; search results may be stale). Nothing found proves nothing (`NotFound`) unless the
tool declares `completes_within_s`, which it must not against Stripe itself, whose search lags.
What was found settles as in `halfway.tools.payments`: an intent under our key for other
amounts, currency or customer is an operator's question (LookupFailed); several succeeded
intents are reported as one with the others named (`Found.others`: charged twice).

`refund_payment` (keyed, subject `payment_intent:{id}`) refunds a succeeded PaymentIntent,
whole or in part, the same way: our key as Idempotency-Key and in the refund's metadata; its
lookup lists the intent's refunds (a consistent list, no search lag) for our key. It is the
tool a compensable payment step would name as its undo (`$result.payment_intent_id`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any, Literal

import httpx
import stripe
from pydantic import BaseModel, ConfigDict, Field

from halfway.app.app import App
from halfway.app.functions import ERROR_CHARS_MAX, failure_of
from halfway.contract import EffectClass, Outcome
from halfway.contract.webhooks import WebhookReceived
from halfway.core.classify import (
    CallFailure,
    NotSent,
    Replied,
    TimedOut,
    ToolRefused,
    Unexpected,
)
from halfway.core.reconcile import WebhookReport
from halfway.tools.http import httpx_timeout
from halfway.tools.payments import TOOL_NAME, ChargeArgs, charge_customer_spec
from halfway.tools.spec import (
    CallContext,
    CallResult,
    Found,
    LookupFailed,
    LookupResult,
    NotFound,
    Succeeded,
    ToolSpec,
)

STRIPE_API_BASE = "https://api.stripe.com"
API_KEY_ENV = "STRIPE_API_KEY"
API_BASE_ENV = "STRIPE_API_BASE"
KEY_TTL_S_MAX = 86_400.0  # API v1 replays a key's saved answer for at least 24 h
REFUND_TOOL = "refund_payment"
PROVIDER = "stripe"
METADATA_KEY = "halfway_key"  # the metadata entry that carries our idempotency key
METADATA_STEP = "halfway_step"
SEARCH_LIMIT = 10  # one key names one effect; more than a few intents under it is a finding
EVENT_PAGE_LIMIT = 100  # Stripe's largest page
EVENT_PAGES_MAX = 5  # the events fallback reads at most the latest 500 payment_intent events
REFUND_LIST_LIMIT = 100
CAUSES_MAX = 10  # how deep an exception chain is searched for the network error
SUCCEEDED_EVENT = "payment_intent.succeeded"
FAILED_EVENTS = frozenset({"payment_intent.payment_failed", "payment_intent.canceled"})
INSTRUCTIONS = "You collect payments: charge customers for invoices, and refund them."


# --- arguments -----------------------------------------------------------------------------------


class RefundArgs(BaseModel):
    """What the model decides for a refund; `amount_cents` None refunds what is left."""

    model_config = ConfigDict(extra="forbid")

    payment_intent_id: str = Field(pattern=r"^pi_[A-Za-z0-9_]{1,250}$",
                                   description="the PaymentIntent to refund, e.g. pi_123")
    amount_cents: int | None = Field(default=None, gt=0, le=99_999_999, strict=True,
                                     description="cents to refund; omit to refund all")
    reason: Literal["duplicate", "fraudulent", "requested_by_customer"] | None = None


def refund_subject(args: BaseModel) -> str:
    return f"payment_intent:{_refund_args(args).payment_intent_id}"


# --- configuration and the client ----------------------------------------------------------------


class _HTTPXClient(stripe.HTTPXClient):
    """stripe's httpx transport, sending the form body it encoded as `content` (httpx
    deprecates raw text as `data`; under -W error the warning would become a failed call)."""

    def _get_request_args_kwargs(self, method: str, url: str, headers: Mapping[str, str],
                                 post_data: Any) -> Any:
        args, kwargs = super()._get_request_args_kwargs(method, url, headers, post_data)
        data = kwargs.get("data")
        if isinstance(data, str | bytes):
            kwargs["content"] = kwargs.pop("data")
        return args, kwargs


class StripeConnection:
    """One `stripe.StripeClient` shared by the tools of one `stripe_tools` call, made on first
    use (on the running loop: its httpx pool belongs to that loop); `aclose()` closes it (closing
    again is harmless). The API key lives here and nowhere else; it is never in a repr."""

    def __init__(self, *, api_key: str, api_base: str, timeout_s: float) -> None:
        if not api_key:
            raise ValueError(f"a Stripe API key is required (set {API_KEY_ENV})")
        self._api_key = api_key
        self.api_base = api_base.rstrip("/")
        self.timeout_s = timeout_s
        self._http: _HTTPXClient | None = None
        self._client: stripe.StripeClient | None = None

    def __repr__(self) -> str:
        return f"StripeConnection(api_base={self.api_base!r})"

    def client(self) -> stripe.StripeClient:
        if self._client is None:
            self._http = _HTTPXClient(timeout=httpx_timeout(self.timeout_s))
            # No retries inside the library: each of our attempts is exactly one request.
            self._client = stripe.StripeClient(self._api_key,
                                               base_addresses={"api": self.api_base},
                                               max_network_retries=0, http_client=self._http)
        return self._client

    async def aclose(self) -> None:
        if self._http is not None:
            http, self._http, self._client = self._http, None, None
            await http.close_async()


def stripe_tools(app: App, *, api_key: str, api_base: str = STRIPE_API_BASE,
                 timeout_s: float = 10.0, key_ttl_s: float = KEY_TTL_S_MAX,
                 completes_within_s: float | None = None, payment_method: str | None = None,
                 off_session: bool = False, refunds: bool = True) -> StripeConnection:
    """Add `charge_customer` (and `refund_payment`, unless `refunds=False`) to `app`, talking
    to Stripe (or paysim) at `api_base` with `api_key`; returns their shared connection.

    `payment_method`: the payment method every charge confirms with (Stripe requires one; in
    test mode e.g. `pm_card_visa`); None sends none, which paysim answers by charging the
    customer's default card. `off_session`: the customer is not present (renewals), so Stripe
    declines rather than asking for authentication. `completes_within_s`: only for a provider
    whose search never lags (paysim without search lag), never for Stripe itself."""
    if not 0 < key_ttl_s <= KEY_TTL_S_MAX:
        raise ValueError(f"key_ttl_s must be positive and at most {KEY_TTL_S_MAX:g} s "
                         f"(Stripe API v1 keeps keys 24 h), got {key_ttl_s}")
    connection = StripeConnection(api_key=api_key, api_base=api_base, timeout_s=timeout_s)
    app.add(charge_spec(timeout_s=timeout_s, key_ttl_s=key_ttl_s,
                        completes_within_s=completes_within_s),
            ChargeAdapter(connection, payment_method=payment_method, off_session=off_session))
    if refunds:
        app.add(refund_spec(timeout_s=timeout_s, key_ttl_s=key_ttl_s),
                RefundAdapter(connection))
    return connection


def stripe_app(name: str = "stripe-payments", instructions: str = INSTRUCTIONS, *,
               env: Mapping[str, str] | None = None, timeout_s: float = 10.0,
               completes_within_s: float | None = None) -> App:
    """An app with the Stripe tools, configured from STRIPE_API_KEY (required) and
    STRIPE_API_BASE (default https://api.stripe.com)."""
    env = os.environ if env is None else env
    app = App(name=name, instructions=instructions)
    stripe_tools(app, api_key=env.get(API_KEY_ENV, ""),
                 api_base=env.get(API_BASE_ENV) or STRIPE_API_BASE, timeout_s=timeout_s,
                 completes_within_s=completes_within_s)
    return app


def __getattr__(name: str) -> Any:
    if name == "app":  # `--app halfway.tools.stripe_payments:app`, built at each access
        return stripe_app()
    raise AttributeError(name)


def charge_spec(timeout_s: float = 10.0, key_ttl_s: float = KEY_TTL_S_MAX,
                completes_within_s: float | None = None) -> ToolSpec:
    """The hand-written tool's spec (`halfway.tools.payments`: the same arguments, subject,
    pivot role and once-per-subject), naming the effect by its PaymentIntent."""
    return dataclasses.replace(
        charge_customer_spec(timeout_s=timeout_s, key_ttl_s=key_ttl_s,
                             completes_within_s=completes_within_s),
        evidence_id="payment_intent_id")


def refund_spec(timeout_s: float = 10.0, key_ttl_s: float = KEY_TTL_S_MAX) -> ToolSpec:
    return ToolSpec(
        name=REFUND_TOOL,
        description=("Refund a succeeded payment (a PaymentIntent id, pi_...), whole or "
                     "amount_cents of it."),
        args_model=RefundArgs,
        effect_class=EffectClass.KEYED,
        timeout_s=timeout_s,
        subject=refund_subject,
        key_ttl_s=key_ttl_s,
        has_lookup=True,
        evidence_id="refund_id",
    )


# --- what the library raised ---------------------------------------------------------------------


def stripe_failure(exc: stripe.StripeError, timeout_s: float) -> CallFailure:
    """What an exception of the stripe library reports (the table in the module docstring)."""
    status = exc.http_status
    replayed = _header(exc.headers, "idempotent-replayed") == "true"
    error = exc.error
    code = (getattr(error, "code", None) or exc.code or getattr(error, "type", None))
    message = str(exc.user_message or exc)[:ERROR_CHARS_MAX]
    what = f"HTTP {status} {type(exc).__name__}: {message}"[:ERROR_CHARS_MAX]
    if isinstance(exc, stripe.APIConnectionError):
        return _connection_failure(exc, timeout_s)
    if status is None or not 400 <= status < 600:
        return Unexpected(what)  # no status, or a 2xx/3xx the library could not read
    if isinstance(exc, stripe.IdempotencyError):
        return Unexpected(f"{what} (our key is bound to another request; that request's "
                          f"outcome is not this answer's)"[:ERROR_CHARS_MAX])
    if isinstance(exc, stripe.RateLimitError) or status == 429:
        return Replied(429, code="rate_limit", message=what, replayed=replayed)
    if status in (401, 403) and not replayed:
        return NotSent(f"refused before the endpoint ran (Stripe checks keys and permissions "
                       f"ahead of its idempotency layer): {what}"[:ERROR_CHARS_MAX])
    if status == 424:
        return Unexpected(f"{what} (an external dependency failed; it may have happened)"
                          [:ERROR_CHARS_MAX])
    if isinstance(exc, stripe.CardError):
        decline = getattr(error, "decline_code", None)
        if decline:
            message = f"{message} (decline_code {decline})"[:ERROR_CHARS_MAX]
    return Replied(status, code=code, message=message, replayed=replayed)


def _connection_failure(exc: stripe.APIConnectionError, timeout_s: float) -> CallFailure:
    """The network error under an APIConnectionError: never sent only when the chain proves it
    (refused, DNS, connect timeout); a read timeout or a reset after sending is unknown."""
    for cause in _causes(exc):
        failure = failure_of(cause, timeout_s)
        if not isinstance(failure, Unexpected):
            return failure
    return Unexpected(f"APIConnectionError: {exc.user_message}"[:ERROR_CHARS_MAX])


def _causes(exc: BaseException) -> Iterator[BaseException]:
    seen = {id(exc)}
    current = exc.__cause__ or exc.__context__
    while current is not None and id(current) not in seen and len(seen) <= CAUSES_MAX:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _header(headers: Any, name: str) -> str | None:
    """A response header, whatever mapping the library kept (httpx's is case-insensitive)."""
    if not headers:
        return None
    if isinstance(headers, httpx.Headers):
        value = headers.get(name)
    else:
        value = next((v for k, v in dict(headers).items() if k.lower() == name), None)
    return None if value is None else str(value).lower()


def _replayed(obj: stripe.StripeObject) -> bool:
    response = obj.last_response
    return response is not None and _header(response.headers, "idempotent-replayed") == "true"


async def _attempt(call: Callable[[], Awaitable[Any]], timeout_s: float) -> Any:
    """One library call within the attempt's budget: its result, or the CallFailure."""
    try:
        async with asyncio.timeout(timeout_s):
            return await call()
    except TimeoutError:
        return TimedOut(timeout_s)
    except stripe.StripeError as exc:
        return stripe_failure(exc, timeout_s)
    except Exception as exc:
        return Unexpected(f"{type(exc).__name__}: {exc}"[:ERROR_CHARS_MAX])


# --- charge_customer -----------------------------------------------------------------------------


class ChargeAdapter:
    """charge_customer's call, lookup and webhook reading, on a shared StripeConnection."""

    def __init__(self, connection: StripeConnection, *, payment_method: str | None = None,
                 off_session: bool = False) -> None:
        self.connection = connection
        self.payment_method = payment_method
        self.off_session = off_session

    async def aclose(self) -> None:
        await self.connection.aclose()  # shared: the first close closes it, the rest are no-ops

    def params(self, charge: ChargeArgs, ctx: CallContext) -> dict[str, Any]:
        """The create parameters: the same for every attempt of a step (never the attempt)."""
        params: dict[str, Any] = {
            "amount": charge.amount_cents,
            "currency": charge.currency,
            "customer": charge.customer,
            "description": f"invoice {charge.invoice}",
            "confirm": True,
            "payment_method_types": ["card"],  # no redirect methods: no return_url needed
            "metadata": {METADATA_KEY: ctx.key, METADATA_STEP: ctx.step_id,
                         "invoice": charge.invoice},
        }
        if self.payment_method is not None:
            params["payment_method"] = self.payment_method
        if self.off_session:
            params["off_session"] = True
        return params

    async def call(self, args: BaseModel, ctx: CallContext) -> CallResult:
        params = self.params(_charge_args(args), ctx)
        answer = await _attempt(lambda: self.connection.client().v1.payment_intents.create_async(
            params, {"idempotency_key": ctx.key}), ctx.timeout_s)
        if not isinstance(answer, stripe.PaymentIntent):
            return answer if _is_failure(answer) else Unexpected(
                f"not a PaymentIntent: {type(answer).__name__}")
        return intent_result(answer.to_dict(), replayed=_replayed(answer))

    async def lookup(self, args: BaseModel, ctx: CallContext) -> LookupResult:
        """Find the intents carrying our key (search, then events); settle what they say."""
        charge = _charge_args(args)
        try:
            async with asyncio.timeout(ctx.timeout_s):
                found, where = await self._find(ctx.key)
        except TimeoutError:
            return LookupFailed(f"the lookup took longer than {ctx.timeout_s:g} s")
        except stripe.StripeError as exc:
            return LookupFailed(f"the lookup failed: HTTP {exc.http_status} "
                                f"{type(exc).__name__}: {exc.user_message}"[:ERROR_CHARS_MAX])
        except Exception as exc:
            return LookupFailed(f"the lookup failed: {type(exc).__name__}: {exc}"
                                [:ERROR_CHARS_MAX])
        return settle(found, charge, ctx.key, where)

    async def _find(self, key: str) -> tuple[list[dict[str, Any]], str]:
        intents = self.connection.client().v1.payment_intents
        result = await intents.search_async(
            {"query": f"metadata['{METADATA_KEY}']:{search_literal(key)}",
             "limit": SEARCH_LIMIT})
        ids = [str(i["id"]) for i in (r.to_dict() for r in result.data)
               if (i.get("metadata") or {}).get(METADATA_KEY) == key]
        where = "search"
        if not ids:
            ids = await self._ids_from_events(key)
            where = (f"search, and the latest {EVENT_PAGES_MAX * EVENT_PAGE_LIMIT} "
                     f"payment_intent events")
        # Each one's current state: a retrieve is consistent, a search result may be stale.
        found = [(await intents.retrieve_async(i)).to_dict()
                 for i in list(dict.fromkeys(ids))[:SEARCH_LIMIT]]
        return found, where

    async def _ids_from_events(self, key: str) -> list[str]:
        """Intents named by events whose request carried our key (Stripe keeps 30 days)."""
        events = self.connection.client().v1.events
        ids: list[str] = []
        after: str | None = None
        for _ in range(EVENT_PAGES_MAX):
            params: dict[str, Any] = {"type": "payment_intent.*", "limit": EVENT_PAGE_LIMIT}
            if after is not None:
                params["starting_after"] = after
            page = await events.list_async(params)  # type: ignore[arg-type]
            for event in (e.to_dict() for e in page.data):
                request = event.get("request") or {}
                obj = (event.get("data") or {}).get("object") or {}
                if request.get("idempotency_key") == key and \
                        obj.get("object") == "payment_intent":
                    ids.append(str(obj["id"]))
            if not page.has_more or not page.data:
                break
            after = page.data[-1].id
        return ids

    def read_webhook(self, args: BaseModel, hook: WebhookReceived) -> WebhookReport | None:
        """What a payment_intent.succeeded / payment_failed / canceled event says about this
        step's intent (a charge.* event of the same payment says nothing more)."""
        kind = hook.provider_event_type
        if kind != SUCCEEDED_EVENT and kind not in FAILED_EVENTS:
            return None
        charge = _charge_args(args)
        data = hook.payload.get("data")
        obj = data.get("object") if isinstance(data, dict) else None
        if not isinstance(obj, dict):
            return None
        mismatch = _mismatch(obj, charge)
        if kind == SUCCEEDED_EVENT:
            return WebhookReport(Outcome.DONE, hook.object_id, evidence=_evidence(obj),
                                 mismatch=mismatch)
        return WebhookReport(Outcome.NOT_DONE, hook.object_id,
                             reason=_failure_reason(obj) or kind, mismatch=mismatch)


def intent_result(intent: Mapping[str, Any], *, replayed: bool) -> CallResult:
    """What a 2xx PaymentIntent says: done only when `succeeded`; failed for good when the
    attempt was declined or the intent canceled; otherwise not final yet (unknown)."""
    status = intent.get("status")
    if status == "succeeded":
        return Succeeded(evidence=_evidence(intent), replayed=replayed)
    if _failed(intent):
        return ToolRefused(f"payment {intent.get('id')} failed: "
                           f"{_failure_reason(intent) or status}"[:ERROR_CHARS_MAX])
    return Unexpected(f"PaymentIntent {intent.get('id')} is {status!r}, not succeeded: it may "
                      f"still complete")


def settle(intents: list[dict[str, Any]], args: ChargeArgs, key: str,
           where: str = "search") -> LookupResult:
    """What the intents found under our key say about the effect (oldest first)."""
    if not intents:
        return NotFound(f"no PaymentIntent under key {key} in {where}")
    intents = sorted(intents, key=lambda i: (i.get("created") or 0, str(i.get("id"))))
    for intent in intents:
        mismatch = _mismatch(intent, args)
        if mismatch is not None:
            # Our key on another payment: something other than this step made it. Done or not
            # done would both be guesses, so leave it to an operator.
            return LookupFailed(f"PaymentIntent {intent.get('id')} carries key {key} but "
                                f"{mismatch}")
    succeeded = [i for i in intents if i.get("status") == "succeeded"]
    if succeeded:
        # More than one: a key reused after Stripe forgot it, the customer charged twice.
        return Found(evidence=_evidence(succeeded[0]), succeeded=True,
                     others=tuple(str(i.get("id")) for i in succeeded[1:]))
    failed = [i for i in intents if _failed(i)]
    if len(failed) == len(intents):
        return Found(evidence=_evidence(failed[0]), succeeded=False,
                     reason=_failure_reason(failed[0]) or "the payment failed")
    pending = sorted({str(i.get("status")) for i in intents if not _failed(i)})
    return LookupFailed(f"PaymentIntent {intents[0].get('id')} is not final yet "
                        f"({', '.join(pending)})")


def _failed(intent: Mapping[str, Any]) -> bool:
    """Failed for good, for a create-and-confirm: declined (waiting for another payment method
    nobody will give it) or canceled."""
    status = intent.get("status")
    return status == "canceled" or (status == "requires_payment_method"
                                    and bool(intent.get("last_payment_error")))


def _failure_reason(intent: Mapping[str, Any]) -> str:
    error = intent.get("last_payment_error")
    if isinstance(error, Mapping):
        return " ".join(str(p) for p in (error.get("code"), error.get("decline_code"),
                                          error.get("message")) if p)
    if intent.get("status") == "canceled":
        return f"canceled ({intent.get('cancellation_reason') or 'no reason given'})"
    return ""


def _mismatch(intent: Mapping[str, Any], args: ChargeArgs) -> str | None:
    seen = (intent.get("amount"), intent.get("currency"), intent.get("customer"))
    asked = (args.amount_cents, args.currency, args.customer)
    if seen == asked:
        return None
    return (f"charges {seen[0]} {seen[1]} to {seen[2]}, the step asked for {asked[0]} "
            f"{asked[1]} to {asked[2]}")


def _evidence(intent: Mapping[str, Any]) -> dict[str, Any]:
    return {"payment_intent_id": intent.get("id"), "charge_id": intent.get("latest_charge"),
            "amount_cents": intent.get("amount"), "currency": intent.get("currency"),
            "status": intent.get("status"), "provider": PROVIDER}


def _charge_args(args: BaseModel) -> ChargeArgs:
    if not isinstance(args, ChargeArgs):
        raise TypeError(f"{TOOL_NAME} takes ChargeArgs, got {type(args).__name__}")
    return args


def _is_failure(value: Any) -> bool:
    return isinstance(value, CallFailure)


def search_literal(value: str) -> str:
    """A Search API string literal: single-quoted, with \\ and ' escaped."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


# --- refund_payment ------------------------------------------------------------------------------


class RefundAdapter:
    """refund_payment's call and lookup, on a shared StripeConnection."""

    def __init__(self, connection: StripeConnection) -> None:
        self.connection = connection

    async def aclose(self) -> None:
        await self.connection.aclose()

    async def call(self, args: BaseModel, ctx: CallContext) -> CallResult:
        refund = _refund_args(args)
        params: dict[str, Any] = {
            "payment_intent": refund.payment_intent_id,
            "metadata": {METADATA_KEY: ctx.key, METADATA_STEP: ctx.step_id}}
        if refund.amount_cents is not None:
            params["amount"] = refund.amount_cents
        if refund.reason is not None:
            params["reason"] = refund.reason
        answer = await _attempt(lambda: self.connection.client().v1.refunds.create_async(
            params, {"idempotency_key": ctx.key}), ctx.timeout_s)
        if not isinstance(answer, stripe.Refund):
            return answer if _is_failure(answer) else Unexpected(
                f"not a Refund: {type(answer).__name__}")
        made = answer.to_dict()
        status = made.get("status")
        if status == "succeeded":
            return Succeeded(evidence=_refund_evidence(made), replayed=_replayed(answer))
        if status in ("failed", "canceled"):
            return ToolRefused(f"refund {made.get('id')} {status}: "
                               f"{made.get('failure_reason') or 'no reason given'}")
        return Unexpected(f"refund {made.get('id')} is {status!r}, not succeeded: it may "
                          f"still complete")

    async def lookup(self, args: BaseModel, ctx: CallContext) -> LookupResult:
        """The intent's refunds carrying our key (a list: consistent, unlike search)."""
        refund = _refund_args(args)
        try:
            async with asyncio.timeout(ctx.timeout_s):
                page = await self.connection.client().v1.refunds.list_async(
                    {"payment_intent": refund.payment_intent_id, "limit": REFUND_LIST_LIMIT})
        except TimeoutError:
            return LookupFailed(f"the lookup took longer than {ctx.timeout_s:g} s")
        except Exception as exc:
            return LookupFailed(f"the lookup failed: {type(exc).__name__}: {exc}"
                                [:ERROR_CHARS_MAX])
        mine = [r for r in (x.to_dict() for x in page.data)
                if (r.get("metadata") or {}).get(METADATA_KEY) == ctx.key]
        if not mine:
            if page.has_more:
                return LookupFailed(f"more than {REFUND_LIST_LIMIT} refunds on "
                                    f"{refund.payment_intent_id}; none of the latest is ours")
            return NotFound(f"no refund of {refund.payment_intent_id} under key {ctx.key}")
        mine.sort(key=lambda r: (r.get("created") or 0, str(r.get("id"))))
        for made in mine:
            if refund.amount_cents is not None and made.get("amount") != refund.amount_cents:
                return LookupFailed(f"refund {made.get('id')} carries key {ctx.key} but "
                                    f"refunds {made.get('amount')}, not {refund.amount_cents}")
        done = [r for r in mine if r.get("status") == "succeeded"]
        if done:
            return Found(evidence=_refund_evidence(done[0]), succeeded=True,
                         others=tuple(str(r.get("id")) for r in done[1:]))
        if all(r.get("status") in ("failed", "canceled") for r in mine):
            return Found(evidence=_refund_evidence(mine[0]), succeeded=False,
                         reason=f"refund {mine[0].get('status')}")
        return LookupFailed(f"refund {mine[0].get('id')} is not final yet "
                            f"({mine[0].get('status')})")


def _refund_evidence(refund: Mapping[str, Any]) -> dict[str, Any]:
    return {"refund_id": refund.get("id"), "payment_intent_id": refund.get("payment_intent"),
            "charge_id": refund.get("charge"), "amount_cents": refund.get("amount"),
            "currency": refund.get("currency"), "status": refund.get("status"),
            "provider": PROVIDER}


def _refund_args(args: BaseModel) -> RefundArgs:
    if not isinstance(args, RefundArgs):
        raise TypeError(f"{REFUND_TOOL} takes RefundArgs, got {type(args).__name__}")
    return args


__all__ = ["ChargeAdapter", "RefundAdapter", "RefundArgs", "StripeConnection", "charge_spec",
           "intent_result", "refund_spec", "settle", "stripe_app", "stripe_failure",
           "stripe_tools"]
