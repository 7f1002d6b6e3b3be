"""The outcomes publisher's sends are refused for a while: it tries again, backing off, goes on
reading the journal meanwhile, and sends every message once the broker takes them.

Against the real broker, with the publisher in this process and journal events written by hand
(the helpers of `test_outcomes_sealing`).
"""

from __future__ import annotations

from typing import Any

import pytest
from aiokafka.errors import KafkaTimeoutError

from halfway.client import OutcomeStream
from halfway.contract.outcomes import OutcomeChanged
from halfway.contract.topics import OUTCOMES
from halfway.journal import JournalWriter
from halfway.outcomes import OutcomesPublisher, messages
from tests.test_outcomes_sealing import (
    HOUR,
    T0,
    deployment,
    done_task,
    idle,
    on_topic,
    one_partition,
    publishing,
    until,
    until_seen,
)

pytestmark = pytest.mark.broker


class Refusing:
    """The publisher's outcome sends fail while `on` (the broker refuses them), counted."""

    def __init__(self, publisher: OutcomesPublisher) -> None:
        self.on = True
        self.refused = 0
        writer = publisher.writer
        original = writer.append_raw

        async def append_raw(spec: Any, value: bytes | None, **kw: Any) -> Any:
            if spec is OUTCOMES and self.on:
                self.refused += 1
                raise KafkaTimeoutError("not sent (the test's broker refuses it)")
            return await original(spec, value, **kw)

        writer.append_raw = append_raw  # type: ignore[method-assign]


async def test_sends_refused_for_a_while_go_out_later_and_the_journal_is_read_meanwhile(
        kafka_settings: Any) -> None:
    """Two tasks' sends fail in one batch, and again when tried later (on Python 3.11, a
    TaskGroup's failure here once left the fold's task cancelled-looking, and the next wake of
    its fetch ended it: the publisher ran on and told nothing more). Once the broker takes
    them, every message goes out once, and a task that came later is told too."""
    partition, ids = one_partition(["one", "two", "later"], kafka_settings.partitions)
    logs = {ids["one"]: done_task(ids["one"], T0), ids["two"]: done_task(ids["two"], T0),
            ids["later"]: done_task(ids["later"], T0 + HOUR)}
    told = {t: messages(log, t) for t, log in logs.items()}
    async with (deployment(kafka_settings) as settings, JournalWriter(settings) as journal,
                publishing(settings) as (publisher, changed),
                OutcomeStream(settings, None, from_beginning=True) as stream):
        refusing = Refusing(publisher)
        await journal.append_all([*logs[ids["one"]], *logs[ids["two"]]])
        # Each task refused once, then again by a later try: the fold's loop was woken for
        # the tries and lived on.
        await until(changed, lambda: refusing.refused >= 4, "both tasks' sends tried again")
        refusing.on = False
        seen: dict[str, OutcomeChanged] = {}
        await until_seen(stream, seen, [*told[ids["one"]], *told[ids["two"]]],
                         "the refused messages, once the broker takes them")
        await journal.append_all(logs[ids["later"]])
        await until_seen(stream, seen, told[ids["later"]], "the later task's messages")
        await until(changed, lambda: idle(publisher), "the publisher has sent everything")
        topic = await on_topic(settings, partition)
        for task_id, wanted in told.items():
            assert topic.get(task_id) == wanted, task_id
