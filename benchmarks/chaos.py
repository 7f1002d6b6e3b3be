"""Our own chaos suite: N tasks through the real services while everything goes wrong.

    .venv/bin/python benchmarks/chaos.py --tasks 2000 [--seed 1] [--json] [--help for more]

Every part runs as its own process, configured through the environment as in a deployment: a
Kafka broker of the run's own (`chaos_broker`: it is killed, so never the shared one), two (or
`--instances`) of each service (decider, executor, reconciler, outcomes publisher; with
`--workers`, workers in place of deciders and executors: each a decider and an executor in one
process, sharing their folds and journaling a settlement with the next move), the webhook
gateway, and paysim sending signed webhooks to the gateway. The services reach paysim through a
relay whose port can be shut (`chaos_gate`), so refused connections happen too.

The tasks are renewals (one `charge_customer` step, each on its own invoice), a share of them in
pairs that both want to charge one invoice, published at a steady rate over the window. With
`--trips SHARE`, that share of the single tasks are trips instead: sagas of four steps (hold a
flight, book a hotel, charge the card, email the itinerary) on tripsim and paysim, a third of
them at a hotel with no room, so that the saga is called off and the flight hold released. What
goes wrong meanwhile:
- at paysim: charges slower than the client's timeout, replies lost after the charge was made,
  5xx before and after the commit, 429s, declines; webhooks delivered twice and late;
- the relays: short windows of refused connections (open connections reset), at paysim and
  tripsim together; tripsim meets paysim's fault mix, undos included;
- the services: kill -9 of instances (restarted after a moment, as a supervisor would) and
  SIGSTOP/SIGCONT, some pauses past the consumer session timeout so that the group moves the
  partitions and the instance wakes up a zombie. The victims' kinds take turns, the instance is
  drawn at random; `--kill-kinds`, `--pause-kinds` and `--long-pause-kinds` narrow them;
- the broker: one kill -9 (after the first long pause is over), then a restart.
A service that exits on its own is restarted too, and the exit is counted.

Then the run drains: it waits (bounded) until every task is finished or waits for a person,
folding the journal as it grows; paysim's faults stay armed until then, so that work the
broker's outage pushed past the window meets them too. The journal's writers stop, the outcomes
publishers catch up (bounded) and stop, and the oracle (`chaos_oracle`) compares the ledger, the
journal (`replay`) and the outcomes topic (`read_outcomes`). Figures only (`chaos_report`): the
exit code is 0 unless the harness itself broke. Every process's log, the chaos as it happened
(chaos.jsonl) and each finding with its journal, guard records, charges and log lines
(findings.txt) stay in the run folder, printed at the end; the broker's data is removed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import random
import resource
import sys
import time
import traceback
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # `benchmarks.*` and `tests.processes`, also when run as a script

import httpx  # noqa: E402
from aiokafka import AIOKafkaConsumer, TopicPartition  # noqa: E402
from aiokafka.structs import ConsumerRecord  # noqa: E402
from benchmarks.chaos_broker import PLACEMENT, DedicatedBroker, free_ports  # noqa: E402
from benchmarks.chaos_gate import TcpGate  # noqa: E402
from benchmarks.chaos_oracle import (  # noqa: E402
    Requested,
    judge,
    last_outcomes,
    settled_or_waiting,
)
from benchmarks.chaos_report import (  # noqa: E402
    Report,
    assignments,
    assignments_logged,
    fault_counts,
    render,
    settlement_counts,
    webhook_counts,
    write_findings,
)
from pydantic import ValidationError  # noqa: E402
from tests.processes import Proc, kill9, pause, renewal_request, resume, stop  # noqa: E402

from halfway import log  # noqa: E402
from halfway.contract import Event, TaskRequested  # noqa: E402
from halfway.contract.guards import GuardRecord  # noqa: E402
from halfway.contract.outcomes import OutcomeChanged, parse_outcome  # noqa: E402
from halfway.contract.topics import (  # noqa: E402
    ALL_TOPICS,
    DEAD_LETTERS,
    GUARDS,
    JOURNAL,
    OUTCOMES,
    TASKS,
    TopicSpec,
)
from halfway.core.fold import TaskState, apply  # noqa: E402
from halfway.demo.trip import FULL_HOTEL, trip_request  # noqa: E402
from halfway.journal import JournalWriter, ensure_topics  # noqa: E402
from halfway.journal.limits import fetch_limits  # noqa: E402
from halfway.journal.records import InvalidRecord, decode, decode_guard  # noqa: E402
from halfway.journal.replay import replay  # noqa: E402
from halfway.outcomes.derive import visible  # noqa: E402
from halfway.outcomes.service import read_outcomes  # noqa: E402
from halfway.settings import HOST, KafkaSettings  # noqa: E402

# --- bounds and shapes (every wait is bounded by one of these) ----------------------------------

SERVICE_KINDS = ("decider", "executor", "reconciler", "outcomes")
WORKER_KINDS = ("worker", "reconciler", "outcomes")  # --workers: a worker is both of the first two
GATEWAY = "gateway"
GATEWAYS = 1  # paysim sends webhooks to one URL, so one gateway on one port (kept on restarts)
READERS = ("outcomes",)  # what only reads the journal: it stops after the writers
START_TIMEOUT_S = 90.0  # ten cold interpreters at once on two cores, each joining its group
STOP_TIMEOUT_S = 15.0  # SIGTERM to exit; then SIGKILL
READY_POLL_S = 0.1
GATEWAY_READY = '"gateway listening"'  # the gateway's log event once it accepts webhooks
HTTP_TIMEOUT_S = 30.0  # the harness's own calls to paysim, which must never time out
FETCH_MS = 200  # one fetch of a live view when the topic is quiet
PROBE_EVERY_S = 0.25  # a drain probe folds every task: not after every one of many fetches
PUBLISH_RETRY_S = 240.0  # one request keeps being re-sent (same event id) this long at most
PUBLISH_BACKOFF_S = 0.5
BROKER_UP_ATTEMPTS = 3
SUPERVISOR_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)  # after an exit we did not cause, then the last
SESSION_TIMEOUT_S = 10.0  # aiokafka's default session_timeout_ms: past it, partitions move
LONG_PAUSE_OVER_S = (4.0, 8.0)  # plus the session timeout: expiry, a rebalance and a rejoin
SHORT_PAUSE_S = (0.5, 5.0)
RESTART_AFTER_KILL_S = (0.0, 3.0)  # a supervisor's delay: sometimes the group rebalances first
BROKER_OUTAGE_S = (1.0, 3.0)  # from kill -9 to the restart command (which takes ~15 s itself)
BROKER_KILL_AT = (0.35, 0.55)  # share of the window
FIRST_LONG_PAUSE_AT = (0.02, 0.1)  # share of the window
AFTER_LONG_PAUSE_S = 2.0  # the broker dies this long after the first long pause at the soonest
SHUT_S = (0.5, 2.5)  # refused-connection windows
CHAOS_SPAN = (0.05, 0.9)  # kills, pauses and shut windows fall in this share of the window
PUBLISH_RATE_DEFAULT = 20.0  # tasks per second, for the default window
KILL_EVERY_S, KILLS_MIN = 10.0, 3  # default kills: one per 10 s of window, at least 3
PAUSE_EVERY_S, PAUSES_MIN = 15.0, 2  # default pauses: one per 15 s of window, at least 2
LONG_PAUSE_ONE_IN, LONG_PAUSES_MIN = 3, 1  # default long pauses: a third of them, at least 1
WINDOW_S_MIN = 30.0
WEBHOOK_SECRET = "whsec_chaos"
OUTCOMES_SETTLE_S_DEFAULT = 60.0
TOPIC_PREFIX = "chaos."

# The fault mix at paysim (charge requests; lookups are not faulted), as rules tried in order.
# Probabilities are per request, scaled by --fault-scale. Slow: past the client's timeout.
SLOW_DELAYS_S = (1.5, 2.2, 3.0)
FAULTS: tuple[tuple[str, float, dict[str, Any]], ...] = (
    *((f"slow {d:g} s", 0.03, {"delay_s": d}) for d in SLOW_DELAYS_S),
    ("lost reply after commit", 0.03, {"lose_reply": True}),
    ("500 before commit", 0.015, {"status": 500, "when": "before_commit"}),
    ("503 after commit", 0.02, {"status": 503, "when": "after_commit"}),
    ("429", 0.03, {"status": 429}),
    ("decline", 0.02, {"decline": True}),
)
WEBHOOK_DUPLICATE_P = 0.3
TRIP_FULL_ONE_IN = 3  # of the trips, every third is at a hotel with no room: the saga unwinds
WEBHOOK_DELAY_S_MAX = 2.0


@dataclass
class ChaosConfig:
    tasks: int = 200
    seed: int = 1
    window_s: float | None = None  # publish window; None: tasks / PUBLISH_RATE_DEFAULT
    drain_s: float = 300.0
    outcomes_settle_s: float = OUTCOMES_SETTLE_S_DEFAULT
    pair_share: float = 0.2  # of tasks that come in pairs on one invoice
    instances: int = 2  # of each service kind
    kills: int | None = None  # None: KILL_EVERY_S, KILLS_MIN
    pauses: int | None = None  # None: PAUSE_EVERY_S, PAUSES_MIN
    long_pauses: int | None = None  # None: LONG_PAUSE_ONE_IN, LONG_PAUSES_MIN
    shuts: int = 2
    broker_kill: bool = True
    charge_timeout_s: float = 1.0
    key_ttl_s: float = 60.0  # paysim and tripsim keep keys this long; the services are told
    # paysim finishes every request within its slowest fault here (3 s): with a margin, what
    # the services may rely on (compressed, like the key lifetime; a real paysim's is 660 s).
    completes_within_s: float = 10.0
    fault_scale: float = 1.0
    workers: bool = False  # worker processes in place of deciders and executors
    trips: float = 0.0  # share of the single tasks that are trips (sagas) instead of renewals
    # Who kill -9, a short SIGSTOP and a long one may hit; None: every kind of the run.
    kill_kinds: tuple[str, ...] | None = None
    pause_kinds: tuple[str, ...] | None = None
    long_pause_kinds: tuple[str, ...] | None = None
    run_dir: Path | None = None

    def service_kinds(self) -> tuple[str, ...]:
        return WORKER_KINDS if self.workers else SERVICE_KINDS

    def all_kinds(self) -> tuple[str, ...]:
        """Every kind of process the fleet runs, the gateway included."""
        return (*self.service_kinds(), GATEWAY)

    def writers(self) -> tuple[str, ...]:
        """What writes the journal and the webhooks topic."""
        return tuple(k for k in self.all_kinds() if k not in READERS)

    def window(self) -> float:
        if self.window_s is not None:
            return self.window_s
        return max(WINDOW_S_MIN, self.tasks / PUBLISH_RATE_DEFAULT)

    def kill_count(self) -> int:
        if self.kills is not None:
            return self.kills
        return max(KILLS_MIN, int(self.window() / KILL_EVERY_S))

    def pause_count(self) -> int:
        if self.pauses is not None:
            return self.pauses
        return max(PAUSES_MIN, int(self.window() / PAUSE_EVERY_S))

    def long_pause_count(self) -> int:
        if self.long_pauses is not None:
            return self.long_pauses
        return max(LONG_PAUSES_MIN, self.pause_count() // LONG_PAUSE_ONE_IN)


class HarnessError(RuntimeError):
    """The harness itself could not do its job (as opposed to a figure it measured)."""


# --- what the run saw happen -------------------------------------------------------------------


class ChaosLog:
    """Every chaos action and every exit, in order, to chaos.jsonl and in memory."""

    def __init__(self, path: Path, started: float) -> None:
        self.path = path
        self.started = started
        self.entries: list[dict[str, Any]] = []
        self.broker_down = False  # exits while it is down are the outage's, not a crash's

    def note(self, what: str, **details: Any) -> None:
        entry = {"t_s": round(time.monotonic() - self.started, 3),
                 "at": datetime.now(UTC).isoformat(), "what": what, **details}
        self.entries.append(entry)
        with self.path.open("a") as f:
            f.write(json.dumps(entry, default=str) + "\n")

    def count(self, what: str, **match: Any) -> int:
        return sum(1 for e in self.entries if e["what"] == what
                   and all(e.get(k) == v for k, v in match.items()))


# --- live views of a topic ---------------------------------------------------------------------


class LiveTopic:
    """A topic read from offset zero as it grows, as a reader (no consumer group): every record
    goes to `on_record`; `until(probe)` checks the probe again after fetches. Survives a broker
    restart: the consumer reconnects by itself."""

    def __init__(self, settings: KafkaSettings, spec: TopicSpec,
                 on_record: Callable[[ConsumerRecord], None]) -> None:
        self.topic = spec.name(settings.topic_prefix)
        self.partitions = spec.partitions
        self.settings = settings
        self.on_record = on_record
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._news = asyncio.Event()

    async def start(self) -> None:
        self._consumer = AIOKafkaConsumer(**self.settings.client(),
                                          group_id=None, enable_auto_commit=False,
                                          isolation_level="read_committed", **fetch_limits())
        await self._consumer.start()
        tps = [TopicPartition(self.topic, p) for p in range(self.partitions)]
        self._consumer.assign(tps)
        await self._consumer.seek_to_beginning(*tps)
        self._task = asyncio.create_task(self._run(), name=f"live-{self.topic}")

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
                batches = await self._consumer.getmany(timeout_ms=FETCH_MS)
                for records in batches.values():
                    for record in records:
                        self.on_record(record)
                self._news.set()  # also when nothing came: probes may depend on the clock
                self._news = asyncio.Event()
        finally:
            self._news.set()

    async def until(self, probe: Callable[[], bool], timeout_s: float) -> bool:
        """True once `probe()` holds; False if it still does not after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            checked_at = time.monotonic()
            if probe():
                return True
            assert self._task is not None
            if self._task.done():
                raise HarnessError(f"the reader of {self.topic} stopped: {self._task!r}")
            if checked_at >= deadline:
                return False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await self._news.wait()
                    # Throttled: many small fetches must not each pay for a probe of every task.
                    await asyncio.sleep(max(0.0, PROBE_EVERY_S - (time.monotonic() - checked_at)))


