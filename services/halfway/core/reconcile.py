"""reconcile: what a provider's webhook may say about one of our effects. Pure.

Theory of operation
-------------------
A webhook names a provider object (a charge) and carries our key in the object's metadata, so
it matches one step (key `{task}:{n}`) or one compensation (`{task}:{n}:undo`, or a successor
key `:undo2`: news of an earlier undo key is weighed against that undo's proof). The tool's
adapter reads it into a `WebhookReport`: the outcome it states (`done`, or `not_done` for a
failed object), the object's id, the evidence, and whether the object matches what the step
asked for (amount, currency, customer). For a tool with no reader of its own, the report is what
the provider's declared mapping says (`declared_report`: the outcome the gateway stamped, the
object as evidence). `weigh_webhook` decides what that report is worth:

1. **Order.** A provider cannot know our key before we send it. The gateway stamps each
   webhook with the end offset of the task's journal partition at the moment it arrived; the
   report is evidence only about an effect whose first attempt was journaled below that
   offset. Anything else (a key never attempted, attempted only after the webhook arrived, or
   a webhook that cannot be ordered) is an orphan: quarantined with the reason, never applied,
   not now and not when the step appears later.
2. **Agreement.** An object that does not match the step (other amounts, another customer), or
   that names another object than the one the journal already knows as done, or a report
   that contradicts a definitive outcome, is a contradiction: journaled as such (kept, shown,
   the effect needs an operator), never as the outcome.
3. **Proof.** `done` from the provider's own event settles an unknown effect. A negative report
   (`failed`) is corroborated first: where the tool has a lookup, the lookup settles it (the
   provider's record, not a message about it); only a tool without one takes the event's word.
   A tool that has one while the reconciler's lookups are off is not corroborated at all: its
   effect stays unknown, and an operator is asked (the event's word alone is not proof).
4. A report that agrees with what is known, or that is already on record (its provider event
   id in a settlement), adds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from halfway.contract import Outcome, parse_step_id
from halfway.contract.ids import step_of_key
from halfway.contract.webhooks import WebhookReceived
from halfway.core.fold import EffectState


@dataclass(frozen=True, slots=True)
class WebhookReport:
    """What a provider event says about the effect its object is, in our terms."""

    outcome: Outcome  # DONE, or NOT_DONE for an object the provider records as failed
    effect_id: str  # the provider's object id
    evidence: dict[str, Any] | None = None  # for DONE
    reason: str | None = None  # for NOT_DONE
    mismatch: str | None = None  # the object does not match the step's arguments, in words


@dataclass(frozen=True, slots=True)
class Quarantine:
    """Never apply this webhook; record why (a dead letter)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Settle:
    """Journal a settlement from the webhook (a contradiction when `contradiction` is set)."""

    outcome: Outcome
    effect_id: str
    evidence: dict[str, Any] | None = None
    reason: str | None = None
    contradiction: str | None = None


@dataclass(frozen=True, slots=True)
class Corroborate:
    """A negative report: look the effect up now; the lookup settles it. Where lookups are
    off, nothing can: the effect stays unknown, for an operator (`told`: what the provider
    said, for them)."""

    told: str = ""


@dataclass(frozen=True, slots=True)
class Ignore:
    why: str


WebhookMove = Quarantine | Settle | Corroborate | Ignore


def declared_report(hook: WebhookReceived, evidence_id: str | None) -> WebhookReport | None:
    """What the provider's declared mapping says (the outcome the gateway stamped on the
    record), for a tool that does not read webhooks itself; None if it says nothing. The
    provider's object goes into the evidence under the tool's `evidence_id` (what an undo's
    `$result.<evidence_id>` reads), else as `object_id`."""
    if hook.outcome is None:
        return None
    if hook.outcome is Outcome.DONE:
        evidence = {evidence_id or "object_id": hook.object_id, "provider": hook.provider,
                    "event_type": hook.provider_event_type}
        return WebhookReport(Outcome.DONE, hook.object_id, evidence=evidence)
    return WebhookReport(Outcome.NOT_DONE, hook.object_id)


