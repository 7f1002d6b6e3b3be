"""`halfway demo renewal`: the $49 renewal from the essay, on the real broker, twice.

The payment provider (the simulator, its own process) takes 6.2 s to process the first charge;
both harnesses wait 5 s.

- halfway: the decider journals the decision, the executor journals the attempt, sends it with
  the key `renewal-…:1`, times out, journals `unknown`, looks the charge up, retries with the
  same key (the provider answers 409 while the first request is still processing, then
  replays its saved result) and settles the step `done` with the charge id. One charge.
- naive: the same call without a key, the timeout treated as an ordinary error, and the model
  allowed to retry. Two charges.

`run(settings, stripe=True)` runs the same renewal through Stripe's official client library
against the same simulator: halfway's `charge_customer` is then `halfway.tools.stripe_payments`
(a PaymentIntent created and confirmed in one request, the library's retries off, our key as
its Idempotency-Key), and the naive harness calls `payment_intents.create` as a naive agent
would, letting the library mint a fresh random key for each call. Still one charge against two.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from halfway import settings as env
from halfway.api import queries
from halfway.api.status import status_table
from halfway.contract import Outcome, TaskRequested
from halfway.contract.topics import JOURNAL, TASKS
from halfway.core.fold import StepStatus, TaskState, apply
from halfway.journal import EventConsumer, JournalWriter, ensure_topics
from halfway.models import ScriptedModel
from halfway.projector import store
from halfway.projector.service import Projector, journal_end_offsets
from halfway.render import step_line
from halfway.serve import Service, run_service
from halfway.settings import KafkaSettings
from halfway.tools.payments import PaymentsAdapter, charge_customer_spec
from halfway.tools.registry import Registry, Tool

PROVIDER_DELAY_S = 6.2
CLIENT_TIMEOUT_S = 5.0
TASK_TIMEOUT_S = 120.0
READ_MODEL_TIMEOUT_S = 60.0
SIM_START_TIMEOUT_S = 30.0
PAYSIM_API_KEY = "sk_test_paysim"  # paysim accepts any key; the stripe client needs one
STRIPE_CLIENT = "stripe (official client), POST /v1/payment_intents confirm=true"


@dataclass
class Harness:
    name: str
    charges: int = 0
    lines: list[str] = field(default_factory=list)
    steps: list[dict[str, Any]] = field(default_factory=list)
    final: str = ""
    client: str = "httpx, POST /v1/charges"  # how the harness spoke to the provider
    status_table: str = ""  # what `halfway status` shows, from the PostgreSQL read model
    read_model_state: str = ""


def renewal_request(task_id: str) -> TaskRequested:
    # One invoice per run: an invoice is charged once, and the demo may run again.
    invoice = f"INV-2291-{task_id.rsplit('-', 1)[-1]}"
    charge = {"invoice": invoice, "customer": "cus_8812", "amount_cents": 4900,
              "currency": "usd"}
    return TaskRequested(
        event_id=uuid.uuid4().hex, task_id=task_id, at=datetime.now(UTC),
        # A real model asked again would not say the same thing: "49.00" instead of 4900.
        input={"script": [{"tool": "charge_customer", "args": charge,
                           "reask_args": {"amount_cents": "49.00"}}],
               "summary": f"renewed the subscription: $49.00 charged for invoice {invoice}"},
        allowed_tools=["charge_customer"],
    )


@contextlib.asynccontextmanager
async def simulator(module: str = "halfway.simulators.payments") -> Any:
    """A provider simulator (payments by default) as its own process; yields its URL."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", module, "--port", "0", stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(SIM_START_TIMEOUT_S):
            line = (await proc.stdout.readline()).decode().strip()
        if not line.startswith("listening on "):
            raise RuntimeError(f"the simulator did not start: {line!r}")
        yield line.removeprefix("listening on ")
    finally:
        if proc.returncode is None:
            proc.terminate()
            await proc.wait()


async def provider(url: str, method: str, path: str, body: Any = None) -> Any:
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        response = await client.request(method, path, json=body)
        response.raise_for_status()
        return response.json()


async def slow_first_charge(url: str) -> None:
    await provider(url, "POST", "/_sim/reset")
    await provider(url, "POST", "/_sim/faults", {"rules": [
        {"match": {"nth": 1}, "times": 1, "action": {"delay_s": PROVIDER_DELAY_S}}]})


async def ledger(url: str) -> list[dict[str, Any]]:
    return (await provider(url, "GET", "/_sim/ledger"))["charges"]


