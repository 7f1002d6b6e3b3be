"""Round-trip time of one journal append (acks=all, idempotent) on this machine.

    .venv/bin/python benchmarks/produce_rtt.py [--sends 2000] [--warmup 200]

The yardstick for every later figure: how long `JournalWriter.append` (send_and_wait, one
event at a time, as the services write before acting) takes against the local broker. Printed
beside two baselines measured in the same run, so the ratios hold on any machine:
- acks=1 without idempotence (what durability costs on top of a plain write),
- a TCP echo round trip on loopback (the floor any network call pays).
Figures only; nothing here passes or fails on time.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime

from aiokafka import AIOKafkaProducer

from halfway.contract import DecidedBy, EffectClass, StepIntended, mint_key, step_id
from halfway.contract.topics import JOURNAL
from halfway.journal import JournalWriter, ensure_topics
from halfway.journal.admin import delete_topics
from halfway.journal.records import record_headers, record_key, record_value
from halfway.settings import KafkaSettings


def sample_event(i: int) -> StepIntended:
    task = f"bench-{i % 64}"
    sid = step_id(task, 1 + i // 64 % 9999)
    return StepIntended(event_id=uuid.uuid4().hex, task_id=task, at=datetime.now(UTC),
                        step_id=sid, n=1 + i // 64 % 9999, tool="charge_customer",
                        args={"invoice": f"INV-{i}", "amount_cents": 4900}, key=mint_key(sid),
                        subject=f"invoice:INV-{i}", effect_class=EffectClass.KEYED,
                        decided_by=DecidedBy(model="bench"))


async def timed(sends: int, warmup: int, one: Callable[[int], Awaitable[object]]) -> list[float]:
    for i in range(warmup):
        await one(i)
    samples_ms = []
    for i in range(sends):
        start = time.perf_counter_ns()
        await one(i)
        samples_ms.append((time.perf_counter_ns() - start) / 1e6)
    return samples_ms


def describe(name: str, samples_ms: list[float]) -> dict[str, float]:
    q = statistics.quantiles(samples_ms, n=100, method="inclusive")
    figures = {"median": statistics.median(samples_ms), "p99": q[98], "mean":
               statistics.fmean(samples_ms), "max": max(samples_ms)}
    print(f"{name:<38} n={len(samples_ms):>5}  median {figures['median']:7.3f} ms  "
          f"p99 {figures['p99']:7.3f} ms  mean {figures['mean']:7.3f} ms  "
          f"max {figures['max']:7.3f} ms")
    return figures


async def echo_baseline(sends: int, warmup: int) -> list[float]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(4096):
            writer.write(data)
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    payload = record_value(sample_event(0))

    async def one(_: int) -> None:
        writer.write(payload)
        await writer.drain()
        await reader.readexactly(len(payload))

    try:
        return await timed(sends, warmup, one)
    finally:
        writer.close()
        server.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sends", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    args = parser.parse_args()
    base = KafkaSettings.from_env()
    settings = base.with_prefix(f"bench-{uuid.uuid4().hex[:6]}.")
    await ensure_topics(settings, (JOURNAL,))
    events = [sample_event(i) for i in range(args.sends + args.warmup)]
    print(f"{os.cpu_count()} cores, broker {settings.bootstrap}, topic "
          f"{JOURNAL.name(settings.topic_prefix)} ({JOURNAL.partitions} partitions), "
          f"{len(record_value(events[0]))} B events, one send at a time")

    async with JournalWriter(settings) as journal:
        journal_ms = await timed(args.sends, args.warmup,
                                 lambda i: journal.append(events[i]))
    plain = AIOKafkaProducer(**settings.client(), acks=1,
                             enable_idempotence=False)
    await plain.start()
    try:
        topic = JOURNAL.name(settings.topic_prefix)
        plain_ms = await timed(args.sends, args.warmup, lambda i: plain.send_and_wait(
            topic, record_value(events[i]), key=record_key(events[i]),
            headers=record_headers(events[i])))
    finally:
        await plain.stop()
    echo_ms = await echo_baseline(args.sends, args.warmup)
    await delete_topics(settings, (JOURNAL,))

    journal_f = describe("journal append (acks=all, idempotent)", journal_ms)
    plain_f = describe("baseline: acks=1, not idempotent", plain_ms)
    echo_f = describe("baseline: loopback TCP echo", echo_ms)
    for name, base_f in (("acks=1", plain_f), ("TCP echo", echo_f)):
        print(f"ratio journal/{name}: median {journal_f['median'] / base_f['median']:.2f}x, "
              f"p99 {journal_f['p99'] / base_f['p99']:.2f}x")


if __name__ == "__main__":
    asyncio.run(main())
