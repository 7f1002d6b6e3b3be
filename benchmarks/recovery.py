"""Restart → first action, and memory, against the journal's length.

    .venv/bin/python benchmarks/recovery.py [--events 10000,100000,1000000] [--keep]
    .venv/bin/python benchmarks/recovery.py --events 10000000 --prefix recovery-1234abcd.
    .venv/bin/python benchmarks/recovery.py --service outcomes [--events ...] [--no-cold]

For each size: a fresh topic prefix gets a synthetic history of finished tasks (valid events:
requested, started, a step intended, attempted and settled done, finished: 6 per task) spread
over the last 30 days, then one live task is requested. A decider is started as its own
process (`halfway run decider`) and the clock runs until it acts on the live task (its
`task.started` is in the journal): first cold (no snapshot: the journal from zero), kept
running until it wrote a snapshot of every partition; then again, restoring the snapshots. The
figures: seconds from process start to that first action, and the decider's RSS then; and how
often the deciders lost partitions while they ran ("partitions revoked": a replay that starved
its heartbeat would lose them and start over); and of how many partitions the second start
read a snapshot ("restored"; the others, if any, were replayed from zero), and when the last of
them was restored ("all restored", seconds from process start: the first action waits only for
the live task's partition, so it varies with the order the images are read in; this does not).
Figures only; nothing passes or fails.

`--service outcomes`: the same for the outcomes publisher (`halfway run outcomes`), whose first
action is the first message on the outcomes topic for a live task started after the history.
Its first start publishes the whole history's messages (an empty outcomes topic: not a restart,
timed as "(first)"); then "cold" is a restart from zero (`HALFWAY_SNAPSHOTS=off`: the journal
and the outcomes topic read whole), and "from snapshot" one that restores the first start's
images and reads only the tails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from halfway.contract import (
    DecidedBy,
    EffectClass,
    Event,
    FinalState,
    Outcome,
    SettlementSource,
    StepAttempted,
    StepIntended,
    StepSettled,
    TaskFinished,
    TaskRequested,
    TaskStarted,
    mint_key,
    step_id,
)
from halfway.contract.topics import ALL_TOPICS, JOURNAL, OUTCOMES, TASKS
from halfway.journal import ensure_topics
from halfway.journal.admin import delete_topics
from halfway.journal.records import decode, record_headers, record_key, record_value
from halfway.settings import KafkaSettings

EVENTS_PER_TASK = 6
HISTORY_DAYS = 30
LOG_DIR = Path(".halfway/bench")  # the service's log of each run
SERVICES = ("decider", "outcomes")
WAIT_S = 1800.0  # for one restart, at the largest size (`--wait-s`: a first start at 10M)
QUIET_S = 3.0  # the outcomes topic's end unchanged this long: the publisher told everything


def history(task_id: str, at: datetime) -> list[Event]:
    def stamp(k: int) -> dict:
        return {"event_id": uuid.uuid4().hex, "task_id": task_id,
                "at": at + timedelta(milliseconds=k)}

    sid = step_id(task_id, 1)
    args = {"invoice": f"INV-{task_id}", "customer": "cus_1", "amount_cents": 4900,
            "currency": "usd"}
    script = {"script": [{"tool": "charge_customer", "args": args}]}
    return [
        TaskRequested(**stamp(0), input=script, allowed_tools=["charge_customer"]),
        TaskStarted(**stamp(1), input=script, allowed_tools=["charge_customer"]),
        StepIntended(**stamp(2), step_id=sid, n=1, tool="charge_customer", args=args,
                     key=mint_key(sid), subject=f"invoice:{args['invoice']}",
                     effect_class=EffectClass.KEYED, decided_by=DecidedBy(model="bench")),
        StepAttempted(**stamp(3), step_id=sid, attempt=1, key=mint_key(sid),
                      started_at=at),
        StepSettled(**stamp(4), step_id=sid, outcome=Outcome.DONE, attempt=1,
                    source=SettlementSource.CALL, evidence={"charge_id": f"ch_{task_id}"}),
        TaskFinished(**stamp(5), state=FinalState.SUCCEEDED, summary="renewed"),
    ]


def templates() -> list[tuple[str, str, bytes]]:
    """One finished task's records as text with placeholders (task id, time, event id): the
    fill formats millions of them without building and validating each event again."""
    base = datetime(2000, 1, 1, tzinfo=UTC)
    out = []
    for event in history(_TASK, base):
        text = record_value(event).decode().replace(event.event_id, _EVENT_ID)
        out.append((text.replace(_BASE, _AT), event.type, record_key(event)))
    return out


_TASK, _EVENT_ID, _BASE, _AT = "TASKIDXX", "EVENTIDXX", "2000-01-01T00:00:00", "ATXX"


async def fill(settings: KafkaSettings, events: int) -> None:
    """Write `events` journal events (finished tasks) as fast as the producer batches them."""
    producer = AIOKafkaProducer(**settings.client(), acks=1,
                                linger_ms=20, max_batch_size=512 * 1024,
                                compression_type="gzip")
    await producer.start()
    journal = JOURNAL.name(settings.topic_prefix)
    tasks = events // EVENTS_PER_TASK
    # The history spans HISTORY_DAYS, oldest first, as a deployment's journal would: the
    # services keep only what ended within the seal window (a day by default) whole.
    first = datetime.now(UTC).replace(microsecond=0) - timedelta(days=HISTORY_DAYS)
    step = timedelta(days=HISTORY_DAYS) / max(1, tasks)
    shapes = templates()
    try:
        pending = []
        for i in range(tasks):
            task_id = f"old-{i}"
            at = (first + i * step).replace(microsecond=0).isoformat()[:19]
            for text, kind, _ in shapes:
                event_id = os.urandom(16).hex()
                value = (text.replace(_TASK, task_id).replace(_AT, at)
                         .replace(_EVENT_ID, event_id).encode())
                pending.append(await producer.send(
                    journal, value=value, key=task_id.encode(),
                    headers=[("type", kind.encode()), ("schema_version", b"1"),
                             ("event_id", event_id.encode())]))
            if len(pending) >= 20_000:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
    finally:
        await producer.stop()


async def first_action(settings: KafkaSettings, service: str, probe: str,
                       ready: asyncio.Event) -> float:
    """The monotonic time at which the service's first act for `probe` was read: the decider's
    `task.started` on the journal, the outcomes publisher's first message (`ready` is set once
    the watcher sits at the topic's end)."""
    topic = JOURNAL if service == "decider" else OUTCOMES
    consumer = AIOKafkaConsumer(topic.name(settings.topic_prefix),
                                **settings.client(),
                                auto_offset_reset="latest", group_id=None)
    await consumer.start()
    try:
        for tp in consumer.assignment():
            await consumer.position(tp)
        ready.set()
        async with asyncio.timeout(WAIT_S):
            while True:
                batches = await consumer.getmany(timeout_ms=200)
                for records in batches.values():
                    for record in records:
                        if service == "outcomes":
                            if record.key == probe.encode():
                                return time.monotonic()
                            continue
                        try:
                            event = decode(record)
                        except Exception:
                            continue
                        if isinstance(event, TaskStarted) and event.task_id == probe:
                            return time.monotonic()
    finally:
        await consumer.stop()


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def request_probe(settings: KafkaSettings, service: str) -> str:
    """A live task for the service to act on: a request on the tasks topic for the decider; its
    request and start in the journal for the outcomes publisher."""
    probe = f"probe-{uuid.uuid4().hex[:8]}"
    events = history(probe, datetime.now(UTC))
    sends = [(TASKS, events[0])] if service == "decider" else [(JOURNAL, e) for e in events[:2]]
    producer = AIOKafkaProducer(**settings.client())
    await producer.start()
    try:
        for topic, event in sends:
            await producer.send_and_wait(topic.name(settings.topic_prefix),
                                         value=record_value(event), key=record_key(event),
                                         headers=record_headers(event))
    finally:
        await producer.stop()
    return probe


