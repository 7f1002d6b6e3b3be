"""What a flood of orphan webhooks costs the reconciler: memory, and how fast it gets through.

    .venv/bin/python benchmarks/orphan_webhooks.py [--webhooks 50000] [--rounds 3]

Starts `halfway run reconciler` on a fresh prefix, then, each round, publishes N
verified-looking webhooks (as the gateway would, stamped with the journal's end) for keys no
step ever attempted, straight onto the webhooks topic, and samples the reconciler's resident
memory until it has weighed them all (its committed offsets reach the topic's end). Each is an
orphan: quarantined on the dead-letter topic and dropped. Before this was fenced, 50,000 of
them were kept for good and grew a reconciler from 58 to 241 MiB. RSS never shrinks much in
CPython (freed memory stays in its arenas), so the figure to read is whether later rounds grow
it further: kept webhooks would add the same again each round. Figures only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

from aiokafka import AIOKafkaConsumer, TopicPartition

from halfway.contract.topics import ALL_TOPICS, DEAD_LETTERS, WEBHOOKS
from halfway.contract.webhooks import WebhookReceived
from halfway.journal import JournalWriter, ensure_topics
from halfway.journal.admin import delete_topics
from halfway.journal.records import partition_of
from halfway.settings import KafkaSettings

SAMPLE_S = 0.2
WAIT_S_MAX = 600.0
START_S_MAX = 60.0
SENDS_IN_FLIGHT = 500


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def orphan(i: int) -> WebhookReceived:
    task = f"orphan-{i}"
    now = datetime.now(UTC)
    return WebhookReceived(
        provider="paysim", provider_event_id=f"evt_orphan_{i}",
        provider_event_type="charge.succeeded", object_id=f"ch_orphan_{i}", key=f"{task}:1",
        task_id=task, payload={"id": f"evt_orphan_{i}", "type": "charge.succeeded",
                               "data": {"object": {"id": f"ch_orphan_{i}", "amount": 4900}}},
        signed_at=now, received_at=now,
        journal_partition=partition_of(task.encode(), WEBHOOKS.partitions), journal_offset=0)


async def committed_total(settings: KafkaSettings, group: str) -> int:
    consumer = AIOKafkaConsumer(**settings.client(), group_id=group,
                                enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(WEBHOOKS.name(settings.topic_prefix), p)
               for p in range(WEBHOOKS.partitions)]
        return sum([await consumer.committed(tp) or 0 for tp in tps])
    finally:
        await consumer.stop()


async def letters(settings: KafkaSettings) -> int:
    consumer = AIOKafkaConsumer(**settings.client(), group_id=None)
    await consumer.start()
    try:
        tp = TopicPartition(DEAD_LETTERS.name(settings.topic_prefix), 0)
        return (await consumer.end_offsets([tp]))[tp]
    finally:
        await consumer.stop()


async def main(count: int, rounds: int) -> None:
    base = KafkaSettings.from_env()
    settings = base.with_prefix(f"bench-orphans-{uuid.uuid4().hex[:6]}.")
    await ensure_topics(settings, ALL_TOPICS)
    env = dict(os.environ, HALFWAY_TOPIC_PREFIX=settings.topic_prefix,
               HALFWAY_LOG_LEVEL="ERROR", HALFWAY_KAFKA_BOOTSTRAP=settings.bootstrap)
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "halfway", "run", "reconciler", env=env,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    group = f"{settings.topic_prefix}reconciler"
    try:
        await asyncio.sleep(START_S_MAX / 10)  # imports and the first group join
        print(f"reconciler idle: rss {rss_mib(proc.pid):.0f} MiB")
        async with JournalWriter(settings, linger_ms=5) as writer:
            for round_ in range(1, rounds + 1):
                first_i = (round_ - 1) * count
                began_s = time.monotonic()
                for first in range(first_i, first_i + count, SENDS_IN_FLIGHT):
                    batch = [orphan(i)
                             for i in range(first, min(first_i + count, first + SENDS_IN_FLIGHT))]
                    await asyncio.gather(*(writer.append_raw(
                        WEBHOOKS, h.model_dump_json().encode(), key=h.record_key())
                        for h in batch))
                peak_mib = 0.0
                done_s = None
                while time.monotonic() - began_s < WAIT_S_MAX:
                    await asyncio.sleep(SAMPLE_S)
                    peak_mib = max(peak_mib, rss_mib(proc.pid))
                    if await committed_total(settings, group) >= round_ * count:
                        done_s = time.monotonic() - began_s
                        break
                assert done_s is not None, "the reconciler did not weigh them all in time"
                print(f"round {round_}: {count} orphans published and weighed in "
                      f"{done_s:.1f} s ({count / done_s:,.0f}/s); rss peak {peak_mib:.0f} MiB, "
                      f"{rss_mib(proc.pid):.0f} MiB once done")
        print(f"quarantine letters on the dead-letter topic: {await letters(settings)}")
    finally:
        if proc.returncode is None:
            proc.terminate()
            await proc.wait()
        await delete_topics(settings, ALL_TOPICS)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--webhooks", type=int, default=50_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    asyncio.run(main(args.webhooks, args.rounds))
