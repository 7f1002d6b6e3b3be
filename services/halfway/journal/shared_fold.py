"""One fold per journal record per process, however many followers read it.

A worker runs a decider and an executor, each with its own follower of the same journal
partitions: each would fold every record, so every event of a step would be folded twice (a
tenth of a worker's CPU). The fold is pure, and its states are immutable, so a follower that
folds an event onto the very state object another follower folded it onto takes that
follower's result. Both followers start from nothing and fold the same records in the same
(log) order, so they hold the same objects all along; a follower restored from a snapshot, or
one whose history differs, holds other objects and folds for itself.

The last SHARED_FOLDS_KEPT results are kept (oldest out first): a few live tasks' latest steps.
"""

from __future__ import annotations

from halfway.contract import Event
from halfway.core.fold import TaskState, apply

SHARED_FOLDS_KEPT = 1024


class SharedFolds:
    def __init__(self, kept: int = SHARED_FOLDS_KEPT) -> None:
        self._kept = kept
        # (event id, id of the state folded onto) -> (that state, the event, the result). The
        # state is kept with its id, so an id reused by a later object is never mistaken for it.
        self._results: dict[tuple[str, int], tuple[TaskState | None, Event, TaskState]] = {}

    def apply(self, before: TaskState | None, event: Event) -> TaskState:
        """`apply(before or a new state, event)`, folded once for every follower here."""
        key = (event.event_id, id(before))
        hit = self._results.get(key)
        if hit is not None and hit[0] is before and (hit[1] is event or hit[1] == event):
            return hit[2]  # the event compared too: a forged copy of an id folds for itself
        after = apply(before or TaskState(task_id=event.task_id), event)
        self._results[key] = (before, event, after)
        if len(self._results) > self._kept:
            del self._results[next(iter(self._results))]
        return after


shared_folds = SharedFolds()
