"""The same 3-step task through halfway, Restate, DBOS and a direct loop, side by side.

    .venv/bin/python benchmarks/side_by_side.py [--rounds 5] [--tasks 50] [--skip restate,dbos]
        [--pairs 2] [--variant LABEL:VAR=VALUE[,VAR=VALUE]]...

The task: three POSTs to one stub provider (`side_by_side/stub.py`, a process of its own), each
with an `Idempotency-Key`, one after the other. Four ways to run it:
- direct: the caller makes the three keyed POSTs itself. Nothing is journaled: the baseline
  every overhead is measured against.
- halfway: the app `side_by_side/bench_app.py` (a keyed tool `make_thing` with a lookup), run by
  `halfway run decider`, `executor` and `reconciler` as processes of their own on a fresh topic
  prefix, with the scripted model (the task's `input.script` lists the three steps). The caller
  starts a task with `HalfwayClient.start_task` and it is over when the caller reads its
  `task.finished` from the journal. The reconciler is there because a deployment has one: a
  call that outlives the tool's 5 s timeout (under load) is settled `unknown`, and only its
  lookup settles it; the report counts those.
- halfway-w: the same, with `halfway run worker` (a decider and an executor in one process)
  instead of the two processes: a step's decision reaches its attempt, and its settlement the
  next decision, without a consumer's fetch round trip.
- restate: `restate-server` (npm `@restatedev/restate-server`) and the service
  `side_by_side/restate_service.py` (`restate-sdk`), a handler doing three `ctx.run(...)` steps;
  the caller POSTs to the ingress and gets the handler's result back.
- w-LABEL (`--variant`, repeatable): halfway-w again, its processes started with more
  environment variables, e.g. `base:PYTHONPATH=/tmp/base/services` runs another checkout's
  code (a `git worktree` of the commit before a change). Compare a change within one run, not
  between runs: on a shared 2-core machine the spread between runs (worker CPU per task
  ±10-15%) is larger than most single changes.
- dbos: `side_by_side/dbos_app.py` (`dbos`), a workflow of three `@DBOS.step()`s with its system
  database on the local PostgreSQL (a database of its own, dropped at the end), behind a small
  HTTP front; the caller POSTs and gets the workflow's result back.
Every HTTP client (the caller's, the apps', the tools') is aiohttp: httpx's connection pool
slows down badly with hundreds of requests in flight on one client (seconds per request).
The peers are installed on first use into a cache folder outside the repository
(`~/.cache/halfway-bench`, or `--cache`/HALFWAY_BENCH_CACHE): restate-server with npm, and two
virtual environments of their own for `restate-sdk` and `dbos` (nothing is added to the
project's). A peer that cannot be installed or started gets its reason in its row.

How it runs: after a warm-up, `--rounds` rounds; each round runs every system in turn (the order
rotates from round to round, so no system always goes first or last), and for each system:
1. sequential: `--tasks` tasks one after the other; each one's latency, start to finished;
2. `--callers` (8) concurrent callers sharing `--tasks` tasks: tasks/s;
3. `--inflight` (256) tasks started at once: steps/s (3 steps a task) until the last finished.
The floor is measured in every round too, on a topic prefix of its own: one journal append
(acks=all, idempotent, as the services write: send to ack) and one produce→consume hop (send to
receipt by a consumer already waiting at the partition's end, as the services read; the record
may reach the consumer before the producer has its ack, so a hop can be shorter than an append).

How to read the table:
- task p50/p99: latency of one task, sequential, pooled over the rounds; "p50 by round" shows
  the spread of the per-round medians.
- overhead/step: (task p50 - direct p50) / 3, what a system adds to each step over calling the
  provider yourself. halfway's includes the caller's side of the journal (its request append
  and reading `task.finished`), as the others' include their HTTP front.
- the ratios divide halfway's overhead per step by the floor (how many journal round trips a
  step costs, in effect), by halfway's critical path per step (the round trips a halfway task
  cannot do without, in series: its request's hop to the decider, 2 + 3 per step appends (a
  worker's: 1 + 1 per step, a settlement goes with the next move), and the hop of
  `task.finished` to the caller, each at the floor's p50; divided by the steps; a peer's
  against halfway-w's) and by each peer's overhead per step (above 1: halfway adds more).
- CPU per task: CPU time (utime+stime from /proc) of each process over all of a system's
  phases, divided by that system's tasks: halfway's decider, executor, reconciler and the Kafka
  broker; restate-server and the service; the DBOS app and PostgreSQL (the backends of its
  database and the server's own auxiliary processes); and for every system the caller (this
  process) and the stub. The broker and PostgreSQL are shared machines: anything else using
  them during a run is counted too. By phase: the same for the system's processes alone (not
  the caller, not the stub), per task of each phase, which shows what concurrency amortizes.
- unknown: halfway's steps settled `unknown` (a call past the tool's timeout), each settled
  later by the reconciler's lookup; each one stretches its task's latency.
Durability is not the same everywhere, and the figures say nothing about it: the local broker
acknowledges acks=all from memory (one replica, no fsync per write), restate-server fsyncs its
local log, and PostgreSQL commits with synchronous_commit (fsync) unless configured otherwise.
All of it shares the machine's cores with the caller and the stub. Figures only; nothing here
passes or fails.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
import asyncpg
from aiokafka import AIOKafkaConsumer, TopicPartition

from halfway import log
from halfway.client import HalfwayClient
from halfway.contract import DecidedBy, EffectClass, StepIntended, mint_key, step_id
from halfway.contract.topics import ALL_TOPICS, JOURNAL
from halfway.infra.paths import halfway_home, kafka_home, read_pid
from halfway.journal import JournalWriter, ensure_topics
from halfway.journal.admin import delete_topics
from halfway.journal.limits import fetch_limits
from halfway.journal.records import decode
from halfway.settings import KafkaSettings, pg_dsn, pg_is_external, pg_port

HERE = Path(__file__).resolve().parent / "side_by_side"
STEPS = 3
SCRIPT = [{"tool": "make_thing", "args": {"n": n}} for n in range(1, STEPS + 1)]
# A halfway task's journal round trips in series: task.started, then intended, attempted and
# settled per step, then task.finished; the request's hop to the decider and the finish's to
# the caller. A worker with the scripted model journals a task's start with its first step's
# decision and attempt, and each settlement with the next move (the next step's decision and
# attempt, or the finish): one append per step, and one more.
JOURNAL_APPENDS = {"halfway": 2 + 3 * STEPS, "halfway-w": 1 + STEPS}
JOURNAL_HOPS = 2
TASK_TIMEOUT_S = 60.0  # one task, start to finished (the first one waits for the services)
INFLIGHT_TIMEOUT_S = 120.0  # one of the tasks started at once
INSTALL_TIMEOUT_S = 600.0
START_TIMEOUT_S = 60.0
WARMUP_TASKS = 20
FLOOR_WARMUP = 50
CLK_TCK = os.sysconf("SC_CLK_TCK")
SYSTEMS = ("direct", "halfway", "halfway-w", "restate", "dbos")
PEERS = ("halfway", "halfway-w", "restate", "dbos")


class NotRun(Exception):
    """A system that cannot run here; the message says why, in the table."""


# --- processes and their CPU time -------------------------------------------------------------


def default_cache() -> Path:
    """Where the peers are installed and each run's logs go."""
    return Path(os.environ.get("HALFWAY_BENCH_CACHE", "~/.cache/halfway-bench")).expanduser()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_s(pid: int) -> float:
    """utime + stime of one process, in seconds (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cmdline_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
            errors="replace")
    except OSError:
        return ""


def all_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


def parent_of(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def broker_pid() -> int | None:
    pid = read_pid(kafka_home() / "kafka.pid")
    if pid is not None and "kafka.Kafka" in cmdline_of(pid):
        return pid
    found = [p for p in all_pids() if "kafka.Kafka" in cmdline_of(p)]
    return found[0] if len(found) == 1 else None


def postmaster_pid() -> int | None:
    """The PostgreSQL server on our port (not the one of any other cluster)."""
    if pg_is_external():
        return None
    for pid in all_pids():
        cmd = cmdline_of(pid)
        if "postgres" in cmd and f"-p {pg_port()}" in cmd and " -D " in cmd:
            return pid
    return None


def postgres_cpu_s(postmaster: int, database: str) -> float:
    """The postmaster, the backends of `database`, and the auxiliary processes (walwriter,
    checkpointer, ...): not the backends of anyone else's databases."""
    total = cpu_s(postmaster)
    for pid in all_pids():
        if parent_of(pid) != postmaster:
            continue
        title = cmdline_of(pid)
        if f" {database} " in title or "(" not in title:
            total += cpu_s(pid)
    return total


