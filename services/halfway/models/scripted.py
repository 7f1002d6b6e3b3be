"""A deterministic scripted model: the embedded default for demos and tests.

It follows the task's input: `input["script"]` is a list of steps `{"tool", "args"}`; after
the last one it finishes with `input.get("summary")` (without one, the decider words the end
from the facts: "done", or which step was not done when the last one was not). A task
without a script, or with one that is not such a list, is a permanent model failure (the task
fails at once, saying why), never a success with no step nor a question asked again.

It behaves like a real model in the one way that matters here: asked twice for the same step
it answers differently (a step may carry `"reask_args"`, merged over `args` on every ask after
the first, e.g. `{"amount_cents": "49.00"}`), so tests can prove a resumed task re-reads its
decision instead of asking again. Told that a proposal was refused, it corrects itself and
proposes the script's own args.

A step may also carry `"second_ask_delay_s"`: asked for that step a second time (by another
decider that took the task over, say), the model thinks that long before it answers, as a slow
model would; tests use it to order a race.

Every question is counted. With `HALFWAY_MODEL_CALL_LOG` set, each one is appended as a JSON
line to that file, so the count survives a kill -9 and is shared by every process.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from pathlib import Path
from typing import Any

from halfway import settings
from halfway.models.base import (
    History,
    ModelUnavailable,
    Proposal,
    ProposeCall,
    ProposeFinish,
)

DELAY_S_MAX = 600.0  # of a scripted model's thinking
# Questions remembered (task, step number), to tell a question asked again (`reask_args`,
# `second_ask_delay_s`: scripts that test a re-ask); past this the oldest are forgotten, and
# a step asked again after that many others reads as asked once. A workflow never re-asks.
ASKED_KEPT = 100_000


class ScriptedModel:
    name = "scripted"
    version: str | None = "1"
    # Answers without I/O (a workflow's script): a worker's decider asks it as part of the
    # append that journals what it answers after (halfway.decider.service, `Carry`).
    immediate = True

    def __init__(self, call_log: Path | None = None) -> None:
        env = settings.model_call_log()
        self.call_log = call_log or (Path(env) if env else None)
        self._asked: dict[tuple[str, int], int] = {}  # in order of first asking

    def times_asked(self, task_id: str, n: int) -> int:
        if self.call_log is None:
            return self._asked.get((task_id, n), 0)
        if not self.call_log.exists():
            return 0
        lines = self.call_log.read_text().splitlines()
        return sum(1 for line in lines
                   if (e := json.loads(line))["task_id"] == task_id and e["n"] == n)

    def _record(self, task_id: str, n: int, answer: dict[str, Any]) -> None:
        asked = self._asked
        if (task_id, n) not in asked and len(asked) >= ASKED_KEPT:
            del asked[next(iter(asked))]
        asked[(task_id, n)] = asked.get((task_id, n), 0) + 1
        if self.call_log is not None:
            with self.call_log.open("a") as f:
                f.write(json.dumps({"task_id": task_id, "n": n, **answer}) + "\n")
                f.flush()
                os.fsync(f.fileno())  # the count must survive a kill -9 right after

    async def decide(self, history: History) -> Proposal:
        if "script" not in history.input:
            # Finishing "done" after no step would tell the caller the task succeeded.
            raise ModelUnavailable(
                "the scripted model follows input.script, and this task has none: give the "
                "task a script, or run the decider with a real model (--model openai:NAME)",
                transient=False)
        script = _checked(history.input["script"])
        asked_before = self.times_asked(history.task_id, history.n)
        if history.n > len(script):
            # No summary in the input: the decider words the end from the facts.
            summary = str(history.input.get("summary", ""))
            self._record(history.task_id, history.n, {"finish": summary})
            return ProposeFinish(summary)
        entry = script[history.n - 1]
        if asked_before == 1 and entry.get("second_ask_delay_s"):
            await asyncio.sleep(min(float(entry["second_ask_delay_s"]), DELAY_S_MAX))
        args = dict(entry.get("args", {}))
        if asked_before and not history.refusals:
            args |= entry.get("reask_args", {})
        self._record(history.task_id, history.n, {"tool": entry["tool"], "args": args})
        return ProposeCall(tool=entry["tool"], args=args)


def _checked(script: Any) -> list[dict[str, Any]]:
    """The script, whole: a malformed one is the caller's mistake, which asking again cannot
    mend (so not transient: the task fails at once, as after a model's 400)."""
    shape = 'each step {"tool": NAME, "args": {...}}'
    if not isinstance(script, list):
        raise ModelUnavailable(f"input.script is not a list of steps: {shape}", transient=False)
    for n, entry in enumerate(script, start=1):
        problem = _step_problem(entry)
        if problem is not None:
            raise ModelUnavailable(f"input.script step {n} {problem}: {shape}", transient=False)
    return script


def _step_problem(entry: Any) -> str | None:
    if not isinstance(entry, dict):
        return "is not an object"
    if not isinstance(entry.get("tool"), str):
        return "names no tool"
    if any(not isinstance(entry.get(k, {}), dict) for k in ("args", "reask_args")):
        return "has args that are not an object"
    delay = entry.get("second_ask_delay_s", 0)
    if isinstance(delay, bool) or not isinstance(delay, int | float) or not math.isfinite(delay):
        return "has a second_ask_delay_s that is not a number of seconds"
    return None
