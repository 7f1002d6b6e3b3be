"""Provider webhooks, as the gateway publishes them once their signature is verified.

Not an event of a task: a provider's statement about one of its objects (a charge), which the
reconciler matches to a step through our key in the object's metadata. Records on the webhooks
topic are keyed by `task_id` when our key names one (so a task's webhooks share a partition
with its journal) and by `object_id` otherwise; either way one effect's events stay in order.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from halfway.contract.events import SCHEMA_VERSION, Instant, Outcome, TaskId, _type_is_required


class WebhookReceived(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, json_schema_extra=_type_is_required)

    type: Literal["webhook.received"] = "webhook.received"
    schema_version: Literal[1] = SCHEMA_VERSION
    provider: str = Field(min_length=1, description="Which provider sent it, e.g. paysim")
    provider_event_id: str = Field(min_length=1, description="The provider's id: dedupes")
    provider_event_type: str = Field(min_length=1, description="e.g. charge.succeeded")
    object_id: str = Field(min_length=1, description="The provider's object, e.g. ch_...")
    key: str | None = Field(None, description="Our idempotency key, from the object's metadata")
    outcome: Literal[Outcome.DONE, Outcome.NOT_DONE] | None = Field(
        None, description="What the provider's declared mapping says this event type means for "
                          "the effect our key names (None: it says nothing). A tool that reads "
                          "webhooks itself decides instead")
    task_id: TaskId | None = Field(None, description="The task our key names, if any")
    payload: dict[str, JsonValue] = Field(description="The provider's event, whole")
    signed_at: Instant = Field(description="The signature's timestamp (t=)")
    received_at: Instant
    journal_partition: int | None = Field(
        None, ge=0, description="The journal partition of the task our key names")
    journal_offset: int | None = Field(
        None, ge=0,
        description="The end offset of that journal partition when the gateway received the "
                    "webhook. A provider cannot know our key before we send it, so the webhook "
                    "is evidence only about an attempt journaled below this offset; anything "
                    "else is an orphan, quarantined and never applied")

    def record_key(self) -> bytes:
        return (self.task_id or self.object_id).encode()


def parse_webhook(raw: bytes | str) -> WebhookReceived:
    return WebhookReceived.model_validate_json(raw)
