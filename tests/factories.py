"""Building events in tests: a clock that ticks and one valid example of every event type."""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from halfway.contract import (
    ClaimWithdrawn,
    CompensationAttempted,
    CompensationChecked,
    CompensationIntended,
    CompensationPlan,
    CompensationSettled,
    DecidedBy,
    EffectClass,
    Event,
    FinalState,
    ModelFailed,
    Outcome,
    ProposedCall,
    SagaRole,
    SettlementSource,
    StepAttempted,
    StepChecked,
    StepIntended,
    StepRefused,
    StepSettled,
    StepUnserved,
    TaskAborted,
    TaskFinished,
    TaskPolicy,
    TaskRejected,
    TaskRequested,
    TaskStarted,
    Usage,
    mint_key,
    mint_undo_key,
    step_id,
)

EPOCH = datetime(2026, 12, 2, 9, 0, tzinfo=UTC)


@dataclass
class Stamper:
    """Stamps event ids and times like a writer would: ids unique, time moving forward."""

    task_id: str
    now: datetime = EPOCH
    tick: timedelta = timedelta(milliseconds=100)
    _ids: itertools.count = field(default_factory=itertools.count)

    def stamp(self) -> dict[str, Any]:
        self.now += self.tick
        return {"event_id": uuid.uuid4().hex, "task_id": self.task_id, "at": self.now}

    def requested(self, **kw: Any) -> TaskRequested:
        return TaskRequested(**self.stamp(), input={"invoice": "INV-2291", "amount_cents": 4900},
                             allowed_tools=["charge_customer"], **kw)

    def started(self, **kw: Any) -> TaskStarted:
        fields = {"input": {"invoice": "INV-2291"}, "allowed_tools": ["charge_customer"]} | kw
        return TaskStarted(**self.stamp(), **fields)

    def rejected(self, reason: str = "unknown tool") -> TaskRejected:
        return TaskRejected(**self.stamp(), reason=reason)

    def intended(self, n: int, *, args: dict[str, Any] | None = None, **kw: Any) -> StepIntended:
        # Also takes accept_call's fields as they are (tool, args, subject, ...).
        sid = step_id(self.task_id, n)
        fields: dict[str, Any] = {
            "tool": "charge_customer",
            "args": args if args is not None else {"invoice": "INV-2291", "amount_cents": 4900},
            "subject": "invoice:INV-2291",
            "effect_class": EffectClass.KEYED,
            "decided_by": DecidedBy(model="scripted", version="1"),
        } | kw
        return StepIntended(**self.stamp(), step_id=sid, n=n, key=mint_key(sid), **fields)

    def refused(self, n: int, reason: str = "refused: amount_cents: Input should be a valid "
                "integer", args: dict[str, Any] | None = None) -> StepRefused:
        return StepRefused(**self.stamp(), n=n, tool="charge_customer",
                           args=args if args is not None else {"amount_cents": "49.00"},
                           reason=reason, decided_by=DecidedBy(model="scripted", version="1"))

    def model_failed(self, n: int, error: str = "HTTP 429 rate_limit_exceeded: slow down",
                     *, status: int | None = 429, transient: bool = True,
                     retry_after_s: float | None = None) -> ModelFailed:
        return ModelFailed(**self.stamp(), n=n, model="gpt-4o-mini", error=error,
                           status=status, transient=transient, retry_after_s=retry_after_s)

    def unserved(self, n: int, tool: str = "charge_customer",
                 app: str = "tickets@0123456789ab") -> StepUnserved:
        return StepUnserved(**self.stamp(), step_id=step_id(self.task_id, n), tool=tool,
                            app=app)

    def withdrawn(self, n: int, *claim_ids: str,
                  subject: str = "invoice:INV-2291") -> ClaimWithdrawn:
        return ClaimWithdrawn(**self.stamp(), step_id=step_id(self.task_id, n),
                              claim_ids=list(claim_ids) or ["claim-1"], subject=subject,
                              tool="charge_customer",
                              reason="the claim never became a step (a decider crashed)")

    def attempted(self, n: int, attempt: int) -> StepAttempted:
        sid = step_id(self.task_id, n)
        return StepAttempted(**self.stamp(), step_id=sid, attempt=attempt, key=mint_key(sid),
                             started_at=self.now)

    def settled(self, n: int, outcome: Outcome, *, attempt: int | None = None,
                source: SettlementSource = SettlementSource.CALL,
                evidence: dict[str, Any] | None = None, reason: str | None = None) -> StepSettled:
        return StepSettled(**self.stamp(), step_id=step_id(self.task_id, n),
                           **_settlement(outcome, attempt, source, evidence, reason))

    def checked(self, n: int, next_in: timedelta | None = timedelta(seconds=2)) -> StepChecked:
        stamp = self.stamp()
        return StepChecked(**stamp, step_id=step_id(self.task_id, n),
                           next_check_at=None if next_in is None else stamp["at"] + next_in)

    def undo_intended(self, n: int, tool: str = "refund_charge",
                      args: dict[str, Any] | None = None, *,
                      generation: int = 1) -> CompensationIntended:
        sid = step_id(self.task_id, n)
        return CompensationIntended(**self.stamp(), step_id=sid, tool=tool,
                                    args={"charge": "ch_1"} if args is None else args,
                                    key=mint_undo_key(sid, generation), generation=generation)

    def undo_attempted(self, n: int, attempt: int, *,
                       generation: int = 1) -> CompensationAttempted:
        sid = step_id(self.task_id, n)
        return CompensationAttempted(**self.stamp(), step_id=sid, attempt=attempt,
                                     key=mint_undo_key(sid, generation), started_at=self.now)

    def undo_settled(self, n: int, outcome: Outcome, *, attempt: int | None = None,
                     source: SettlementSource = SettlementSource.CALL, generation: int = 1,
                     **kw: Any) -> CompensationSettled:
        fields = _settlement(outcome, attempt, source, None, None) | kw
        return CompensationSettled(**self.stamp(), step_id=step_id(self.task_id, n),
                                   generation=generation, **fields)

    def undo_checked(self, n: int, next_in: timedelta | None = timedelta(seconds=2), *,
                     generation: int = 1) -> CompensationChecked:
        stamp = self.stamp()
        return CompensationChecked(**stamp, step_id=step_id(self.task_id, n),
                                   next_check_at=None if next_in is None else stamp["at"] + next_in,
                                   generation=generation)

    def aborted(self, reason: str = "the customer cancelled the trip",
                by: str = "operator") -> TaskAborted:
        return TaskAborted(**self.stamp(), reason=reason, by=by)

    def finished(self, state: FinalState = FinalState.SUCCEEDED) -> TaskFinished:
        return TaskFinished(**self.stamp(), state=state, summary=f"task {state}")


