"""The Python client: start a task, follow its outcomes, rebuild its state from the journal.

    from halfway.client import HalfwayClient

    async with HalfwayClient() as client:  # where Kafka is: the HALFWAY_* variables
        await client.start_task("renewal-8812", {"invoice": "INV-2291"}, ["charge_customer"])
        async with client.outcomes("renewal-8812") as outcomes:
            async for message in outcomes:
                print(message.words)  # "unknown, being checked: ...; next check at 09:00:07Z"
                if message.finished:
                    break
        state = await client.task_state("renewal-8812")  # the fold of the journal, no database

Everything here talks to Kafka only: the tasks topic (requests), the outcomes topic (what users
see) and the journal (the system of record). It needs no read model and no running service but
the ones that do the work (and, for `outcomes`, the outcomes publisher).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from types import TracebackType
from typing import Self

from aiokafka import AIOKafkaConsumer, TopicPartition
from pydantic import JsonValue, ValidationError

from halfway import log
from halfway.contract import TaskAborted, TaskPolicy, TaskRequested
from halfway.contract.ids import TASK_ID_PATTERN, is_task_id
from halfway.contract.outcomes import OutcomeChanged, parse_outcome
from halfway.contract.topics import JOURNAL, OUTCOMES, TASKS
from halfway.core.fold import TaskState, TaskStatus, apply
from halfway.finite import refuse_non_finite
from halfway.journal import JournalWriter
from halfway.journal.admin import topic_partitions
from halfway.journal.limits import fetch_limits
from halfway.journal.records import InvalidRecord, decode, partition_of, stamp
from halfway.journal.replay import task_state as replay_task_state
from halfway.settings import KafkaSettings

__all__ = ["HalfwayClient", "OutcomeStream"]

FETCH_TIMEOUT_MS = 500
# Subjects (a task's steps, undos and the task itself) whose last seq a stream keeps, newest
# first: a subscriber to every task would otherwise keep one per subject ever seen.
SUBJECTS_KEPT = 100_000


class HalfwayClient:
    """The small public surface callers meet. Use it as an async context manager."""

    def __init__(self, settings: KafkaSettings | None = None) -> None:
        self.settings = settings or KafkaSettings.from_env("caller")
        self._writer: JournalWriter | None = None

    async def __aenter__(self) -> Self:
        writer = JournalWriter(self.settings)
        await writer.start()
        self._writer = writer
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._writer is not None:
            await self._writer.stop()
            self._writer = None

    async def start_task(self, task_id: str, input: dict[str, JsonValue],
                         allowed_tools: list[str], policy: TaskPolicy | None = None,
                         ) -> TaskRequested:
        """Ask for a task. Requesting the same task id again starts it once (the first request
        counts). Returns once the broker has the request. ValueError if a number in `input`
        is NaN or infinite (not JSON)."""
        if self._writer is None:
            raise RuntimeError("use the client as `async with HalfwayClient() as client:`")
        refuse_non_finite(input)  # the API's check: the journal would keep NaN as null
        # Stamped once: a retried send carries the same event id and time.
        request = TaskRequested(**stamp(task_id), input=input, allowed_tools=allowed_tools,
                                policy=policy or TaskPolicy())
        await self._writer.append(request, TASKS)
        return request

    async def abort_task(self, task_id: str, reason: str, by: str = "caller") -> TaskAborted:
        """Call a started task off: no new step is decided, steps in flight settle, and a saga
        undoes what is done. Raises `halfway.resolve.ResolveRefused` if the task has not
        started, has finished, or was called off already."""
        from aiokafka.errors import TopicAuthorizationFailedError

        from halfway.resolve import abort_task

        try:
            return await abort_task(self.settings, task_id, reason=reason, by=by)
        except TopicAuthorizationFailedError:
            raise PermissionError(
                f"the Kafka principal {self.settings.principal or '(none)'} may not journal "
                "task.aborted: calling a task off is an operator's act (callers only request "
                "tasks). Use HalfwayClient(KafkaSettings.from_env(\"operator\")), `halfway "
                "abort`, or the API's POST /api/tasks/{task_id}/abort") from None

    def outcomes(self, task_id: str | None = None, *, from_beginning: bool = True,
                 ) -> OutcomeStream:
        """The outcomes topic as an async iterator: one task's messages (or every task's), in
        order, each message once. `from_beginning=False` starts at the end the topic has when
        the stream starts (`async with`, or the first `async for` step)."""
        return OutcomeStream(self.settings, None if task_id is None else _checked(task_id),
                             from_beginning=from_beginning)

    async def task_state(self, task_id: str) -> TaskState:
        """The task's state, folded from its journal partition (no read model involved)."""
        return await replay_task_state(self.settings, _checked(task_id))

    async def wait_finished(self, task_id: str, timeout_s: float) -> TaskState:
        """The task's state once it is finished or rejected, read from the journal.
        TimeoutError after `timeout_s` (a task waiting for an operator does not finish)."""
        task_id = _checked(task_id)
        async with asyncio.timeout(timeout_s):
            return await _follow_until_over(self.settings, task_id)