@dataclass
class Proc:
    name: str
    process: asyncio.subprocess.Process
    log: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    async def wait_line(self, prefix: str, timeout_s: float = START_TIMEOUT_S) -> str:
        """The first line of the log that starts with `prefix` (the process prints it once it
        accepts connections)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.log.read_text(errors="replace").splitlines():
                if line.startswith(prefix):
                    return line
            if self.process.returncode is not None:
                break
            await asyncio.sleep(0.1)
        raise NotRun(f"{self.name} did not start: {self.tail(3)[-300:]!r}")

    async def stop(self) -> None:
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.terminate()
            try:
                await asyncio.wait_for(self.process.wait(), 10)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    self.process.kill()
                await self.process.wait()


async def spawn(name: str, argv: list[str], logdir: Path, *, env: dict[str, str] | None = None,
                cwd: Path | None = None) -> Proc:
    log = logdir / f"{name}.log"
    with log.open("wb") as out:
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=out, stderr=out,
            env=env if env is not None else dict(os.environ), cwd=cwd)
    return Proc(name, process, log)


# --- installing the peers ---------------------------------------------------------------------


def run_quietly(argv: list[str], what: str, cwd: Path | None = None) -> None:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, cwd=cwd,
                              timeout=INSTALL_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NotRun(f"{what}: {exc}") from None
    if done.returncode != 0:
        last = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"]
        raise NotRun(f"{what} failed: {last[0][:200]}")


def venv(cache: Path, name: str, packages: list[str], probe: str) -> Path:
    """A virtual environment of its own in the cache, with `packages`; its python."""
    home = cache / name
    python = home / "bin" / "python"
    marker = home / ".installed"
    if marker.exists() and marker.read_text() == " ".join(packages):
        return python
    if not python.exists():
        run_quietly([sys.executable, "-m", "venv", str(home)], f"python -m venv {home}")
    run_quietly([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                 *packages], f"pip install {' '.join(packages)}")
    run_quietly([str(python), "-c", f"import {probe}"], f"import {probe}")
    marker.write_text(" ".join(packages))
    return python


def install_restate(cache: Path) -> tuple[Path, Path]:
    """(the restate-server binary, the Python of the venv with restate-sdk)."""
    prefix = cache / "restate"
    found = sorted(prefix.glob("node_modules/@restatedev/restate-server-*/bin/restate-server"))
    if not found:
        if shutil.which("npm") is None:
            raise NotRun("npm is not installed (restate-server comes from npm)")
        run_quietly(["npm", "install", "--prefix", str(prefix), "--no-audit", "--no-fund",
                     "--ignore-scripts", "--loglevel=error", "@restatedev/restate-server"],
                    "npm install @restatedev/restate-server")
        found = sorted(prefix.glob(
            "node_modules/@restatedev/restate-server-*/bin/restate-server"))
        shim = prefix / "node_modules" / ".bin" / "restate-server"
        if not found and shim.exists():
            found = [shim]
    if not found:
        raise NotRun("npm installed no restate-server binary for this platform")
    python = venv(cache, "restate-venv", ["restate-sdk", "hypercorn", "aiohttp"], "restate")
    return found[0], python


def install_dbos(cache: Path) -> Path:
    return venv(cache, "dbos-venv", ["dbos", "aiohttp"], "dbos")


def version_of(python: Path, dist: str) -> str:
    done = subprocess.run([str(python), "-c", f"import importlib.metadata as m; "
                           f"print(m.version({dist!r}))"], capture_output=True, text=True,
                          check=False)
    return done.stdout.strip() or "?"


# --- the systems ------------------------------------------------------------------------------


def new_client(limit: int = 1024) -> aiohttp.ClientSession:
    """aiohttp, everywhere in this benchmark: httpx's pool slows down badly with hundreds of
    requests in flight on one client (see side_by_side/bench_app.py)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit),
                                 timeout=aiohttp.ClientTimeout(total=INFLIGHT_TIMEOUT_S))