def stripe_registry(url: str) -> Registry:
    """charge_customer on Stripe's official client, pointed at the simulator."""
    from halfway.app import App
    from halfway.tools.stripe_payments import stripe_tools

    app = App(name="renewal-stripe")
    stripe_tools(app, api_key=PAYSIM_API_KEY, api_base=url, timeout_s=CLIENT_TIMEOUT_S,
                 refunds=False)
    return app.registry()


async def run_halfway(settings: KafkaSettings, url: str, out: Harness, *,
                      stripe: bool = False) -> None:
    await slow_first_charge(url)
    if stripe:
        registry = stripe_registry(url)
        out.client = STRIPE_CLIENT
    else:
        registry = Registry([Tool(charge_customer_spec(timeout_s=CLIENT_TIMEOUT_S),
                                  PaymentsAdapter(url))])
    services = [asyncio.create_task(run_service(s, settings, registry, ScriptedModel()))
                for s in (Service.DECIDER, Service.EXECUTOR, Service.RECONCILER)]
    # The read model too, so the demo ends with what an operator sees in `halfway status`.
    projector = Projector(settings, env.pg_dsn(), schema=env.pg_schema())
    services.append(asyncio.create_task(projector.run()))
    task_id = f"renewal-{uuid.uuid4().hex[:6]}"
    started = time.monotonic()
    try:
        async with JournalWriter(settings) as writer:
            await writer.append(renewal_request(task_id), TASKS)
            out.lines.append(f"{0:5.1f} s  task.requested {task_id}")
            state = await _follow(settings, writer, task_id, started, out)
        found = await _read_model_task(settings, task_id)
        out.read_model_state = found["state"]
        out.status_table = status_table(found, now=datetime.now(UTC))
    finally:
        for service in services:
            service.cancel()
        await asyncio.gather(*services, return_exceptions=True)
        await registry.aclose()
    out.final = f"{state.final_state}" if state.final_state else f"{state.status}"
    for step in state.steps.values():
        states = [u.outcome.value for u in step.effect.unknowns]
        if step.outcome in (Outcome.DONE, Outcome.NOT_DONE):
            states.append(step.outcome.value)
        settlement = step.effect.settlement
        out.steps.append({"step_id": step.step_id, "key": step.intent.key, "states": states,
                          "evidence": settlement.evidence if settlement else None,
                          "attempts": len(step.effect.attempts)})
    out.charges = len([c for c in await ledger(url) if c.get("customer") == "cus_8812"])


async def _read_model_task(settings: KafkaSettings, task_id: str) -> dict[str, Any]:
    """The task as the read model has it, once the projector has caught up with the journal."""
    ends = await journal_end_offsets(settings)
    conn = await store.connect(env.pg_dsn())
    try:
        async with asyncio.timeout(READ_MODEL_TIMEOUT_S):
            while True:
                applied = (await store.read_offsets(conn, env.pg_schema(),
                                                    JOURNAL.name(settings.topic_prefix))
                           if await store.schema_exists(conn, env.pg_schema()) else {})
                if all(applied.get(p, 0) >= end for p, end in ends.items() if end):
                    break
                await asyncio.sleep(0.1)
        found = await queries.get_task(conn, env.pg_schema(), task_id)
    finally:
        await conn.close()
    if found is None:
        raise RuntimeError(f"the read model has no task {task_id}")
    return found


async def _follow(settings: KafkaSettings, writer: JournalWriter, task_id: str,
                  started: float, out: Harness) -> TaskState:
    state = TaskState(task_id=task_id)
    shown = ""
    consumer = EventConsumer(settings, topics=(JOURNAL,), group=f"demo-{task_id}",
                             writer=writer)
    async with consumer, asyncio.timeout(TASK_TIMEOUT_S):
        async for delivery in consumer.deliveries():
            if delivery.event.task_id != task_id:
                continue
            state = apply(state, delivery.event)
            step = state.step(1)
            line = step_line(step) if step else delivery.event.type
            if line != shown or delivery.event.type == "task.finished":
                elapsed = time.monotonic() - started
                what = delivery.event.type
                out.lines.append(f"{elapsed:5.1f} s  {what:<15} "
                                 + (line if what.startswith("step") else ""))
                shown = line
            if state.finished is not None:
                return state
    return state