def _settlement(outcome: Outcome, attempt: int | None, source: SettlementSource,
                evidence: dict[str, Any] | None, reason: str | None) -> dict[str, Any]:
    if outcome is Outcome.DONE:
        evidence = evidence or {"charge_id": "ch_1"}
    else:
        reason = reason or ("refused: card declined" if outcome is Outcome.NOT_DONE
                            else "no reply within 5 s")
    return {"outcome": outcome, "attempt": attempt, "source": source,
            "evidence": evidence, "reason": reason}


def one_of_each(task_id: str = "renewal-8812") -> list[Event]:
    """One valid example of every event type, in an order a real task could write them."""
    s = Stamper(task_id)
    return [
        s.requested(policy=TaskPolicy(saga=True, max_steps=5)),
        s.started(),
        s.rejected(),
        s.refused(1),
        s.model_failed(1, retry_after_s=2.0),
        s.withdrawn(1, "claim-1"),
        s.intended(1, saga_role=SagaRole.COMPENSABLE, compensation=CompensationPlan(
            tool="refund_charge", args={"charge": "$result.id"}), claim_id="claim-2",
            decided_by=DecidedBy(model="gpt-4o-mini", usage=Usage(input_tokens=812,
                                                                  output_tokens=40),
                                 app="billing@0123456789ab"),
            also_proposed=[ProposedCall(tool="send_email", args={"to": "a@example.com"})]),
        s.unserved(1),
        s.attempted(1, 1),
        s.settled(1, Outcome.UNKNOWN, attempt=1),
        s.checked(1),
        s.settled(1, Outcome.DONE, source=SettlementSource.LOOKUP),
        s.undo_intended(1),
        s.aborted(),
        s.undo_attempted(1, 1),
        s.undo_settled(1, Outcome.UNKNOWN, attempt=1),
        s.undo_checked(1),
        s.undo_settled(1, Outcome.DONE, source=SettlementSource.LOOKUP),
        s.finished(FinalState.COMPENSATED),
    ]