async def post_json(http: aiohttp.ClientSession, url: str, **kwargs: Any) -> Any:
    async with http.post(url, **kwargs) as response:
        response.raise_for_status()
        return await response.json()


@dataclass
class System:
    name: str
    version: str = ""
    why_not: str | None = None
    # figures, pooled over the rounds
    latencies_ms: list[float] = field(default_factory=list)
    round_p50_ms: list[float] = field(default_factory=list)
    callers_tps: list[float] = field(default_factory=list)
    inflight_sps: list[float] = field(default_factory=list)
    cpu: dict[str, float] = field(default_factory=dict)
    tasks_run: int = 0
    # CPU of the system's own processes (not the caller's, not the stub's) and tasks, by phase
    phase_cpu: dict[str, dict[str, float]] = field(default_factory=dict)
    phase_tasks: dict[str, int] = field(default_factory=dict)

    async def setup(self, bench: Bench) -> None: ...

    async def one(self, task_id: str) -> None:
        raise NotImplementedError

    async def diagnose(self, task_id: str) -> str:
        """Where an unfinished task stands, in words (for a timeout's message)."""
        return "no more is known"

    def processes(self) -> dict[str, Callable[[], float]]:
        """Named CPU-time probes of the processes that do this system's work."""
        return {}

    async def teardown(self) -> None: ...


class Direct(System):
    def __init__(self) -> None:
        super().__init__("direct")

    async def setup(self, bench: Bench) -> None:
        self.http = new_client()
        self.stub = bench.stub_url

    async def one(self, task_id: str) -> None:
        for n in range(1, STEPS + 1):
            await post_json(self.http, f"{self.stub}/things", json={"n": n},
                            headers={"Idempotency-Key": f"{task_id}:{n}"})

    async def teardown(self) -> None:
        await self.http.close()


async def journal_at_end(settings: KafkaSettings) -> AIOKafkaConsumer:
    """A consumer of every journal partition, positioned at their ends (as the services read:
    read_committed, the project's fetch limits)."""
    topic = JOURNAL.name(settings.topic_prefix)
    consumer = AIOKafkaConsumer(**settings.client(), group_id=None,
                                enable_auto_commit=False, isolation_level="read_committed",
                                **fetch_limits())
    await consumer.start()
    tps = [TopicPartition(topic, p) for p in range(JOURNAL.partitions)]
    consumer.assign(tps)
    await consumer.seek_to_end(*tps)
    for tp in tps:  # resolve the ends now, not at the first fetch
        await consumer.position(tp)
    return consumer


class FinishWatcher:
    """Reads the journal from its end and resolves each awaited task at its `task.finished`."""

    def __init__(self, settings: KafkaSettings) -> None:
        self.settings = settings
        self.waiting: dict[str, asyncio.Future[str]] = {}
        self.unknowns = 0  # step settlements `unknown` seen (a lookup settles them later)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.consumer = await journal_at_end(self.settings)
        self._task = asyncio.create_task(self._run())

    def expect(self, task_id: str) -> asyncio.Future[str]:
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self.waiting[task_id] = future
        return future

    async def _run(self) -> None:
        while True:
            batches = await self.consumer.getmany(timeout_ms=500)
            for records in batches.values():
                for record in records:
                    kind = dict(record.headers or ()).get("type")
                    if kind == b"step.settled" and record.value is not None and \
                            json.loads(record.value).get("outcome") == "unknown":
                        self.unknowns += 1
                    if kind != b"task.finished" or record.key is None:
                        continue
                    future = self.waiting.pop(record.key.decode(), None)
                    if future is not None and not future.done():
                        try:
                            state = str(getattr(decode(record), "state", "?"))
                        except Exception as exc:
                            state = f"undecodable: {exc}"
                        future.set_result(state)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.consumer.stop()