async def run_naive(url: str, out: Harness) -> None:
    """What most agent frameworks do today: an error is an error, and the model retries."""
    await slow_first_charge(url)
    started = time.monotonic()
    params = {"amount": 4900, "currency": "usd", "customer": "cus_naive",
              "metadata[invoice]": "INV-2291"}
    async with httpx.AsyncClient(base_url=url, timeout=CLIENT_TIMEOUT_S) as client:
        for attempt in (1, 2, 3):
            try:
                response = await client.post("/v1/charges", data=params)
                response.raise_for_status()
                out.lines.append(f"{time.monotonic() - started:5.1f} s  attempt {attempt}: "
                                 f"charged {response.json()['id']}; the model reports success")
                break
            except httpx.HTTPError as exc:
                out.lines.append(f"{time.monotonic() - started:5.1f} s  attempt {attempt}: "
                                 f"error ({type(exc).__name__}); the model retries")
    out.charges = len(await _naive_charges(url, started))
    out.final = "reported success"


async def run_naive_stripe(url: str, out: Harness) -> None:
    """The naive agent on the official client: its retries off, as ours, but no key of its
    own, so the library mints a fresh random one for every call the model retries."""
    import stripe as stripe_lib

    from halfway.tools.stripe_payments import StripeConnection

    await slow_first_charge(url)
    out.client = STRIPE_CLIENT
    started = time.monotonic()
    connection = StripeConnection(api_key=PAYSIM_API_KEY, api_base=url,
                                  timeout_s=CLIENT_TIMEOUT_S)
    params: dict[str, Any] = {"amount": 4900, "currency": "usd", "customer": "cus_naive",
                              "confirm": True, "metadata": {"invoice": "INV-2291"}}
    try:
        for attempt in (1, 2, 3):
            try:
                # The library's own timeout (CLIENT_TIMEOUT_S) ends a slow call.
                intent = await connection.client().v1.payment_intents.create_async(params)
                out.lines.append(f"{time.monotonic() - started:5.1f} s  attempt {attempt}: "
                                 f"paid {intent.id}; the model reports success")
                break
            except stripe_lib.StripeError as exc:
                out.lines.append(f"{time.monotonic() - started:5.1f} s  attempt {attempt}: "
                                 f"error ({type(exc).__name__}); the model retries")
    finally:
        await connection.aclose()
    out.charges = len(await _naive_charges(url, started))
    out.final = "reported success"


async def _naive_charges(url: str, started: float) -> list[dict[str, Any]]:
    """The naive customer's charges, once the slow first one has landed (at 6.2 s, whether or
    not anyone is still listening)."""
    charges: list[dict[str, Any]] = []
    for _ in range(100):
        charges = [c for c in await ledger(url) if c.get("customer") == "cus_naive"]
        if len(charges) >= 2 or time.monotonic() - started > PROVIDER_DELAY_S + 2:
            break
        await asyncio.sleep(0.1)
    return charges


async def run(settings: KafkaSettings, *, stripe: bool = False) -> tuple[Harness, Harness]:
    """Both harnesses, one after the other, against one simulator; `stripe`: both through
    Stripe's official client (PaymentIntents) instead of plain HTTP charges."""
    await ensure_topics(settings)
    ours, naive = Harness("halfway"), Harness("naive")
    async with simulator() as url:
        await run_halfway(settings, url, ours, stripe=stripe)
        if stripe:
            await run_naive_stripe(url, naive)
        else:
            await run_naive(url, naive)
    return ours, naive


def as_json(ours: Harness, naive: Harness) -> dict[str, Any]:
    return {"ledger": {"halfway": ours.charges, "naive": naive.charges},
            "final": {"halfway": ours.final, "naive": naive.final},
            "steps": ours.steps, "read_model": {"state": ours.read_model_state}}


def as_text(ours: Harness, naive: Harness) -> str:
    out = ["The renewal: charge $49.00 for invoice INV-2291. The provider takes "
           f"{PROVIDER_DELAY_S} s; both harnesses wait {CLIENT_TIMEOUT_S:g} s.",
           f"Both speak to it through {ours.client}.", "",
           "halfway (journal + key + lookup):"]
    out += [f"  {line}" for line in ours.lines]
    out += ["", "naive (timeout = error, the model retries):"]
    out += [f"  {line}" for line in naive.lines]
    out += ["", f"{'':<22}{'halfway':<14}naive",
            f"{'charges in the ledger':<22}{ours.charges:<14}{naive.charges}",
            f"{'the customer paid':<22}{'$%.2f' % (49 * ours.charges):<14}"
            f"${49 * naive.charges:.2f}"]
    for step in ours.steps:
        out.append(f"{step['step_id']}: " + " -> ".join(step["states"])
                   + f"  evidence {step['evidence']}")
    out += ["", "halfway status (from the PostgreSQL read model):", ours.status_table]
    return "\n".join(out)


def verdict_ok(ours: Harness) -> bool:
    return ours.charges == 1 and all(s["states"][-1:] == [StepStatus.DONE.value]
                                     for s in ours.steps)
