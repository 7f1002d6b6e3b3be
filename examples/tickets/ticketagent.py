"""ticketagent: a support-ticket agent, an app for halfway to run (`--app ticketagent:app`).

Its tools are plain async functions that call the helpdesk (helpdesk.py, next to this file).
You write no retry or three-state logic; halfway reads what your function did:

- it returned a dict: done, and the dict is the evidence the journal keeps;
- it raised Refused("why"): proof it was not done (the model reads why);
- it raised a connect error: the request never left (never reached);
- it timed out or raised anything else: unknown, until the lookup settles it.
"""

from __future__ import annotations

import os
from typing import Annotated, Any

import httpx
from pydantic import Field

from halfway import App, CallContext, Refused

HELPDESK_URL = os.environ.get("HELPDESK_URL", "http://127.0.0.1:18082")

app = App(
    name="tickets",
    # The model's system prompt.
    instructions="You open and close support tickets at the helpdesk. A customer reference "
                 "looks like ACME-42. Open one ticket per problem, with a short title; close a "
                 "ticket only when asked to.",
)

# The arguments the model may pass. halfway validates them strictly (from these hints) before
# a call is placed; the descriptions and limits are part of the schema the model reads.
Ref = Annotated[str, Field(description="customer reference, like ACME-42", max_length=40)]
Title = Annotated[str, Field(description="one-line summary of the problem", min_length=1,
                             max_length=200)]
TicketId = Annotated[str, Field(description="ticket id, like T-000001", pattern=r"^T-[0-9]+$",
                                max_length=20)]

_client: httpx.AsyncClient | None = None


def helpdesk() -> httpx.AsyncClient:
    """One HTTP client per process, made on first use (it keeps connections open)."""
    global _client
    if _client is None:
        _client = httpx.AsyncClient(base_url=HELPDESK_URL)
    return _client


@app.on_shutdown
async def close_helpdesk() -> None:
    """halfway calls this when a service stops: close the shared client cleanly."""
    if _client is not None:
        await _client.aclose()


def evidence(ticket: dict[str, Any]) -> dict[str, Any]:
    """What the journal keeps of a ticket: enough to name it and show its state."""
    return {"ticket_id": ticket["id"], "ref": ticket["ref"], "status": ticket["status"]}


def ticket_of(response: httpx.Response) -> dict[str, Any]:
    """The ticket from a 2xx; Refused if the helpdesk said no; otherwise raise (unknown)."""
    if 400 <= response.status_code < 500 and response.status_code not in (408, 409, 429):
        try:
            message = response.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = response.text[:200]
        raise Refused(f"helpdesk said {response.status_code}: {message}")
    response.raise_for_status()  # 408, 409, 429, 5xx: it may have happened, so halfway checks
    return evidence(response.json())


# keyed: the helpdesk dedupes by our Idempotency-Key for 24 h, so halfway may retry with it.
# subject: the business object (one ticket per ref in flight at a time). evidence_id: the
# evidence field naming the ticket. undo: how a saga would take it back (not used otherwise).
@app.tool(effect="keyed", key_ttl_s=86_400, timeout_s=5.0, subject="ticket:{ref}",
          evidence_id="ticket_id", undo=("close_ticket", {"ticket_id": "$result.ticket_id"}))
async def open_ticket(ref: Ref, title: Title, *, ctx: CallContext) -> dict[str, Any]:
    """Open a support ticket for a customer reference. Returns the ticket id."""
    response = await helpdesk().post("/tickets", json={"ref": ref, "title": title},
                                     headers={"Idempotency-Key": ctx.key},  # same on retries
                                     timeout=ctx.timeout_s)
    return ticket_of(response)


# After a timeout, halfway asks: did the ticket named by our key get made? Found: done.
# None: nothing yet (not proof on its own). Raising: the lookup failed, it proves nothing.
@open_ticket.lookup
async def find_ticket(ref: Ref, title: Title, *, ctx: CallContext) -> dict[str, Any] | None:
    response = await helpdesk().get("/tickets", params={"key": ctx.key}, timeout=ctx.timeout_s)
    response.raise_for_status()
    found = response.json()["data"]
    return evidence(found[0]) if found else None


# idempotent: closing a closed ticket changes nothing, so a repeat is safe without a key.
@app.tool(effect="idempotent", timeout_s=5.0)
async def close_ticket(ticket_id: TicketId, *, ctx: CallContext) -> dict[str, Any]:
    """Close a support ticket by its id."""
    response = await helpdesk().post(f"/tickets/{ticket_id}/close", timeout=ctx.timeout_s)
    return ticket_of(response)


# read: no effect at all, so a failed read is simply retried (a few times).
@app.tool(effect="read", timeout_s=5.0)
async def list_tickets(ref: Ref, *, ctx: CallContext) -> dict[str, Any]:
    """List the support tickets of a customer reference."""
    response = await helpdesk().get("/tickets", params={"ref": ref}, timeout=ctx.timeout_s)
    response.raise_for_status()
    return {"tickets": [{"ticket_id": t["id"], "title": t["title"], "status": t["status"]}
                        for t in response.json()["data"]]}
