"""Real processes for integration tests: the payment simulator, deciders and executors.

Every process is a real child (`python -m halfway run decider|executor`,
`python -m halfway.simulators.payments`) configured only through the environment, as in a
deployment, on a topic prefix of its own test. Its stdout and stderr go to a log file; when a
test fails, the tail of every log is attached to the failure report (this module is also a
pytest plugin: `pytest_plugins = ["tests.processes"]`).

The journal is watched as a reader would: `JournalWatcher` reads the test's journal topic from
offset zero, without a consumer group, and folds every task as it goes. Every wait is bounded
(a hang fails the test, it never blocks CI) and waits on events, never on fixed sleeps.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
import uuid
from collections.abc import Callable, Generator, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from halfway import settings as env
from halfway.contract import Event, TaskRequested
from halfway.contract.topics import ALL_TOPICS, JOURNAL, TASKS
from halfway.core.fold import StepStatus, TaskState, apply
from halfway.journal import JournalWriter, ensure_topics, read_topic
from halfway.journal.admin import delete_topics, topic_partitions
from halfway.journal.limits import fetch_limits
from halfway.journal.records import InvalidRecord, decode
from halfway.settings import KafkaSettings

T = TypeVar("T")

WAIT_S = 90.0  # default bound for any wait on the journal
START_TIMEOUT_S = 30.0  # a cold interpreter importing aiohttp, aiokafka and pydantic
STOP_TIMEOUT_S = 10.0
POLL_S = 0.05  # for what only a poll can see: a log line, the provider's request log
HTTP_TIMEOUT_S = 30.0  # the test's own client to the simulator, which should never time out
TAIL_LINES = 60
TAIL_LINE_CHARS = 600


# --- processes -----------------------------------------------------------------------------------


@dataclass
class Proc:
    """One child process and the file its output goes to."""

    name: str
    process: asyncio.subprocess.Process
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.process.returncode is None

    def log_events(self) -> list[dict[str, Any]]:
        """The JSON log lines written so far (HALFWAY_LOG_FORMAT=json), parsed."""
        out = []
        with contextlib.suppress(FileNotFoundError):
            for line in self.log_path.read_text(errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    entry = json.loads(line)
                    if isinstance(entry, dict):
                        out.append(entry)
        return out

    def logged(self, event: str) -> list[dict[str, Any]]:
        return [e for e in self.log_events() if e.get("event") == event]

    async def until_logged(self, event: str, count: int = 1, timeout_s: float = WAIT_S,
                           ) -> list[dict[str, Any]]:
        """The log lines with this event (e.g. "partitions assigned") once there are `count`
        of them; polled (a log file has no notification), bounded."""
        try:
            async with asyncio.timeout(timeout_s):
                while len(found := self.logged(event)) < count:
                    if not self.alive:
                        raise AssertionError(f"{self.name} exited before logging {event!r}\n"
                                             + self.tail())
                    await asyncio.sleep(POLL_S)
        except TimeoutError:
            raise AssertionError(f"{self.name} did not log {event!r} {count} times within "
                                 f"{timeout_s:g} s\n" + self.tail()) from None
        return found

    def tail(self, lines: int = TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except FileNotFoundError:
            text = ["(no log)"]
        state = "running" if self.alive else f"exited {self.process.returncode}"
        body = "\n".join(f"  {line[:TAIL_LINE_CHARS]}" for line in text)
        return f"--- {self.name} (pid {self.pid}, {state}) {self.log_path}\n{body}"


async def kill9(proc: Proc) -> None:
    """SIGKILL: no cleanup, no leaving the consumer group, a call in flight cut off."""
    if proc.alive:
        proc.process.send_signal(signal.SIGKILL)
    await asyncio.wait_for(proc.process.wait(), STOP_TIMEOUT_S)


async def stop(proc: Proc, timeout_s: float = STOP_TIMEOUT_S) -> int:
    """SIGTERM, then a bounded wait; SIGKILL if it did not stop. Returns the exit code."""
    if proc.alive:
        proc.process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(proc.process.wait(), timeout_s)
        except TimeoutError:
            await kill9(proc)
    code = proc.process.returncode
    assert code is not None
    return code


# --- the journal, watched ------------------------------------------------------------------------


class JournalWatcher:
    """Every event of a journal topic, in log order per partition, and each task's fold."""

    def __init__(self, settings: KafkaSettings) -> None:
        self.settings = settings
        self.events: list[Event] = []
        self.states: dict[str, TaskState] = {}
        self.invalid: list[tuple[int, int, str]] = []
        self._news = asyncio.Event()
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        topic = JOURNAL.name(self.settings.topic_prefix)
        self._consumer = AIOKafkaConsumer(**self.settings.client(),
                                          group_id=None, enable_auto_commit=False,
                                          **fetch_limits())
        await self._consumer.start()
        # The topic's own count (a deployment may have fewer than the default): seeking a
        # partition that does not exist waits out the request timeout (40 s).
        tps = [TopicPartition(topic, p)
               for p in sorted(await topic_partitions(self.settings, topic))]
        self._consumer.assign(tps)
        await self._consumer.seek_to_beginning(*tps)
        self._task = asyncio.create_task(self._run(), name="journal-watcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        if self._consumer is not None:
            await self._consumer.stop()

    async def _run(self) -> None:
        assert self._consumer is not None
        try:
            while True:
                batches = await self._consumer.getmany(timeout_ms=200)
                for records in batches.values():
                    for record in records:
                        try:
                            event = decode(record)
                        except InvalidRecord as exc:
                            self.invalid.append((record.partition, record.offset, exc.reason))
                            continue
                        self.events.append(event)
                        state = self.states.get(event.task_id) or TaskState(event.task_id)
                        self.states[event.task_id] = apply(state, event)
                if batches:
                    self._notify()
        finally:
            self._notify()  # a waiter sees the watcher is gone instead of hanging

    def _notify(self) -> None:
        self._news.set()
        self._news = asyncio.Event()

    async def wait_for(self, probe: Callable[[], T | None], what: str,
                       timeout_s: float = WAIT_S) -> T:
        """Wait until `probe()` returns something other than None (checked on every batch)."""
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    found = probe()
                    if found is not None:
                        return found
                    assert self._task is not None
                    if self._task.done():
                        raise AssertionError(f"the journal watcher stopped while waiting for "
                                             f"{what}: {self._task}")
                    await self._news.wait()
        except TimeoutError:
            raise AssertionError(f"no {what} within {timeout_s:g} s\n"
                                 + self.describe()) from None

    async def first(self, predicate: Callable[[Event], bool], what: str = "matching event",
                    timeout_s: float = WAIT_S) -> Event:
        """The first event in the journal (as read) for which `predicate` holds."""
        seen = 0

        def probe() -> Event | None:
            nonlocal seen
            for event in self.events[seen:]:
                if predicate(event):
                    return event
            seen = len(self.events)
            return None

        return await self.wait_for(probe, what, timeout_s)

    async def until_finished(self, task_ids: Iterable[str], timeout_s: float = WAIT_S,
                             ) -> dict[str, TaskState]:
        """Each task's state once every one of them has `task.finished`."""
        wanted = set(task_ids)

        def probe() -> dict[str, TaskState] | None:
            if all(self.finished(t) for t in wanted):
                return {t: self.states[t] for t in wanted}
            return None

        return await self.wait_for(probe, f"task.finished for all {len(wanted)} tasks",
                                   timeout_s)

    async def until_settled_or_stuck(self, task_ids: Iterable[str], timeout_s: float = WAIT_S,
                                     ) -> dict[str, TaskState]:
        """Each task's state once every one is finished or needs an operator (a visible
        unknown the harness will not check again)."""
        wanted = set(task_ids)

        def done(task_id: str) -> bool:
            state = self.states.get(task_id)
            return state is not None and (state.finished is not None or state.needs_attention)

        def probe() -> dict[str, TaskState] | None:
            if all(done(t) for t in wanted):
                return {t: self.states[t] for t in wanted}
            return None

        return await self.wait_for(probe, f"a final state or an escalated unknown for all "
                                   f"{len(wanted)} tasks", timeout_s)

    def finished(self, task_id: str) -> bool:
        state = self.states.get(task_id)
        return state is not None and state.finished is not None

    def of(self, task_id: str) -> list[Event]:
        return [e for e in self.events if e.task_id == task_id]

    def describe(self, limit: int = 20) -> str:
        """The unfinished tasks and their steps, for a failure message."""
        unfinished = [s for s in self.states.values() if s.finished is None]
        lines = [f"journal: {len(self.events)} events, {len(self.states)} tasks, "
                 f"{len(unfinished)} unfinished, {len(self.invalid)} invalid"]
        for state in unfinished[:limit]:
            steps = ", ".join(f"{s.n}:{s.status}" for s in state.steps.values())
            lines.append(f"  {state.task_id}: {state.status} steps [{steps}] "
                         f"last {[e.type for e in self.of(state.task_id)][-4:]}")
        return "\n".join(lines)


async def journal_now(settings: KafkaSettings) -> list[Event]:
    """Every event of the journal up to its end at this moment (not just what a watcher has
    read so far): for assertions that something is *not* in the log."""
    return [d.event async for d in read_topic(settings, JOURNAL)]


# --- the cluster of one test ---------------------------------------------------------------------


def renewal_request(task_id: str, *, invoice: str | None = None, customer: str = "cus_8812",
                    amount_cents: int = 4900, reask: bool = True) -> TaskRequested:
    """The renewal of `halfway.demo.renewal`: one charge, then finish.

    With `reask` (the demo's model), a model asked twice for the charge answers "49.00" the
    second time, which the tool refuses: the decider then finishes the task `failed`, so a
    second question shows in the journal and in the ledger (no charge). Without it the model
    answers the same way every time."""
    # Each task its own invoice unless told: an invoice is charged once (the subject guard).
    invoice = invoice or f"INV-{task_id}"
    charge = {"invoice": invoice, "customer": customer, "amount_cents": amount_cents,
              "currency": "usd"}
    step: dict[str, Any] = {"tool": "charge_customer", "args": charge}
    if reask:
        step["reask_args"] = {"amount_cents": "49.00"}
    return TaskRequested(
        event_id=uuid.uuid4().hex, task_id=task_id, at=datetime.now(UTC),
        input={"script": [step],
               "summary": f"renewed: {amount_cents} cents charged for invoice {invoice}"},
        allowed_tools=["charge_customer"],
    )


@dataclass
class Cluster:
    """The simulator, the services and the journal of one test, on a topic prefix of its own."""

    settings: KafkaSettings
    workdir: Path
    charge_timeout_s: float = 1.0
    sim_url: str = ""
    tripsim_url: str = ""
    gateway_url: str = ""
    procs: list[Proc] = field(default_factory=list)
    watcher: JournalWatcher | None = None
    writer: JournalWriter | None = None
    _counts: dict[str, int] = field(default_factory=dict)

    @property
    def model_call_log(self) -> Path:
        return self.workdir / "model-calls.jsonl"

    @property
    def journal(self) -> JournalWatcher:
        assert self.watcher is not None
        return self.watcher

    def env(self, **extra: str) -> dict[str, str]:
        out = dict(os.environ)
        out |= {
            "HALFWAY_TOPIC_PREFIX": self.settings.topic_prefix,
            "HALFWAY_PAYSIM_URL": self.sim_url,
            "HALFWAY_TRIPSIM_URL": self.tripsim_url,
            "HALFWAY_TRAVEL_TIMEOUT_S": str(self.charge_timeout_s),
            "HALFWAY_CHARGE_TIMEOUT_S": str(self.charge_timeout_s),
            "HALFWAY_MODEL_CALL_LOG": str(self.model_call_log),
            "HALFWAY_LOG_FORMAT": "json",
            "PYTHONUNBUFFERED": "1",
            # The simulators' published dev secrets (paysim's webhooks) are accepted only so.
            "HALFWAY_DEV_MODE": "1",
        }
        if self.settings.bootstrap != env.kafka_bootstrap():
            out["HALFWAY_KAFKA_BOOTSTRAP"] = self.settings.bootstrap
        return out | extra

    async def _spawn(self, name: str, args: list[str], environ: dict[str, str],
                     stdout: int | None = None, cwd: Path | None = None) -> Proc:
        count = self._counts.get(name, 0) + 1
        self._counts[name] = count
        label = f"{name}-{count}"
        log_path = self.workdir / f"{label}.log"
        with log_path.open("ab") as log_file:
            process = await asyncio.create_subprocess_exec(
                sys.executable, *args, env=environ, stdin=asyncio.subprocess.DEVNULL,
                stdout=stdout if stdout is not None else log_file, stderr=log_file, cwd=cwd)
        proc = Proc(label, process, log_path)
        self.procs.append(proc)
        return proc

    async def start_gateway(self, **extra_env: str) -> str:
        """`halfway run gateway` on a free port; returns its paysim webhook endpoint."""
        proc = await self._spawn("gateway", ["-m", "halfway", "run", "gateway"],
                                 self.env(HALFWAY_GATEWAY_PORT="0", **extra_env),
                                 stdout=asyncio.subprocess.PIPE)
        assert proc.process.stdout is not None
        try:
            line = await asyncio.wait_for(proc.process.stdout.readline(), START_TIMEOUT_S)
        except TimeoutError:
            raise AssertionError("the gateway did not start\n" + proc.tail()) from None
        text = line.decode().strip()
        assert text.startswith("listening on http://"), f"{text!r}\n{proc.tail()}"
        self.gateway_url = text.removeprefix("listening on ") + "/webhooks/paysim"
        return self.gateway_url

    async def start_simulator(self, *args: str) -> str:
        self.sim_url = await self._start_listener("paysim", "halfway.simulators.payments", args)
        return self.sim_url

    async def start_tripsim(self, *args: str) -> str:
        """The flight, hotel and email providers (`halfway.simulators.travel`)."""
        self.tripsim_url = await self._start_listener("tripsim", "halfway.simulators.travel",
                                                      args)
        return self.tripsim_url

    async def _start_listener(self, name: str, module: str, args: tuple[str, ...]) -> str:
        return await self.start_listener(name, ["-m", module, "--port", "0", *args])

    async def start(self, service: str, *options: str, cwd: Path | None = None,
                    **extra_env: str) -> Proc:
        """`halfway run decider|executor [options]` as its own process, in `cwd`."""
        assert self.sim_url, "start the simulator first"
        return await self._spawn(service, ["-m", "halfway", "run", service, *options],
                                 self.env(**extra_env), cwd=cwd)

    async def start_listener(self, name: str, args: list[str], cwd: Path | None = None) -> str:
        """Any server that prints `listening on URL` once it accepts connections."""
        proc = await self._spawn(name, args, self.env(), stdout=asyncio.subprocess.PIPE,
                                 cwd=cwd)
        assert proc.process.stdout is not None
        try:
            line = await asyncio.wait_for(proc.process.stdout.readline(), START_TIMEOUT_S)
        except TimeoutError:
            raise AssertionError(f"{name} did not start\n" + proc.tail()) from None
        text = line.decode().strip()
        assert text.startswith("listening on http://"), f"{text!r}\n{proc.tail()}"
        return text.removeprefix("listening on ")

    async def publish(self, *requests: TaskRequested) -> None:
        assert self.writer is not None
        await asyncio.gather(*(self.writer.append(r, TASKS) for r in requests))

    # -- the provider ------------------------------------------------------------------------

    async def _sim(self, method: str, path: str, body: Any = None) -> Any:
        async with httpx.AsyncClient(base_url=self.sim_url, timeout=HTTP_TIMEOUT_S) as client:
            response = await client.request(method, path, json=body)
            response.raise_for_status()
            return response.json()

    async def webhook_behaviour(self, **settings: Any) -> None:
        """paused, duplicate_p, delay_s_max, seed: how the provider delivers webhooks."""
        await self._sim("POST", "/_sim/webhooks", settings)

    async def webhook_log(self) -> dict[str, Any]:
        return await self._sim("GET", "/_sim/webhooks")

    async def faults(self, *rules: dict[str, Any]) -> None:
        """Reset the simulator and arm these fault rules (request numbers count from 1)."""
        await self._sim("POST", "/_sim/reset")
        await self._sim("POST", "/_sim/faults", {"rules": list(rules)})

    async def ledger(self) -> list[dict[str, Any]]:
        return await ledger(self.sim_url)

    async def trip(self, method: str, path: str, body: Any = None) -> Any:
        """A request to tripsim (faults, ledger, clock)."""
        async with httpx.AsyncClient(base_url=self.tripsim_url,
                                     timeout=HTTP_TIMEOUT_S) as client:
            response = await client.request(method, path, json=body)
            response.raise_for_status()
            return response.json()

    async def trip_faults(self, *rules: dict[str, Any]) -> None:
        await self.trip("POST", "/_sim/faults", {"rules": list(rules)})

    async def trip_ledger(self) -> dict[str, Any]:
        """{"holds", "bookings", "emails", "refused"}: tripsim's ground truth."""
        return await self.trip("GET", "/_sim/ledger")

    async def sim_requests(self) -> list[dict[str, Any]]:
        return (await self._sim("GET", "/_sim/requests"))["requests"]

    async def until_provider_has(self, key: str, timeout_s: float = WAIT_S) -> dict[str, Any]:
        """The first create request the provider received with this idempotency key."""
        try:
            async with asyncio.timeout(timeout_s):
                while True:
                    for request in await self.sim_requests():
                        if request["idempotency_key"] == key:
                            return request
                    await asyncio.sleep(POLL_S)
        except TimeoutError:
            raise AssertionError(f"the provider got no request with key {key} within "
                                 f"{timeout_s:g} s\n" + self.tails()) from None

    # -- the model -----------------------------------------------------------------------------

    def model_calls(self) -> list[dict[str, Any]]:
        if not self.model_call_log.exists():
            return []
        return [json.loads(line) for line in self.model_call_log.read_text().splitlines()]

    # -- reporting and teardown ----------------------------------------------------------------

    def tails(self) -> str:
        parts = [p.tail() for p in self.procs]
        if self.watcher is not None:
            parts.append(self.watcher.describe())
        return "\n".join(parts)

    async def close(self) -> None:
        # SIGTERM first: a service that stops cleanly leaves its consumer group at once, so the
        # next test's services (same group names) do not wait for a dead member's session.
        await asyncio.gather(*(stop(p) for p in self.procs if p.alive),
                             return_exceptions=True)
        if self.watcher is not None:
            await self.watcher.stop()
        if self.writer is not None:
            await self.writer.stop()
        await delete_topics(self.settings, ALL_TOPICS)


@contextlib.asynccontextmanager
async def cluster(base: KafkaSettings, workdir: Path, *, charge_timeout_s: float = 1.0,
                  sim_args: tuple[str, ...] = (), webhooks: bool = False,
                  tripsim: bool = False) -> Any:
    """A fresh prefix with its topics, a simulator, a writer for requests and a watcher."""
    settings = base.with_prefix(f"core-{uuid.uuid4().hex[:8]}.")
    out = Cluster(settings, workdir, charge_timeout_s=charge_timeout_s)
    try:
        await ensure_topics(settings, ALL_TOPICS)
        out.writer = JournalWriter(settings)
        await out.writer.start()
        out.watcher = JournalWatcher(settings)
        await out.watcher.start()
        if webhooks:  # the provider signs and sends webhooks to our gateway
            sim_args = (*sim_args, "--webhook-url", await out.start_gateway())
        await out.start_simulator(*sim_args)
        if tripsim:
            await out.start_tripsim()
        yield out
    finally:
        await out.close()


@pytest.fixture
async def core(kafka_settings: KafkaSettings, tmp_path: Path,
               request: pytest.FixtureRequest) -> Any:
    """A cluster with the defaults (a charge timeout of 1 s) for one test, stashed so its
    processes' logs go into the failure report."""
    async with cluster(kafka_settings, tmp_path) as c:
        request.node.stash[CLUSTER_KEY] = c
        yield c


@pytest.fixture
async def trip(kafka_settings: KafkaSettings, tmp_path: Path,
               request: pytest.FixtureRequest) -> Any:
    """The same, with the travel simulator (the trip's sagas)."""
    async with cluster(kafka_settings, tmp_path, charge_timeout_s=1.0, tripsim=True) as c:
        request.node.stash[CLUSTER_KEY] = c
        yield c


async def ledger(url: str) -> list[dict[str, Any]]:
    """Every charge the provider made, oldest first."""
    async with httpx.AsyncClient(base_url=url, timeout=HTTP_TIMEOUT_S) as client:
        response = await client.get("/_sim/ledger")
        response.raise_for_status()
        return response.json()["charges"]


def charges_for(charges: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    """The charges that carry `key` (in metadata or as their idempotency key)."""
    return [c for c in charges
            if (c.get("metadata") or {}).get("halfway_key") == key
            or c.get("idempotency_key") == key]


def unknown_steps(state: TaskState) -> list[int]:
    return [s.n for s in state.steps.values()
            if s.status in (StepStatus.UNKNOWN, StepStatus.IN_FLIGHT)]


# --- pytest plugin: process logs in the failure report --------------------------------------------

CLUSTER_KEY = pytest.StashKey[Cluster]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None],
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report: pytest.TestReport = yield
    found = item.stash.get(CLUSTER_KEY, None)
    if found is not None and report.failed and report.when in ("call", "setup"):
        report.sections.append(("halfway processes", found.tails()))
    return report


# --- pauses ---------------------------------------------------------------------------------------


def pause(proc: Proc) -> None:
    """SIGSTOP: the process freezes where it is, heartbeats included. Past its consumer session
    timeout its group moves its partitions; resumed, it carries on as a zombie until it notices."""
    if proc.alive:
        proc.process.send_signal(signal.SIGSTOP)


def resume(proc: Proc) -> None:
    """SIGCONT (harmless for a process that is not stopped)."""
    if proc.alive:
        proc.process.send_signal(signal.SIGCONT)
