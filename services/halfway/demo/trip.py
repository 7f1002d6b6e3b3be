"""`halfway demo trip`: a saga on the real broker, twice: once it succeeds, once the hotel
refuses.

A trip is four steps that only make sense together: hold a flight (compensable: released),
book a hotel (compensable: cancelled), charge the card (the pivot: no undo), email the
itinerary (retriable, after the pivot). Each undo is declared with its step, before it runs.

- `trip-ok-…`: every step done; the task succeeds.
- `trip-full-…`: the hotel has no room (a 422: proof of not done). The decider calls the saga
  off and journals the undo of the one done step; the executor releases the flight hold with
  its own key (`trip-full-…:1:undo`). The card is never charged and no email goes out; the
  task ends `compensated`.

The providers are simulators in their own processes (tripsim for flights, hotels and email;
paysim for the card); their ledgers are the ground truth the demo prints at the end. With
`email="smtp"` the itinerary goes over SMTP instead (`halfway.tools.email_smtp`, the real
aiosmtplib client) to smtpsim, a relay of its own process, whose ledger lists the message.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal
from urllib.parse import urlsplit

from halfway import settings as env
from halfway.api.status import status_table
from halfway.contract import OnUnknown, SagaRole, TaskPolicy, TaskRequested
from halfway.contract.topics import JOURNAL, TASKS
from halfway.core.fold import TaskState, apply
from halfway.demo.renewal import _read_model_task, provider, simulator
from halfway.journal import EventConsumer, JournalWriter, ensure_topics
from halfway.models import ScriptedModel
from halfway.projector.service import Projector
from halfway.render import step_line, undo_line
from halfway.serve import Service, run_service
from halfway.settings import KafkaSettings
from halfway.tools.email_smtp import SmtpRelay, key_from_message_id, smtp_email_tool
from halfway.tools.payments import PaymentsAdapter, charge_customer_spec
from halfway.tools.registry import Registry, Tool
from halfway.tools.travel import SEND_EMAIL, travel_tools

TOOLS = ["hold_flight", "book_hotel", "charge_customer", "send_email"]
FULL_HOTEL = "HTL-FULL"  # tripsim refuses it: no availability
TASK_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 5.0
SMTP_SENDER = "trips@halfway.example"  # the From of the itinerary over SMTP
Email = Literal["http", "smtp"]  # tripsim's HTTP email API, or SMTP to smtpsim


def trip_request(task_id: str, *, passenger: str = "Ada Lovelace", hotel: str = "HTL-ROMA-7",
                 customer: str = "cus_8812", email: str = "ada@example.com",
                 on_unknown: OnUnknown = OnUnknown.WAIT) -> TaskRequested:
    """The trip as a saga, scripted: what a model would decide, step by step. The invoice is
    the task's own (an invoice is charged once, whichever task asks)."""
    script = [
        {"tool": "hold_flight", "args": {"flight": "LH-454", "passenger": passenger}},
        {"tool": "book_hotel", "args": {"hotel": hotel, "guest": passenger, "nights": 3}},
        {"tool": "charge_customer", "args": {"invoice": f"INV-{task_id}", "customer": customer,
                                             "amount_cents": 128_000, "currency": "eur"}},
        {"tool": "send_email", "args": {"to": email, "subject": f"Your trip {task_id}",
                                        "body": "Flight LH-454, 3 nights in Rome."}},
    ]
    return TaskRequested(
        event_id=uuid.uuid4().hex, task_id=task_id, at=datetime.now(UTC),
        input={"script": script, "summary": f"trip {task_id} booked, paid and confirmed"},
        allowed_tools=TOOLS, policy=TaskPolicy(saga=True, on_unknown=on_unknown))


@dataclass
class Trip:
    task_id: str
    lines: list[str] = field(default_factory=list)
    state: TaskState | None = None
    status_table: str = ""


