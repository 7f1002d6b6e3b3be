"""Projector figures: replay speed, rebuild speed, and lag under a burst.

    .venv/bin/python benchmarks/projector.py [--events 20000] [--tasks 2000] [--burst 10000]

- Replay speed (events per second, median of 3 runs) of `--events` events across `--tasks`
  tasks: (a) folding the journal from Kafka alone (`halfway.journal.replay`), the baseline;
  (b) `rebuild` into PostgreSQL (read, fold, and write every row; the comparison is not timed).
- Lag under a burst: the projector runs as its own process (`python -m halfway.projector`) on
  an empty journal; `--burst` events are written as fast as one producer can (acks=all,
  idempotent, not waiting for each); every 100 ms the lag (end offsets minus applied offsets)
  is sampled; printed as median, p99 and max, with the time from the last write's ack until
  the lag is 0 (polled every 10 ms once the writes are acked).
Figures only; nothing here passes or fails. Own topic prefixes and schemas, removed after.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
import sys
import tempfile
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from halfway import settings as env
from halfway.contract import (
    DecidedBy,
    EffectClass,
    Event,
    FinalState,
    Outcome,
    SettlementSource,
    StepAttempted,
    StepChecked,
    StepIntended,
    StepSettled,
    TaskFinished,
    TaskStarted,
    mint_key,
    step_id,
)
from halfway.contract.topics import JOURNAL
from halfway.journal import ensure_topics, replay
from halfway.journal.admin import delete_topics
from halfway.journal.records import record_headers, record_key, record_value
from halfway.projector import store
from halfway.projector.rebuild import rebuild
from halfway.settings import KafkaSettings

RUNS = 3
SAMPLE_INTERVAL_S = 0.1
CATCH_UP_POLL_S = 0.01
WAIT_S = 120.0  # bound on any wait (the projector's start, its catching up)
BASE = datetime(2026, 12, 2, 9, 0, tzinfo=UTC)


def task_events(task_id: str) -> list[Event]:
    """Ten events: a charge that times out, is checked, found done; a second step; finished."""
    at = iter(BASE + timedelta(milliseconds=100 * i) for i in range(100))

    def envelope(**kw: object) -> dict[str, object]:
        return {"event_id": uuid.uuid4().hex, "task_id": task_id, "at": next(at), **kw}

    def intended(n: int) -> StepIntended:
        sid = step_id(task_id, n)
        return StepIntended(**envelope(), step_id=sid, n=n, tool="charge_customer",
                            args={"invoice": f"INV-{task_id}-{n}", "amount_cents": 4900},
                            key=mint_key(sid), subject=f"invoice:INV-{task_id}-{n}",
                            effect_class=EffectClass.KEYED, decided_by=DecidedBy(model="bench"))

    def attempted(n: int) -> StepAttempted:
        sid = step_id(task_id, n)
        return StepAttempted(**envelope(), step_id=sid, attempt=1, key=mint_key(sid),
                             started_at=BASE)

    def settled(n: int, outcome: Outcome, source: SettlementSource) -> StepSettled:
        done = outcome is Outcome.DONE
        return StepSettled(**envelope(), step_id=step_id(task_id, n), outcome=outcome,
                           source=source, attempt=None if source is SettlementSource.LOOKUP else 1,
                           evidence={"charge_id": f"ch_{n}"} if done else None,
                           reason=None if done else "no reply within 5 s")

    return [
        TaskStarted(**envelope(), input={"invoice": task_id}, allowed_tools=["charge_customer"]),
        intended(1), attempted(1), settled(1, Outcome.UNKNOWN, SettlementSource.CALL),
        StepChecked(**envelope(), step_id=step_id(task_id, 1), next_check_at=BASE),
        settled(1, Outcome.DONE, SettlementSource.LOOKUP),
        intended(2), attempted(2), settled(2, Outcome.DONE, SettlementSource.CALL),
        TaskFinished(**envelope(), state=FinalState.SUCCEEDED, summary="done"),
    ]


def workload(events_total: int, tasks: int, name: str) -> list[Event]:
    """Interleaved like a busy journal: event k of every task, then event k + 1."""
    per_task = [task_events(f"{name}-{i}") for i in range(tasks)]
    out = [events[k] for k in range(10) for events in per_task]
    return out[:events_total]


async def write(settings: KafkaSettings, events: list[Event]) -> float:
    """Write as fast as one producer can; returns the monotonic time the last ack arrived."""
    producer = AIOKafkaProducer(**settings.client(), acks="all",
                                enable_idempotence=True, linger_ms=5)
    await producer.start()
    try:
        topic = JOURNAL.name(settings.topic_prefix)
        acks = [await producer.send(topic, record_value(e), key=record_key(e),
                                    headers=record_headers(e)) for e in events]
        await asyncio.gather(*acks)
        return time.monotonic()
    finally:
        await producer.stop()


def prefixed(base: KafkaSettings, what: str) -> KafkaSettings:
    return base.with_prefix(f"bench-{what}-{uuid.uuid4().hex[:6]}.")


async def replay_speed(settings: KafkaSettings, schema: str) -> None:
    fold_rates, rebuild_rates = [], []
    for _ in range(RUNS):
        started = time.monotonic()
        result = await replay(settings)
        fold_rates.append(result.events / (time.monotonic() - started))
    for _ in range(RUNS):
        report = await rebuild(settings, env.pg_dsn(), live=schema)  # swaps: a fresh copy each
        if report.live_existed and not report.equal:  # a figure is worthless if this happens
            print("WARNING: two rebuilds differ:\n" + "\n".join(report.lines()))
        rebuild_rates.append(report.events_per_s)
    for name, rates in (("(a) fold-only replay from Kafka", fold_rates),
                        ("(b) rebuild into PostgreSQL", rebuild_rates)):
        runs = ", ".join(f"{r:,.0f}" for r in rates)
        print(f"{name:<34} median {statistics.median(rates):>9,.0f} events/s  (runs: {runs})")
    ratio = statistics.median(rebuild_rates) / statistics.median(fold_rates)
    print(f"rebuild / fold-only: {ratio:.2f}")


async def spawn_projector(settings: KafkaSettings, schema: str, log_path: Path,
                          ) -> asyncio.subprocess.Process:
    environ = dict(os.environ) | {"HALFWAY_TOPIC_PREFIX": settings.topic_prefix,
                                  "HALFWAY_PG_SCHEMA": schema, "HALFWAY_LOG_FORMAT": "json"}
    if settings.bootstrap != env.kafka_bootstrap():
        environ["HALFWAY_KAFKA_BOOTSTRAP"] = settings.bootstrap
    with log_path.open("ab") as log_file:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "halfway.projector", env=environ,
            stdin=asyncio.subprocess.DEVNULL, stdout=log_file, stderr=log_file)


def log_text(log_path: Path) -> str:
    return log_path.read_text(errors="replace")


async def until_logged(log_path: Path, text: str, process: asyncio.subprocess.Process) -> None:
    async with asyncio.timeout(WAIT_S):
        while text not in log_text(log_path):
            if process.returncode is not None:
                raise RuntimeError(f"the projector exited:\n{log_text(log_path)[-3000:]}")
            await asyncio.sleep(CATCH_UP_POLL_S)


async def burst_lag(base: KafkaSettings, burst: int, schema: str) -> None:
    settings = prefixed(base, "burst")
    await ensure_topics(settings, (JOURNAL,))
    topic = JOURNAL.name(settings.topic_prefix)
    conn = await store.connect(env.pg_dsn())
    ends_reader = AIOKafkaConsumer(**settings.client(), group_id=None,
                                   enable_auto_commit=False, isolation_level="read_committed")
    await ends_reader.start()
    with tempfile.TemporaryDirectory() as tmp:
        log_path = Path(tmp) / "projector.log"
        projector = await spawn_projector(settings, schema, log_path)
        try:
            await until_logged(log_path, "stored offsets read", projector)
            tps = [TopicPartition(topic, p) for p in range(JOURNAL.partitions)]

            one_at_a_time = asyncio.Lock()  # the sampler and the catch-up poll share clients

            async def lag() -> int:
                async with one_at_a_time:
                    ends = await ends_reader.end_offsets(tps)
                    applied = await store.read_offsets(conn, schema, topic)
                return sum(ends.values()) - sum(applied.values())

            samples: list[int] = []

            async def sample() -> None:
                while True:
                    samples.append(await lag())
                    await asyncio.sleep(SAMPLE_INTERVAL_S)

            events = workload(burst, burst // 10, "burst")
            sampler = asyncio.create_task(sample())
            started = time.monotonic()
            last_ack = await write(settings, events)
            async with asyncio.timeout(WAIT_S):
                while True:
                    if await lag() <= 0:
                        break
                    await asyncio.sleep(CATCH_UP_POLL_S)
            caught_up = time.monotonic()
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
        finally:
            if projector.returncode is None:
                projector.terminate()
                await asyncio.wait_for(projector.wait(), WAIT_S)
            await ends_reader.stop()
            await store.drop_schema(conn, schema)
            await conn.close()
            await delete_topics(settings, (JOURNAL,))
    p99 = (statistics.quantiles(samples, n=100, method="inclusive")[98] if len(samples) > 1
           else samples[0])
    print(f"burst of {burst:,} events ({burst // 10:,} tasks) written in "
          f"{last_ack - started:.2f} s ({burst / (last_ack - started):,.0f} events/s)")
    print(f"projector lag, {len(samples)} samples every {SAMPLE_INTERVAL_S * 1000:.0f} ms: "
          f"median {statistics.median(samples):,.0f}  p99 {p99:,.0f}"
          f"  max {max(samples):,} events")
    print(f"from the last write's ack to lag 0: {(caught_up - last_ack) * 1000:,.0f} ms")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--tasks", type=int, default=2_000)
    parser.add_argument("--burst", type=int, default=10_000)
    args = parser.parse_args()
    base = KafkaSettings.from_env()
    run = uuid.uuid4().hex[:6]
    schema, burst_schema = f"bench_{run}", f"bench_{run}_burst"
    settings = prefixed(base, "replay")
    await ensure_topics(settings, (JOURNAL,))
    conn = await store.connect(env.pg_dsn())
    try:
        print(f"{os.cpu_count()} cores, broker {settings.bootstrap}, {JOURNAL.partitions} "
              f"partitions; PostgreSQL schema {schema}")
        await write(settings, workload(args.events, args.tasks, "bench"))
        print(f"replay of {args.events:,} events across {args.tasks:,} tasks, {RUNS} runs each:")
        await replay_speed(settings, schema)
        await burst_lag(base, args.burst, burst_schema)
    finally:
        for name in (schema, f"{schema}_rebuild", f"{schema}_old"):
            await store.drop_schema(conn, name)
        await conn.close()
        await delete_topics(settings, (JOURNAL,))


if __name__ == "__main__":
    asyncio.run(main())