class Halfway(System):
    """halfway with deciders and executors as separate processes (`--pairs` of each)."""

    def __init__(self, name: str = "halfway", env: dict[str, str] | None = None) -> None:
        super().__init__(name)
        self.procs: list[Proc] = []
        self.env = env or {}  # a variant's settings, over this process's environment

    def services(self, pairs: int) -> list[str]:
        return [*(["decider", "executor"] * pairs), "reconciler"]

    async def setup(self, bench: Bench) -> None:
        base = KafkaSettings.from_env()
        # Topics (and so consumer groups) of its own: halfway and halfway-w sharing them would
        # be one mixed deployment, each system's tasks run by the other's processes too.
        self.settings = base.with_prefix(f"sbs-{bench.run_id}-{self.name}.")
        await ensure_topics(self.settings, ALL_TOPICS)
        env = dict(os.environ) | {"HALFWAY_TOPIC_PREFIX": self.settings.topic_prefix,
                                  "HALFWAY_LOG_LEVEL": "WARNING", "HALFWAY_MODEL": "scripted",
                                  "STUB_URL": bench.stub_url, "PYTHONUNBUFFERED": "1",
                                  # this broker's credentials, for a variant's checkout too
                                  "HALFWAY_HOME": str(halfway_home())} | self.env
        env.pop("HALFWAY_MODEL_CALL_LOG", None)  # the model must not fsync a file per answer
        services = self.services(bench.pairs)
        logs = bench.logdir / self.name
        logs.mkdir()
        seen: dict[str, int] = {}
        for service in services:
            seen[service] = seen.get(service, 0) + 1
            name = service if seen[service] == 1 else f"{service}-{seen[service]}"
            self.procs.append(await spawn(
                name, [sys.executable, "-m", "halfway", "run", service,
                       "--app", "bench_app:app"], logs, env=env, cwd=HERE))
        self.watcher = FinishWatcher(self.settings)
        await self.watcher.start()
        self.client = HalfwayClient(self.settings)
        await self.client.__aenter__()
        self.broker = broker_pid()

    async def one(self, task_id: str) -> None:
        finished = self.watcher.expect(task_id)
        try:
            await self.client.start_task(task_id, {"script": SCRIPT, "summary": "3 things"},
                                         ["make_thing"])
            state = await finished
        finally:
            self.watcher.waiting.pop(task_id, None)
        if state != "succeeded":
            raise RuntimeError(f"task {task_id} finished {state}")

    async def diagnose(self, task_id: str) -> str:
        state = await self.client.task_state(task_id)
        def words(effect: Any) -> str:
            settled = effect.settlement
            if settled is None:
                return "unsettled"
            return settled.outcome.value + (f" ({settled.reason})" if settled.reason else "")

        steps = ", ".join(f"{n}: {len(step.effect.attempts)} attempt(s), {words(step.effect)}"
                          for n, step in sorted(state.steps.items()))
        return (f"journal says {state.status.value if state.status else 'nothing'}"
                f"{' (' + state.final_state.value + ')' if state.final_state else ''}; "
                f"steps {{{steps}}}")

    def processes(self) -> dict[str, Callable[[], float]]:
        probes = {p.name: (lambda pid=p.pid: cpu_s(pid)) for p in self.procs}
        if self.broker is not None:
            probes["broker"] = lambda pid=self.broker: cpu_s(pid)
        return probes

    async def teardown(self) -> None:
        if hasattr(self, "client"):
            await self.client.__aexit__(None, None, None)
        if hasattr(self, "watcher"):
            await self.watcher.stop()
        for proc in self.procs:
            await proc.stop()
        if hasattr(self, "settings"):
            await delete_topics(self.settings, ALL_TOPICS)


class HalfwayWorker(Halfway):
    """halfway with `halfway run worker` processes (a decider and an executor in one process,
    `--pairs` of them): a step's decision and attempt skip the fetch round trips."""

    def __init__(self, name: str = "halfway-w", env: dict[str, str] | None = None) -> None:
        super().__init__(name, env)

    def services(self, pairs: int) -> list[str]:
        return [*(["worker"] * pairs), "reconciler"]


