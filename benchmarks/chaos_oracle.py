"""The chaos run's oracle: three views of one run, compared. Pure: no I/O, no clock.

The views:
- the ledger (paysim's `GET /_sim/ledger`): every charge the provider made, the ground truth;
  for trips, tripsim's too: every flight hold, hotel booking and email, with what undid it;
- the journal, folded (`halfway.journal.replay.replay`): every task's `TaskState`;
- the outcomes topic: the last message (highest `seq`) per task and subject.

What is judged, per category (every finding names a task, or a charge, and says why):
- duplicate: an invoice with more than one succeeded charge (a key with more than one is such an
  invoice too, and is named in the finding). Counted per invoice.
- lost: a requested task the decider never started or rejected; a charge in the ledger whose key
  no step of the journal carries; a step the journal says is `done` while the ledger has no
  succeeded charge with its key. Counted per finding.
- wrong: a step outcome or a final state that the ledger contradicts (`succeeded` iff a succeeded
  charge with the task's key is in the ledger; `failed`, `compensated` or `rejected` iff none);
  evidence that names a charge the ledger does not hold under the key; an outcomes-topic last
  state that differs from the journal fold's visible state. Counted per task.
- stuck: a task neither finished nor needing attention.
- needs attention: an unknown step the harness will not check again, grouped by reason, and a
  task waiting on a subject whose holder needs attention. Counted, never "wrong".

Trips (sagas) are judged the same way against tripsim's ledger, step by step and undo by undo:
- duplicate: more than one hold, booking or email under one step's key;
- lost: an effect under a key no step carries; a step `done` with no effect under its key;
- wrong: a step `not_done` with an effect under its key; an undo `done` whose effect still
  stands, or one `not_done` (under any of its keys) whose effect that key undid; a trip
  `succeeded` with an effect undone, or one `failed`/`compensated` with a hold or booking
  still standing or an email sent.

Steps still unknown are never judged against the ledger: unknown is not wrong.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from halfway.contract import FinalState, Outcome
from halfway.contract.ids import parse_step_id, step_of_key
from halfway.contract.outcomes import OutcomeChanged
from halfway.core.fold import EffectState, TaskState
from halfway.outcomes.derive import visible

CHARGE_TOOL = "charge_customer"
# A travel tool's effects in tripsim's ledger, the status an undo gives them, and the field that
# lists the keys of the undos that were answered for it (None: no undo).
TRAVEL_STORES: dict[str, tuple[str, str | None, str | None]] = {
    "hold_flight": ("holds", "released", "release_keys"),
    "book_hotel": ("bookings", "cancelled", "cancel_keys"),
    "send_email": ("emails", None, None),
}
KEY_METADATA = "halfway_key"  # where charge_customer puts our key on a charge
INVOICE_METADATA = "invoice"
REASON_CHARS_MAX = 160  # a needs-attention reason, once its ids are replaced, for grouping

# Ids and numbers in a reason make every reason unique; replaced so that reasons group.
_STEP_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._\-]*:\d+(?::undo[2-9]?)?")
_PROVIDER_ID = re.compile(r"\b(?:ch|evt|req)_[0-9a-f]+\b")
_NUMBER = re.compile(r"\b\d+(?:\.\d+)?\b")
_TIMESTAMP = re.compile(r"\d{4}-\d{2}-\d{2}[T ][\d:.+\-]+Z?")


@dataclass(frozen=True, slots=True)
class Requested:
    """A task the run published (and the broker acknowledged), and the invoice it charges."""

    task_id: str
    invoice: str
    trip: bool = False  # a saga on tripsim and paysim, not a renewal


@dataclass(frozen=True, slots=True)
class Finding:
    task_id: str | None  # None: a charge no task can be named for
    what: str
    others: tuple[str, ...] = ()  # other tasks in it (a duplicate's other charges' tasks)


@dataclass
class Verdict:
    tasks: int
    duplicates: list[Finding] = field(default_factory=list)
    lost: list[Finding] = field(default_factory=list)
    wrong: list[Finding] = field(default_factory=list)
    stuck: list[Finding] = field(default_factory=list)
    needs_attention: dict[str, list[str]] = field(default_factory=dict)  # reason -> task ids
    contradictions: list[Finding] = field(default_factory=list)  # kept by the fold, surfaced
    anomalies: list[Finding] = field(default_factory=list)  # the fold's own notes
    final_states: Counter[str] = field(default_factory=Counter)
    unknown_to_settled_s: list[float] = field(default_factory=list)
    unknown_never_settled: int = 0
    charges_succeeded: int = 0
    charges_failed: int = 0
    unrequested_tasks: list[str] = field(default_factory=list)  # in the journal, never asked

    @property
    def wrong_tasks(self) -> int:
        return len({f.task_id for f in self.wrong})

    @property
    def needs_attention_tasks(self) -> int:
        return sum(len(ids) for ids in self.needs_attention.values())

    def counts(self) -> dict[str, int]:
        return {"tasks": self.tasks, "duplicates": len(self.duplicates), "lost": len(self.lost),
                "wrong": self.wrong_tasks, "stuck": len(self.stuck),
                "needs_attention": self.needs_attention_tasks}

    def to_json(self) -> dict[str, Any]:
        def listed(findings: list[Finding]) -> list[dict[str, Any]]:
            return [{"task_id": f.task_id, "what": f.what, "others": list(f.others)}
                    for f in findings]

        return {
            **self.counts(),
            "findings": {"duplicates": listed(self.duplicates), "lost": listed(self.lost),
                         "wrong": listed(self.wrong), "stuck": listed(self.stuck),
                         "contradictions": listed(self.contradictions),
                         "anomalies": listed(self.anomalies)},
            "needs_attention_by_reason": {reason: sorted(ids)
                                          for reason, ids in self.needs_attention.items()},
            "final_states": dict(self.final_states),
            "unknown_to_settled_s": {"count": len(self.unknown_to_settled_s),
                                     "p50": percentile(self.unknown_to_settled_s, 50),
                                     "p99": percentile(self.unknown_to_settled_s, 99),
                                     "max": max(self.unknown_to_settled_s, default=None)},
            "unknown_never_settled": self.unknown_never_settled,
            "charges": {"succeeded": self.charges_succeeded, "failed": self.charges_failed},
            "unrequested_tasks": sorted(self.unrequested_tasks),
        }


def percentile(values: Iterable[float], p: float) -> float | None:
    """Nearest-rank percentile (p in 0..100); None for no values."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = max(1, -(-len(ordered) * p // 100))  # ceil(n * p / 100), at least the first
    return ordered[int(rank) - 1]


