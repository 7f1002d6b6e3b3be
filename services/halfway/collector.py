"""Python's cycle collector, set for a process that folds a journal and serves steps.

CPython collects its youngest generation every 700 container allocations (its default). A step
allocates thousands (events, states, futures, an HTTP exchange), so a step's objects are walked
several times while it is in flight, and whatever lives a few milliseconds (a step waiting on
its provider, a fold a task holds) is promoted to the oldest generation, whose collections walk
everything there: in a worker with 1,000 tasks in flight that was 17% of its CPU (gen 2 alone
2.7 s of 21.5 s). Our objects nearly all die by their reference counts (the fold's states are
immutable and hold no cycles), so collecting young objects less often finds the same garbage,
a little later, with a fraction of the walks, and far fewer objects reach the old generation.
`benchmarks/side_by_side.py` with `--variant` showed it: worker CPU per task 5.37 → 3.76 ms.

The `halfway` command sets them before it imports its modules and freezes what they built
(`halfway/__main__.py`), so the imports' lasting objects are never walked; the follower's
`gc.freeze` after a replay (`journal.follower`) is the other half: what was folded before the
process went live is never walked again.
"""

from __future__ import annotations

import gc

# Container allocations (net of frees) between two collections of the youngest generation
# (CPython: 700). At most this many young objects wait for a collection: a few MiB.
YOUNG_ALLOCATIONS = 100_000
# Young collections per collection of the middle generation (CPython: 10).
MIDDLE_EVERY = 50
# Middle collections, at least, per full collection (CPython: 10); CPython also waits until
# the objects promoted since the last full one are a quarter of the old generation.
FULL_EVERY_AT_LEAST = 20


def tune() -> None:
    """Set the thresholds above for this process (the `halfway` command: every long-running
    service, and the short commands, which end before a young collection is due)."""
    gc.set_threshold(YOUNG_ALLOCATIONS, MIDDLE_EVERY, FULL_EVERY_AT_LEAST)