class JournalView:
    """The journal, folded per task as it grows, with each task's events kept for reports."""

    def __init__(self, settings: KafkaSettings) -> None:
        self.states: dict[str, TaskState] = {}
        self.events: dict[str, list[Event]] = {}
        self.invalid = 0
        self.live = LiveTopic(settings, JOURNAL, self._on_record)

    def _on_record(self, record: ConsumerRecord) -> None:
        try:
            event = decode(record)
        except InvalidRecord:
            self.invalid += 1
            return
        self.events.setdefault(event.task_id, []).append(event)
        state = self.states.get(event.task_id) or TaskState(task_id=event.task_id)
        self.states[event.task_id] = apply(state, event)


class OutcomesView:
    """The outcomes topic's last message per task and subject, as it grows."""

    def __init__(self, settings: KafkaSettings) -> None:
        self.last: dict[tuple[str, str], OutcomeChanged] = {}
        self.invalid = 0
        self.live = LiveTopic(settings, OUTCOMES, self._on_record)

    def _on_record(self, record: ConsumerRecord) -> None:
        try:
            message = parse_outcome(record.value or b"")
        except ValidationError:
            self.invalid += 1
            return
        about = (message.task_id, message.about)
        if about not in self.last or message.seq > self.last[about].seq:
            self.last[about] = message