def charge_key(charge: Mapping[str, Any]) -> str | None:
    return (charge.get("metadata") or {}).get(KEY_METADATA) or charge.get("idempotency_key")


def charge_invoice(charge: Mapping[str, Any]) -> str | None:
    return (charge.get("metadata") or {}).get(INVOICE_METADATA)


def last_outcomes(messages: Iterable[OutcomeChanged]) -> dict[tuple[str, str], OutcomeChanged]:
    """The last message per (task, subject): the highest seq (a redelivery has the same seq
    and the same content, so which copy is kept does not matter)."""
    last: dict[tuple[str, str], OutcomeChanged] = {}
    for message in messages:
        about = (message.task_id, message.about)
        if about not in last or message.seq > last[about].seq:
            last[about] = message
    return last


def reason_group(text: str) -> str:
    """A reason with its ids, times and numbers replaced, so that equal reasons group."""
    text = _TIMESTAMP.sub("<time>", text)
    text = _STEP_ID.sub("<step>", text)
    text = _PROVIDER_ID.sub("<id>", text)
    text = _NUMBER.sub("N", text)
    return text[:REASON_CHARS_MAX]


def judge(requested: Iterable[Requested], charges: list[dict[str, Any]],
          states: Mapping[str, TaskState],
          outcomes: Mapping[tuple[str, str], OutcomeChanged] | None,
          travel: Mapping[str, list[dict[str, Any]]] | None = None) -> Verdict:
    """Compare the ledger, the journal fold and (unless None) the outcomes topic's last
    messages, for the tasks the run requested; `travel`: tripsim's ledger, for trips."""
    wanted = {r.task_id: r for r in requested}
    verdict = Verdict(tasks=len(wanted))
    succeeded_by_key: dict[str, list[dict[str, Any]]] = {}
    failed_by_key: dict[str, list[dict[str, Any]]] = {}
    for charge in charges:
        key = charge_key(charge) or ""
        if charge.get("status") == "succeeded":
            succeeded_by_key.setdefault(key, []).append(charge)
            verdict.charges_succeeded += 1
        else:
            failed_by_key.setdefault(key, []).append(charge)
            verdict.charges_failed += 1

    shown: dict[str, dict[str, OutcomeChanged]] = {}
    for (task_id, about), message in (outcomes or {}).items():
        shown.setdefault(task_id, {})[about] = message

    _judge_ledger(verdict, charges, states)
    if travel is not None:
        _judge_travel(verdict, [r.task_id for r in wanted.values() if r.trip], travel, states)
    for task_id in sorted(wanted):
        state = states.get(task_id)
        _judge_task(verdict, task_id, state, states, succeeded_by_key, failed_by_key)
        if outcomes is None:
            continue
        if state is not None:
            _judge_outcomes(verdict, task_id, state, shown.get(task_id, {}))
        elif task_id in shown:
            verdict.wrong.append(Finding(task_id, "outcomes: messages about a task the "
                                                  "journal does not have"))
    verdict.unrequested_tasks = sorted(set(states) - set(wanted))
    return verdict


