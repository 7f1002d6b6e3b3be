"""Running a service: wiring settings, the journal writer, the app's tools and the model.

`halfway run decider|executor|reconciler|outcomes|worker [--app MODULE:ATTR] [--model NAME]`
calls `serve(name, app=..., model=...)`; `halfway dev` and the demos run the same services in
one process with `run_service(...)`.

A worker is a decider and an executor in one process, each with its own Kafka principal and
consumer group, exactly as when run apart (workers and separate deciders and executors mix in
one deployment). What it gains: each folds the other's appends as soon as they are
acknowledged (`halfway.journal.writer.local_appends`), so a step goes from decided to
attempted, and from settled to the next decision, without a consumer's fetch round trip.
Both then have little to fetch from the journal that they have not folded already (the
reconciler's settlements, steps of deciders or executors elsewhere), so they let the broker
gather those fetches for WORKER_GATHER_MS: a fetch per window, not one per journal record.
The decider still reads requests at once, with a consumer of their own (`EventConsumer`'s
`prompt`). And the decider hands each step it decides to the executor (`Executor.place`),
which journals the decision with its first attempt in one append when it would attempt it at
once. benchmarks/side_by_side.py's 3-step task, one worker alone, sequential: worker CPU
16 -> 10.5 ms, broker CPU 6.5-9 -> 4.5-5 ms, start to finished 18-19 -> 12.7-13.5 ms (the
gathered fetches).
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import TYPE_CHECKING

from halfway import log
from halfway.journal import JournalWriter
from halfway.journal.admin import check_access, ensure_topics_once_up, needed_topics
from halfway.models import Model, ScriptedModel
from halfway.settings import KafkaSettings
from halfway.tools.registry import Registry

if TYPE_CHECKING:
    from halfway.app import App


class Service(StrEnum):
    DECIDER = "decider"
    EXECUTOR = "executor"
    RECONCILER = "reconciler"
    OUTCOMES = "outcomes"
    WORKER = "worker"


# The services a process of each kind runs.
PARTS = {Service.WORKER: (Service.DECIDER, Service.EXECUTOR)}
# How long a worker's decider and executor let the broker gather a journal fetch: what is
# written elsewhere (the reconciler, or deciders and executors of a mixed deployment) reaches
# them at most this much later. Also how often an idle worker fetches (as the reconciler).
WORKER_GATHER_MS = 100


async def run_service(name: Service, settings: KafkaSettings, registry: Registry,
                      model: Model | None = None, *, app: App | None = None) -> None:
    """Run one service until cancelled (a worker: both its parts, each with its own writer
    and principal). `app` (when given) names what is served: its instructions go to the
    model, its label into the journal."""
    from halfway import settings as env
    from halfway.decider.service import Decider
    from halfway.executor.service import Executor
    from halfway.journal.writer import DEFAULT_BATCH_BYTES
    from halfway.loops import run_until_cancelled
    from halfway.outcomes.service import WRITER_BATCH_BYTES, OutcomesPublisher
    from halfway.reconciler.service import Reconciler

    label = app.label if app is not None else "unnamed"
    instructions = app.instructions if app is not None else ""
    if name is Service.WORKER:
        decider_settings = settings.as_kind(Service.DECIDER.value)
        executor_settings = settings.as_kind(Service.EXECUTOR.value)
        async with JournalWriter(decider_settings) as decider_writer, \
                JournalWriter(executor_settings) as executor_writer:
            executor = Executor(executor_settings, registry, executor_writer, app_label=label,
                                gather_ms=WORKER_GATHER_MS)
            decider = Decider(decider_settings, registry, model or ScriptedModel(),
                              decider_writer, instructions=instructions, app_label=label,
                              gather_ms=WORKER_GATHER_MS, hand=executor)
            executor.partner = decider
            await run_until_cancelled(executor.run(), decider.run())
        return
    # The outcomes publisher has hundreds of sends in flight when it tells a history.
    batch_bytes = WRITER_BATCH_BYTES if name is Service.OUTCOMES else DEFAULT_BATCH_BYTES
    async with JournalWriter(settings, batch_bytes=batch_bytes) as writer:
        match name:
            case Service.DECIDER:
                service: Decider | Executor | Reconciler | OutcomesPublisher = Decider(
                    settings, registry, model or ScriptedModel(), writer,
                    instructions=instructions, app_label=label)
            case Service.EXECUTOR:
                service = Executor(settings, registry, writer, app_label=label)
            case Service.RECONCILER:
                service = Reconciler(settings, registry, writer,
                                     lookups=env.reconciler_lookups(), app_label=label)
            case Service.OUTCOMES:
                service = OutcomesPublisher(settings, writer)
        # In a task of its own: a cancellation that is not ours ends the process with an
        # error (LoopEnded), not as a stop that was asked for.
        await run_until_cancelled(service.run())


def stop_on_signals() -> asyncio.Event:
    """SIGTERM and SIGINT cancel the running task: services stop cleanly. Returns an event set
    once one came, which tells a stop asked for from any other cancellation."""
    task = asyncio.current_task()
    assert task is not None
    stopping = asyncio.Event()

    def stop() -> None:
        stopping.set()
        task.cancel()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
    return stopping


async def until_stopped(main: Callable[[], Awaitable[None]], *, kind: str | None = None) -> None:
    """`main()`, stopped by SIGTERM or SIGINT from the process's first moment as a normal stop:
    for entry points that install their own handlers only once they serve (the projector,
    `halfway dev`, the MCP proxy), so that a stop while they wait for the broker is not lost.
    With `kind`: first wait for the broker and its topics, and check that this process's
    principal has `kind`'s rights (`check_access`), before `main` touches anything."""
    stopping = stop_on_signals()
    try:
        if kind is not None:
            check_settings()
            settings = KafkaSettings.from_env(kind)
            await ensure_topics_once_up(settings, needed_topics(kind))
            await check_access(settings, kind)
        await main()
    except asyncio.CancelledError:
        if not stopping.is_set():
            raise
        log.get("halfway.serve").info("stopped before serving")


