"""`halfway start`: ask for a task, and with `--follow` print its outcomes as they come.

The request goes to the tasks topic (`task.requested`); the outcomes come from the outcomes
topic, three states per step: done with evidence; not done, safe to try again; unknown, being
checked, with when. The exit code says how the task ended: 0 only when it succeeded.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from halfway.client import HalfwayClient
from halfway.contract import TaskPolicy
from halfway.contract.outcomes import OutcomeChanged
from halfway.journal.admin import ensure_topics_once_up
from halfway.settings import KafkaSettings

EXIT_SUCCEEDED = 0
EXIT_NOT_SUCCEEDED = 1  # failed, compensated, rejected, needs attention
EXIT_TIMED_OUT = 3  # --timeout passed before the task finished
BROKER_WAIT_S = 60.0  # for the broker to answer before the request is given up


class BrokerUnreachable(Exception):
    """The request could not be sent: no broker answered."""


async def start(task_id: str, input: dict[str, Any], tools: list[str], *, saga: bool,
                follow: bool, timeout_s: float | None,
                echo: Callable[[OutcomeChanged], None]) -> int:
    """Request the task; with `follow`, echo its outcome messages until it is over."""
    settings = KafkaSettings.from_env("caller")
    try:
        async with asyncio.timeout(BROKER_WAIT_S):  # `halfway dev` may still be starting
            await ensure_topics_once_up(settings)
    except TimeoutError:
        raise BrokerUnreachable(f"no Kafka broker answers at {settings.bootstrap} within "
                                f"{BROKER_WAIT_S:g} s: is it running (halfway up, or halfway "
                                f"dev)?") from None
    async with HalfwayClient(settings) as client:
        stream = client.outcomes(task_id) if follow else None
        if stream is not None:
            await stream.start()  # from the beginning: a task started earlier shows whole
        try:
            await client.start_task(task_id, input, tools, TaskPolicy(saga=saga))
            if stream is None:
                return EXIT_SUCCEEDED
            try:
                async with asyncio.timeout(timeout_s):
                    async for message in stream:
                        echo(message)
                        if message.subject == "task" and message.finished:
                            return (EXIT_SUCCEEDED if message.state == "succeeded"
                                    else EXIT_NOT_SUCCEEDED)
            except TimeoutError:
                return EXIT_TIMED_OUT
        finally:
            if stream is not None:
                await stream.aclose()
    return EXIT_NOT_SUCCEEDED