def _judge_ledger(verdict: Verdict, charges: list[dict[str, Any]],
                  states: Mapping[str, TaskState]) -> None:
    """Duplicates per invoice, and charges the journal does not know."""
    known_keys = {step.intent.key for state in states.values() for step in state.steps.values()}
    by_invoice: dict[str, list[dict[str, Any]]] = {}
    for charge in charges:
        key = charge_key(charge)
        if charge.get("status") == "succeeded":
            by_invoice.setdefault(charge_invoice(charge) or f"(no invoice: {charge.get('id')})",
                                  []).append(charge)
        if key is None or key not in known_keys:
            verdict.lost.append(Finding(
                _task_of(key), f"ledger charge {charge.get('id')} ({charge.get('status')}, key "
                               f"{key}) is not the charge of any step in the journal"))
    for invoice, made in sorted(by_invoice.items()):
        if len(made) < 2:
            continue
        keys = Counter(charge_key(c) for c in made)
        twice = sorted(str(k) for k, n in keys.items() if n > 1)
        tasks = list(dict.fromkeys(t for c in made if (t := _task_of(charge_key(c)))))
        verdict.duplicates.append(Finding(
            tasks[0] if tasks else None,
            f"invoice {invoice}: {len(made)} succeeded charges "
            f"{[(c.get('id'), charge_key(c)) for c in made]}"
            + (f"; key(s) charged more than once: {twice}" if twice else ""),
            tuple(tasks[1:])))


def _judge_travel(verdict: Verdict, trips: list[str],
                  travel: Mapping[str, list[dict[str, Any]]],
                  states: Mapping[str, TaskState]) -> None:
    """Each trip's travel steps and undos against tripsim's effects (module docstring)."""
    by_key: dict[str, list[dict[str, Any]]] = {}
    known_keys = {step.intent.key for state in states.values() for step in state.steps.values()}
    for store, _, _ in TRAVEL_STORES.values():
        for effect in travel.get(store, []):
            key = effect.get("idempotency_key")
            by_key.setdefault(str(key), []).append(effect)
            if key not in known_keys:
                verdict.lost.append(Finding(_task_of(key), f"tripsim {store[:-1]} "
                                            f"{effect.get('id')} ({effect.get('status')}, key "
                                            f"{key}) is not the effect of any step"))
    for task_id in trips:
        state = states.get(task_id)
        if state is not None:
            _judge_trip(verdict, task_id, state, by_key)


