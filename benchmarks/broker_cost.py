"""Where the broker's CPU goes: idle, with a halfway deployment idle, and per sequential task.

    .venv/bin/python benchmarks/broker_cost.py [--tasks 500] [--idle-s 10] [--skip halfway]

`side_by_side.py` counts the broker's CPU per task in each phase. This splits what a halfway
deployment costs it when nothing happens (its consumers' empty fetches, heartbeats) from what
each task costs (its appends and the fetches they answer). For each of `halfway` (decider and
executor processes) and `halfway-w` (a worker), on a fresh topic prefix, as `side_by_side.py`
runs them, with the same app, stub provider and caller:
1. the broker's CPU per second over `--idle-s`, with no deployment up;
2. the same once the deployment is up and idle, and each of its processes' own;
3. `--tasks` 3-step tasks one after the other: the seconds, and CPU ms per task of the
   broker and of each process.
CPU is utime+stime from /proc. The broker is shared: anything else using it is counted too.
Figures only.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import side_by_side as sbs

WARMUP_TASKS = 10


def cpu_ms_per(pids: dict[str, int], before: dict[str, float], per: float) -> str:
    return ", ".join(f"{name} {(sbs.cpu_s(pid) - before[name]) * 1000 / per:.2f}"
                     for name, pid in pids.items())


def cpu_now(pids: dict[str, int]) -> dict[str, float]:
    return {name: sbs.cpu_s(pid) for name, pid in pids.items()}


async def idle(pids: dict[str, int], seconds: float) -> str:
    before, started = cpu_now(pids), time.monotonic()
    await asyncio.sleep(seconds)  # what is measured is what happens meanwhile
    return cpu_ms_per(pids, before, time.monotonic() - started)


async def measure(system: sbs.Halfway, bench: sbs.Bench, args: argparse.Namespace,
                  broker: int) -> None:
    await system.setup(bench)
    try:
        for i in range(WARMUP_TASKS):
            await sbs.timed(system, f"{bench.run_id}-{system.name}-warm{i}")
        pids = {"broker": broker} | {p.name: p.pid for p in system.procs}
        print(f"{system.name} idle, CPU ms/s: {await idle(pids, args.idle_s)}", flush=True)
        before, started = cpu_now(pids), time.monotonic()
        for i in range(args.tasks):
            await sbs.timed(system, f"{bench.run_id}-{system.name}-{i}")
        seconds = time.monotonic() - started
        print(f"{system.name} {args.tasks} sequential tasks in {seconds:.2f} s "
              f"({seconds * 1000 / args.tasks:.2f} ms each), CPU ms per task: "
              f"{cpu_ms_per(pids, before, args.tasks)}", flush=True)
    finally:
        await system.teardown()


async def main(args: argparse.Namespace) -> None:
    sbs.log.configure(json=False, level="WARNING")
    broker = sbs.broker_pid()
    if broker is None:
        raise SystemExit("no local broker found (infra/dev up)")
    run_id = uuid.uuid4().hex[:8]
    logdir = args.cache / "runs" / run_id
    logdir.mkdir(parents=True)
    bench = sbs.Bench(run_id, args.cache, logdir)
    stub = await sbs.spawn("stub", [sys.executable, str(sbs.HERE / "stub.py"), "--port", "0"],
                           logdir)
    try:
        bench.stub_url = (await stub.wait_line("listening on")).removeprefix("listening on ")
        bench.stub_pid = stub.pid
        print(f"run {run_id}: logs {logdir}", flush=True)
        print(f"no deployment, CPU ms/s: {await idle({'broker': broker}, args.idle_s)}",
              flush=True)
        for system in (sbs.Halfway(), sbs.HalfwayWorker()):
            if system.name not in args.skip:
                await measure(system, bench, args, broker)
    finally:
        await stub.stop()


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=500)
    parser.add_argument("--idle-s", type=float, default=10.0)
    parser.add_argument("--skip", default="", help="comma-separated, of halfway,halfway-w")
    parser.add_argument("--cache", type=Path, default=sbs.default_cache())
    args = parser.parse_args()
    args.skip = {s for s in args.skip.split(",") if s}
    return args


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