class Restate(System):
    def __init__(self) -> None:
        super().__init__("restate")
        self.procs: list[Proc] = []

    async def setup(self, bench: Bench) -> None:
        server, python = await asyncio.to_thread(install_restate, bench.cache)
        done = await asyncio.to_thread(subprocess.run, [str(server), "--version"],
                                       capture_output=True, text=True, check=False)
        self.version = (f"server {done.stdout.strip().split()[-1] if done.stdout else '?'}, "
                        f"sdk {version_of(python, 'restate-sdk')}")
        ingress, admin, fabric, service = (free_port() for _ in range(4))
        self.data = bench.logdir / "restate-data"
        env = dict(os.environ) | {
            "RESTATE_INGRESS__BIND_ADDRESS": f"127.0.0.1:{ingress}",
            "RESTATE_ADMIN__BIND_ADDRESS": f"127.0.0.1:{admin}",
            "RESTATE_BIND_ADDRESS": f"127.0.0.1:{fabric}",
            "RESTATE_LISTEN_MODE": "tcp", "RESTATE_LOG_FILTER": "warn",
            "RESTATE_DISABLE_TELEMETRY": "true"}
        self.procs.append(await spawn("restate-server", [
            str(server), "--no-logo", "--base-dir", str(self.data), "--node-name", "bench"],
            bench.logdir, env=env))
        self.procs.append(await spawn("restate-service", [
            str(python), str(HERE / "restate_service.py"), str(service), bench.stub_url],
            bench.logdir))
        await self.procs[1].wait_line("listening on")
        self.http = new_client()
        admin_url = f"http://127.0.0.1:{admin}"
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # the admin API answers once the server is up
            try:
                async with self.http.get(f"{admin_url}/health") as response:
                    if response.status == 200:
                        break
            except aiohttp.ClientError:
                pass
            if time.monotonic() > deadline or self.procs[0].process.returncode is not None:
                raise NotRun(f"restate-server did not start: {self.procs[0].tail(3)[-300:]!r}")
            await asyncio.sleep(0.2)
        async with self.http.post(f"{admin_url}/deployments",
                                  json={"uri": f"http://127.0.0.1:{service}"}) as response:
            if response.status >= 300:
                raise NotRun(f"registering the service failed: {response.status} "
                             f"{(await response.text())[:200]}")
        self.url = f"http://127.0.0.1:{ingress}/Bench/run"

    async def one(self, task_id: str) -> None:
        answer = await post_json(self.http, self.url, json={"task": task_id})
        if len(answer["ids"]) != STEPS:
            raise RuntimeError(f"restate answered {answer!r:.200}")

    def processes(self) -> dict[str, Callable[[], float]]:
        return {p.name: (lambda pid=p.pid: cpu_s(pid)) for p in self.procs}

    async def teardown(self) -> None:
        if hasattr(self, "http"):
            await self.http.close()
        for proc in reversed(self.procs):
            await proc.stop()
        if hasattr(self, "data"):
            shutil.rmtree(self.data, ignore_errors=True)


class Dbos(System):
    def __init__(self) -> None:
        super().__init__("dbos")
        self.procs: list[Proc] = []
        self.database: str | None = None

    async def setup(self, bench: Bench) -> None:
        python = await asyncio.to_thread(install_dbos, bench.cache)
        self.version = f"dbos {version_of(python, 'dbos')}"
        database = f"sbs_dbos_{bench.run_id}"
        conn = await asyncpg.connect(pg_dsn())
        try:
            await conn.execute(f'CREATE DATABASE "{database}"')
        finally:
            await conn.close()
        self.database = database
        port = free_port()
        self.procs.append(await spawn("dbos-app", [
            str(python), str(HERE / "dbos_app.py"), str(port), bench.stub_url,
            pg_dsn(database)], bench.logdir))
        await self.procs[0].wait_line("listening on")
        self.http = new_client()
        self.url = f"http://127.0.0.1:{port}/run"
        self.postmaster = postmaster_pid()

    async def one(self, task_id: str) -> None:
        answer = await post_json(self.http, f"{self.url}/{task_id}")
        if len(answer["ids"]) != STEPS:
            raise RuntimeError(f"dbos answered {answer!r:.200}")

    def processes(self) -> dict[str, Callable[[], float]]:
        probes = {p.name: (lambda pid=p.pid: cpu_s(pid)) for p in self.procs}
        if self.postmaster is not None and self.database is not None:
            probes["postgres"] = (lambda pm=self.postmaster, db=self.database:
                                  postgres_cpu_s(pm, db))
        return probes

    async def teardown(self) -> None:
        if hasattr(self, "http"):
            await self.http.close()
        for proc in self.procs:
            await proc.stop()
        if self.database is not None:
            conn = await asyncpg.connect(pg_dsn())
            try:
                await conn.execute(f'DROP DATABASE IF EXISTS "{self.database}" WITH (FORCE)')
            finally:
                await conn.close()


# --- the floor --------------------------------------------------------------------------------


class Floor:
    """One journal append (acks=all, idempotent) and one produce→consume hop, on a prefix of
    its own (the services never see these events)."""

    def __init__(self, run_id: str) -> None:
        base = KafkaSettings.from_env()
        self.settings = base.with_prefix(f"sbs-floor-{run_id}.")
        self.append_ms: list[float] = []
        self.hop_ms: list[float] = []
        self._arrived: dict[str, asyncio.Future[float]] = {}

    async def start(self) -> None:
        await ensure_topics(self.settings, (JOURNAL,))
        self.writer = JournalWriter(self.settings)
        await self.writer.start()
        self.consumer = await journal_at_end(self.settings)
        self._reader = asyncio.create_task(self._read())
        await self.measure(FLOOR_WARMUP, record=False)

    async def _read(self) -> None:
        while True:
            batches = await self.consumer.getmany(timeout_ms=500)
            now = time.perf_counter()
            for records in batches.values():
                for record in records:
                    event_id = dict(record.headers or ()).get("event_id", b"").decode()
                    future = self._arrived.pop(event_id, None)
                    if future is not None and not future.done():
                        future.set_result(now)

    @staticmethod
    def event(i: int) -> StepIntended:
        task = "floor-task"
        sid = step_id(task, 1 + i)
        return StepIntended(event_id=uuid.uuid4().hex, task_id=task, at=datetime.now(UTC),
                            step_id=sid, n=1 + i, tool="make_thing", args={"n": 1 + i % 3},
                            key=mint_key(sid), subject=None, effect_class=EffectClass.KEYED,
                            decided_by=DecidedBy(model="bench"))

    async def measure(self, samples: int, *, record: bool = True) -> None:
        appends, hops = self.append_ms if record else [], self.hop_ms if record else []
        for i in range(samples):
            event = self.event(i)
            start = time.perf_counter()
            await self.writer.append(event)
            appends.append((time.perf_counter() - start) * 1e3)
        loop = asyncio.get_running_loop()
        for i in range(samples):
            event = self.event(i)
            arrived: asyncio.Future[float] = loop.create_future()
            self._arrived[event.event_id] = arrived
            start = time.perf_counter()
            await self.writer.append(event)
            hops.append((await asyncio.wait_for(arrived, 10) - start) * 1e3)

    async def stop(self) -> None:
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader
        await self.consumer.stop()
        await self.writer.stop()
        await delete_topics(self.settings, (JOURNAL,))