class GuardsView:
    """The subject guard's claims and releases per subject, for the findings' context."""

    def __init__(self, settings: KafkaSettings) -> None:
        self.by_subject: dict[str, list[GuardRecord]] = {}
        self.invalid = 0
        self.live = LiveTopic(settings, GUARDS, self._on_record)

    def _on_record(self, record: ConsumerRecord) -> None:
        try:
            claim = decode_guard(record)
        except InvalidRecord:
            self.invalid += 1
            return
        self.by_subject.setdefault(claim.subject, []).append(claim)


def outcomes_agree(last: dict[tuple[str, str], OutcomeChanged], states: dict[str, TaskState],
                   task_ids: Iterable[str]) -> bool:
    """Every subject's last outcome state is the fold's visible state (and nothing else)."""
    shown: dict[str, dict[str, str]] = {}
    for (task_id, about), message in last.items():
        shown.setdefault(task_id, {})[about] = message.state
    for task_id in task_ids:
        state = states.get(task_id)
        want = {} if state is None else {a: c.state for a, c in visible(state).items()}
        if shown.get(task_id, {}) != want:
            return False
    return True


# --- the fleet: service processes, supervised --------------------------------------------------


@dataclass
class Slot:
    """One instance of a service: its process comes and goes (kills, crashes), the slot stays."""

    kind: str
    index: int
    log_path: Path
    proc: Proc | None = None
    paused: bool = False
    long_paused: bool = False  # the pause outlasts the consumer session timeout
    killing: bool = False  # we are killing it: its exit is ours, and its restart is scheduled
    restart_after_s: float = 0.0
    starts: int = 0

    @property
    def name(self) -> str:
        return f"{self.kind}-{self.index}"

    @property
    def up(self) -> bool:
        return self.proc is not None and self.proc.alive and not self.killing