def _judge_trip(verdict: Verdict, task_id: str, state: TaskState,
                by_key: Mapping[str, list[dict[str, Any]]]) -> None:
    standing: list[str] = []  # effects that stand at the end: "hold h_1 (step t:1)"
    undone: list[str] = []
    for step in state.steps.values():
        if step.intent.tool not in TRAVEL_STORES:
            continue
        store, undone_status, undo_keys = TRAVEL_STORES[step.intent.tool]
        made = by_key.get(step.intent.key, [])
        named = [f"{store[:-1]} {e.get('id')}" for e in made]
        if len(made) > 1:
            verdict.duplicates.append(Finding(task_id, f"{step.step_id}: {len(made)} effects "
                                                       f"under one key: {named}"))
        if step.outcome is Outcome.DONE and not made:
            verdict.lost.append(Finding(task_id, f"{step.step_id} is done in the journal, but "
                                                  f"tripsim has no {store[:-1]} under its key"))
        elif step.outcome is Outcome.NOT_DONE and made:
            verdict.wrong.append(Finding(task_id, f"{step.step_id} is not_done in the journal, "
                                                   f"but tripsim has {named} under its key"))
        for effect, name in zip(made, named, strict=True):
            if effect.get("status") == undone_status:
                undone.append(f"{name} ({step.step_id})")
            else:
                standing.append(f"{name} ({step.step_id})")
            answered = effect.get(undo_keys, []) if undo_keys is not None else []
            if step.undo.outcome is Outcome.DONE and effect.get("status") != undone_status:
                verdict.wrong.append(Finding(task_id, f"{step.step_id}: its undo is done in the "
                                                      f"journal, but {name} still stands"))
            for undo in step.undos:  # under each of its keys
                key = undo.plan.key
                if undo.state.outcome is Outcome.NOT_DONE and key in answered:
                    verdict.wrong.append(Finding(task_id, f"{step.step_id}: its undo under {key} "
                                                          f"is not_done in the journal, but that "
                                                          f"key undid {name}"))
    final = state.final_state
    if final is FinalState.SUCCEEDED and undone:
        verdict.wrong.append(Finding(task_id, f"finished succeeded, but tripsim undid {undone}"))
    elif final in (FinalState.FAILED, FinalState.COMPENSATED) and standing:
        verdict.wrong.append(Finding(task_id, f"finished {final}, but {standing} still "
                                              "stand(s) at tripsim"))
    elif state.rejected is not None and (standing or undone):
        verdict.wrong.append(Finding(task_id, "rejected, but tripsim has effects of it"))


def _task_of(key: str | None) -> str | None:
    if key is None:
        return None
    try:
        return parse_step_id(step_of_key(key))[0]
    except ValueError:
        return None


def _judge_task(verdict: Verdict, task_id: str, state: TaskState | None,
                states: Mapping[str, TaskState],
                succeeded_by_key: Mapping[str, list[dict[str, Any]]],
                failed_by_key: Mapping[str, list[dict[str, Any]]]) -> None:
    if state is None or (state.started is None and state.rejected is None):
        verdict.lost.append(Finding(task_id, "requested, but the journal has no task.started or "
                                             "task.rejected"))
        verdict.final_states["(never started)"] += 1
        return
    for finding in state.anomalies:
        verdict.anomalies.append(Finding(task_id, finding))

    charged = False  # a succeeded charge under one of this task's keys
    for step in state.steps.values():
        if step.intent.tool != CHARGE_TOOL:
            continue
        key = step.intent.key
        made = succeeded_by_key.get(key, [])
        charged = charged or bool(made)
        _judge_step(verdict, task_id, step.step_id, step.effect, made,
                    failed_by_key.get(key, []))
        _latency(verdict, step.effect)
    if state.rejected is not None:
        verdict.final_states["rejected"] += 1
        if charged:
            verdict.wrong.append(Finding(task_id, "rejected, but the ledger has a charge"))
        return
    final = state.final_state
    if final is None:
        verdict.final_states["(not finished)"] += 1
        _judge_unfinished(verdict, task_id, state, states)
        return
    verdict.final_states[str(final)] += 1
    if final is FinalState.NEEDS_ATTENTION:  # ended waiting for a person: counted, not judged
        summary = state.finished.summary if state.finished is not None else ""
        verdict.needs_attention.setdefault(reason_group(f"finished needs_attention: {summary}"),
                                           []).append(task_id)
    if final is FinalState.SUCCEEDED and not charged:
        verdict.wrong.append(Finding(task_id, "finished succeeded, but the ledger has no "
                                              "succeeded charge under its keys"))
    elif final in (FinalState.FAILED, FinalState.COMPENSATED) and charged:
        verdict.wrong.append(Finding(task_id, f"finished {final}, but the ledger has a "
                                              "succeeded charge under its key"))


