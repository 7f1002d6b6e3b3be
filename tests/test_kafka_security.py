"""Kafka authentication and ACLs on the real broker: who may write what, and the audit's three
forgeries refused by the broker or ignored by the fold, with the reason where people look.

The broker is the suite's (`infra/dev up`: SASL_PLAINTEXT with SCRAM-SHA-512, StandardAuthorizer,
nothing allowed without an ACL); every process connects as the principal of its kind. These
tests fail, never skip, against a broker without them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import pytest
from aiokafka.conn import create_conn
from aiokafka.errors import KafkaConnectionError, SaslAuthenticationFailed
from aiokafka.errors import TopicAuthorizationFailedError as Refused
from aiokafka.partitioner import murmur2

from halfway.contract import (
    DecidedBy,
    EffectClass,
    Outcome,
    SettlementSource,
    StepIntended,
    StepSettled,
    TaskRequested,
)
from halfway.contract.ids import mint_key, step_id
from halfway.contract.outcomes import OutcomeChanged, message_id_for
from halfway.contract.topics import ALL_TOPICS, JOURNAL, OUTCOMES, TASKS
from halfway.journal import JournalWriter, ensure_topics
from halfway.journal.acls import WRITES, may_write
from halfway.journal.admin import delete_topics
from halfway.journal.records import stamp
from halfway.settings import KAFKA_KINDS, KafkaSettings

pytest.register_assert_rewrite("tests.processes")

from tests.processes import Cluster, charges_for, renewal_request  # noqa: E402

pytest_plugins = ["tests.processes"]
pytestmark = pytest.mark.broker

WAIT_S = 30.0
PROBE = b'{"probe": "who may write here"}'


def forged_intent(task_id: str, amount_cents: int = 99_999) -> StepIntended:
    """The audit's first forgery: a charge decided for a task nobody requested."""
    sid = step_id(task_id, 1)
    return StepIntended(**stamp(task_id), step_id=sid, n=1, tool="charge_customer",
                        args={"invoice": f"INV-{task_id}", "customer": "cus_8812",
                              "amount_cents": amount_cents, "currency": "usd"},
                        subject=f"invoice:INV-{task_id}", key=mint_key(sid),
                        effect_class=EffectClass.KEYED,
                        decided_by=DecidedBy(model="scripted", version="1"))


def forged_done(task_id: str) -> StepSettled:
    """The second: `done` for a step that does not exist yet."""
    return StepSettled(**stamp(task_id), step_id=step_id(task_id, 1), outcome=Outcome.DONE,
                       source=SettlementSource.WEBHOOK, evidence={"charge_id": "ch_forged"})


def forged_outcome(task_id: str) -> bytes:
    """The third: success reported for a task never requested."""
    return OutcomeChanged(message_id=message_id_for(task_id, "task", None, 1), seq=1,
                          task_id=task_id, subject="task", state="succeeded",
                          words="renewed: 4900 cents charged", at=datetime.now(UTC),
                          finished=True).model_dump_json().encode()


@pytest.fixture(scope="module")
async def private(kafka_settings: KafkaSettings) -> AsyncIterator[KafkaSettings]:
    """Topics of this module's own (nobody else consumes them), with their ACLs, as the admin."""
    settings = kafka_settings.with_prefix(f"sec-{uuid.uuid4().hex[:8]}.")
    await ensure_topics(settings, ALL_TOPICS)
    yield settings
    await delete_topics(settings, ALL_TOPICS)


def as_kind(settings: KafkaSettings, kind: str) -> KafkaSettings:
    return settings.as_kind(kind)


# --- the broker runs with authentication and ACLs ---------------------------------------------


def test_the_suite_connects_as_the_admin_over_scram(kafka_settings: KafkaSettings) -> None:
    assert kafka_settings.security.get("security_protocol") == "SASL_PLAINTEXT", (
        "the broker runs without SCRAM: `infra/dev down kafka` then `infra/dev up` upgrades it")
    assert kafka_settings.security["sasl_mechanism"] == "SCRAM-SHA-512"
    assert kafka_settings.principal == "admin"
    assert "sasl_plain_password" not in repr(kafka_settings)
    assert kafka_settings.security["sasl_plain_password"] not in repr(kafka_settings)


async def test_a_wrong_password_and_no_password_are_refused(
        kafka_settings: KafkaSettings) -> None:
    host, _, port = kafka_settings.bootstrap.partition(",")[0].rpartition(":")
    wrong = {**kafka_settings.as_kind("caller").security, "sasl_plain_password": "not-it"}
    with pytest.raises(SaslAuthenticationFailed) as refused:
        await create_conn(host, int(port), **wrong)
    assert "not-it" not in str(refused.value)
    # Without SASL the listener does not even answer a metadata request.
    plain = dataclasses.replace(kafka_settings, security={})
    writer = JournalWriter(plain)
    with pytest.raises(KafkaConnectionError):
        async with asyncio.timeout(WAIT_S):
            await writer.start()
    await writer.stop()


