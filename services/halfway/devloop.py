"""`halfway dev`: the local development loop in one process.

It starts the local broker and PostgreSQL when they are not running (`halfway up`), creates
the topics, and runs every service of the app: decider, executor, reconciler, outcomes and the
read-model projector, with readable logs, until Ctrl-C. What `temporal server start-dev` is to
Temporal's users: one command, then `halfway start TASK --app ... --follow` in another shell.
A service that fails stops the loop with its error (no silent half-running harness).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from halfway import log, metrics
from halfway.journal.admin import ensure_topics_once_up
from halfway.loops import run_until_cancelled
from halfway.serve import PARTS, Service, run_service, stop_on_signals
from halfway.settings import KafkaSettings

if TYPE_CHECKING:
    from halfway.app import App
    from halfway.models import Model


async def run_dev(app: App, model: Model) -> None:
    from halfway import settings as env
    from halfway.projector.service import Projector

    settings = KafkaSettings.from_env()
    metrics.serve_from_env()
    await ensure_topics_once_up(settings)
    await app.prepare()  # its MCP servers' tools: waits (logged) while one is down
    registry = app.registry()
    stop_on_signals()
    logger = log.get("halfway.dev")
    logger.info("halfway dev: serving", app=app.label, tools=sorted(registry.names()),
                model=model.name, bootstrap=settings.bootstrap, postgres=env.pg_dsn(),
                next="halfway start TASK_ID --app MODULE:ATTR --input '{\"prompt\": ...}' "
                     "--follow")
    projector = Projector(settings, env.pg_dsn(), schema=env.pg_schema())
    services = [run_service(s, settings, registry, model if s is Service.DECIDER else None,
                            app=app) for s in Service if s not in PARTS]
    try:
        # One that ends by itself stops them all, loudly (a TaskGroup would run on without a
        # child cancelled by someone else).
        await run_until_cancelled(*services, projector.run())
    except asyncio.CancelledError:
        logger.info("halfway dev: stopped")
    finally:
        await registry.aclose()
        close = getattr(model, "aclose", None)
        if close is not None:
            await close()
