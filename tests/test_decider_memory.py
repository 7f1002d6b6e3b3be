"""What a decider keeps per task beside the fold follows the tasks it owns and that wait: not
every task that ever waited, failed to place a step, or released a claim.

Driven without a broker: the decider is built, never started, and its partitions are set by
hand, as `tests.followers.unstarted` does for a follower.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import pytest
from aiokafka import TopicPartition

from halfway.contract import SubjectHeld
from halfway.contract.topics import JOURNAL
from halfway.decider.service import Decider
from halfway.journal import JournalWriter
from halfway.journal.follower import _Partition
from halfway.journal.records import partition_of
from halfway.models import ScriptedModel
from halfway.settings import KafkaSettings
from halfway.tools.registry import Registry

SETTINGS = KafkaSettings(bootstrap="127.0.0.1:1", topic_prefix="mem.", replication_factor=1)
PARTITIONS = 2


def journal_tp(task_id: str) -> TopicPartition:
    return TopicPartition(JOURNAL.name(SETTINGS.topic_prefix),
                          partition_of(task_id.encode(), PARTITIONS))


@pytest.fixture
async def decider() -> AsyncIterator[Decider]:
    writer = JournalWriter(SETTINGS)
    made = Decider(SETTINGS, Registry([]), ScriptedModel(), writer)
    for p in range(PARTITIONS):
        tp = TopicPartition(JOURNAL.name(SETTINGS.topic_prefix), p)
        made.follower._partitions[tp] = _Partition(end_at_assign=0, applied_to=-1,
                                                   caught_up=True)
    yield made
    for timer in made._timers.values():
        timer.cancel()
    await made.follower.stop()
    await made.guards.stop()
    await writer.stop()


def held(subject: str) -> SubjectHeld:
    return SubjectHeld(subject=subject, tool="charge_customer", holder="other-1:1")


def task_ids(count: int) -> list[str]:
    return [f"t-{i}" for i in range(count)]


def own(decider: Decider, tasks: list[str]) -> None:
    for task_id in tasks:
        decider.follower._partitions[journal_tp(task_id)].tasks.add(task_id)


async def test_a_task_waits_for_one_subject_and_an_ended_wait_keeps_nothing(
        decider: Decider) -> None:
    tasks = task_ids(50)
    own(decider, tasks)
    until = datetime.now(UTC) + timedelta(hours=1)
    for task_id in tasks:
        decider._wait(task_id, held("invoice:A"), until)
        decider._wait(task_id, held("invoice:B"), until)  # refused for another subject since
    assert set(decider._waiting) == {("charge_customer", "invoice:B")}
    for task_id in tasks[:10]:
        decider._stop_waiting(task_id)  # as when the task ends
    assert list(decider._waiting[("charge_customer", "invoice:B")]) == tasks[10:]  # in order
    assert set(decider._waits_on) == set(tasks[10:])


async def test_a_revoked_partitions_tasks_leave_nothing_behind(decider: Decider) -> None:
    tasks = task_ids(200)
    own(decider, tasks)
    until = datetime.now(UTC) + timedelta(hours=1)
    for task_id in tasks:
        decider._wait(task_id, held(f"invoice:{task_id}"), until)
        decider._place_failures[(task_id, 1)] = 3
        decider._released[task_id] = {"claim"}
    revoked = TopicPartition(JOURNAL.name(SETTINGS.topic_prefix), 0)
    decider.follower._partitions.pop(revoked)  # what the follower drops before it says so
    decider._forget_revoked({0})
    kept = {t for t in tasks if journal_tp(t).partition == 1}
    assert 0 < len(kept) < len(tasks)
    assert {t for waiting in decider._waiting.values() for t in waiting} == kept
    assert set(decider._waits_on) == kept
    assert {t for t, _ in decider._place_failures} == kept
    assert set(decider._released) == kept
    assert set(decider._timers) == kept

