"""reconcile: what a provider's webhook says about one of our effects. Pure.

A webhook names its object (a charge) and carries our key in the object's metadata, so it
matches exactly one step (key `{task}:{n}`) or one compensation (`{task}:{n}:undo`). What it
proves: `charge.succeeded` that the effect happened (`done`), `charge.failed` that it did not
(`not_done`, the provider's own record). Anything else proves nothing here.

A webhook that agrees with the outcome already known adds nothing. One that contradicts a
definitive outcome is still journaled: the fold keeps it as a contradiction and surfaces it
(never silently dropped), once per provider event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from halfway.contract import Outcome
from halfway.contract.webhooks import WebhookReceived
from halfway.core.fold import EffectState

SUCCEEDED_TYPES = frozenset({"charge.succeeded"})
FAILED_TYPES = frozenset({"charge.failed"})


@dataclass(frozen=True, slots=True)
class WebhookVerdict:
    outcome: Outcome
    evidence: dict[str, Any] | None = None
    reason: str | None = None


def webhook_verdict(effect: EffectState, hook: WebhookReceived) -> WebhookVerdict | None:
    """The settlement to journal for `hook`, or None when it tells nothing new."""
    if hook.provider_event_type in SUCCEEDED_TYPES:
        verdict = WebhookVerdict(Outcome.DONE, evidence={
            "charge_id": hook.object_id, "provider": hook.provider,
            "provider_event_id": hook.provider_event_id})
    elif hook.provider_event_type in FAILED_TYPES:
        verdict = WebhookVerdict(Outcome.NOT_DONE, reason=(
            f"the provider reports {hook.provider_event_type} for {hook.object_id} "
            f"(event {hook.provider_event_id})"))
    else:
        return None
    if effect.outcome is verdict.outcome:
        return None
    if any(_from(s, hook) for s in effect.contradictions):
        return None  # this provider event is already on record
    return verdict


def _from(settlement: Any, hook: WebhookReceived) -> bool:
    evidence = settlement.evidence or {}
    return (evidence.get("provider_event_id") == hook.provider_event_id
            or hook.provider_event_id in (settlement.reason or ""))