# --- the run ----------------------------------------------------------------------------------


@dataclass
class Bench:
    run_id: str
    cache: Path
    logdir: Path
    stub_url: str = ""
    stub_pid: int = 0
    pairs: int = 1  # halfway decider+executor instances sharing the work (one group each)


def pct(samples: list[float], p: int) -> float:
    if len(samples) < 2:
        return samples[0] if samples else float("nan")
    return statistics.quantiles(samples, n=100, method="inclusive")[p - 1]


async def timed(system: System, task_id: str, timeout_s: float = TASK_TIMEOUT_S) -> float:
    """One task's latency in ms; a task not finished in time is an error saying where it is."""
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            await system.one(task_id)
    except TimeoutError:
        raise RuntimeError(f"{task_id} not finished after {timeout_s:.0f} s: "
                           f"{await system.diagnose(task_id)}") from None
    return (time.perf_counter() - start) * 1e3


async def all_of(runs: list[Awaitable[float]]) -> None:
    """Run them all to the end (each has its own timeout); then raise the first failure."""
    results = await asyncio.gather(*runs, return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(results)} failed; the first: {failed[0]}")


async def things(http: aiohttp.ClientSession, stub_url: str) -> int:
    async with http.get(f"{stub_url}/count") as response:
        return int((await response.json())["things"])


async def run_system(system: System, bench: Bench, args: argparse.Namespace, r: int,
                     http: aiohttp.ClientSession) -> None:
    """One round of one system: sequential, concurrent callers, many in flight."""
    tag = f"{bench.run_id}-{system.name}-r{r}"
    probes = system.processes()
    before = {name: probe() for name, probe in probes.items()}
    caller_before = resource.getrusage(resource.RUSAGE_SELF)
    stub_before = cpu_s(bench.stub_pid)
    made_before = await things(http, bench.stub_url)
    mark = dict(before)

    def phase_done(phase: str, tasks: int) -> None:
        spent = system.phase_cpu.setdefault(phase, {})
        for name, probe in probes.items():
            now = probe()
            spent[name] = spent.get(name, 0.0) + now - mark[name]
            mark[name] = now
        system.phase_tasks[phase] = system.phase_tasks.get(phase, 0) + tasks

    latencies = [await timed(system, f"{tag}-s{i}") for i in range(args.tasks)]
    phase_done("sequential", args.tasks)
    system.latencies_ms += latencies
    system.round_p50_ms.append(statistics.median(latencies))

    queue = iter(range(args.tasks))

    async def caller() -> float:
        for i in queue:
            await timed(system, f"{tag}-c{i}")
        return 0.0

    if args.callers:
        start = time.perf_counter()
        await all_of([caller() for _ in range(args.callers)])
        system.callers_tps.append(args.tasks / (time.perf_counter() - start))
        phase_done(f"{args.callers} callers", args.tasks)

    if args.inflight:
        start = time.perf_counter()
        await all_of([timed(system, f"{tag}-f{i}", INFLIGHT_TIMEOUT_S)
                      for i in range(args.inflight)])
        system.inflight_sps.append(STEPS * args.inflight / (time.perf_counter() - start))
        phase_done(f"{args.inflight} in flight", args.inflight)

    ran = args.tasks * (2 if args.callers else 1) + args.inflight
    system.tasks_run += ran
    made = await things(http, bench.stub_url) - made_before
    if made != STEPS * ran:
        print(f"  note: {system.name} round {r}: the stub made {made} things for {ran} tasks "
              f"(expected {STEPS * ran})", flush=True)
    after = resource.getrusage(resource.RUSAGE_SELF)
    for name, probe in probes.items():
        system.cpu[name] = system.cpu.get(name, 0.0) + probe() - before[name]
    system.cpu["caller"] = system.cpu.get("caller", 0.0) + (
        after.ru_utime + after.ru_stime - caller_before.ru_utime - caller_before.ru_stime)
    system.cpu["stub"] = system.cpu.get("stub", 0.0) + cpu_s(bench.stub_pid) - stub_before


def fmt(value: float, digits: int = 1) -> str:
    return "—" if value != value else f"{value:,.{digits}f}"  # NaN: not measured


