"""The journal: Kafka topics as the system of record (the imperative shell around the core)."""

from halfway.journal.admin import ensure_topics
from halfway.journal.reader import EventConsumer
from halfway.journal.records import Delivery, InvalidRecord
from halfway.journal.replay import ReplayResult, read_topic, replay
from halfway.journal.writer import JournalWriter

__all__ = [
    "Delivery",
    "EventConsumer",
    "InvalidRecord",
    "JournalWriter",
    "ReplayResult",
    "ensure_topics",
    "read_topic",
    "replay",
]
