"""GuardView: the subject guard's shell. Claims, waits for the log's verdict, releases.

Every decider instance reads every partition of the guards topic from the start (no consumer
group: the guard is shared by all instances, not split among them) and folds it into one
`GuardBook` (`halfway.core.guard`). To claim, it appends a `subject.claimed` keyed by subject
and waits until its own fold has applied that offset: the verdict is then what the log order
says, the same in every instance. Nothing about the guard lives only in a process: a restart
folds the topic again.

Invalid records go to the dead-letter topic with the reason (each instance that reads one
writes the letter, keyed by its source, so copies are recognisable) and never stop the fold.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import UTC, datetime

from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.structs import ConsumerRecord

from halfway import log
from halfway.contract.events import new_event_id
from halfway.contract.guards import GuardRecord, Release, SubjectClaimed, SubjectReleased
from halfway.contract.topics import GUARDS
from halfway.core.guard import GuardBook, Verdict
from halfway.journal.admin import topic_partitions
from halfway.journal.deadletters import send_dead_letter
from halfway.journal.limits import fetch_limits
from halfway.journal.records import InvalidRecord, decode_guard
from halfway.journal.writer import JournalWriter
from halfway.settings import KafkaSettings

FETCH_TIMEOUT_MS = 100
FETCH_RECORDS_MAX = 1000
# A claim's verdict (or the first catch-up) takes one round trip to a healthy broker; past
# this, something is wrong and the claim fails (the step stays undecided and is asked again).
WAIT_S_MAX = 60.0


class GuardView:
    def __init__(self, settings: KafkaSettings, writer: JournalWriter, *,
                 on_record: Callable[[GuardRecord], None] | None = None) -> None:
        self.settings = settings
        self.writer = writer
        self.book = GuardBook()
        self._on_record = on_record  # told of every record folded (after the book has it)
        self._topic = GUARDS.name(settings.topic_prefix)
        self._consumer = AIOKafkaConsumer(**settings.client(),
                                          enable_auto_commit=False,
                                          isolation_level="read_committed",
                                          **fetch_limits())
        self._next: dict[int, int] = {}  # partition -> next offset to apply
        self._ends_at_start: dict[int, int] = {}
        self._wanted: dict[str, Verdict | None] = {}  # claim event id -> its verdict, once read
        self._progress = asyncio.Condition()
        self._log = log.get("halfway.guard")

    async def start(self) -> None:
        await self._consumer.start()
        partitions = [TopicPartition(self._topic, p)
                      for p in sorted(await topic_partitions(self.settings,
                                                             self._topic))]
        self._consumer.assign(partitions)
        await self._consumer.seek_to_beginning(*partitions)
        ends = await self._consumer.end_offsets(partitions)
        self._ends_at_start = {tp.partition: end for tp, end in ends.items()}
        self._next = {tp.partition: 0 for tp in partitions}

    async def stop(self) -> None:
        await self._consumer.stop()

    async def run(self) -> None:
        """Fold the guards topic until cancelled."""
        while True:
            await asyncio.sleep(0)  # a prefetched fetch never suspends: let heartbeats run
            batches = await self._consumer.getmany(timeout_ms=FETCH_TIMEOUT_MS,
                                                   max_records=FETCH_RECORDS_MAX)
            for tp, records in batches.items():
                for record in records:
                    await self._apply(record)
                    self._next[tp.partition] = record.offset + 1
            if batches:
                async with self._progress:
                    self._progress.notify_all()

    async def caught_up(self) -> None:
        """Wait until everything written before `start` is folded: only then is a "free"
        subject really free."""
        await self._until(lambda: all(self._next[p] >= end
                                      for p, end in self._ends_at_start.items()))

    async def claim(self, claim: SubjectClaimed) -> Verdict:
        """Append the claim and return the verdict the log gives it."""
        self._wanted[claim.event_id] = None
        try:
            meta = await self.writer.append_raw(GUARDS, claim.model_dump_json().encode(),
                                                key=claim.record_key())
            await self._until(lambda: self._next.get(meta.partition, 0) > meta.offset)
            verdict = self._wanted[claim.event_id]
            assert verdict is not None, "a claim folded without a verdict"
            return verdict
        finally:
            del self._wanted[claim.event_id]

    async def release(self, claim: SubjectClaimed, release: Release) -> None:
        record = SubjectReleased(event_id=new_event_id(), at=datetime.now(UTC),
                                 subject=claim.subject, tool=claim.tool, step_id=claim.step_id,
                                 task_id=claim.task_id, release=release,
                                 claim_id=claim.event_id)
        await self.writer.append_raw(GUARDS, record.model_dump_json().encode(),
                                     key=record.record_key())
        self._log.info("released", subject=claim.subject, step_id=claim.step_id,
                       release=release)

    async def _until(self, ready: Callable[[], bool]) -> None:
        async with asyncio.timeout(WAIT_S_MAX), self._progress:
            await self._progress.wait_for(ready)

    async def _apply(self, record: ConsumerRecord) -> None:
        try:
            guard = decode_guard(record)
        except InvalidRecord as exc:
            # Retried, then skipped with an error logged if it cannot be written: the fold
            # (and every claim's verdict behind this record) must go on.
            await send_dead_letter(self.writer, record, exc.reason, group=None,
                                   logger=self._log)
            return
        verdict = self.book.apply(guard)
        if isinstance(guard, SubjectClaimed) and guard.event_id in self._wanted:
            self._wanted[guard.event_id] = verdict
        if self._on_record is not None:
            self._on_record(guard)
