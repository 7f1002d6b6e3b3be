"""Projector figures: replay speed, rebuild speed, lag under a burst, and restart cost.

    .venv/bin/python benchmarks/projector.py [--events 20000] [--tasks 2000] [--burst 10000]
        [--restart-events 1000000] [--restart-tail 600] [--only replay|burst|restart]
        [--keep | --prefix P --schema S]

- Replay speed (events per second, median of 3 runs) of `--events` events across `--tasks`
  tasks: (a) folding the journal from Kafka alone (`halfway.journal.replay`), the baseline;
  (b) `rebuild` into PostgreSQL (read, fold, and write every row; the comparison is not timed).
- Lag under a burst: the projector runs as its own process (`python -m halfway.projector`) on
  an empty journal; `--burst` events are written as fast as one producer can (acks=all,
  idempotent, not waiting for each); every 100 ms the lag (end offsets minus applied offsets)
  is sampled; printed as median, p99 and max, with the time from the last write's ack until
  the lag is 0 (polled every 10 ms once the writes are acked).
- Restart cost: a journal of `--restart-events` events (finished tasks over 30 days, as
  `benchmarks/recovery.py` fills it; the last day's are live work, the rest sealed) is
  projected by a first projector process until it has snapshotted every partition at its
  end; then, each time after `--restart-tail` more events, the projector is started again:
  from zero with HALFWAY_SNAPSHOTS=off (it keeps no events for an image), from zero with
  snapshots on (the group's pointers cleared: it keeps its open tasks' events, and snapshots
  again), and from its snapshots. Printed: seconds from process start until PostgreSQL holds
  the journal's end ("caught up", polled every 10 ms), the process's RSS then, and how many
  partitions were restored from a snapshot. `--keep` leaves that journal and read model (the
  largest sizes take long to fill and to project a first time); `--prefix P --schema S` then
  times only a restart from their snapshots. Each start's log stays in `.halfway/bench`.
Figures only; nothing here passes or fails. Own topic prefixes and schemas, removed after
(unless `--keep`).
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
from halfway.contract.topics import ALL_TOPICS, JOURNAL
from halfway.journal import ensure_topics, replay
from halfway.journal.admin import delete_topics
from halfway.journal.records import record_headers, record_key, record_value
from halfway.projector import store
from halfway.projector.rebuild import rebuild
from halfway.settings import KafkaSettings

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `benchmarks.recovery`, also when run as a script
from benchmarks.recovery import (  # noqa: E402
    EVENTS_PER_TASK,
    LOG_DIR,
    fill,
    history,
    logged,
    rss_mib,
)

RUNS = 3
SAMPLE_INTERVAL_S = 0.1
CATCH_UP_POLL_S = 0.01
WAIT_S = 120.0  # bound on any wait (the projector's start, its catching up)
RESTART_WAIT_S = 1800.0  # bound on one restart's catching up, at the largest sizes
RESTART_POLL_S = 0.2  # the projector's log, for its snapshots
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
                          **extra: str) -> asyncio.subprocess.Process:
    environ = dict(os.environ) | {"HALFWAY_TOPIC_PREFIX": settings.topic_prefix,
                                  "HALFWAY_PG_SCHEMA": schema, "HALFWAY_LOG_FORMAT": "json",
                                  **extra}
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


# -- restart cost: from zero and from snapshots --------------------------------------------


async def caught_up(settings: KafkaSettings, schema: str, log_path: Path,
                    process: asyncio.subprocess.Process) -> None:
    """Until the projector has taken up every partition (restored or not: a partition the
    tail left alone is already stored) and PostgreSQL holds the journal's end offsets (as
    they are now)."""
    ends = await journal_ends(settings)
    conn = await store.connect(env.pg_dsn())
    try:
        async with asyncio.timeout(RESTART_WAIT_S):
            while True:
                if await store.schema_exists(conn, schema):
                    stored = await store.read_offsets(conn, schema,
                                                      JOURNAL.name(settings.topic_prefix))
                    if (all(stored.get(p, 0) >= e for p, e in ends.items())
                            and adopted(log_path) >= set(ends)):
                        return
                if process.returncode is not None:
                    raise RuntimeError(f"the projector exited:\n{log_text(log_path)[-3000:]}")
                await asyncio.sleep(CATCH_UP_POLL_S)
    finally:
        await conn.close()


def adopted(log_path: Path) -> set[int]:
    """The partitions the projector has read its stored offsets of (after a restore)."""
    return {int(p) for entry in logged(log_path, "stored offsets read")
            for p in entry.get("offsets", {})}


async def journal_ends(settings: KafkaSettings) -> dict[int, int]:
    consumer = AIOKafkaConsumer(**settings.client(), group_id=None,
                                enable_auto_commit=False, isolation_level="read_committed")
    await consumer.start()
    try:
        topic = JOURNAL.name(settings.topic_prefix)
        tps = [TopicPartition(topic, p) for p in range(JOURNAL.partitions)]
        return {tp.partition: offset for tp, offset in (await consumer.end_offsets(tps)).items()}
    finally:
        await consumer.stop()


async def snapshotted_at_end(settings: KafkaSettings, log_path: Path,
                             process: asyncio.subprocess.Process) -> list[dict]:
    """Until the projector logged a snapshot of every partition at its end; those entries."""
    ends = {p: e for p, e in (await journal_ends(settings)).items() if e}
    async with asyncio.timeout(RESTART_WAIT_S):
        while True:
            written = {e.get("partition"): e for e in logged(log_path, "snapshot written")
                       if e.get("journal_next") == ends.get(e.get("partition"))}
            if set(written) >= set(ends):
                return list(written.values())
            if process.returncode is not None:
                raise RuntimeError(f"the projector exited:\n{log_text(log_path)[-3000:]}")
            await asyncio.sleep(RESTART_POLL_S)  # a log file has no notification


async def forget_snapshots(settings: KafkaSettings) -> None:
    """Commit the projector group's offsets with no pointer: its next start has no snapshot."""
    topic = JOURNAL.name(settings.topic_prefix)
    consumer = AIOKafkaConsumer(**settings.client(), group_id=f"{settings.topic_prefix}projector",
                                enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(JOURNAL.partitions)]
        consumer.assign(tps)
        await consumer.commit({tp: (0, "") for tp in tps})
    finally:
        await consumer.stop()