@dataclass
class Result:
    trips: list[Trip]
    ledger: dict[str, Any]
    charges: list[dict[str, Any]]
    email: Email = "http"

    def effects_of(self, task_id: str) -> dict[str, list[str]]:
        """What the providers did for one trip, by kind: ids with their final status."""
        def mine(record: dict[str, Any]) -> bool:
            key = str((record.get("metadata") or {}).get("halfway_key")
                      or record.get("idempotency_key") or record.get("message_id") or "")
            return task_id in key

        out = {kind: [f"{r['id']} {r['status']}" for r in self.ledger.get(kind, []) if mine(r)]
               for kind in ("holds", "bookings", "emails")}
        out["charges"] = [f"{c['id']} {c['status']}" for c in self.charges if mine(c)]
        return out


async def run(settings: KafkaSettings, *, email: Email = "http") -> Result:
    """Both trips. `email`: "http" sends the itinerary with tripsim's email API; "smtp" sends
    it over SMTP to smtpsim (its messages stand in the ledger's `emails`)."""
    if email not in ("http", "smtp"):
        raise ValueError(f"email must be 'http' or 'smtp', not {email!r}")
    await ensure_topics(settings)
    suffix = uuid.uuid4().hex[:6]
    trips = [Trip(f"trip-ok-{suffix}"), Trip(f"trip-full-{suffix}")]
    async with (simulator() as paysim, simulator("halfway.simulators.travel") as tripsim,
                _smtpsim(email == "smtp") as smtpsim):
        tools = [Tool(charge_customer_spec(timeout_s=CALL_TIMEOUT_S), PaymentsAdapter(paysim)),
                 *(Tool(s, a) for s, a in travel_tools(tripsim, timeout_s=CALL_TIMEOUT_S)
                   if smtpsim is None or s.name != SEND_EMAIL)]
        if smtpsim is not None:
            tools.append(Tool(*smtp_email_tool(_relay(smtpsim), saga_role=SagaRole.RETRIABLE)))
        registry = Registry(tools)
        services = [asyncio.create_task(run_service(s, settings, registry, ScriptedModel()))
                    for s in (Service.DECIDER, Service.EXECUTOR, Service.RECONCILER)]
        projector = Projector(settings, env.pg_dsn(), schema=env.pg_schema())
        services.append(asyncio.create_task(projector.run()))
        try:
            async with JournalWriter(settings) as writer:
                await writer.append(trip_request(trips[0].task_id), TASKS)
                await writer.append(trip_request(trips[1].task_id, passenger="Grace Hopper",
                                                 email="grace@example.com", hotel=FULL_HOTEL),
                                    TASKS)
                await _follow(settings, writer, trips)
            for trip in trips:
                found = await _read_model_task(settings, trip.task_id)
                trip.status_table = status_table(found, now=datetime.now(UTC))
            ledger = await provider(tripsim, "GET", "/_sim/ledger")
            if smtpsim is not None:
                messages = (await provider(smtpsim[1], "GET", "/messages"))["data"]
                ledger["emails"] = [_smtp_email(m) for m in messages]
            charges = (await provider(paysim, "GET", "/_sim/ledger"))["charges"]
        finally:
            for service in services:
                service.cancel()
            await asyncio.gather(*services, return_exceptions=True)
            await registry.aclose()
    return Result(trips, ledger, charges, email)


@contextlib.asynccontextmanager
async def _smtpsim(wanted: bool) -> AsyncIterator[tuple[str, str] | None]:
    """smtpsim as its own process, when wanted: (its smtp:// URL, its http:// URL)."""
    if not wanted:
        yield None
        return
    async with simulator("halfway.simulators.smtpsim") as where:
        smtp_url, http_url = where.split()  # "smtp://HOST:PORT http://HOST:PORT"
        yield smtp_url, http_url


def _relay(smtpsim: tuple[str, str]) -> SmtpRelay:
    smtp = urlsplit(smtpsim[0])
    if smtp.hostname is None or smtp.port is None:
        raise RuntimeError(f"smtpsim said it listens on {smtpsim[0]!r}")
    # smtpsim records a message before its 250, so nothing found past the bound is not done.
    return SmtpRelay(host=smtp.hostname, port=smtp.port, sender=SMTP_SENDER,
                     lookup_url=f"{smtpsim[1]}/messages", timeout_s=CALL_TIMEOUT_S,
                     completes_within_s=CALL_TIMEOUT_S)