def logged(path: Path, event: str) -> list[dict]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict) and entry.get("event") == event:
            out.append(entry)
    return out


def snapshotted(log_path: Path) -> set[int]:
    """The partitions that have a snapshot now: written by this process, or restored."""
    written = {e.get("partition") for e in logged(log_path, "snapshot written")}
    restored = {e.get("partition") for e in logged(log_path, "partition restored")}
    return written | restored


async def quiet(settings: KafkaSettings) -> None:
    """Until the outcomes topic's end has not moved for QUIET_S: nothing left to tell."""
    topic = OUTCOMES.name(settings.topic_prefix)
    consumer = AIOKafkaConsumer(**settings.client(), group_id=None)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(JOURNAL.partitions)]  # as many
        last, since = -1, time.monotonic()
        while time.monotonic() - since < QUIET_S:
            end = sum((await consumer.end_offsets(tps)).values())
            if end != last:
                last, since = end, time.monotonic()
            await asyncio.sleep(0.5)  # an end offset has no notification: polled, bounded
    finally:
        await consumer.stop()


async def restart(settings: KafkaSettings, service: str, label: str, *,
                  until_snapshots: int = 0, snapshots: bool = True,
                  snapshot_soon: bool = False) -> tuple[float, float, Path, float]:
    """Start the service, time its first action on a fresh live task, and its RSS then; with
    `until_snapshots`, keep it running until it restored or wrote snapshots of that many
    partitions (`snapshot_soon`: it writes one as soon as a partition caught up, not five
    minutes after, as deployed). The outcomes publisher is stopped only once it told
    everything: the next start times a restart, not what this one left to send."""
    env = dict(os.environ) | {"HALFWAY_TOPIC_PREFIX": settings.topic_prefix,
                              "HALFWAY_LOG_FORMAT": "json",
                              "HALFWAY_SNAPSHOTS": "on" if snapshots else "off"}
    if snapshot_soon:  # a benchmark has no five minutes to wait at the small sizes
        env["HALFWAY_SNAPSHOT_EVERY_S"] = "1"
    probe = await request_probe(settings, service)  # nobody acts on it before the start
    ready = asyncio.Event()
    watcher = asyncio.create_task(first_action(settings, service, probe, ready))
    await ready.wait()  # the watcher sits at the topic's end before the service writes
    log_path = LOG_DIR / f"{service}-{label}.log"
    with log_path.open("wb") as log_file:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "halfway", "run", service, env=env,
            stdout=asyncio.subprocess.DEVNULL, stderr=log_file)
    since, spawned_at = time.monotonic(), time.time()  # (log lines carry the wall clock)
    try:
        seconds = await watcher - since
        rss = rss_mib(proc.pid)
        async with asyncio.timeout(WAIT_S):
            while len(snapshotted(log_path)) < until_snapshots:  # noqa: ASYNC110 (a log file has no notification)
                await asyncio.sleep(0.5)
            if service == "outcomes":
                await quiet(settings)
    finally:
        proc.terminate()
        await proc.wait()
    return seconds, rss, log_path, spawned_at