async def write_tail(settings: KafkaSettings, events: int, name: str) -> None:
    """`events` more (whole tasks of `recovery.history`, now): the work a restart has."""
    tasks = [history(f"{name}-{i}", datetime.now(UTC))
             for i in range(max(1, events // EVENTS_PER_TASK))]
    await write(settings, [e for task in tasks for e in task])


async def start_once(settings: KafkaSettings, schema: str, log_path: Path, *,
                     snapshots: bool, keep_until_snapshotted: bool = False,
                     ) -> tuple[float, float, int]:
    """Start a projector process; seconds until caught up, its RSS (MiB) then, and how many
    partitions it restored from a snapshot."""
    extra = {"HALFWAY_SNAPSHOT_EVERY_S": "1",  # a snapshot soon after catching up
             "HALFWAY_SNAPSHOTS": "on" if snapshots else "off"}
    started = time.monotonic()
    process = await spawn_projector(settings, schema, log_path, **extra)
    try:
        await caught_up(settings, schema, log_path, process)
        seconds = time.monotonic() - started
        rss = rss_mib(process.pid)
        if keep_until_snapshotted:
            images = await snapshotted_at_end(settings, log_path, process)
            print(f"  snapshots at the end: {len(images)} partitions, "
                  f"{sum(e.get('live_events', 0) for e in images):,} live events, "
                  f"{sum(e.get('sealed', 0) for e in images):,} sealed tasks, "
                  f"{sum(e.get('bytes', 0) for e in images) / 2**20:.1f} MiB")
    finally:
        if process.returncode is None:
            process.terminate()
            await asyncio.wait_for(process.wait(), WAIT_S)
    return seconds, rss, len(logged(log_path, "partition restored from its snapshot"))


async def restart_cost(base: KafkaSettings, events: int, tail: int, schema: str, *,
                       prefix: str | None = None, keep: bool = False) -> None:
    """The four starts on a fresh journal of `events`; with `prefix` (and `schema`) of an
    earlier `--keep` run, only a restart from its snapshots after a tail. `keep`: leave the
    topics and the schema for such a run (printed)."""
    settings = base.with_prefix(prefix) if prefix else prefixed(base, "restart")
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    await ensure_topics(settings, ALL_TOPICS)
    # (label, snapshots on, a tail first, its pointers forgotten first, snapshotted)
    runs = [("first (empty read model)", True, False, False, True),
            ("restart from zero, snapshots off", False, True, False, False),
            ("restart from zero, snapshots on", True, True, True, True),
            ("restart from snapshots", True, True, False, False)]
    conn = await store.connect(env.pg_dsn())
    try:
        if prefix is None:
            started = time.monotonic()
            await fill(settings, events)
            print(f"restart cost: {events:,} journal events (finished tasks over 30 days) "
                  f"written in {time.monotonic() - started:.1f} s; a tail of {tail:,} "
                  "before each restart")
        else:  # and its images written again, by this build, for the next such run
            runs = [(*runs[-1][:-1], True)]
            print(f"restart cost: the kept journal {prefix} ({events:,} events named); a tail "
                  f"of {tail:,} first")
        print(f"{'start':<34} {'until caught up':>16} {'RSS':>9} {'restored':>9}")
        run = uuid.uuid4().hex[:6]
        for i, (label, snapshots, tail_first, forget, snapshotted) in enumerate(runs):
            if tail_first:
                await write_tail(settings, tail, f"tail{run}{i}")
            if forget:
                await forget_snapshots(settings)
            log_path = LOG_DIR / f"projector-{settings.topic_prefix}{run}-{i}.log"
            seconds, rss, restored = await start_once(
                settings, schema, log_path, snapshots=snapshots,
                keep_until_snapshotted=snapshotted)
            print(f"{label:<34} {seconds:>14.2f} s {rss:>5.0f} MiB "
                  f"{restored:>5}/{JOURNAL.partitions}  ({log_path})", flush=True)
    finally:
        if keep or prefix is not None:  # a journal reused stays, whatever happened
            print(f"kept: --prefix {settings.topic_prefix} --schema {schema}", flush=True)
        else:
            await store.drop_schema(conn, schema)
            await delete_topics(settings, ALL_TOPICS)
        await conn.close()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--tasks", type=int, default=2_000)
    parser.add_argument("--burst", type=int, default=10_000)
    parser.add_argument("--restart-events", type=int, default=1_000_000)
    parser.add_argument("--restart-tail", type=int, default=600)
    parser.add_argument("--only", choices=("replay", "burst", "restart"))
    parser.add_argument("--keep", action="store_true",
                        help="restart: keep the journal and the read model (printed)")
    parser.add_argument("--prefix", help="restart: a journal kept by --keep (with --schema): "
                                         "only the restart from its snapshots is timed")
    parser.add_argument("--schema", help="restart: the read model kept with --prefix")
    args = parser.parse_args()
    base = KafkaSettings.from_env()
    run = uuid.uuid4().hex[:6]
    schema, burst_schema = f"bench_{run}", f"bench_{run}_burst"
    print(f"{os.cpu_count()} cores, broker {base.bootstrap}, {JOURNAL.partitions} partitions")
    if args.only in (None, "replay"):
        await replay_figures(base, args.events, args.tasks, schema)
    if args.only in (None, "burst"):
        await burst_lag(base, args.burst, burst_schema)
    if args.only in (None, "restart"):
        await restart_cost(base, args.restart_events, args.restart_tail,
                           args.schema or f"bench_{run}_restart", prefix=args.prefix,
                           keep=args.keep)


async def replay_figures(base: KafkaSettings, events: int, tasks: int, schema: str) -> None:
    settings = prefixed(base, "replay")
    await ensure_topics(settings, (JOURNAL,))
    conn = await store.connect(env.pg_dsn())
    try:
        print(f"PostgreSQL schema {schema}")
        await write(settings, workload(events, tasks, "bench"))
        print(f"replay of {events:,} events across {tasks:,} tasks, {RUNS} runs each:")
        await replay_speed(settings, schema)
    finally:
        for name in (schema, f"{schema}_rebuild", f"{schema}_old"):
            await store.drop_schema(conn, name)
        await conn.close()
        await delete_topics(settings, (JOURNAL,))


if __name__ == "__main__":
    asyncio.run(main())