def _smtp_email(message: dict[str, Any]) -> dict[str, Any]:
    """A message smtpsim accepted, in the ledger's shape: its queue id, our key."""
    try:
        key: str | None = key_from_message_id(str(message.get("message_id") or ""))
    except ValueError:
        key = None  # not ours
    return {"id": message.get("queue_id"), "status": "queued", "idempotency_key": key,
            "message_id": message.get("message_id"), "to": message.get("rcpt_tos")}


async def _follow(settings: KafkaSettings, writer: JournalWriter, trips: list[Trip]) -> None:
    """Each trip's journal as it happens: one line per change of a step or an undo."""
    by_id = {t.task_id: t for t in trips}
    shown: dict[str, str] = {}
    started = asyncio.get_running_loop().time()
    consumer = EventConsumer(settings, topics=(JOURNAL,), group=f"demo-{trips[0].task_id}",
                             writer=writer)
    async with consumer, asyncio.timeout(TASK_TIMEOUT_S):
        async for delivery in consumer.deliveries():
            trip = by_id.get(delivery.event.task_id)
            if trip is None:
                continue
            trip.state = apply(trip.state or TaskState(task_id=trip.task_id), delivery.event)
            elapsed = asyncio.get_running_loop().time() - started
            for step in trip.state.steps.values():
                for name, line in ((step.step_id, step_line(step)),
                                   (f"{step.step_id}:undo", undo_line(step))):
                    if line is not None and shown.get(name) != line:
                        shown[name] = line
                        trip.lines.append(f"{elapsed:5.1f} s  {line}")
            event = delivery.event
            if event.type in ("task.aborted", "task.finished"):
                what = getattr(event, "reason", None) or getattr(event, "summary", "")
                label = (f"finished {event.state}" if event.type == "task.finished"
                         else "called off")
                trip.lines.append(f"{elapsed:5.1f} s  {label}: {what}")
            if all(t.state is not None and t.state.finished is not None for t in trips):
                return


def as_text(result: Result) -> str:
    out = ["The trip saga: hold a flight (undo: release), book a hotel (undo: cancel), charge",
           "the card (the pivot), email the itinerary (after the pivot). Twice: once the hotel",
           f"has a room, once it is full ({FULL_HOTEL}).", ""]
    if result.email == "smtp":
        out[-1:-1] = ["The itinerary goes over SMTP (aiosmtplib) to smtpsim, a mail relay."]
    for trip in result.trips:
        out.append(f"{trip.task_id}:")
        out += [f"  {line}" for line in trip.lines]
        out.append("  what the providers did (their own ledgers):")
        for kind, records in result.effects_of(trip.task_id).items():
            out.append(f"    {kind:<9}{', '.join(records) if records else 'none'}")
        out.append("")
    out.append("halfway status (from the PostgreSQL read model):")
    for trip in result.trips:
        out += [trip.status_table, ""]
    return "\n".join(out)


def as_json(result: Result) -> dict[str, Any]:
    return {"trips": [{"task_id": t.task_id,
                       "final": str(t.state.final_state) if t.state else None,
                       "lines": t.lines, "effects": result.effects_of(t.task_id)}
                      for t in result.trips]}


def verdict_ok(result: Result) -> bool:
    ok, full = result.trips
    good = result.effects_of(ok.task_id)
    bad = result.effects_of(full.task_id)
    return (ok.state is not None and str(ok.state.final_state) == "succeeded"
            and full.state is not None and str(full.state.final_state) == "compensated"
            and [len(good[k]) for k in ("holds", "bookings", "charges", "emails")] == [1] * 4
            and [r.split()[-1] for r in bad["holds"]] == ["released"]
            and bad["bookings"] == bad["charges"] == bad["emails"] == [])
