"""Running a service: wiring settings, the journal writer, tools and model, until stopped.

`halfway run decider|executor` calls `serve(name)`; the demo runs the same services in one
process with `start(name, ...)`.
"""

from __future__ import annotations

import asyncio
import signal
from enum import StrEnum

from halfway import log
from halfway.journal import JournalWriter
from halfway.journal.admin import ensure_topics_once_up
from halfway.models import Model, ScriptedModel
from halfway.settings import KafkaSettings
from halfway.tools.registry import Registry, default_registry


class Service(StrEnum):
    DECIDER = "decider"
    EXECUTOR = "executor"
    RECONCILER = "reconciler"
    OUTCOMES = "outcomes"


async def run_service(name: Service, settings: KafkaSettings, registry: Registry,
                      model: Model | None = None) -> None:
    """Run one service until cancelled."""
    from halfway import settings as env
    from halfway.decider.service import Decider
    from halfway.executor.service import Executor
    from halfway.outcomes.service import OutcomesPublisher
    from halfway.reconciler.service import Reconciler

    async with JournalWriter(settings) as writer:
        match name:
            case Service.DECIDER:
                await Decider(settings, registry, model or ScriptedModel(), writer).run()
            case Service.EXECUTOR:
                await Executor(settings, registry, writer).run()
            case Service.RECONCILER:
                await Reconciler(settings, registry, writer,
                                 lookups=env.reconciler_lookups()).run()
            case Service.OUTCOMES:
                await OutcomesPublisher(settings, writer).run()


async def serve(name: Service) -> None:
    """The process entry point: stop cleanly on SIGTERM or SIGINT."""
    log.configure()
    settings = KafkaSettings.from_env()
    await ensure_topics_once_up(settings)
    registry = default_registry()
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, task.cancel)
    log.get("halfway.serve").info("service starting", service=name.value,
                                  bootstrap=settings.bootstrap, prefix=settings.topic_prefix)
    try:
        await run_service(name, settings, registry)
    except asyncio.CancelledError:
        log.get("halfway.serve").info("service stopped", service=name.value)
    finally:
        await registry.aclose()
