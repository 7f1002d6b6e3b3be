"""What users see change: the visible state of a task, its steps and their compensations.

Pure: no I/O, no clock. `changes(before, after)` compares two states of one task (before and
after one journal event, in practice) and returns the subjects whose visible state differs,
steps first and the task last (a step's news is the cause of the task's). "Visible" is what a
user reads: the state, the sentence, evidence, reason, reference and next check time. So
`in_flight -> unknown` is a change, and so is `unknown -> unknown` with a new next check time
(users see when the answer will come); a redelivered or ignored event changes nothing.

`at` is not part of what is compared: it says which journal fact caused the change (the
newest fact behind the visible state), never the clock, so deriving again gives the same
message, byte for byte.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from halfway.contract import Event, FinalState
from halfway.contract.ids import UNDO_SUFFIX
from halfway.contract.outcomes import OutcomeChanged, about_key, message_id_for
from halfway.core.fold import EffectState, StepState, StepStatus, TaskState, TaskStatus, apply
from halfway.render import attention_words, step_line, undo_line

# A message's free text and evidence are bounded, whatever the journal holds: the evidence as
# the harness journals it (halfway.app: 16 KiB), the words as the longest sentence it writes.
WORDS_CHARS_MAX = 4000
EVIDENCE_BYTES_MAX = 16_384


@dataclass(frozen=True, slots=True)
class Change:
    """One subject's visible state: the fields of an OutcomeChanged, without its number."""

    task_id: str
    subject: str  # "task" | "step" | "compensation"
    step_id: str | None
    state: str
    words: str
    evidence: dict[str, Any] | None = None
    reason: str | None = None
    reference: str | None = None
    next_check_at: datetime | None = None
    finished: bool = False
    at: datetime | None = field(default=None, compare=False)  # the cause, not the state

    @property
    def about(self) -> str:
        return about_key(self.task_id, self.subject, self.step_id)

    def message(self, seq: int) -> OutcomeChanged:
        return OutcomeChanged(
            message_id=message_id_for(self.task_id, self.subject, self.step_id, seq), seq=seq,
            task_id=self.task_id, step_id=self.step_id, subject=self.subject,  # type: ignore[arg-type]
            state=self.state,  # type: ignore[arg-type]
            words=_cut(self.words, WORDS_CHARS_MAX), evidence=_bounded(self.evidence),
            reason=None if self.reason is None else _cut(self.reason, WORDS_CHARS_MAX),
            reference=self.reference, next_check_at=self.next_check_at, at=self.at,
            finished=self.finished)


def _cut(text: str, chars_max: int) -> str:
    return text if len(text) <= chars_max else text[: chars_max - 1] + "…"


def _bounded(evidence: dict[str, Any] | None) -> dict[str, Any] | None:
    """`evidence`, or its first fields that fit EVIDENCE_BYTES_MAX and `"truncated": true`:
    a message must always fit the topic (the journal may hold up to a megabyte of it, from a
    writer of its own), or it would be tried again forever and the task's news stop there."""
    if evidence is None or _size(evidence) <= EVIDENCE_BYTES_MAX:
        return evidence
    kept: dict[str, Any] = {"truncated": True}
    for key, value in evidence.items():
        if _size({**kept, key: value}) > EVIDENCE_BYTES_MAX:
            break
        kept[key] = value
    return kept


def _size(value: Any) -> int:
    return len(json.dumps(value, separators=(",", ":"), default=str).encode())


def changes(before: TaskState | None, after: TaskState) -> list[Change]:
    """The subjects whose visible state differs from `before` to `after`, in display order."""
    old = visible(before) if before is not None else {}
    return [now for about, now in visible(after).items() if old.get(about) != now]


def visible(state: TaskState) -> dict[str, Change]:
    """Every subject of a task as a user sees it now; steps in order, the task last."""
    out: dict[str, Change] = {}
    for n in sorted(state.steps):
        step = state.steps[n]
        out[step.step_id] = _step(step)
        if step.compensation is not None:
            out[step.step_id + UNDO_SUFFIX] = _compensation(step)
    task = _task(state)
    if task is not None:
        out["task"] = task
    return out


@dataclass
class Sequencer:
    """Numbers each subject's changes 1, 2, ... in log order: the `seq` of a message id.
    Fed the same log, it hands out the same numbers, which is what makes ids deterministic."""

    seqs: dict[str, int] = field(default_factory=dict)

    def number(self, change: Change) -> OutcomeChanged:
        seq = self.seqs.get(change.about, 0) + 1
        self.seqs[change.about] = seq
        return change.message(seq)


def messages(events: Iterable[Event], task_id: str) -> list[OutcomeChanged]:
    """Every message the outcomes topic carries for one task, from its journal in log order."""
    sequencer, state = Sequencer(), TaskState(task_id=task_id)
    before: TaskState | None = None
    out: list[OutcomeChanged] = []
    for event in events:
        state = apply(state, event)
        out += [sequencer.number(c) for c in changes(before, state)]
        before = state
    return out


# --- steps and compensations ---------------------------------------------------------------------


def _step(step: StepState) -> Change:
    effect, status = step.effect, step.status
    words = step_line(step)
    if effect.contradictions:
        # A later settlement that disagrees is kept and surfaced, never silently dropped.
        words += "; " + _contradiction(effect)
    return Change(task_id=step.intent.task_id, subject="step", step_id=step.step_id,
                  state=str(status), words=words, **_details(effect, status),
                  reference=step.intent.key, at=_cause_at(effect, status, step.intent.at))