async def test_each_kind_writes_only_the_topics_it_needs(private: KafkaSettings) -> None:
    """The full matrix, through the real writer: allowed writes land, the rest are refused."""
    landed: dict[str, set[str]] = {}
    for kind in KAFKA_KINDS:
        if kind == "admin":
            continue
        landed[kind] = set()
        async with JournalWriter(as_kind(private, kind)) as writer:
            for spec in ALL_TOPICS:
                try:
                    async with asyncio.timeout(WAIT_S):
                        await writer.append_raw(spec, PROBE, key=b"probe")
                except Refused:
                    continue
                landed[kind].add(spec.suffix)
    expected = {kind: {s.suffix for s in ALL_TOPICS if may_write(kind, s)} for kind in landed}
    assert landed == expected
    # The words, from the matrix itself.
    assert {k for k, topics in landed.items() if topics & {"journal"}} == {
        "decider", "executor", "reconciler", "operator", "api"}
    assert landed["caller"] == {"tasks"}
    assert {k for k, t in landed.items() if "webhooks" in t} == {"gateway"}
    assert {k for k, t in landed.items() if "outcomes" in t} == {"outcomes"}
    assert {k for k, t in landed.items() if "guards" in t} == {"decider"}
    assert set(WRITES) == set(landed)


# --- the audit's forgeries, refused by the broker -------------------------------------------------


async def test_a_caller_cannot_forge_a_decision_a_settlement_or_an_outcome(
        private: KafkaSettings) -> None:
    task_id = f"forged-{uuid.uuid4().hex[:8]}"
    async with JournalWriter(as_kind(private, "caller")) as caller:
        with pytest.raises(Refused, match=JOURNAL.name(private.topic_prefix)):
            await caller.append(forged_intent(task_id))
        with pytest.raises(Refused, match=JOURNAL.name(private.topic_prefix)):
            await caller.append(forged_done(task_id))
        with pytest.raises(Refused, match=OUTCOMES.name(private.topic_prefix)):
            await caller.append_raw(OUTCOMES, forged_outcome(task_id), key=task_id.encode())
        # What a caller may do still works on the same connection.
        request = TaskRequested(**stamp(task_id), input={}, allowed_tools=[])
        assert (await caller.append(request, TASKS)).offset >= 0
    # Neither may the gateway (webhooks only) nor the executor (journal, not outcomes).
    async with JournalWriter(as_kind(private, "gateway")) as gateway:
        with pytest.raises(Refused):
            await gateway.append(forged_intent(task_id))
    async with JournalWriter(as_kind(private, "executor")) as executor:
        with pytest.raises(Refused):
            await executor.append_raw(OUTCOMES, forged_outcome(task_id), key=task_id.encode())


# --- inside the boundary: the fold ignores them, and says why -------------------------------------


def same_partition_as(task_id: str, prefix: str) -> str:
    """Another task id whose journal records share `task_id`'s partition: the executor meets
    them in log order, so once the second is done the first has been read."""
    want = (murmur2(task_id.encode()) & 0x7FFFFFFF) % JOURNAL.partitions
    while True:
        other = f"{prefix}-{uuid.uuid4().hex[:8]}"
        if (murmur2(other.encode()) & 0x7FFFFFFF) % JOURNAL.partitions == want:
            return other


async def test_forgeries_from_a_journal_writer_are_ignored_by_the_fold(core: Cluster) -> None:
    """A principal that may write the journal (here the reconciler's, as if compromised)
    forges a 99,999-cent decision for a task nobody requested, and plants `done` for a task
    that does not exist yet. The real decider and executor (each as its own principal) charge
    nothing for the first; the second task, requested after, is charged once and succeeds on
    its real charge."""
    await core.start("decider")
    await core.start("executor")
    nobody = f"nobody-{uuid.uuid4().hex[:8]}"
    planted = same_partition_as(nobody, "planted")
    async with JournalWriter(core.settings.as_kind("reconciler")) as inside:
        await inside.append(forged_intent(nobody))
        await inside.append(forged_done(planted))
    await core.publish(renewal_request(planted, reask=False))
    (state,) = (await core.journal.until_finished([planted])).values()

    assert state.final_state == "succeeded"
    step = state.step(1)
    assert step.outcome is Outcome.DONE
    assert step.effect.settlement.source is SettlementSource.CALL
    assert step.effect.settlement.evidence != {"charge_id": "ch_forged"}
    (kept,) = state.not_accepted
    assert kept.event.evidence == {"charge_id": "ch_forged"}
    assert "before the step was decided" in kept.reason

    forged = core.journal.states[nobody]
    assert forged.steps == {}
    assert "never started" in forged.not_accepted[0].reason
    charges = await core.ledger()
    assert [c["amount"] for c in charges_for(charges, step.intent.key)] == [4900]
    assert not charges_for(charges, mint_key(step_id(nobody, 1)))
    assert all(c["amount"] != 99_999 for c in charges)