def report(systems: list[System], floor: Floor, args: argparse.Namespace, seconds: float
           ) -> None:
    by_name = {s.name: s for s in systems}
    direct = by_name["direct"]
    direct_p50 = statistics.median(direct.latencies_ms) if direct.latencies_ms else float("nan")
    overhead: dict[str, float] = {}
    print()
    print(f"side by side: {STEPS} keyed POSTs per task to one stub provider; {args.rounds} "
          f"rounds interleaved; per round and system {args.tasks} sequential tasks, "
          f"{args.tasks} over {args.callers} callers, {args.inflight} in flight; "
          f"{os.cpu_count()} cores, load average now {os.getloadavg()[0]:.2f}; {seconds:.0f} s")
    header = (f"{'system':<9} {'task p50':>9} {'task p99':>9} {'p50 by round':>15} "
              f"{'overhead/step':>14} {f'{args.callers} callers':>11} "
              f"{f'{args.inflight} in flight':>13}")
    units = (f"{'':<9} {'ms':>9} {'ms':>9} {'ms (min..max)':>15} {'p50, ms':>14} "
             f"{'tasks/s':>11} {'steps/s':>13}")
    print(header)
    print(units)
    for s in systems:
        if s.why_not is not None and not s.latencies_ms:
            print(f"{s.name:<9} not run: {s.why_not}")
            continue
        p50 = statistics.median(s.latencies_ms)
        spread = f"{min(s.round_p50_ms):.1f}..{max(s.round_p50_ms):.1f}"
        if s.name == "direct":
            step = "(baseline)"
        else:
            overhead[s.name] = (p50 - direct_p50) / STEPS
            step = fmt(overhead[s.name], 2)
        tps = fmt(statistics.median(s.callers_tps)) if s.callers_tps else "—"
        sps = fmt(statistics.median(s.inflight_sps), 0) if s.inflight_sps else "—"
        print(f"{s.name:<9} {p50:>9.2f} {pct(s.latencies_ms, 99):>9.2f} {spread:>15} "
              f"{step:>14} {tps:>11} {sps:>13}")
        if s.why_not is not None:
            print(f"{'':<9} stopped early: {s.why_not}")
    append50, hop50 = statistics.median(floor.append_ms), statistics.median(floor.hop_ms)
    print()
    print(f"floor: journal append (acks=all) p50 {append50:.3f} ms, p99 "
          f"{pct(floor.append_ms, 99):.3f} ms; produce→consume hop p50 {hop50:.3f} ms, p99 "
          f"{pct(floor.hop_ms, 99):.3f} ms (n={len(floor.append_ms)} each)")
    # What a halfway task cannot do without, in series: its request's hop to the decider,
    # the journal appends before and after each step's call and at its start and end, and the
    # hop of `task.finished` back to the caller.
    paths = {name: (JOURNAL_HOPS * hop50 + appends * append50) / STEPS
             for name, appends in JOURNAL_APPENDS.items()}
    for name, appends in JOURNAL_APPENDS.items():
        print(f"{name}'s critical path per step: ({appends} appends + {JOURNAL_HOPS} hops) / "
              f"{STEPS} = {paths[name]:.3f} ms")
    print("ratios (overhead per step, p50):")
    peers = [*PEERS, *(f"w-{label}" for label, _ in args.variant)]
    for name in peers:
        if name not in overhead:
            continue
        own = paths.get(name, paths["halfway-w"])
        line = (f"  {name:<9} {overhead[name] / append50:6.1f}x an append, "
                f"{overhead[name] / hop50:6.1f}x a hop, "
                f"{overhead[name] / own:5.2f}x {name if name in paths else 'halfway-w'}'s "
                f"critical path")
        others = [f"{overhead[name] / overhead[o]:.2f}x {o}" for o in peers
                  if o != name and o in overhead and overhead[o] > 0]
        if name.startswith(("halfway", "w-")) and others:
            line += f"; {name} = " + ", ".join(others)
        print(line)
    for halfway in systems:
        if isinstance(halfway, Halfway) and hasattr(halfway, "watcher"):
            print(f"{halfway.name}: {halfway.watcher.unknowns} step(s) settled unknown (a call "
                  f"past the tool's 5 s timeout), then settled by the reconciler's lookup")
    print("CPU per task, ms (all phases of all rounds):")
    for s in systems:
        if not s.tasks_run:
            continue
        per = {k: v / s.tasks_run * 1e3 for k, v in s.cpu.items()}
        system_ms = sum(v for k, v in per.items() if k not in ("caller", "stub"))
        parts = [f"{k} {v:.2f}" for k, v in per.items() if k not in ("caller", "stub")]
        print(f"  {s.name:<8} " + (", ".join(parts) + f" (= {system_ms:.2f}); " if parts else "")
              + f"caller {per.get('caller', 0):.2f}, stub {per.get('stub', 0):.2f}"
              + f"  [{s.tasks_run} tasks]")
    print("CPU per task by phase, ms (the system's processes; whether concurrency amortizes):")
    for s in systems:
        for phase, n in s.phase_tasks.items():
            spent = s.phase_cpu.get(phase, {})
            if n and spent:
                parts = ", ".join(f"{k} {v / n * 1e3:.2f}" for k, v in spent.items())
                print(f"  {s.name:<9} {phase:<14} {sum(spent.values()) / n * 1e3:6.2f} "
                      f"({parts})")
    versions = [f"{s.name}: {s.version}" for s in systems if s.version]
    if versions:
        print("versions: " + "; ".join(versions))


