"""A decider asks at most MODEL_CALLS_MAX questions at once; the rest wait for a slot in order,
each as a key in a queue, not as a task of its own, and none is asked twice.

Driven without a broker, as `test_decider_memory.py` does: the decider is built, never
started, its partitions and folds set by hand, and what it journals recorded.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator

import pytest
from aiokafka import TopicPartition
from prometheus_client import REGISTRY

from halfway.contract import Event, TaskFinished
from halfway.contract.topics import JOURNAL
from halfway.core.decide import Ask
from halfway.core.fold import TaskState, apply
from halfway.decider import service
from halfway.decider.service import MODEL_CALLS_MAX, Decider
from halfway.journal import JournalWriter
from halfway.journal.follower import _Partition
from halfway.journal.records import partition_of
from halfway.models import ProposeFinish
from halfway.models.base import History
from halfway.settings import KafkaSettings
from halfway.tools.registry import Registry
from tests.factories import Stamper

SETTINGS = KafkaSettings(bootstrap="127.0.0.1:1", topic_prefix="questions.",
                         replication_factor=1)
PARTITIONS = 2
TASKS = MODEL_CALLS_MAX * 3 + 7


class HeldModel:
    """Answers "finish" once released; counts the questions it is asked at once."""

    name = "held"
    version = None

    def __init__(self) -> None:
        self.asked: list[str] = []
        self.release = asyncio.Event()
        self.in_flight = 0
        self.most_in_flight = 0

    async def decide(self, history: History) -> ProposeFinish:
        self.asked.append(history.task_id)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await self.release.wait()
        finally:
            self.in_flight -= 1
        return ProposeFinish(summary="done")


@pytest.fixture
async def decider() -> AsyncIterator[Decider]:
    writer = JournalWriter(SETTINGS)
    made = Decider(SETTINGS, Registry([]), HeldModel(), writer)
    topic = JOURNAL.name(SETTINGS.topic_prefix)
    for p in range(PARTITIONS):
        made.follower._partitions[TopicPartition(topic, p)] = _Partition(
            end_at_assign=0, applied_to=-1, caught_up=True)
    yield made
    for task in made._asking.values():
        if task is not None:
            task.cancel()
    for timer in made._timers.values():
        timer.cancel()
    await made.follower.stop()
    await made.guards.stop()
    await writer.stop()


def started_tasks(decider: Decider, count: int) -> list[str]:
    """`count` started tasks the decider owns and holds, each waiting for its first step."""
    topic = JOURNAL.name(SETTINGS.topic_prefix)
    task_ids = [f"q-{i}" for i in range(count)]
    for task_id in task_ids:
        tp = TopicPartition(topic, partition_of(task_id.encode(), PARTITIONS))
        decider.follower._partitions[tp].tasks.add(task_id)
        decider.follower.states[task_id] = apply(TaskState(task_id=task_id),
                                                 Stamper(task_id).started())
    return task_ids


def asking_tasks(decider: Decider) -> list[asyncio.Task[object]]:
    """The loop's tasks running this decider's `_ask` (the session's loop has others)."""
    out = []
    for task in asyncio.all_tasks():
        coro = task.get_coro()
        frame = getattr(coro, "cr_frame", None)
        if getattr(coro, "__qualname__", "") == "Decider._ask" and frame is not None and \
                frame.f_locals.get("self") is decider:
            out.append(task)
    return out


def waiting_gauge() -> float:
    value = REGISTRY.get_sample_value("halfway_model_questions_waiting")
    assert value is not None
    return value


async def answered(decider: Decider) -> None:
    """Until every question asked or queued is answered (each ends by starting the next)."""
    async with asyncio.timeout(30):
        while decider._asking:
            running = [task for task in decider._asking.values() if task is not None]
            assert running, "questions left queued with none asked"
            await asyncio.gather(*running)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_questions_past_the_slots_wait_in_order_as_keys_and_each_is_asked_once(
        decider: Decider, monkeypatch: pytest.MonkeyPatch) -> None:
    model = decider.model
    assert isinstance(model, HeldModel)
    written: list[Event] = []

    async def write(event: Event, carry: object = None) -> None:
        written.append(event)

    monkeypatch.setattr(decider, "_write", write)
    task_ids = started_tasks(decider, TASKS)
    waiting_before = waiting_gauge()

    for task_id in task_ids:
        assert decider._decide(decider._state(task_id)) == Ask(1)
        await decider._make(task_id, Ask(1))
    await settle()
    assert model.in_flight == MODEL_CALLS_MAX
    # The others are keys, not tasks.
    assert len(asking_tasks(decider)) == MODEL_CALLS_MAX
    assert sum(task is not None for task in decider._asking.values()) == MODEL_CALLS_MAX
    assert len(decider._asking) == TASKS
    assert waiting_gauge() - waiting_before == TASKS - MODEL_CALLS_MAX

    for task_id in task_ids:  # news of every task: nothing is asked or queued twice
        await decider._make(task_id, Ask(1))
    await settle()
    assert len(model.asked) == MODEL_CALLS_MAX
    assert len(decider._queued) == TASKS - MODEL_CALLS_MAX

    model.release.set()
    await answered(decider)
    assert model.asked == task_ids  # the queue is first in, first out
    assert Counter(model.asked).most_common(1)[0][1] == 1
    assert model.most_in_flight == MODEL_CALLS_MAX
    assert sorted(e.task_id for e in written if isinstance(e, TaskFinished)) == \
        sorted(task_ids)
    assert decider._asks_running == 0
    assert waiting_gauge() == waiting_before


async def test_a_queued_question_of_a_task_no_longer_owned_is_not_asked(
        decider: Decider, monkeypatch: pytest.MonkeyPatch) -> None:
    model = decider.model
    assert isinstance(model, HeldModel)
    monkeypatch.setattr(service, "MODEL_CALLS_MAX", 1)
    first, gone = started_tasks(decider, 2)
    await decider._make(first, Ask(1))
    await decider._make(gone, Ask(1))
    await settle()
    assert model.asked == [first]
    for part in decider.follower._partitions.values():  # its partition revoked meanwhile
        part.tasks.discard(gone)
    monkeypatch.setattr(decider, "_write", lambda *_: asyncio.sleep(0))
    model.release.set()
    await answered(decider)
    assert model.asked == [first]


@pytest.mark.parametrize("journal_down", [False, True])
async def test_a_move_that_keeps_failing_ends_the_task_needing_attention_unless_the_journal_is_down(
        decider: Decider, monkeypatch: pytest.MonkeyPatch, journal_down: bool) -> None:
    """A proposal that raises while it is placed (a bug, a tool's schema that raises) is not
    asked again for ever, a paid question each time: after PLACE_FAILURES_MAX in a row the
    task ends needing attention, saying why. The journal not answering is waited out."""
    from aiokafka.errors import KafkaConnectionError

    model = decider.model
    assert isinstance(model, HeldModel)
    model.release.set()
    written: list[Event] = []
    retries: list[float] = []

    async def write(event: Event, carry: object = None) -> None:
        written.append(event)

    async def place(*_: object) -> None:
        raise KafkaConnectionError("no broker") if journal_down else RuntimeError("x" * 10_000)

    monkeypatch.setattr(decider, "_write", write)
    monkeypatch.setattr(decider, "_place", place)
    monkeypatch.setattr(decider, "_wake_in", lambda _task, in_s: retries.append(in_s))
    [task_id] = started_tasks(decider, 1)
    for _ in range(service.PLACE_FAILURES_MAX + 2):
        if written:
            break
        await decider._make(task_id, Ask(1))
        await answered(decider)
    if journal_down:
        assert written == []
        assert len(retries) == service.PLACE_FAILURES_MAX + 2
        return
    [ended] = written
    assert isinstance(ended, TaskFinished)
    assert ended.state == "needs_attention"
    assert ended.summary.startswith("halfway could not move this task: RuntimeError: xxx")
    assert len(ended.summary) <= 1_100
    assert len(model.asked) == service.PLACE_FAILURES_MAX
    assert len(retries) == service.PLACE_FAILURES_MAX - 1
