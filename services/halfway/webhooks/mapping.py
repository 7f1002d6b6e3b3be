"""What a provider's event means to us, declared as data: where its id, its type, the provider's
object (the evidence id) and our idempotency key are in the event's JSON, and which event types
say the effect is `done` or `not_done`.

Places are dotted paths through JSON objects (`data.object.metadata.halfway_key`); lists are
not walked. An event type the mapping does not list says nothing about the outcome: the event
is still published (a tool's own reader may understand it), with no outcome.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

PATH_SEGMENTS_MAX = 16
EVENT_TYPES_MAX = 64

JsonPath = Annotated[str, StringConstraints(
    max_length=256, pattern=rf"^[^.\s]+(\.[^.\s]+){{0,{PATH_SEGMENTS_MAX - 1}}}$")]
EventType = Annotated[str, StringConstraints(min_length=1, max_length=200)]
DeclaredOutcome = Literal["done", "not_done"]


class EventMapping(BaseModel):
    """How to read one provider's events (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    events: dict[EventType, DeclaredOutcome] = Field(
        min_length=1, max_length=EVENT_TYPES_MAX,
        description="event type -> what it says of the effect our key names")
    key: JsonPath = Field(description="where our idempotency key is, e.g. "
                                      "data.object.metadata.halfway_key")
    object_id: JsonPath = Field(description="the provider's object the event is about: the "
                                            "evidence id a settlement keeps, e.g. data.object.id")
    event_id: JsonPath | None = Field(
        None, description="where the event's id is (it dedupes redeliveries); null: the id the "
                          "delivery carries in a header (Standard Webhooks' webhook-id)")
    event_type: JsonPath = Field("type", description="where the event's type is")


class Unreadable(ValueError):
    """The event lacks what its provider's mapping says it has; `reason` says which."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class MappedEvent:
    event_id: str
    event_type: str
    object_id: str
    key: Any  # as found (None if absent): the gateway decides whether it is one of ours
    outcome: DeclaredOutcome | None  # None: the mapping says nothing about this event type


def find(event: dict[str, Any], path: str) -> Any:
    """The value at the dotted `path`, or None where the path leaves the JSON objects."""
    node: Any = event
    for name in path.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(name)
    return node


def _text(event: dict[str, Any], path: str) -> str:
    value = find(event, path)
    if not isinstance(value, str) or not value:
        raise Unreadable(f"the event has no {path} (a non-empty string)")
    return value


def read(mapping: EventMapping, event: dict[str, Any], delivery_id: str | None) -> MappedEvent:
    """`event` read through `mapping`; `delivery_id` is the id a header carried, if any.
    Unreadable if an id, the type or the object id is missing."""
    if mapping.event_id is not None:
        event_id = _text(event, mapping.event_id)
    elif delivery_id:
        event_id = delivery_id
    else:
        raise Unreadable("the delivery carries no event id")
    event_type = _text(event, mapping.event_type)
    object_id = _text(event, mapping.object_id)
    return MappedEvent(event_id, event_type, object_id, find(event, mapping.key),
                       mapping.events.get(event_type))