def variant(text: str) -> tuple[str, dict[str, str]]:
    """`--variant LABEL:VAR=VALUE[,VAR=VALUE]` as (label, environment)."""
    label, _, assignments = text.partition(":")
    if not re.fullmatch(r"[a-z0-9_-]{1,7}", label):
        raise argparse.ArgumentTypeError(f"{label!r}: a label is 1-7 of a-z 0-9 _ - "
                                         "(it names topics and a table row)")
    env = {}
    for assignment in filter(None, assignments.split(",")):
        name, eq, value = assignment.partition("=")
        if not eq or not name:
            raise argparse.ArgumentTypeError(f"{assignment!r} is not VAR=VALUE")
        env[name] = value
    return label, env


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=50,
                        help="tasks per round and system, sequential and over the callers")
    parser.add_argument("--callers", type=int, default=8,
                        help="concurrent callers sharing --tasks tasks (0: skip)")
    parser.add_argument("--inflight", type=int, default=256,
                        help="tasks started at once per round and system (0: skip)")
    parser.add_argument("--floor-samples", type=int, default=200, help="per round")
    parser.add_argument("--skip", default="", help=f"comma-separated, of {','.join(PEERS)}")
    parser.add_argument("--pairs", type=int, default=1,
                        help="halfway decider+executor pairs sharing the work (scale-out)")
    parser.add_argument("--variant", action="append", default=[], type=variant,
                        metavar="LABEL:VAR=VALUE[,VAR=VALUE]",
                        help="also run workers with these environment variables, as system "
                             "w-LABEL, interleaved with the others (repeatable): an A/B in one "
                             "run, e.g. base:PYTHONPATH=/path/to/other/checkout/services")
    parser.add_argument("--cache", type=Path, default=default_cache())
    args = parser.parse_args()
    if min(args.rounds, args.tasks) < 1 or min(args.callers, args.inflight) < 0:
        parser.error("--rounds and --tasks take 1 or more, --callers and --inflight 0 or more")
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.skip - set(PEERS):
        parser.error(f"--skip takes {','.join(PEERS)}, not "
                     f"{','.join(sorted(args.skip - set(PEERS)))}")
    args.cache.mkdir(parents=True, exist_ok=True)
    return args


async def main(args: argparse.Namespace) -> None:
    log.configure(json=False, level="WARNING")
    # Right after a topic is made, the first offset lookups may meet a partition whose leader
    # is not elected yet; aiokafka logs that as an error and retries. Not news here.
    logging.getLogger("aiokafka.consumer.fetcher").setLevel(logging.CRITICAL)
    skip = args.skip
    started = time.monotonic()
    run_id = uuid.uuid4().hex[:8]
    logdir = args.cache / "runs" / run_id
    await asyncio.to_thread(logdir.mkdir, parents=True)
    bench = Bench(run_id, args.cache, logdir, pairs=max(1, args.pairs))
    print(f"run {run_id}: cache {args.cache}, logs {logdir}; load average "
          f"{os.getloadavg()[0]:.2f} (others on the machine share its cores)", flush=True)

    stub = await spawn("stub", [sys.executable, str(HERE / "stub.py"), "--port", "0"], logdir)
    systems: list[System] = [Direct()]
    for cls in (Halfway, HalfwayWorker, Restate, Dbos):
        systems.append(cls())
    systems += [HalfwayWorker(f"w-{label}", env) for label, env in args.variant]
    floor = Floor(run_id)
    http = new_client(16)
    try:
        bench.stub_url = (await stub.wait_line("listening on")).removeprefix("listening on ")
        bench.stub_pid = stub.pid
        await floor.start()
        for s in systems:
            if s.name in skip:
                s.why_not = "skipped (--skip)"
                continue
            t0 = time.monotonic()
            print(f"setting up {s.name} ...", flush=True)
            try:
                await s.setup(bench)
                for i in range(WARMUP_TASKS):
                    await timed(s, f"{run_id}-{s.name}-warm{i}")
                await all_of([timed(s, f"{run_id}-{s.name}-warmc{i}")
                              for i in range(args.callers)])
            except Exception as exc:
                s.why_not = str(exc) if isinstance(exc, NotRun) else f"{type(exc).__name__}: {exc}"
                print(f"  {s.name}: not run: {s.why_not}", flush=True)
                continue
            print(f"  {s.name} ready in {time.monotonic() - t0:.1f} s"
                  + (f" ({s.version})" if s.version else ""), flush=True)
        live = [s for s in systems if s.why_not is None]
        for r in range(args.rounds):
            order = live[r % len(live):] + live[:r % len(live)]
            t0 = time.monotonic()
            await floor.measure(args.floor_samples)
            for s in order:
                if s.why_not is not None:
                    continue
                try:
                    await run_system(s, bench, args, r, http)
                except Exception as exc:
                    s.why_not = f"round {r + 1}: {type(exc).__name__}: {exc}"[:600]
                    print(f"  {s.name}: {s.why_not}", flush=True)
            print(f"round {r + 1}/{args.rounds} ({' → '.join(s.name for s in order)}) "
                  f"{time.monotonic() - t0:.1f} s", flush=True)
        report(systems, floor, args, time.monotonic() - started)
    finally:
        await http.close()
        for s in reversed(systems):
            try:
                await s.teardown()
            except Exception as exc:
                print(f"  teardown of {s.name}: {type(exc).__name__}: {exc}", flush=True)
        with contextlib.suppress(Exception):
            await floor.stop()
        await stub.stop()
    print(f"total {time.monotonic() - started:.0f} s; logs in {logdir}")


if __name__ == "__main__":
    asyncio.run(main(parse_args()))
