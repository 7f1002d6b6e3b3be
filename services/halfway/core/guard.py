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

- A claim is granted when no other claim holds the same tool on the subject. The holder keeps
  it while its step is intended, in flight or unknown: moving on while a charge may have
  happened is how customers pay twice.
- A claim is a single record, named by its event id: a second claim by the same step is not
  the same claim and is blocked while the first holds (the first is withdrawn, then released,
  before its step claims again). One step, one live claim: a step placed on a claim is placed
  on the only claim that can hold the subject for it.
- A release (`subject.released`) of the claim that holds the subject frees it. A tool declared
  `once_per_subject` that was `done` leaves a mark instead: its claims on the subject are then
  blocked for good, by any task, however much later.
- A release of a claim that does not hold the subject changes nothing (a duplicate, or a
  paused decider's late release of an older claim: it must never free a newer one).

`guard_moves` says what a task's owner must do with its claims, from the task's journal:
release it when its step settled; when the claim never became the step (a crash between the
claim and `step.intended`, a paused decider, another proposal placed instead), and the fold has
read as far as the claimer had (the task started, the step before decided), withdraw it in
the task's journal first (`claim.withdrawn`), and release it only once the journal accepted
the withdrawal. Why that order is enough: a release of an abandoned claim is written only after
a withdrawal that the fold accepted, so every `step.intended` placed on that claim either came
before the withdrawal (then the withdrawal is void, the step holds the claim and no release is
written) or after it (then the fold refuses the step and nothing executes it). No other task
can hold the subject while a step on the claim could still be accepted.
"""

from __future__ import annotations

from collections.abc import Iterable, KeysView, Mapping
from dataclasses import dataclass

from halfway.contract import Outcome, StepIntended, parse_step_id
from halfway.contract.guards import Release as ReleaseKind
from halfway.contract.guards import SubjectClaimed, SubjectReleased
from halfway.core.fold import TaskState


@dataclass(frozen=True, slots=True)
class Granted:
    pass


@dataclass(frozen=True, slots=True)
class Blocked:
    reason: str  # in words the model can read
    holder: str | None = None  # the step holding the subject (None: a once-per-subject mark)
    own: bool = False  # held by an earlier claim of the same step: withdraw that first


Verdict = Granted | Blocked


@dataclass(slots=True)
class _Subject:
    holder: SubjectClaimed | None = None
    # The step whose once-per-subject effect happened: its id alone, kept for good (a whole
    # claim was 1.6 KB a mark: a quarter GB after 150,000 invoices paid).
    done_by: str | None = None


class GuardBook:
    """Every subject's holder, folded from the guards topic in log order.

    Mutable on purpose (the topic is kept forever and read at every start); `apply` is still a
    pure function of the records applied so far: no clock, no I/O."""

    def __init__(self) -> None:
        self._subjects: dict[tuple[str, str], _Subject] = {}
        self._held: dict[str, dict[str, SubjectClaimed]] = {}  # task id -> step id -> claim

    def apply(self, record: SubjectClaimed | SubjectReleased) -> Verdict | None:
        """Apply one record; for a claim, its verdict."""
        name = (record.tool, record.subject)
        if isinstance(record, SubjectClaimed):
            return self._claim(self._subjects.setdefault(name, _Subject()), record)
        subject = self._subjects.get(name)
        holder = None if subject is None else subject.holder
        if subject is None or holder is None or holder.step_id != record.step_id:
            return None  # not the holder: a duplicate or a stale release
        if record.claim_id is not None and record.claim_id != holder.event_id:
            return None  # a late release of an older claim of this step
        subject.holder = None
        self._held.get(holder.task_id, {}).pop(holder.step_id, None)
        if not self._held.get(holder.task_id):
            self._held.pop(holder.task_id, None)
        if record.release is ReleaseKind.DONE and holder.once_per_subject:
            subject.done_by = holder.step_id
        if subject.done_by is None:
            # A free subject is what an unknown one reads as: keeping it would hold every
            # subject ever claimed. Only holders and once-per-subject marks stay.
            del self._subjects[name]
        return None

    def _claim(self, subject: _Subject, claim: SubjectClaimed) -> Verdict:
        holder, done = subject.holder, subject.done_by
        if holder is not None and holder.event_id == claim.event_id:
            return Granted()  # the same record, read again
        if holder is not None and holder.step_id == claim.step_id:
            return Blocked(f"blocked: an earlier claim of {claim.step_id} on {claim.subject} "
                           f"still holds it; it is withdrawn before the step claims again",
                           holder=holder.step_id, own=True)
        if holder is not None:
            return Blocked(f"blocked: {holder.step_id} on {claim.subject} is not settled yet "
                           f"(intended, in flight or unknown); {claim.tool} waits until it is",
                           holder=holder.step_id)
        if claim.once_per_subject and done is not None and done != claim.step_id:
            return Blocked(f"blocked: {done} already did {claim.tool} on "
                           f"{claim.subject}; {claim.tool} happens once per subject")
        subject.holder = claim
        self._held.setdefault(claim.task_id, {})[claim.step_id] = claim
        return Granted()

    def holder_of(self, tool: str, subject: str) -> SubjectClaimed | None:
        """The claim holding `subject` for `tool` now, if any."""
        found = self._subjects.get((tool, subject))
        return None if found is None else found.holder

    def held_by(self, task_id: str) -> Mapping[str, SubjectClaimed]:
        """The claims steps of `task_id` hold now, by step id."""
        return dict(self._held.get(task_id, {}))

    def holders(self) -> KeysView[str]:
        """The tasks whose steps hold claims now."""
        return self._held.keys()


@dataclass(frozen=True, slots=True)
class Withdraw:
    """Journal `claim.withdrawn` for these claims of one step (they never became the step)."""

    claims: tuple[SubjectClaimed, ...]
    reason: str


@dataclass(frozen=True, slots=True)
class Release:
    """Write `subject.released` for the claim."""

    claim: SubjectClaimed
    release: ReleaseKind


GuardMove = Withdraw | Release


def guard_moves(claims: Iterable[SubjectClaimed], state: TaskState,
                placing: set[int]) -> list[GuardMove]:
    """What the owner of `state`'s task must do with the claims its steps hold. `placing`:
    step numbers whose claim is being turned into a step by this process right now (leave
    those alone: the claim is not abandoned, it is about to be used)."""
    withdraw: dict[int, list[SubjectClaimed]] = {}
    out: list[GuardMove] = []
    for claim in claims:
        _, n = parse_step_id(claim.step_id)
        step = state.steps.get(n)
        if step is not None and _placed_on(step.intent, claim):
            if step.outcome is Outcome.DONE:
                out.append(Release(claim, ReleaseKind.DONE))
            elif step.outcome is Outcome.NOT_DONE:
                out.append(Release(claim, ReleaseKind.NOT_DONE))
            continue  # the step holds its claim until it settles
        if step is None and (n in placing or not _fold_reached(state, n)):
            continue
        if claim.event_id in state.withdrawn_claims:
            out.append(Release(claim, ReleaseKind.ABANDONED))
        else:
            withdraw.setdefault(n, []).append(claim)
    for n, mine in sorted(withdraw.items()):
        step = state.steps.get(n)
        why = ("another proposal became the step" if step is not None
               else "the claim never became a step (a decider crashed or paused between "
                    "claiming and deciding)")
        out.append(Withdraw(tuple(mine), why))
    return out


def _fold_reached(state: TaskState, n: int) -> bool:
    """Whether this fold has read as far as the claimer of step `n` had: a decider claims for
    step n only once its fold has the task started and step n-1 decided. A fold without them
    is behind the log (a paused process whose partitions moved while it slept): it cannot tell
    an abandoned claim from a placed one, so it leaves the claim alone until it reads more.
    A rejected task places nothing: its claims are abandoned whatever the fold lacks."""
    if state.rejected is not None:
        return True
    return state.started is not None and (n == 1 or n - 1 in state.steps)


def _placed_on(intent: StepIntended, claim: SubjectClaimed) -> bool:
    if intent.claim_id is not None:
        return intent.claim_id == claim.event_id
    # Steps journaled before claims were named: the step's tool and subject are its claim's.
    return (intent.tool, intent.subject) == (claim.tool, claim.subject)
