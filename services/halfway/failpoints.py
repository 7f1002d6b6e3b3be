"""Failpoints: named places where a test makes a process misbehave on purpose, at an exact
moment no outside signal could hit (FoundationDB's buggify and TiKV's fail-rs are the models).

`HALFWAY_FAILPOINTS="decider.claimed=stop@frozen-"` makes a decider stop itself with SIGSTOP
(as a GC pause, a VM stall or a partition that heals would) right after the guard granted its
claim for a step of a task whose id starts with `frozen-`, before it journals the step; it goes
on where it was when sent SIGCONT. Several are separated by `;`. Actions: `stop` (SIGSTOP
itself) and `crash` (exit at once with status 137, as after kill -9).

Unset, as in every deployment, a failpoint is one dictionary lookup.
"""

from __future__ import annotations

import os
import signal

ENV = "HALFWAY_FAILPOINTS"
KILLED_STATUS = 137  # what a shell reports for a process killed by SIGKILL
ACTIONS = ("stop", "crash")


def _parse(spec: str) -> dict[str, tuple[str, str]]:
    points: dict[str, tuple[str, str]] = {}
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        name, _, rest = item.partition("=")
        action, _, prefix = rest.partition("@")
        if not name or action not in ACTIONS:
            raise ValueError(f"{ENV}: {item!r} is not NAME=ACTION[@TASK_PREFIX] with ACTION "
                             f"one of {', '.join(ACTIONS)}")
        points[name] = (action, prefix)
    return points


_POINTS = _parse(os.environ.get(ENV, ""))


def failpoint(name: str, task_id: str) -> None:
    """Misbehave here if the environment says so for this task."""
    point = _POINTS.get(name)
    if point is None:
        return
    action, prefix = point
    if not task_id.startswith(prefix):
        return
    if action == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)  # returns once someone sends SIGCONT
    else:
        os._exit(KILLED_STATUS)
