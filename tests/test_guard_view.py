"""The guard view against the real broker: claims get the log's verdict, every instance agrees,
a restart folds the same answer, and a poison record is dead-lettered without stopping it."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import UTC, datetime

import pytest

from halfway.contract import DeadLetter
from halfway.contract.guards import Release, SubjectClaimed
from halfway.contract.topics import DEAD_LETTERS, GUARDS
from halfway.core.guard import Blocked, Granted
from halfway.journal import JournalWriter
from halfway.journal.guards import GuardView
from halfway.settings import KafkaSettings
from tests.test_journal import raw_records

pytestmark = pytest.mark.broker


def claim(step: str, subject: str) -> SubjectClaimed:
    return SubjectClaimed(event_id=uuid.uuid4().hex, at=datetime.now(UTC), subject=subject,
                          tool="charge_customer", step_id=step,
                          task_id=step.rsplit(":", 1)[0], once_per_subject=True)


@asynccontextmanager
async def view(settings: KafkaSettings, writer: JournalWriter) -> AsyncIterator[GuardView]:
    guards = GuardView(settings, writer)
    await guards.start()
    fold = asyncio.create_task(guards.run())
    try:
        await guards.caught_up()
        yield guards
    finally:
        fold.cancel()
        await guards.stop()


async def test_two_views_racing_for_a_subject_agree_on_one_holder(
        topics: KafkaSettings, writer: JournalWriter) -> None:
    subject = f"invoice:{uuid.uuid4().hex[:8]}"
    async with view(topics, writer) as one, view(topics, writer) as two:
        a, b = claim(f"race-a-{subject[-8:]}:1", subject), claim(f"race-b-{subject[-8:]}:1",
                                                                  subject)
        verdicts = await asyncio.gather(one.claim(a), two.claim(b))
        assert sorted(type(v).__name__ for v in verdicts) == ["Blocked", "Granted"]
        winner = a if verdicts[0] == Granted() else b
        # Each view folded both claims: both name the same holder.
        assert winner.step_id in one.book.held_by(winner.task_id)
        assert winner.step_id in two.book.held_by(winner.task_id)
        await one.release(winner, Release.DONE)
        again = claim(f"race-c-{subject[-8:]}:1", subject)
        verdict = await two.claim(again)
        assert isinstance(verdict, Blocked)
        assert "already did charge_customer" in verdict.reason
    # A fresh view (a restarted decider) folds the same answer from the topic alone.
    async with view(topics, writer) as fresh:
        late = await fresh.claim(claim(f"race-d-{subject[-8:]}:1", subject))
        assert late == Blocked(f"blocked: {winner.step_id} already did charge_customer on "
                               f"{subject}; charge_customer happens once per subject")


async def test_a_poison_guard_record_is_dead_lettered_and_the_fold_goes_on(
        topics: KafkaSettings, writer: JournalWriter) -> None:
    subject = f"invoice:{uuid.uuid4().hex[:8]}"
    async with view(topics, writer) as guards:
        await writer.append_raw(GUARDS, b'{"type": "subject.claimed", "subject": 1}',
                                key=subject.encode())
        # Behind the poison record, in its partition: the claim still gets its verdict.
        assert await guards.claim(claim(f"after-poison-{subject[-8:]}:1", subject)) == Granted()
    (letter,) = await raw_records(
        topics, DEAD_LETTERS, 1,
        keep=lambda r: DeadLetter.model_validate_json(r.value).key == subject)
    parsed = DeadLetter.model_validate_json(letter.value)
    assert parsed.source_topic == GUARDS.name(topics.topic_prefix)
    assert "invalid event" in parsed.reason