def weigh_webhook(effect: EffectState | None, report: WebhookReport | None,
                  hook: WebhookReceived, *, first_attempt_offset: int | None,
                  has_lookup: bool) -> WebhookMove:
    """What to do with `hook` for the effect named by its key (None: no such effect)."""
    named = task_named_by(hook.key)
    if named is not None and named != hook.task_id:
        # The gateway derives the record's task from the key: a record that disagrees was
        # written by someone else, and would settle another task's step.
        return Quarantine(f"the webhook's key {hook.key} names task {named}, but the record "
                          f"is for task {hook.task_id}")
    if hook.journal_offset is None:
        return Quarantine(f"the webhook for key {hook.key} cannot be ordered against the "
                          f"journal (no journal offset was recorded when it arrived)")
    if effect is None or first_attempt_offset is None or \
            first_attempt_offset >= hook.journal_offset:
        return Quarantine(f"orphan: key {hook.key} was not attempted before the webhook "
                          f"arrived (journal offset {hook.journal_offset}); a provider cannot "
                          f"know our key before we send it, so this is not evidence")
    if report is None:
        return Ignore(f"{hook.provider_event_type} says nothing about the outcome")
    if _on_record(effect, hook):
        return Ignore("already on record")
    told = f"{hook.provider_event_type} for {report.effect_id} (event {hook.provider_event_id})"
    if report.mismatch is not None:
        return _contradiction(report, hook, f"the provider's {told} does not match the "
                                            f"step: {report.mismatch}")
    known = effect.settlement
    if known is not None and known.outcome is Outcome.DONE:
        if report.outcome is Outcome.DONE:
            if known.effect_id is None or known.effect_id == report.effect_id:
                return Ignore("agrees with the known outcome")
            return _contradiction(report, hook, f"the provider's {told} names another "
                                                f"effect than {known.effect_id}, done under "
                                                f"the same key: it may have happened twice")
        return _contradiction(report, hook, f"the provider's {told} says it failed, but the "
                                            f"step is done"
                                            + (f" ({known.effect_id})" if known.effect_id
                                               else ""))
    if known is not None and known.outcome is Outcome.NOT_DONE:
        if report.outcome is Outcome.NOT_DONE:
            return Ignore("agrees with the known outcome")
        return _contradiction(report, hook, f"the provider's {told} says it succeeded, but "
                                            f"the step was settled not done: {known.reason}")
    if report.outcome is Outcome.DONE:
        return Settle(Outcome.DONE, report.effect_id, evidence=_evidence(report, hook))
    if has_lookup:
        return Corroborate(f"the provider's {told} says it failed")
    return Settle(Outcome.NOT_DONE, report.effect_id, reason=_reason(report, hook))


def task_named_by(key: str | None) -> str | None:
    """The task our key (a step's, or an undo's) names; None for what is not our key."""
    if key is None:
        return None
    try:
        task_id, _ = parse_step_id(step_of_key(key))
    except ValueError:
        return None
    return task_id


# A contradiction quotes what the provider sent (amounts, customers, earlier reasons): cut to
# what a settlement holds, or it could never be journaled and the step would stay unknown.
CONTRADICTION_CHARS_MAX = 2000  # StepSettled.contradiction's max_length


def _contradiction(report: WebhookReport, hook: WebhookReceived, why: str) -> Settle:
    why = why[:CONTRADICTION_CHARS_MAX]
    if report.outcome is Outcome.DONE:
        return Settle(Outcome.DONE, report.effect_id, evidence=_evidence(report, hook),
                      contradiction=why)
    return Settle(Outcome.NOT_DONE, report.effect_id, reason=_reason(report, hook),
                  contradiction=why)


def _evidence(report: WebhookReport, hook: WebhookReceived) -> dict[str, Any]:
    return {**(report.evidence or {}), "provider_event_id": hook.provider_event_id}


def _reason(report: WebhookReport, hook: WebhookReceived) -> str:
    detail = f": {report.reason}" if report.reason else ""
    return (f"the provider reports {hook.provider_event_type} for {report.effect_id} "
            f"(event {hook.provider_event_id}){detail}")


def _on_record(effect: EffectState, hook: WebhookReceived) -> bool:
    """The webhook's provider event is already in one of the effect's settlements."""
    for settlement in (effect.settlement, *effect.contradictions):
        if settlement is None:
            continue
        evidence = settlement.evidence or {}
        if evidence.get("provider_event_id") == hook.provider_event_id:
            return True
        if f"(event {hook.provider_event_id})" in (settlement.reason or ""):
            return True
    return False