class Fleet:
    def __init__(self, env: dict[str, str], run_dir: Path, counts: dict[str, int],
                 chaos: ChaosLog) -> None:
        self.env = env
        self.run_dir = run_dir
        self.chaos = chaos
        self.slots = [Slot(kind, i, run_dir / f"{kind}-{i}.log")
                      for kind, n in counts.items() for i in range(1, n + 1)]
        self._supervisors: dict[str, asyncio.Task[None]] = {}
        self._started: dict[str, asyncio.Event] = {}
        self._stopping: set[str] = set()
        self.exits: list[dict[str, Any]] = []  # exits we did not cause

    async def start(self) -> None:
        for slot in self.slots:
            self._started[slot.name] = asyncio.Event()
            self._supervisors[slot.name] = asyncio.create_task(self._supervise(slot),
                                                               name=f"supervise-{slot.name}")
        async with asyncio.timeout(START_TIMEOUT_S):
            await asyncio.gather(*(self._started[s.name].wait() for s in self.slots))
        # Ready: every slot logged its readiness once, in whichever of its starts (a service
        # that crashed at start is restarted by its supervisor and counted as an exit).
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(self._ready(s) for s in self.slots):  # polled: a log has no notification
            if time.monotonic() > deadline:
                late = [s for s in self.slots if not self._ready(s)]
                raise HarnessError("services not ready within "
                                   f"{START_TIMEOUT_S:g} s:\n" + "\n".join(
                                       s.proc.tail() if s.proc else s.name for s in late))
            await asyncio.sleep(READY_POLL_S)

    @staticmethod
    def _ready(slot: Slot) -> bool:
        if slot.kind == GATEWAY:
            return slot.log_path.exists() and GATEWAY_READY in slot.log_path.read_text(
                errors="replace")
        return assignments_logged(slot.log_path) > 0

    async def _spawn(self, slot: Slot) -> Proc:
        slot.starts += 1
        with slot.log_path.open("ab") as log:
            log.write(f"--- chaos: start {slot.starts} of {slot.name} at "
                      f"{datetime.now(UTC).isoformat()}\n".encode())
            log.flush()
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "halfway", "run", slot.kind, env=self.env,
                stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log)
        return Proc(slot.name, process, slot.log_path)

    async def _supervise(self, slot: Slot) -> None:
        failures = 0
        while slot.name not in self._stopping:
            slot.proc = await self._spawn(slot)
            slot.paused = False
            self._started[slot.name].set()
            code = await slot.proc.process.wait()
            if slot.name in self._stopping:
                return
            if slot.killing:
                slot.killing = False
                failures = 0
                delay_s = slot.restart_after_s
            else:
                delay_s = SUPERVISOR_BACKOFF_S[min(failures, len(SUPERVISOR_BACKOFF_S) - 1)]
                failures += 1
                exit_info = {"slot": slot.name, "pid": slot.proc.pid, "code": code,
                             "broker_down": self.chaos.broker_down,
                             "last_error": last_error(slot.log_path)}
                self.exits.append(exit_info)
                self.chaos.note("exit", **exit_info)
            # The supervisor's delay before a restart: part of the experiment, not a wait.
            await asyncio.sleep(delay_s)

    def eligible(self, kinds: Iterable[str], *, with_peer: bool = False) -> list[Slot]:
        """Instances that are up and running; `with_peer`: only those with another instance of
        their kind up and running, which their partitions can move to."""
        wanted = set(kinds)
        # A kind with an instance in a long pause is left alone: its partitions must be able to
        # move to the peers, which is what the long pause is for.
        held = {s.kind for s in self.slots if s.paused and s.long_paused}
        running = [s for s in self.slots if s.up and not s.paused and s.kind not in held]
        return [s for s in running if s.kind in wanted
                and (not with_peer or any(o.kind == s.kind and o is not s for o in running))]

    def peers(self, slot: Slot) -> list[Slot]:
        return [s for s in self.slots if s.kind == slot.kind and s is not slot]

    async def kill(self, slot: Slot, restart_after_s: float) -> None:
        assert slot.proc is not None
        slot.killing = True
        slot.restart_after_s = restart_after_s
        self.chaos.note("kill -9", slot=slot.name, pid=slot.proc.pid,
                        restart_after_s=round(restart_after_s, 2))
        await kill9(slot.proc)

    async def pause(self, slot: Slot, duration_s: float, long: bool) -> None:
        """SIGSTOP for `duration_s`, then SIGCONT. Notes whether a peer was assigned partitions
        meanwhile (the group moved the paused instance's work)."""
        proc = slot.proc
        assert proc is not None
        slot.paused, slot.long_paused = True, long
        assigned_before = sum(assignments_logged(p.log_path) for p in self.peers(slot))
        self.chaos.note("SIGSTOP", slot=slot.name, pid=proc.pid, for_s=round(duration_s, 2),
                        long=long)
        pause(proc)
        try:
            await asyncio.sleep(duration_s)  # the pause itself: the experiment's schedule
        finally:
            resume(proc)
            if slot.proc is proc:
                slot.paused = slot.long_paused = False
            moved = sum(assignments_logged(p.log_path) for p in self.peers(slot)) \
                > assigned_before
            self.chaos.note("SIGCONT", slot=slot.name, pid=proc.pid, long=long,
                            partitions_moved=moved)

    async def stop(self, kinds: Iterable[str]) -> None:
        """SIGCONT (a stopped process cannot handle SIGTERM), then SIGTERM, bounded."""
        chosen = [s for s in self.slots if s.kind in set(kinds)]
        for slot in chosen:
            self._stopping.add(slot.name)
        for slot in chosen:
            if slot.proc is not None:
                resume(slot.proc)
        await asyncio.gather(*(stop(s.proc, STOP_TIMEOUT_S) for s in chosen
                               if s.proc is not None and s.proc.alive),
                             return_exceptions=True)
        for slot in chosen:
            task = self._supervisors.pop(slot.name, None)
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def pids(self) -> dict[str, int | None]:
        return {s.name: s.proc.pid if s.proc is not None else None for s in self.slots}