def check_settings() -> None:
    """Read the settings a service reads only once its follower is made (sealing, snapshots),
    so that a wrong one stops the process at once (SettingsError), not after it has waited for
    the broker and its topics."""
    from halfway import settings as env
    from halfway.journal import snapshots as snaps

    env.seal_after_s()
    snaps.every_s()


async def serve(name: Service, *, app: App, model: Model | None = None) -> None:
    """The process entry point (the app and the model already loaded by the command line,
    which reports a wrong one): stop cleanly on SIGTERM or SIGINT."""
    log.configure()
    check_settings()
    parts = PARTS.get(name, (name,))
    settings = KafkaSettings.from_env(parts[0].value)
    # From here: a stop also ends the waits below (a broker, its topics, an MCP server).
    stop_on_signals()
    registry: Registry | None = None
    try:
        await ensure_topics_once_up(settings)
        for part in parts:  # the wrong credentials stop it here, with what is missing
            await check_access(settings.as_kind(part.value), part.value)
        await app.prepare()  # its MCP servers' tools: waits (logged) while one is down
        registry = app.registry()
        log.get("halfway.serve").info(
            "service starting", service=name.value, app=app.label,
            tools=sorted(registry.names()), model=None if model is None else model.name,
            bootstrap=settings.bootstrap, prefix=settings.topic_prefix,
            loop=type(asyncio.get_running_loop()).__module__.partition(".")[0])  # eventloop
        await run_service(name, settings, registry,
                          model if Service.DECIDER in parts else None, app=app)
    except asyncio.CancelledError:
        log.get("halfway.serve").info("service stopped", service=name.value)
    finally:
        if registry is not None:
            await registry.aclose()
        else:
            await app.close_mcp()  # stopped while preparing: its sessions opened so far
        close = getattr(model, "aclose", None)
        if close is not None:
            await close()
