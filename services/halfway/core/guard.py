"""guard: the subject guard, folded from the guards topic. Pure: no I/O, no clock.

Theory of operation
-------------------
Two tasks may ask for the same effect on the same business object: two renewals of one
invoice, on different partitions, decided by different instances. Each task's journal orders
its own steps, but nothing orders the two tasks. The guards topic does: it is keyed by subject,
so every claim on `invoice:INV-2291` lands in one partition, and the log order decides.

The decider claims (`subject.claimed`) before it places a step with a subject, and places it
only once its claim is confirmed first in the log: `GuardBook.apply` gives every claim its
verdict, the same one in every instance that reads the partition, after any restart.

- A claim is granted when no other step holds the same tool on the subject. The holder keeps
  it while its step is intended, in flight or unknown: moving on while a charge may have
  happened is how customers pay twice.
- A claim by the step that already holds it is granted again (a retried question, a zombie).
- A release (`subject.released`) by the holder frees the subject. A tool declared
  `once_per_subject` that was `done` leaves a mark instead: its claims on the subject are then
  blocked for good, by any task, however much later.
- A release by a step that does not hold the subject changes nothing (a duplicate).

`stale_claims` says which claims a task's owner must release, from the task's journal: the
holder's step settled, or the claim never became the step (a crash between the claim and
`step.intended`, or another proposal placed instead).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from halfway.contract import Outcome, parse_step_id
from halfway.contract.guards import Release, SubjectClaimed, SubjectReleased
from halfway.core.fold import TaskState


@dataclass(frozen=True, slots=True)
class Granted:
    pass


@dataclass(frozen=True, slots=True)
class Blocked:
    reason: str  # in words the model can read


Verdict = Granted | Blocked


@dataclass(slots=True)
class _Subject:
    holder: SubjectClaimed | None = None
    done_by: SubjectClaimed | None = None  # a once-per-subject effect that happened


class GuardBook:
    """Every subject's holder, folded from the guards topic in log order.

    Mutable on purpose (the topic is kept forever and read at every start); `apply` is still a
    pure function of the records applied so far: no clock, no I/O."""

    def __init__(self) -> None:
        self._subjects: dict[tuple[str, str], _Subject] = {}
        self._held: dict[str, dict[str, SubjectClaimed]] = {}  # task id -> step id -> claim

    def apply(self, record: SubjectClaimed | SubjectReleased) -> Verdict | None:
        """Apply one record; for a claim, its verdict."""
        subject = self._subjects.setdefault((record.tool, record.subject), _Subject())
        if isinstance(record, SubjectClaimed):
            return self._claim(subject, record)
        holder = subject.holder
        if holder is None or holder.step_id != record.step_id:
            return None  # not the holder: a duplicate or a stale release
        subject.holder = None
        self._held.get(holder.task_id, {}).pop(holder.step_id, None)
        if record.release is Release.DONE and holder.once_per_subject:
            subject.done_by = holder
        return None

    def _claim(self, subject: _Subject, claim: SubjectClaimed) -> Verdict:
        holder, done = subject.holder, subject.done_by
        if holder is not None and holder.step_id == claim.step_id:
            return Granted()
        if holder is not None:
            return Blocked(f"blocked: {holder.step_id} on {claim.subject} is still unknown "
                           f"(not settled yet); {claim.tool} waits until it is")
        if claim.once_per_subject and done is not None and done.step_id != claim.step_id:
            return Blocked(f"blocked: {done.step_id} already did {claim.tool} on "
                           f"{claim.subject}; {claim.tool} happens once per subject")
        subject.holder = claim
        self._held.setdefault(claim.task_id, {})[claim.step_id] = claim
        return Granted()

    def held_by(self, task_id: str) -> Mapping[str, SubjectClaimed]:
        """The claims steps of `task_id` hold now, by step id."""
        return dict(self._held.get(task_id, {}))


def stale_claims(claims: Iterable[SubjectClaimed], state: TaskState,
                 placing: set[int]) -> list[tuple[SubjectClaimed, Release]]:
    """The claims of `state`'s task to release, and how. `placing`: step numbers whose claim
    is being turned into a step right now (leave those alone)."""
    out: list[tuple[SubjectClaimed, Release]] = []
    for claim in claims:
        _, n = parse_step_id(claim.step_id)
        step = state.steps.get(n)
        if step is None:
            if n not in placing:
                out.append((claim, Release.ABANDONED))
            continue
        if (step.intent.tool, step.intent.subject) != (claim.tool, claim.subject):
            out.append((claim, Release.ABANDONED))  # another proposal became this step
        elif step.outcome is Outcome.DONE:
            out.append((claim, Release.DONE))
        elif step.outcome is Outcome.NOT_DONE:
            out.append((claim, Release.NOT_DONE))
    return out
