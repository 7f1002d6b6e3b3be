"""Names: task ids, step ids and idempotency keys.

The harness names every intended action before it acts, and the model never chooses the name.
A step id is `{task_id}:{n}`; its idempotency key is derived from the step id alone, so every
attempt of a step, in any process, before or after any crash, sends the same key. A
compensation (the undo of a step) is an effect of its own with the key `{task_id}:{n}:undo`.

An undo must happen, but a provider that saved a 5xx under its key (Stripe does) answers every
retry with that key the same way. Once a lookup has proven that nothing happened under the key
(`not_done`), the undo is intended again under a successor key: `{task_id}:{n}:undo2`, then
`:undo3`, at most UNDO_KEYS_MAX keys in all. Each is a new name for a new intended action,
minted by the harness; the proof that the one before never happened is what makes it safe.

These formats are part of the contract (other languages mint and parse them too), so they live
here, beside the events.
"""

from __future__ import annotations

import re

# Task ids are chosen by callers. No colon (it separates the step number), no whitespace, and
# short enough that `{task_id}:{n}:undo` fits every provider's key limit (Stripe: 255, Adyen: 64).
TASK_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,47}$"
STEP_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,47}:[1-9][0-9]{0,3}$"
UNDO_KEYS_MAX = 3  # an undo's keys: the first, and successors after proofs of absence
KEY_PATTERN = (r"^[A-Za-z0-9][A-Za-z0-9._\-]{0,47}:[1-9][0-9]{0,3}"
               rf"(:undo[2-{UNDO_KEYS_MAX}]?)?$")
STEP_N_MAX = 9999
KEY_LENGTH_MAX = 64

_STEP_ID = re.compile(STEP_ID_PATTERN)
_TASK_ID = re.compile(TASK_ID_PATTERN)
_UNDO_KEY = re.compile(rf"^(?P<step>.+):undo(?P<generation>[2-{UNDO_KEYS_MAX}]?)$")
UNDO_SUFFIX = ":undo"


def is_task_id(task_id: str) -> bool:
    return _TASK_ID.fullmatch(task_id) is not None


def step_id(task_id: str, n: int) -> str:
    """The id of step `n` (1, 2, ...) of a task."""
    if not is_task_id(task_id):
        raise ValueError(f"invalid task id {task_id!r}: must match {TASK_ID_PATTERN}")
    if not 1 <= n <= STEP_N_MAX:
        raise ValueError(f"invalid step number {n}: must be 1..{STEP_N_MAX}")
    return f"{task_id}:{n}"


def parse_step_id(step: str) -> tuple[str, int]:
    """(task_id, n) of a step id; ValueError if it is not one."""
    if _STEP_ID.fullmatch(step) is None:
        raise ValueError(f"invalid step id {step!r}: must be '{{task_id}}:{{n}}'")
    task_id, n = step.rsplit(":", 1)
    return task_id, int(n)


def mint_key(step: str) -> str:
    """The idempotency key of a step: a pure function of the step id, stable forever."""
    parse_step_id(step)
    return step


def mint_undo_key(step: str, generation: int = 1) -> str:
    """The idempotency key of the compensation that undoes a step: its first (`generation`
    1), or a successor after the provider was proven to have done nothing under the last."""
    if not 1 <= generation <= UNDO_KEYS_MAX:
        raise ValueError(f"invalid undo generation {generation}: must be 1..{UNDO_KEYS_MAX}")
    return mint_key(step) + UNDO_SUFFIX + (str(generation) if generation > 1 else "")


def parse_undo_key(key: str) -> tuple[str, int] | None:
    """(step id, generation) of an undo key; None if `key` names no undo (a step's key)."""
    match = _UNDO_KEY.fullmatch(key)
    if match is None:
        return None
    try:
        parse_step_id(match["step"])
    except ValueError:
        return None
    return match["step"], int(match["generation"] or 1)


def step_of_key(key: str) -> str:
    """The step id a key names (a step's own key, or one of its undo keys); ValueError if
    it names none."""
    undo = parse_undo_key(key)
    step = undo[0] if undo is not None else key
    parse_step_id(step)
    return step
