"""Followers that are never started, for unit tests: records go to their fold path directly.

`unstarted(...)` makes one with the given partitions owned (caught up or not); the autouse
fixture in conftest closes every one made, after each test.
"""

from __future__ import annotations

from typing import Any

from aiokafka import TopicPartition

from halfway.journal.follower import JournalFollower, _Partition
from halfway.journal.writer import JournalWriter
from halfway.settings import KafkaSettings

MADE: list[tuple[JournalFollower, JournalWriter]] = []


async def _nothing(_tasks: set[str]) -> None:
    return None


def unstarted(settings: KafkaSettings, group: str, owned: list[TopicPartition], *,
              applied_to: int = -1, caught_up: bool = False, **options: Any) -> JournalFollower:
    writer = JournalWriter(settings)
    f = JournalFollower(settings, group=group, writer=writer, on_change=_nothing, **options)
    for tp in owned:
        f._partitions[tp] = _Partition(end_at_assign=0, applied_to=applied_to,
                                       caught_up=caught_up)
    MADE.append((f, writer))
    return f


async def close_made() -> None:
    while MADE:
        f, writer = MADE.pop()
        await f.stop()
        await writer.stop()
