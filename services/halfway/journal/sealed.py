"""Sealed tasks: which tasks are over for good, at 8 bytes each, whatever the journal's length.

A follower keeps a sealed task only to say it is over (and how: finished or rejected), so a
second start is refused and late news is not folded. Kept as ids, that is ~200 bytes a task (the
string, a dict entry, a set entry): 330 MiB after 1.7 million tasks, a cost that grows with all
history. Here each is one 64-bit number, a digest of its id with its status in the lowest bit,
in a sorted array per journal partition (the newest in a small dict until it is merged), and a
snapshot carries the arrays as they are.

The digest is 63 bits of a keyed BLAKE2b: a task id that is not sealed is mistaken for a sealed
one with odds of n / 2^63 (n sealed tasks: about 1 in 5·10^12 per new task at 1.7 million). The
mistake fails safe: that task is never started (it waits as requested) and nothing is sent.
"""

from __future__ import annotations

import functools
import heapq
import sys
from array import array
from bisect import bisect_left
from collections.abc import Iterable, Iterator
from datetime import datetime, timedelta
from hashlib import blake2b

from halfway.core.fold import TaskStatus

_KEY = b"halfway.sealed.v1"
_REJECTED_BIT = 1
# Newest seals wait in a dict until there are this many, or an eighth of the sorted array.
MERGE_AT_LEAST = 4096
_EMPTY = array("Q")
# The newest task ids' digests kept: a live task's is asked for on every record of it.
DIGESTS_KEPT = 8192


@functools.lru_cache(maxsize=DIGESTS_KEPT)
def digest(task_id: str) -> int:
    """The task id's 63-bit digest, shifted: the lowest bit is left for the status."""
    h = int.from_bytes(blake2b(task_id.encode(), digest_size=8, key=_KEY).digest(), "little")
    return (h >> 1) << 1


def _status(value: int) -> TaskStatus:
    return TaskStatus.REJECTED if value & _REJECTED_BIT else TaskStatus.FINISHED


class SealedTasks:
    """Task id -> how it ended, for sealed tasks, by journal partition."""

    def __init__(self) -> None:
        self._sorted: dict[int, array[int]] = {}  # partition -> digest|status, ascending
        self._recent: dict[int, dict[int, TaskStatus]] = {}  # partition -> digest -> status

    def add(self, partition: int, task_id: str, status: TaskStatus) -> None:
        assert status in (TaskStatus.FINISHED, TaskStatus.REJECTED), status
        d = digest(task_id)
        values = self._sorted.get(partition, _EMPTY)
        i = bisect_left(values, d)
        if i < len(values) and values[i] >> 1 == d >> 1:  # sealed again (news, then over)
            values[i] = d | (_REJECTED_BIT if status is TaskStatus.REJECTED else 0)
            return
        recent = self._recent.setdefault(partition, {})
        recent[d] = status
        if len(recent) >= max(MERGE_AT_LEAST, len(values) // 8):
            self._merge(partition)

    def get(self, task_id: str, partition: int | None = None) -> TaskStatus | None:
        """How the task ended, if sealed; `partition` (when known) is the only one looked in."""
        d = digest(task_id)
        numbers = self._sorted.keys() | self._recent.keys() if partition is None else (partition,)
        for number in numbers:
            recent = self._recent.get(number)
            if recent is not None and (status := recent.get(d)) is not None:
                return status
            values = self._sorted.get(number, _EMPTY)
            i = bisect_left(values, d)
            if i < len(values) and values[i] >> 1 == d >> 1:
                return _status(values[i])
        return None

    def has(self, partition: int, task_id: str) -> bool:
        """Whether the task of that journal partition is sealed."""
        return self.get(task_id, partition) is not None

    def __contains__(self, task_id: object) -> bool:
        return isinstance(task_id, str) and self.get(task_id) is not None

    def __len__(self) -> int:
        return sum(map(len, self._sorted.values())) + sum(map(len, self._recent.values()))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SealedTasks):
            return NotImplemented
        numbers = set(self._sorted) | set(self._recent) | set(other._sorted) | set(other._recent)
        return all(self.packed(n) == other.packed(n) for n in numbers)

    __hash__ = None  # type: ignore[assignment]

    def drop(self, partition: int) -> None:
        """Forget a partition's sealed tasks (it is no longer ours)."""
        self._sorted.pop(partition, None)
        self._recent.pop(partition, None)

    def packed(self, partition: int) -> bytes:
        """The partition's sealed tasks as bytes (little-endian 64-bit, ascending)."""
        self._merge(partition)
        values = self._sorted.get(partition, _EMPTY)
        if sys.byteorder != "little":
            values = array("Q", values)
            values.byteswap()
        return values.tobytes()

    def restore(self, partition: int, packed: bytes, *, checked: bool = False) -> None:
        """The partition's sealed tasks from `packed` (raises ValueError if not such bytes;
        `checked`: their order was checked where they come from, a snapshot's `encode`)."""
        self._sorted[partition] = unpack(packed, check=not checked)
        self._recent.pop(partition, None)

    def _merge(self, partition: int) -> None:
        recent = self._recent.pop(partition, None)
        if not recent:
            return
        # Digests in `recent` are not in the array (`add` updates those in place); two sorted
        # runs sort in one pass.
        new = sorted(d | (_REJECTED_BIT if s is TaskStatus.REJECTED else 0)
                     for d, s in recent.items())
        self._sorted[partition] = array("Q", sorted([*self._sorted.get(partition, _EMPTY),
                                                     *new]))


