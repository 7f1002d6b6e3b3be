"""`halfway start`: ask for a task, and with `--follow` print its outcomes as they come.

The request goes to the tasks topic (`task.requested`); the outcomes come from the outcomes
topic, three states per step: done with evidence; not done, safe to try again; unknown, being
checked, with when. The exit code says how the task ended: 0 only when it succeeded.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from halfway.client import HalfwayClient
from halfway.contract import TaskPolicy, TaskRequested, encode_event, parse_event
from halfway.contract.outcomes import OutcomeChanged
from halfway.journal.admin import ensure_topics_once_up
from halfway.journal.records import describe, stamp
from halfway.settings import KafkaSettings

EXIT_SUCCEEDED = 0
EXIT_NOT_SUCCEEDED = 1  # failed, compensated, rejected, needs attention
EXIT_TIMED_OUT = 3  # --timeout passed before the task finished
BROKER_WAIT_S = 60.0  # for the broker to answer before the request is given up
# How deeply --input may nest: well inside what the journal's reader takes (pydantic's JSON
# parser stops near 200 levels, the event around the input included).
INPUT_DEPTH_MAX = 100


class BrokerUnreachable(Exception):
    """The request could not be sent: no broker answered."""


class BadInput(Exception):
    """`--input` cannot be a task's input; the message says why, in one line."""


def task_input(task_id: str, text: str) -> dict[str, Any]:
    """The input `text` gives task `task_id`: a JSON object the journal keeps exactly as given
    (no NaN or 1e999, which JSON cannot say and would come back null), read back as the
    decider reads it. BadInput if not, before anything is sent."""
    try:
        value = json.loads(text, parse_constant=_not_a_number, parse_float=_finite,
                           parse_int=_whole)
    except RecursionError:
        raise BadInput(f"--input nests more than {INPUT_DEPTH_MAX} levels deep") from None
    except ValueError as exc:  # JSONDecodeError
        raise BadInput(f"--input is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise BadInput("--input must be a JSON object, e.g. '{\"prompt\": \"...\"}'")
    if _depth(value) > INPUT_DEPTH_MAX:
        raise BadInput(f"--input nests more than {INPUT_DEPTH_MAX} levels deep")
    try:
        parse_event(encode_event(TaskRequested(**stamp(task_id), input=value)))
    except ValidationError as exc:
        raise BadInput(describe(exc, "--input cannot be journaled: ")) from None
    except ValueError as exc:  # text that is not Unicode: "\ud800"
        raise BadInput(f"--input cannot be journaled: {exc}") from None
    return value


def _not_a_number(name: str) -> Any:
    raise BadInput(f"--input holds {name}, which is not a JSON number")


def _finite(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise BadInput(f"--input holds {text[:40]}, a number too large to keep")
    return number


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:  # past Python's bound on digits (4300)
        raise BadInput(f"--input holds a number of {len(text)} digits, too long to "
                       "read") from None


def _depth(value: Any) -> int:
    """How many levels of objects and arrays `value` nests, counted without recursion."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, level = pending.pop()
        if isinstance(item, dict | list):
            deepest = max(deepest, level)
            pending.extend((child, level + 1)
                           for child in (item.values() if isinstance(item, dict) else item))
    return deepest


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
