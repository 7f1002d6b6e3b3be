"""Partition counts: a new deployment chooses its own (HALFWAY_PARTITIONS), and topics keyed by
task id that disagree stop a service at start with the reason, never a silent misrouting."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import uuid
from pathlib import Path

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from halfway.contract import FinalState
from halfway.contract.topics import ALL_TOPICS, TASKS
from halfway.journal.admin import delete_topics, ensure_topics, topic_partitions
from halfway.settings import KafkaSettings, partitions
from tests.processes import Cluster, charges_for, cluster, renewal_request

pytest_plugins = ["tests.processes"]
pytestmark = pytest.mark.broker

CLI_WAIT_S = 60.0


def test_the_partition_count_is_read_from_the_environment_and_checked(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HALFWAY_PARTITIONS", "12")
    assert partitions() == 12
    assert KafkaSettings.from_env().partitions == 12
    for bad in ("0", "-3", "six", "100000"):
        monkeypatch.setenv("HALFWAY_PARTITIONS", bad)
        with pytest.raises(ValueError, match="HALFWAY_PARTITIONS"):
            partitions()


async def test_a_deployment_with_two_partitions_runs_tasks(kafka_settings: KafkaSettings,
                                                           tmp_path: Path) -> None:
    two = dataclasses.replace(kafka_settings, partitions=2)
    async with cluster(two, tmp_path) as c:
        c: Cluster
        for spec in ALL_TOPICS:
            want = 2 if spec.scales else spec.partitions
            assert len(await topic_partitions(c.settings, spec.name(c.settings.topic_prefix))) \
                == want, spec.suffix
        await c.start("decider")
        await c.start("executor")
        tasks = [f"two-{i}" for i in range(6)]
        await c.publish(*(renewal_request(t) for t in tasks))
        states = await c.journal.until_finished(tasks)
        assert all(s.final_state is FinalState.SUCCEEDED for s in states.values())
        charges = await c.ledger()
        assert all(len(charges_for(charges, f"{t}:1")) == 1 for t in tasks)


async def test_topics_that_disagree_stop_a_service_with_the_reason(
        kafka_settings: KafkaSettings) -> None:
    settings = kafka_settings.with_prefix(f"skew-{uuid.uuid4().hex[:8]}.")
    admin = AIOKafkaAdminClient(**settings.client())
    await admin.start()
    try:  # an operator's mistake: the requests made with another count than the journal
        await admin.create_topics([NewTopic(TASKS.name(settings.topic_prefix), 3, 1)])
    finally:
        await admin.close()
    try:
        await ensure_topics(dataclasses.replace(settings, partitions=2))  # the rest, and ACLs
        env = dict(os.environ) | {"HALFWAY_TOPIC_PREFIX": settings.topic_prefix}
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "halfway", "run", "decider", env=env,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        async with asyncio.timeout(CLI_WAIT_S):
            _, err = await proc.communicate()
        assert proc.returncode == 2, err.decode()[-2000:]
        words = err.decode()
        assert "different partition counts" in words
        assert f"{settings.topic_prefix}journal: 2" in words
        assert f"{settings.topic_prefix}tasks: 3" in words
    finally:
        await delete_topics(settings)