def _checked(task_id: str) -> str:
    """`task_id`, or ValueError: no task can have another id, so nothing is read for it."""
    if not is_task_id(task_id):
        raise ValueError(f"{task_id[:60]!r} is not a task id (it must match "
                         f"{TASK_ID_PATTERN})")
    return task_id


class OutcomeStream:
    """Messages of the outcomes topic, deduped, in order per task.

    Dedupe: message ids are `{task_id}/{about}/{seq}` and a subject's messages are published in
    seq order, so keeping a message only when its seq is higher than the last one seen for its
    subject drops exactly the repeated ids, with memory per subject instead of per message.
    The newest SUBJECTS_KEPT subjects are kept: a repeat of a message about an older one (a
    publisher that restarted long after) is delivered again, with its id, for the caller's own
    dedupe (delivery is at least once)."""

    def __init__(self, settings: KafkaSettings, task_id: str | None, *,
                 from_beginning: bool) -> None:
        self.settings = settings
        self.task_id = task_id
        self.from_beginning = from_beginning
        self._consumer: AIOKafkaConsumer | None = None
        self._ready: deque[OutcomeChanged] = deque()
        self._last_seq: OrderedDict[str, int] = OrderedDict()  # least recently changed first
        self._log = log.get("halfway.client")

    async def start(self) -> Self:
        """Connect and take the starting position; idempotent."""
        if self._consumer is not None:
            return self
        topic = OUTCOMES.name(self.settings.topic_prefix)
        count = await _partition_count(self.settings, topic)
        numbers = (range(count) if self.task_id is None
                   else [partition_of(self.task_id.encode(), count)])
        consumer = AIOKafkaConsumer(**self.settings.client(), group_id=None,
                                    enable_auto_commit=False, isolation_level="read_committed",
                                    **fetch_limits())
        await consumer.start()
        tps = [TopicPartition(topic, p) for p in numbers]
        consumer.assign(tps)
        if self.from_beginning:
            await consumer.seek_to_beginning(*tps)
        else:
            await consumer.seek_to_end(*tps)
            for tp in tps:  # resolve the end now, not at the first fetch
                await consumer.position(tp)
        self._consumer = consumer
        return self

    async def aclose(self) -> None:
        if self._consumer is not None:
            await self._consumer.stop()
            self._consumer = None

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> OutcomeChanged:
        consumer = self._consumer or (await self.start())._consumer
        assert consumer is not None
        # A subscription waits for the next message as long as its caller does: bound it with
        # asyncio.timeout around the iteration.
        while not self._ready:
            batches = await consumer.getmany(timeout_ms=FETCH_TIMEOUT_MS)
            for records in batches.values():
                for record in records:
                    self._take(record.value, record.partition, record.offset)
        return self._ready.popleft()

    def _take(self, value: bytes | None, partition: int, offset: int) -> None:
        try:
            message = parse_outcome(value or b"")
        except ValidationError as exc:
            self._log.warning("invalid outcome record skipped", partition=partition,
                              offset=offset, reason=str(exc)[:500])
            return
        if self.task_id is not None and message.task_id != self.task_id:
            return
        subject = f"{message.task_id}/{message.about}"
        last = self._last_seq
        if message.seq <= last.get(subject, 0):
            return  # a duplicate: its id was delivered already
        last[subject] = message.seq
        last.move_to_end(subject)
        if len(last) > SUBJECTS_KEPT:
            last.popitem(last=False)
        self._ready.append(message)


async def _follow_until_over(settings: KafkaSettings, task_id: str) -> TaskState:
    """Fold the task's journal partition from the beginning until it is finished or rejected."""
    topic = JOURNAL.name(settings.topic_prefix)
    count = await _partition_count(settings, topic)
    tp = TopicPartition(topic, partition_of(task_id.encode(), count))
    consumer = AIOKafkaConsumer(**settings.client(), group_id=None,
                                enable_auto_commit=False, isolation_level="read_committed",
                                **fetch_limits())
    await consumer.start()
    state = TaskState(task_id=task_id)
    try:
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        # Bounded by the caller's timeout (wait_finished).
        while state.status not in (TaskStatus.FINISHED, TaskStatus.REJECTED):
            batches = await consumer.getmany(tp, timeout_ms=FETCH_TIMEOUT_MS)
            for record in batches.get(tp, []):
                with contextlib.suppress(InvalidRecord):  # the services dead-letter those
                    event = decode(record, count)
                    if event.task_id == task_id:
                        state = apply(state, event)
        return state
    finally:
        await consumer.stop()


async def _partition_count(settings: KafkaSettings, topic: str) -> int:
    return len(await topic_partitions(settings, topic))