def _compensation(step: StepState) -> Change:
    plan, effect = step.compensation, step.undo
    assert plan is not None
    status = effect.status
    words = undo_line(step)
    assert words is not None
    if effect.contradictions:
        words += "; " + _contradiction(effect)
    return Change(task_id=plan.task_id, subject="compensation", step_id=step.step_id,
                  state=str(status), words=words, **_details(effect, status),
                  reference=plan.key, at=_cause_at(effect, status, plan.at))


def _details(effect: EffectState, status: StepStatus) -> dict[str, Any]:
    settlement = effect.settlement
    check = effect.last_check
    return {
        "evidence": settlement.evidence if status is StepStatus.DONE and settlement else None,
        "reason": (settlement.reason if settlement is not None
                   and status in (StepStatus.NOT_DONE, StepStatus.UNKNOWN) else None),
        "next_check_at": (check.next_check_at if status is StepStatus.UNKNOWN and check
                          else None),
    }


def _cause_at(effect: EffectState, status: StepStatus, decided_at: datetime) -> datetime:
    """The `at` of the fact that made the visible state what it is."""
    match status:
        case StepStatus.INTENDED:
            return decided_at
        case StepStatus.IN_FLIGHT:
            return effect.attempts[-1].at
        case StepStatus.DONE | StepStatus.NOT_DONE:
            assert effect.settlement is not None
            if effect.contradictions:
                return effect.contradictions[-1].at
            return effect.settlement.at
        case StepStatus.UNKNOWN:
            facts = [f.at for f in (effect.settlement, effect.last_check) if f is not None]
            return max(facts, default=decided_at)


def _contradiction(effect: EffectState) -> str:
    latest = effect.contradictions[-1]
    detail = latest.reason or ", ".join(f"{k}={v}" for k, v in (latest.evidence or {}).items())
    return (f"but a later report ({latest.source}) says {latest.outcome}: {detail}; "
            "an operator should look")


# --- the task ------------------------------------------------------------------------------------

_FINAL_WORDS = {
    FinalState.SUCCEEDED: "succeeded",
    FinalState.FAILED: "failed",
    FinalState.COMPENSATED: "compensated (what was done has been undone)",
    FinalState.NEEDS_ATTENTION: "needs attention",
}


def _task(state: TaskState) -> Change | None:
    base = {"task_id": state.task_id, "subject": "task", "step_id": None}
    match state.status:
        case None:
            return None
        case TaskStatus.REQUESTED:
            assert state.request is not None
            return Change(**base, state="requested",
                          words="requested: waiting for the harness to accept it",
                          at=state.request.at)
        case TaskStatus.REJECTED:
            assert state.rejected is not None
            return Change(**base, state="rejected",
                          words=f"rejected, nothing was done: {state.rejected.reason}",
                          reason=state.rejected.reason, finished=True, at=state.rejected.at)
        case TaskStatus.FINISHED:
            assert state.finished is not None
            final = state.finished
            attention = attention_words(state)
            if attention is not None and final.state is not FinalState.NEEDS_ATTENTION:
                # News after the end (a second charge reported under the step's key): the
                # task's end no longer tells the whole truth, and a person must look.
                return Change(**base, state="needs_attention",
                              words=(f"needs attention: it finished {_FINAL_WORDS[final.state]} "
                                     f"({final.summary}), but {attention}; an operator must "
                                     f"resolve it"),
                              reason=attention, finished=True, at=_newest_at(state))
            return Change(**base, state=str(final.state),
                          words=f"{_FINAL_WORDS[final.state]}: {final.summary}",
                          reason=None if final.state is FinalState.SUCCEEDED else final.summary,
                          finished=True, at=final.at)
        case TaskStatus.RUNNING:
            attention = attention_words(state)
            if attention is not None:
                return Change(**base, state="needs_attention",
                              words=f"needs attention: {attention}; an operator must resolve it",
                              reason=attention, at=_newest_at(state))
            if state.aborted is not None:
                called_off = state.aborted
                return Change(**base, state="running",
                              words=(f"running, called off by {called_off.by}: "
                                     f"{called_off.reason}; no new step is decided, steps in "
                                     f"flight settle, and a saga undoes what is done"),
                              reason=called_off.reason, at=_newest_at(state))
            failing = state.model_failures.get(state.next_step_n)
            if failing is not None:
                count, last = failing
                words = (f"running; the model is unavailable: {last.error}; {count} failed "
                         f"question(s) for step {last.n}")
                return Change(**base, state="running", words=words, reason=last.error,
                              at=max(last.at, _newest_at(state)))
            return Change(**base, state="running", words="running", at=_newest_at(state))


def _newest_at(state: TaskState) -> datetime:
    """The newest fact of a running task: what moved it in or out of needing attention."""
    facts: list[datetime] = [e.at for e in (state.started, state.request, state.aborted,
                                            state.finished) if e is not None]
    for step in state.steps.values():
        facts.append(step.intent.at)
        for effect in (step.effect, step.undo):
            facts += [a.at for a in effect.attempts[-1:]]
            facts += [f.at for f in (effect.settlement, effect.last_check) if f is not None]
            facts += [c.at for c in effect.contradictions[-1:]]
    return max(facts)