async def one(base: KafkaSettings, service: str, events: int, *, prefix: str | None = None,
              keep: bool = False, first: bool = False, cold: bool = True) -> dict[str, float]:
    """Fill a fresh prefix (or reuse `prefix`, filled by an earlier `--keep` run: the restart
    from snapshots only, unless `first`), time the restarts (the outcomes publisher's restart
    from zero only if `cold`), and delete the topics unless `keep` (or reused)."""
    settings = base.with_prefix(prefix or f"recovery-{uuid.uuid4().hex[:8]}.")
    r: dict[str, float] = {"cold_s": float("nan"), "cold_rss": float("nan"),
                           "fill_s": float("nan"), "first_s": float("nan"), "revoked": 0}
    await ensure_topics(settings, ALL_TOPICS)
    try:
        if prefix is None:
            started = time.monotonic()
            await fill(settings, events)
            r["fill_s"] = time.monotonic() - started
        if (prefix is None or first) and service == "outcomes":
            # The first start tells the whole history (and snapshots every partition); then
            # a restart from zero, which writes no snapshot.
            r["first_s"], _, first_log, _ = await restart(
                settings, service, f"{events}-first", until_snapshots=JOURNAL.partitions,
                snapshot_soon=True)
            logs = [first_log]
            if cold:
                r["cold_s"], r["cold_rss"], cold_log, _ = await restart(
                    settings, service, f"{events}-cold", snapshots=False)
                logs.append(cold_log)
            r["revoked"] = sum(len(logged(path, "partitions revoked")) for path in logs)
        elif prefix is None or first:
            # Cold: no snapshot (or only unusable ones: replayed), the journal from zero; it
            # snapshots every partition.
            r["cold_s"], r["cold_rss"], cold_log, _ = await restart(
                settings, service, f"{events}-cold", until_snapshots=JOURNAL.partitions,
                snapshot_soon=True)
            r["revoked"] = len(logged(cold_log, "partitions revoked"))
        # Warm: the snapshots and the journal after them (a probe request or two), snapshot
        # settings as deployed (no image written while the others are read). Kept running
        # until every partition is restored (or replayed and snapshotted again, five minutes
        # on): `restored` counts them all, not only those read before the first action.
        r["warm_s"], r["warm_rss"], log_path, spawned_at = await restart(
            settings, service, f"{events}-warm", until_snapshots=JOURNAL.partitions)
        r["revoked"] += len(logged(log_path, "partitions revoked"))
        restored = logged(log_path, "snapshot read")
        r["restored"] = len(restored)
        r["read_s"] = max((e.get("seconds", 0.0) for e in restored), default=0.0)
        r["all_restored_s"] = max(
            (datetime.fromisoformat(e["timestamp"]).timestamp() - spawned_at
             for e in logged(log_path, "partition restored")), default=float("nan"))
        return r
    finally:
        if keep or prefix is not None:  # a history reused stays, whatever happened
            print(f"kept: --prefix {settings.topic_prefix}", flush=True)
        else:
            await delete_topics(settings, ALL_TOPICS)