def last_error(log_path: Path) -> str | None:
    """The last error-level JSON line of a log (or its last line), for an exit's report."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()[-200:]
    except FileNotFoundError:
        return None
    for line in reversed(lines):
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if isinstance(entry, dict) and entry.get("level") in ("error", "critical"):
                text = f"{entry.get('event')}: {entry.get('exception', '')}"
                return text.strip()[-600:]
    return lines[-1][-600:] if lines else None


# --- publishing ---------------------------------------------------------------------------------


def build_requests(config: ChaosConfig, rng: random.Random, tag: str,
                   ) -> tuple[list[TaskRequested], list[Requested]]:
    """N renewals; a share of them in pairs that want to charge one invoice, published one
    right after the other so that they contend; `config.trips` of the singles are trips (each
    charges its own invoice, `INV-<task id>`)."""
    pairs = int(config.tasks * config.pair_share) // 2
    singles = config.tasks - 2 * pairs
    trips = round(singles * config.trips)
    units: list[list[str]] = [["trip"] for _ in range(trips)] + \
        [["single"] for _ in range(singles - trips)] + [["pair", "pair"] for _ in range(pairs)]
    rng.shuffle(units)
    requests: list[TaskRequested] = []
    expected: list[Requested] = []
    n = trip = 0
    for k, unit in enumerate(units):
        invoice = f"INV-{tag}-p{k:05d}" if len(unit) == 2 else None
        for kind in unit:
            n += 1
            task_id = f"chaos-{tag}-{n:05d}"
            inv = invoice or f"INV-{task_id}"
            if kind == "trip":
                trip += 1
                hotel = FULL_HOTEL if trip % TRIP_FULL_ONE_IN == 0 else "HTL-ROMA-7"
                requests.append(trip_request(task_id, hotel=hotel, customer=f"cus_{n:05d}",
                                             passenger=f"Traveller {n:05d}",
                                             email=f"traveller-{n:05d}@example.com"))
            else:
                requests.append(renewal_request(task_id, invoice=inv, customer=f"cus_{n:05d}",
                                                reask=False))
            expected.append(Requested(task_id, inv, trip=kind == "trip"))
    return requests, expected


class Publisher:
    """Requests at a steady rate over the window; a request whose append fails is sent again
    (the same event, so the same event id) until the broker has it, bounded."""

    def __init__(self, writer: JournalWriter, requests: list[TaskRequested], window_s: float,
                 chaos: ChaosLog) -> None:
        self.writer = writer
        self.requests = requests
        self.window_s = window_s
        self.chaos = chaos
        self.acked: set[str] = set()
        self.failed: list[str] = []
        self.retries = 0
        self._sends: list[asyncio.Task[None]] = []

    async def run(self) -> None:
        started = time.monotonic()
        step_s = self.window_s / max(1, len(self.requests))
        for i, request in enumerate(self.requests):
            # The schedule of the experiment: request i is due at i * step.
            await asyncio.sleep(max(0.0, started + i * step_s - time.monotonic()))
            self._sends.append(asyncio.create_task(self._send(request)))
        await asyncio.gather(*self._sends)

    async def _send(self, request: TaskRequested) -> None:
        deadline = time.monotonic() + PUBLISH_RETRY_S
        while True:
            try:
                await self.writer.append(request, TASKS)
                self.acked.add(request.task_id)
                return
            except Exception as exc:
                self.retries += 1
                if time.monotonic() > deadline:
                    self.failed.append(request.task_id)
                    self.chaos.note("publish failed", task_id=request.task_id, error=repr(exc))
                    return
                await asyncio.sleep(PUBLISH_BACKOFF_S)  # a backoff between sends, bounded


# --- the chaos schedule -----------------------------------------------------------------------


@dataclass(frozen=True)
class Action:
    at_s: float
    kind: str  # kill | pause | long pause | broker | shut
    duration_s: float  # restart delay | pause | outage before the restart | shut window


def plan(config: ChaosConfig, rng: random.Random) -> list[Action]:
    w = config.window()

    def at(span: tuple[float, float]) -> float:
        return rng.uniform(span[0] * w, span[1] * w)

    actions = [Action(at(CHAOS_SPAN), "kill", rng.uniform(*RESTART_AFTER_KILL_S))
               for _ in range(config.kill_count())]
    longs = config.long_pause_count()
    first_long_ends = 0.0
    for i in range(config.pause_count()):
        if i < longs:
            # The first long pause comes early and the broker dies only after it: partitions
            # can move only while the broker and the paused instance's peers are up.
            action = Action(at(FIRST_LONG_PAUSE_AT if i == 0 else CHAOS_SPAN), "long pause",
                            SESSION_TIMEOUT_S + rng.uniform(*LONG_PAUSE_OVER_S))
            if i == 0:
                first_long_ends = action.at_s + action.duration_s
            actions.append(action)
        else:
            actions.append(Action(at(CHAOS_SPAN), "pause", rng.uniform(*SHORT_PAUSE_S)))
    actions += [Action(at(CHAOS_SPAN), "shut", rng.uniform(*SHUT_S))
                for _ in range(config.shuts)]
    if config.broker_kill:
        actions.append(Action(max(at(BROKER_KILL_AT), first_long_ends + AFTER_LONG_PAUSE_S),
                              "broker", rng.uniform(*BROKER_OUTAGE_S)))
    return sorted(actions, key=lambda a: a.at_s)


def fault_rules(config: ChaosConfig) -> list[dict[str, Any]]:
    return [{"match": {"probability": min(1.0, p * config.fault_scale), "seed": config.seed + i},
             "action": action}
            for i, (_, p, action) in enumerate(FAULTS)]


class Chaos:
    """Performs the plan against the fleet, the broker and the gates."""

    def __init__(self, fleet: Fleet, broker: DedicatedBroker, gates: list[TcpGate],
                 rng: random.Random,
                 log: ChaosLog, config: ChaosConfig) -> None:
        self.fleet = fleet
        # Victims' kinds take turns (in a seeded order), so that a few kills reach every kind;
        # the instance within a kind is drawn at random.
        every = config.all_kinds()
        self.kill_turns = _turns(config.kill_kinds or every, rng)
        self.pause_turns = _turns(config.pause_kinds or every, rng)
        self.long_pause_turns = _turns(config.long_pause_kinds or every, rng)
        self.broker = broker
        self.gates = gates
        self.rng = rng
        self.log = log
        self.broker_down_s: list[float] = []

    async def run(self, actions: list[Action]) -> None:
        started = time.monotonic()
        async with asyncio.TaskGroup() as group:
            for action in actions:
                await asyncio.sleep(max(0.0, started + action.at_s - time.monotonic()))
                group.create_task(self._perform(action))

    async def _perform(self, action: Action) -> None:
        match action.kind:
            case "kill":
                slot = self._victim(self.kill_turns)
                if slot is not None:
                    await self.fleet.kill(slot, action.duration_s)
            case "pause":
                slot = self._victim(self.pause_turns)
                if slot is not None:
                    await self.fleet.pause(slot, action.duration_s, long=False)
            case "long pause":
                slot = self._victim(self.long_pause_turns, with_peer=True)
                if slot is not None:
                    await self.fleet.pause(slot, action.duration_s, long=True)
            case "shut":
                self.log.note("port shut", for_s=round(action.duration_s, 2))
                await asyncio.gather(*(g.shut_for(action.duration_s) for g in self.gates))
                self.log.note("port open")
            case "broker":
                await self._broker(action.duration_s)

    def _victim(self, turns: list[str], *, with_peer: bool = False) -> Slot | None:
        """An instance of the kind whose turn it is, or of the next kind with one to spare."""
        for _ in range(len(turns)):
            kind = turns.pop(0)
            turns.append(kind)
            eligible = self.fleet.eligible([kind], with_peer=with_peer)
            if eligible:
                return self.rng.choice(eligible)
        self.log.note("no victim", why="every instance is down or paused", kinds=list(turns))
        return None

    async def _broker(self, outage_s: float) -> None:
        killed_at = time.monotonic()
        self.log.note("broker kill -9", pid=self.broker.pid())
        self.log.broker_down = True
        await self.broker.kill9()
        await asyncio.sleep(outage_s)  # the outage before anyone restarts it
        for attempt in range(1, BROKER_UP_ATTEMPTS + 1):
            try:
                line = await self.broker.up()
                break
            except Exception as exc:
                self.log.note("broker restart failed", attempt=attempt, error=str(exc)[-2000:])
                if attempt == BROKER_UP_ATTEMPTS:
                    raise HarnessError(f"the broker did not come back: {exc}") from exc
        down_s = time.monotonic() - killed_at
        self.log.broker_down = False
        self.broker_down_s.append(down_s)
        self.log.note("broker back", down_s=round(down_s, 2), line=line)


def _turns(kinds: Iterable[str], rng: random.Random) -> list[str]:
    turns = list(dict.fromkeys(kinds))
    rng.shuffle(turns)
    return turns


# --- the run ------------------------------------------------------------------------------------


async def _sim(client: httpx.AsyncClient, method: str, path: str, body: Any = None) -> Any:
    response = await client.request(method, path, json=body)
    response.raise_for_status()
    return response.json()


async def _start_paysim(env: dict[str, str], run_dir: Path, key_ttl_s: float,
                        webhook_url: str) -> tuple[Proc, str]:
    """paysim, sending webhooks to the gateway; (its process, its URL)."""
    return await _start_sim("paysim", "halfway.simulators.payments", env, run_dir,
                            "--key-ttl-s", str(key_ttl_s), "--webhook-url", webhook_url,
                            "--webhook-secret", WEBHOOK_SECRET)


async def _start_sim(name: str, module: str, env: dict[str, str], run_dir: Path,
                     *args: str) -> tuple[Proc, str]:
    """A simulator in its own process; (its process, its URL)."""
    log_path = run_dir / f"{name}.log"
    with log_path.open("ab") as log:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", module, "--port", "0", *args, env=env,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=log)
    proc = Proc(name, process, log_path)
    assert process.stdout is not None
    try:
        async with asyncio.timeout(START_TIMEOUT_S):
            line = (await process.stdout.readline()).decode().strip()
    except TimeoutError:
        raise HarnessError(f"{name} did not start\n" + proc.tail()) from None
    if not line.startswith("listening on http://"):
        raise HarnessError(f"{name} said {line!r}\n{proc.tail()}")
    return proc, line.removeprefix("listening on ")


async def dead_letters(settings: KafkaSettings) -> int:
    """How many records the services dead-lettered (the topic's end offsets)."""
    consumer = AIOKafkaConsumer(**settings.client(), group_id=None)
    await consumer.start()
    try:
        topic = DEAD_LETTERS.name(settings.topic_prefix)
        tps = [TopicPartition(topic, p) for p in range(DEAD_LETTERS.partitions)]
        return sum((await consumer.end_offsets(tps)).values())
    finally:
        await consumer.stop()


def cpu_seconds() -> dict[str, float]:
    """CPU time of this process (the views, the relay, the publisher) and of the children it
    has waited for (the services and paysim; not the broker, which `halfway.infra` detaches):
    on a small machine, how much of the run was the harness itself."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return {"harness": round(own.ru_utime + own.ru_stime, 1),
            "services": round(children.ru_utime + children.ru_stime, 1)}


@contextlib.contextmanager
def library_log(path: Path) -> Iterator[None]:
    """aiokafka in this process logs to a file of the run, not to the terminal: a killed broker
    makes it log an error for every retry of every client."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logger = logging.getLogger("aiokafka")
    saved = logger.propagate
    logger.addHandler(handler)
    logger.propagate = False
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.propagate = saved
        handler.close()


async def run(config: ChaosConfig) -> Report:
    """One chaos run, end to end. Raises HarnessError (or anything else) if the harness broke;
    everything it measured is in the report."""
    run_dir = (config.run_dir or REPO / ".halfway" / "chaos" /
               f"run-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}").resolve()
    if run_dir.exists() and any(run_dir.iterdir()):
        # Logs are appended to and counted: another run's lines would count as this one's.
        raise HarnessError(f"{run_dir} is not empty: give each run a folder of its own")
    run_dir.mkdir(parents=True, exist_ok=True)
    with library_log(run_dir / "harness.log"):
        return await _run(config, run_dir)


async def _run(config: ChaosConfig, run_dir: Path) -> Report:
    wall_started = time.monotonic()
    report = Report(config={k: str(v) if isinstance(v, Path) else v
                            for k, v in asdict(config).items()}, run_dir=str(run_dir))
    chaos_log = ChaosLog(run_dir / "chaos.jsonl", wall_started)
    rng = random.Random(config.seed)
    tag = uuid.uuid4().hex[:4]
    broker = DedicatedBroker(run_dir)
    cleanup: list[Callable[[], Awaitable[Any]]] = []
    try:
        line = await broker.up()
        chaos_log.note("broker up", line=line)
        settings = KafkaSettings(bootstrap=broker.bootstrap, topic_prefix=TOPIC_PREFIX,
                                 replication_factor=1, security=broker.security("admin"))
        await ensure_topics(settings, ALL_TOPICS)
        gateway_port = free_ports(1, avoid={broker.port, broker.controller_port})[0]
        env = {k: v for k, v in os.environ.items()
               if k not in ("HALFWAY_MODEL_CALL_LOG", "HALFWAY_RECONCILER_LOOKUPS")}
        # The broker's own placement: each service finds its kind's password in its home.
        env |= {name: broker.env()[name] for name in PLACEMENT}
        env.pop("HALFWAY_KAFKA_BOOTSTRAP", None)
        env |= {"HALFWAY_TOPIC_PREFIX": TOPIC_PREFIX,
                "HALFWAY_CHARGE_TIMEOUT_S": str(config.charge_timeout_s),
                "HALFWAY_TRAVEL_TIMEOUT_S": str(config.charge_timeout_s),
                "HALFWAY_CHARGE_KEY_TTL_S": str(config.key_ttl_s),
                "HALFWAY_TRAVEL_KEY_TTL_S": str(config.key_ttl_s),
                "HALFWAY_CHARGE_COMPLETES_WITHIN_S": str(config.completes_within_s),
                "HALFWAY_TRAVEL_COMPLETES_WITHIN_S": str(config.completes_within_s),
                "HALFWAY_GATEWAY_PORT": str(gateway_port),
                "HALFWAY_PAYSIM_WEBHOOK_SECRET": WEBHOOK_SECRET,
                "HALFWAY_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1"}
        paysim, paysim_url = await _start_paysim(
            env, run_dir, config.key_ttl_s, f"http://{HOST}:{gateway_port}/webhooks/paysim")
        cleanup.append(lambda: stop(paysim, STOP_TIMEOUT_S))
        sim = httpx.AsyncClient(base_url=paysim_url, timeout=HTTP_TIMEOUT_S)
        cleanup.append(sim.aclose)
        tripsim, tripsim_url = await _start_sim("tripsim", "halfway.simulators.travel", env,
                                                run_dir, "--key-ttl-s", str(config.key_ttl_s))
        cleanup.append(lambda: stop(tripsim, STOP_TIMEOUT_S))
        trip_sim = httpx.AsyncClient(base_url=tripsim_url, timeout=HTTP_TIMEOUT_S)
        cleanup.append(trip_sim.aclose)
        gates: list[TcpGate] = []
        for name, url in (("HALFWAY_PAYSIM_URL", paysim_url), ("HALFWAY_TRIPSIM_URL",
                                                                tripsim_url)):
            host, port = url.removeprefix("http://").split(":")
            gate = TcpGate(host, int(port))
            env[name] = await gate.start()
            cleanup.append(gate.stop)
            gates.append(gate)

        journal = JournalView(settings)
        await journal.live.start()
        cleanup.append(journal.live.stop)
        outcomes_view = OutcomesView(settings)
        await outcomes_view.live.start()
        cleanup.append(outcomes_view.live.stop)
        guards = GuardsView(settings)
        await guards.live.start()
        cleanup.append(guards.live.stop)
        writer = JournalWriter(settings)
        await writer.start()
        cleanup.append(writer.stop)

        counts = {kind: config.instances for kind in config.service_kinds()} | {
            GATEWAY: GATEWAYS}
        fleet = Fleet(env, run_dir, counts, chaos_log)
        cleanup.append(lambda: fleet.stop(config.all_kinds()))
        await fleet.start()
        chaos_log.note("fleet ready", pids=fleet.pids())
        ready_s = time.monotonic() - wall_started

        requests, expected = build_requests(config, rng, tag)
        actions = plan(config, rng)
        await _sim(sim, "POST", "/_sim/faults", {"rules": fault_rules(config)})
        await _sim(trip_sim, "POST", "/_sim/faults", {"rules": fault_rules(config)})
        await _sim(sim, "POST", "/_sim/webhooks", {"duplicate_p": WEBHOOK_DUPLICATE_P,
                                                   "delay_s_max": WEBHOOK_DELAY_S_MAX,
                                                   "seed": config.seed})
        publisher = Publisher(writer, requests, config.window(), chaos_log)
        chaos = Chaos(fleet, broker, gates, rng, chaos_log, config)
        window_started = time.monotonic()
        chaos_log.note("window opens", tasks=len(requests), window_s=config.window(),
                       actions=[asdict(a) for a in actions])
        await asyncio.gather(publisher.run(), chaos.run(actions))
        window_s = time.monotonic() - window_started
        chaos_log.note("window closes", took_s=round(window_s, 2))

        # Drain: every task finished or waiting for a person, or the bound.
        requested = [r for r in expected if r.task_id in publisher.acked]
        ids = [r.task_id for r in requested]
        drain_started = time.monotonic()
        drained = await journal.live.until(
            lambda: all(settled_or_waiting(journal.states.get(t), journal.states) for t in ids),
            config.drain_s)
        drain_s = time.monotonic() - drain_started
        # Armed until now, not only in the window: work the broker's outage pushed past the
        # window meets the faults too. A retry still converges: lookups are never faulted.
        await _sim(sim, "DELETE", "/_sim/faults")
        await _sim(trip_sim, "DELETE", "/_sim/faults")
        chaos_log.note("drained" if drained else "drain timed out", took_s=round(drain_s, 2))

        # The journal's writers stop, so the journal's end is final; the outcomes publishers
        # then get to catch up with it (bounded) before they stop too.
        await fleet.stop(config.writers())
        folded = await replay(settings)
        settle_started = time.monotonic()
        outcomes_settled = await outcomes_view.live.until(
            lambda: outcomes_agree(outcomes_view.last, folded.states, ids),
            config.outcomes_settle_s)
        outcomes_settle_s = time.monotonic() - settle_started
        await fleet.stop(config.service_kinds())
        outcomes = last_outcomes([m async for m in read_outcomes(settings)])

        ledger = (await _sim(sim, "GET", "/_sim/ledger"))["charges"]
        sim_requests = (await _sim(sim, "GET", "/_sim/requests"))["requests"]
        webhooks = await _sim(sim, "GET", "/_sim/webhooks")
        travel = await _sim(trip_sim, "GET", "/_sim/ledger")
        verdict = judge(requested, ledger, folded.states, outcomes, travel)
        report.verdict = verdict
        report.figures = {
            "published": len(publisher.acked), "publish_failed": len(publisher.failed),
            "publish_retries": publisher.retries,
            "pairs": sum(1 for n in Counter(r.invoice for r in requested).values() if n > 1),
            "drained": drained, "outcomes_settled": outcomes_settled,
            "journal": {"events": folded.events, "invalid": len(folded.invalid),
                        "dead_letters": await dead_letters(settings)},
            "outcomes_invalid": outcomes_view.invalid,
            "faults": fault_counts(sim_requests, {name: action for name, _, action in FAULTS}),
            "webhooks": webhook_counts(webhooks),
            "refused_windows": {"count": gates[0].windows,
                                "shut_s": round(gates[0].shut_s, 2),
                                "connections_reset": sum(g.reset for g in gates),
                                "connections_relayed": sum(g.connections for g in gates)},
            "trips": {"requested": sum(r.trip for r in requested),
                      "travel_effects": {store: len(travel.get(store, []))
                                         for store in ("holds", "bookings", "emails")},
                      "travel_refused": len(travel.get("refused", []))},
            "kills": dict(Counter(e["slot"].rsplit("-", 1)[0] for e in chaos_log.entries
                                  if e["what"] == "kill -9")),
            "pauses": {"short": chaos_log.count("SIGSTOP", long=False),
                       "long": chaos_log.count("SIGSTOP", long=True),
                       "long_moved_partitions": chaos_log.count("SIGCONT", long=True,
                                                                partitions_moved=True),
                       "by_kind": dict(Counter(e["slot"].rsplit("-", 1)[0]
                                               for e in chaos_log.entries
                                               if e["what"] == "SIGSTOP"))},
            "assignments": assignments(run_dir, config.service_kinds()),
            "settlements": settlement_counts(e for es in journal.events.values() for e in es),
            "broker_kills": broker.kills,
            "broker_down_s": [round(s, 2) for s in chaos.broker_down_s],
            "unexpected_exits": fleet.exits,
            "cpu_s": cpu_seconds(),
            "seconds": {"ready": round(ready_s, 1), "window": round(window_s, 1),
                        "drain": round(drain_s, 1),
                        "outcomes_settle": round(outcomes_settle_s, 1)},
        }
        write_findings(run_dir / "findings.txt", verdict, journal.events,
                       {r.task_id: r.invoice for r in requested}, ledger, guards.by_subject,
                       run_dir)
    finally:
        for step in reversed(cleanup):
            with contextlib.suppress(Exception):
                await step()
        try:
            await broker.down()
        except Exception as exc:  # reported; the data is removed below either way
            report.error = (report.error or "") + f"broker down failed: {exc}"
        broker.remove_data()
        report.figures.setdefault("seconds", {})["wall"] = round(
            time.monotonic() - wall_started, 1)
    return report


def parse_args(argv: list[str] | None) -> tuple[ChaosConfig, bool]:
    p = argparse.ArgumentParser(prog="benchmarks/chaos.py", description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = ChaosConfig()
    p.add_argument("--tasks", type=int, default=d.tasks, help="tasks to publish")
    p.add_argument("--seed", type=int, default=d.seed,
                   help="seeds the tasks, the plan, the victims' turns and the fault draws")
    p.add_argument("--window-s", type=float, default=None,
                   help=f"publish window; None: tasks / {PUBLISH_RATE_DEFAULT:g} per s, "
                        f"at least {WINDOW_S_MIN:g} s")
    p.add_argument("--drain-s", type=float, default=d.drain_s,
                   help="after the window, how long to wait for every task to settle")
    p.add_argument("--pair-share", type=float, default=d.pair_share,
                   help="share of tasks in pairs that want to charge one invoice")
    p.add_argument("--instances", type=int, default=d.instances,
                   help="instances of each service (the gateway: one)")
    p.add_argument("--kills", type=int, default=None,
                   help=f"kill -9s of service instances; None: one per {KILL_EVERY_S:g} s, "
                        f"at least {KILLS_MIN}")
    p.add_argument("--pauses", type=int, default=None,
                   help=f"SIGSTOPs, long ones included; None: one per {PAUSE_EVERY_S:g} s, "
                        f"at least {PAUSES_MIN}")
    p.add_argument("--long-pauses", type=int, default=None,
                   help=f"of the pauses, how many outlast the session timeout; None: one in "
                        f"{LONG_PAUSE_ONE_IN}, at least {LONG_PAUSES_MIN}")
    p.add_argument("--shuts", type=int, default=d.shuts,
                   help="windows of refused connections to paysim")
    p.add_argument("--no-broker-kill", action="store_true", help="leave the broker alone")
    p.add_argument("--charge-timeout-s", type=float, default=d.charge_timeout_s,
                   help="the services' charge timeout (slow faults take 1.5 to 3 s)")
    p.add_argument("--key-ttl-s", type=float, default=d.key_ttl_s,
                   help="how long paysim and tripsim keep keys, and the services are told so")
    p.add_argument("--fault-scale", type=float, default=d.fault_scale,
                   help="multiplies every fault probability (0: no faults at paysim)")
    p.add_argument("--workers", action="store_true",
                   help="run workers (`halfway run worker`: a decider and an executor in one "
                        "process) in place of deciders and executors")
    p.add_argument("--trips", type=float, default=d.trips,
                   help="share of the single tasks that are trips (sagas of four steps on "
                        f"tripsim and paysim; one in {TRIP_FULL_ONE_IN} unwinds) instead of "
                        "renewals")
    p.add_argument("--kill-kinds", default=None,
                   help="whom kill -9 may hit, comma-separated; None: every kind of the run")
    p.add_argument("--pause-kinds", default=None, help="whom a short SIGSTOP may hit")
    p.add_argument("--long-pause-kinds", default=None,
                   help="whom a SIGSTOP past the session timeout may hit")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="where logs go (default: .halfway/chaos/run-<time>)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    if not 0.0 <= a.trips <= 1.0:
        p.error("--trips is a share: from 0 to 1")
    if a.instances < 2:
        p.error("--instances must be at least 2: the point is instances sharing the work")
    config = ChaosConfig(tasks=a.tasks, seed=a.seed, window_s=a.window_s, drain_s=a.drain_s,
                         pair_share=a.pair_share, instances=a.instances, kills=a.kills,
                         pauses=a.pauses, long_pauses=a.long_pauses, shuts=a.shuts,
                         broker_kill=not a.no_broker_kill,
                         charge_timeout_s=a.charge_timeout_s, key_ttl_s=a.key_ttl_s,
                         fault_scale=a.fault_scale, run_dir=a.run_dir, workers=a.workers,
                         trips=a.trips)
    every = config.all_kinds()
    config.kill_kinds = _kinds(p, a.kill_kinds, every)
    config.pause_kinds = _kinds(p, a.pause_kinds, every)
    config.long_pause_kinds = _kinds(p, a.long_pause_kinds, every)
    return config, a.json


def _kinds(parser: argparse.ArgumentParser, text: str | None,
           every: tuple[str, ...]) -> tuple[str, ...] | None:
    if text is None:
        return None
    kinds = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = set(kinds) - set(every)
    if unknown or not kinds:
        parser.error(f"unknown kinds {sorted(unknown)}: choose from {', '.join(every)}")
    return kinds


def main(argv: list[str] | None = None) -> int:
    config, as_json = parse_args(argv)
    # halfway's own logging (ensure_topics, the writer) to stderr, warnings only: stdout is the
    # report, one JSON object with --json.
    log.configure(json=True, level="WARNING")
    try:
        report = asyncio.run(run(config))
    except Exception:
        print("the chaos harness broke:\n" + traceback.format_exc(), file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(report.to_json(), default=str))
    else:
        print(render(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