def unpack(packed: bytes, *, check: bool = True) -> array[int]:
    """`SealedTasks.packed` bytes back into an array. Raises ValueError if they are not."""
    if len(packed) % 8:
        raise ValueError(f"{len(packed)} bytes are not 64-bit values")
    values = array("Q")
    values.frombytes(packed)
    if sys.byteorder != "little":
        values.byteswap()
    if check and values != array("Q", sorted(values)):  # (sorted input sorts in one pass)
        raise ValueError("sealed digests are not in ascending order")
    return values


class ByTime:
    """(`at`, task id) pairs, earliest first, whatever order they were added in: one dated far
    ahead by a writer's broken clock waits alone instead of holding back every later one."""

    __slots__ = ("_heap",)

    def __init__(self, entries: Iterable[tuple[datetime, str]] = ()) -> None:
        self._heap = list(entries)
        heapq.heapify(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def add(self, at: datetime, task_id: str) -> None:
        heapq.heappush(self._heap, (at, task_id))

    def extend(self, entries: Iterable[tuple[datetime, str]]) -> None:
        self._heap.extend(entries)
        heapq.heapify(self._heap)

    def due(self, now: datetime, after: timedelta) -> Iterator[tuple[datetime, str]]:
        """Remove and yield the pairs `after` or more before `now`, earliest first."""
        heap = self._heap
        if not heap:
            return
        try:
            until = now - after
        except OverflowError:  # `now` within `after` of the calendar's start: nothing is due
            return
        while heap and heap[0][0] <= until:
            yield heapq.heappop(heap)

    def entries(self) -> list[tuple[datetime, str]]:
        """Earliest first: one order for the same pairs, however they came (an image)."""
        return sorted(self._heap)


class EndedTasks:
    """One journal partition's tasks that ended (finished or rejected), by the time of their
    ends by the journal's clock (`at`), until they are due to be sealed: the one rule for when
    a task is sealed, shared by the services' followers and the projector. A task with news
    after it ended ends again later; only its newest end counts."""

    def __init__(self, entries: Iterable[tuple[datetime, str]] = ()) -> None:
        entries = list(entries)  # a restore brings thousands: one heapify
        self._queue = ByTime(entries)
        self._last: dict[str, datetime] = {  # task id -> `at` of its newest end
            task_id: at for at, task_id in entries}

    def add(self, at: datetime, task_id: str) -> None:
        self._queue.add(at, task_id)
        self._last[task_id] = at

    def is_last(self, task_id: str, at: datetime) -> bool:
        """`at` is the task's newest end, not yet due."""
        return self._last.get(task_id) == at

    def last_end(self, task_id: str) -> datetime | None:
        """The task's newest end, if not yet due."""
        return self._last.get(task_id)

    def due(self, now: datetime, after: timedelta) -> list[str]:
        """The tasks whose newest end is `after` before `now`, oldest first, each once: they
        leave the queue (the caller seals those settled for good; another end re-enters one).
        Asked at every record folded: nothing is due, most of the time, at one comparison."""
        out: list[str] = []
        for at, task_id in self._queue.due(now, after):
            if self._last.get(task_id) == at:  # else it had news since: a later entry decides
                del self._last[task_id]
                out.append(task_id)
        return out

    def entries(self) -> list[tuple[datetime, str]]:
        """The queue, earliest first (a snapshot's image holds it)."""
        return self._queue.entries()