def _judge_step(verdict: Verdict, task_id: str, step_id: str, effect: EffectState,
                made: list[dict[str, Any]], failed: list[dict[str, Any]]) -> None:
    settlement = effect.settlement
    outcome = effect.outcome
    if outcome is Outcome.DONE:
        assert settlement is not None
        named = _effect_id(settlement)
        if not made:
            verdict.lost.append(Finding(
                task_id, f"{step_id} is done in the journal (charge {named}, "
                         f"{settlement.source}), but the ledger has no succeeded charge with its "
                         f"key" + (f" (failed ones: {[c.get('id') for c in failed]})"
                                   if failed else "")))
        elif named is not None and named not in {c.get("id") for c in made}:
            verdict.wrong.append(Finding(
                task_id, f"{step_id} is done with charge {named}, but the ledger's succeeded "
                         f"charge(s) under its key are {[c.get('id') for c in made]}"))
    elif outcome is Outcome.NOT_DONE and made:
        assert settlement is not None
        verdict.wrong.append(Finding(
            task_id, f"{step_id} is not_done in the journal ({settlement.source}: "
                     f"{settlement.reason}), but the ledger has succeeded charge(s) "
                     f"{[c.get('id') for c in made]} under its key"))
    for contradiction in effect.contradictions:
        verdict.contradictions.append(Finding(
            task_id, f"{step_id}: {effect.outcome} kept, then {contradiction.outcome} from "
                     f"{contradiction.source}: {contradiction.reason or contradiction.evidence}"))


def _effect_id(settlement: Any) -> str | None:
    named = getattr(settlement, "effect_id", None)  # newer journals name the effect
    return named or (settlement.evidence or {}).get("charge_id")


def _latency(verdict: Verdict, effect: EffectState) -> None:
    """From the first `unknown` to the definitive settlement (by the events' `at`)."""
    if not effect.unknowns:
        return
    settlement = effect.settlement
    if settlement is None or settlement.outcome is Outcome.UNKNOWN:
        verdict.unknown_never_settled += 1
        return
    verdict.unknown_to_settled_s.append(
        (settlement.at - effect.unknowns[0].at).total_seconds())


def _judge_unfinished(verdict: Verdict, task_id: str, state: TaskState,
                      states: Mapping[str, TaskState]) -> None:
    reason = attention_reason(state, states)
    if reason is not None:
        verdict.needs_attention.setdefault(reason, []).append(task_id)
        return
    steps = ", ".join(f"{s.step_id} {s.status}" for s in state.steps.values()) or "no step"
    refused = state.refusals[-1].reason if state.refusals else None
    verdict.stuck.append(Finding(task_id, f"{state.status}: {steps}"
                                          + (f"; last refusal: {refused}" if refused else "")))


def attention_reason(state: TaskState, states: Mapping[str, TaskState]) -> str | None:
    """Why an unfinished task waits for a person (grouped), or None if it does not.

    Either one of its steps needs attention, or its next step is blocked by a subject whose
    holder needs attention: the task waits for that holder, so for the same person."""
    for step in state.steps.values():
        for effect in (step.effect, *(u.state for u in step.undos)):
            if effect.needs_attention:
                check = effect.last_check
                found = check.found if check is not None else "escalated"
                return reason_group(f"{effect.status}: {found}")
    refusals = state.refused(state.next_step_n)
    blocked = getattr(refusals[-1], "blocked", None) if refusals else None
    if blocked is not None:
        holder_task, n = parse_step_id(blocked.holder)
        holder = states.get(holder_task)
        step = holder.step(n) if holder is not None else None
        if step is not None and step.effect.needs_attention:
            return "waiting: blocked by a step on the same subject that needs attention"
    return None


def _judge_outcomes(verdict: Verdict, task_id: str, state: TaskState,
                    outcomes: Mapping[str, OutcomeChanged]) -> None:
    """The outcomes topic's last state of every subject (`outcomes`: this task's, by subject)
    must be the fold's visible state."""
    shown = visible(state)
    for about, change in shown.items():
        message = outcomes.get(about)
        if message is None:
            verdict.wrong.append(Finding(task_id, f"outcomes: nothing about {about}; the "
                                                  f"journal says {change.state}"))
        elif message.state != change.state:
            verdict.wrong.append(Finding(task_id, f"outcomes: {about} last says "
                                                  f"{message.state} (seq {message.seq}); the "
                                                  f"journal says {change.state}"))
    for about, message in outcomes.items():
        if about not in shown:
            verdict.wrong.append(Finding(task_id, f"outcomes: {about} says {message.state}, "
                                                  "a subject the journal does not show"))


def settled_or_waiting(state: TaskState | None, states: Mapping[str, TaskState]) -> bool:
    """The drain's test: the task is over, or waits for a person (nothing more will move it)."""
    if state is None:
        return False
    if state.rejected is not None or state.finished is not None:
        return True
    return attention_reason(state, states) is not None