async def main() -> None:
    global WAIT_S  # `--wait-s`
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", default="10000,100000,1000000")
    parser.add_argument("--keep", action="store_true",
                        help="keep the topics (and print their prefix) for a later --prefix")
    parser.add_argument("--prefix", help="reuse a kept history: only the restart from "
                                         "snapshots is timed (--events names its size)")
    parser.add_argument("--first", action="store_true",
                        help="with --prefix: a first start that writes the snapshots too "
                             "(a kept history whose snapshots this build cannot read)")
    parser.add_argument("--wait-s", type=float, default=WAIT_S,
                        help="bound on one start's wait (the outcomes' first start at 10M "
                             "tells 10M messages: 27 min on 2 cores, near the default "
                             "%(default)s s)")
    parser.add_argument("--no-cold", action="store_true",
                        help="outcomes: no restart from zero (at 10M it reads for long)")
    parser.add_argument("--service", choices=SERVICES, default="decider",
                        help="the service restarted (default: %(default)s)")
    args = parser.parse_args()
    WAIT_S = args.wait_s
    base = KafkaSettings.from_env()
    print(f"{args.service}: restart → first action")
    print(f"{'journal events':>15} {'cold: first action':>19} {'RSS':>8}"
          f" {'from snapshot: first action':>28} {'RSS':>8} {'restored':>9}"
          f" {'all restored':>13} {'revoked':>8}"
          f" {'(fill)':>8} {'(first start)':>14}")
    for events in (int(n) for n in args.events.split(",")):
        r = await one(base, args.service, events, prefix=args.prefix, keep=args.keep,
                      first=args.first, cold=not args.no_cold)
        print(f"{events:>15,} {r['cold_s']:>17.2f} s {r['cold_rss']:>4.0f} MiB"
              f" {r['warm_s']:>26.2f} s {r['warm_rss']:>4.0f} MiB"
              f" {r['restored']:>5.0f}/{JOURNAL.partitions} {r['all_restored_s']:>11.2f} s"
              f" {r['revoked']:>8.0f}"
              f" {r['fill_s']:>7.1f}s {r['first_s']:>13.1f}s", flush=True)


if __name__ == "__main__":
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    asyncio.run(main())
