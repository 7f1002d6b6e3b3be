"""next_action: every branch, then a simulation with crashes, lost replies and redeliveries."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from halfway.contract import EffectClass, Event, Outcome, SettlementSource, StepChecked
from halfway.core import StepStatus, fold
from halfway.core.classify import ConnectionLost, NotSent, Replied, TimedOut, classify
from halfway.core.next_action import (
    Call,
    Escalate,
    Lookup,
    Nothing,
    SettleNotDone,
    SettleUnknown,
    StepPolicy,
    Wait,
    governing,
    next_action,
    plan_check,
)
from tests.factories import Stamper

KEYED = StepPolicy(EffectClass.KEYED, timeout_s=5, key_ttl_s=86_400)
S = timedelta(seconds=1)


def effect_of(log: list[Event]):
    return fold(log).step(1).effect


def checked(s: Stamper, next_check_at: datetime | None) -> StepChecked:
    return StepChecked(**s.stamp(), step_id=f"{s.task_id}:1", next_check_at=next_check_at)


@pytest.fixture
def s() -> Stamper:
    return Stamper("renewal-8812")


def test_settled_steps_replay(s: Stamper) -> None:
    for outcome in (Outcome.DONE, Outcome.NOT_DONE):
        log = [s.started(), s.intended(1), s.attempted(1, 1), s.settled(1, outcome, attempt=1)]
        assert next_action(effect_of(log), KEYED, s.now) == Nothing()


def test_a_new_step_is_called_once_with_attempt_one(s: Stamper) -> None:
    assert next_action(effect_of([s.started(), s.intended(1)]), KEYED, s.now) == Call(1)


def test_an_attempt_nobody_runs_is_settled_unknown_first(s: Stamper) -> None:
    log = [s.started(), s.intended(1), s.attempted(1, 1)]
    assert next_action(effect_of(log), KEYED, s.now) == SettleUnknown(1)


def test_unknown_looks_up_before_anything_else(s: Stamper) -> None:
    log = [s.started(), s.intended(1), s.attempted(1, 1), s.settled(1, Outcome.UNKNOWN, attempt=1)]
    assert next_action(effect_of(log), KEYED, s.now) == Lookup()


def test_after_an_empty_lookup_the_same_key_is_retried_when_the_check_is_due(s: Stamper) -> None:
    log = [s.started(), s.intended(1), s.attempted(1, 1), s.settled(1, Outcome.UNKNOWN, attempt=1)]
    due = s.now + 2 * S
    log.append(checked(s, due))
    assert next_action(effect_of(log), KEYED, s.now) == Wait(due)
    assert next_action(effect_of(log), KEYED, due) == Call(2)


def test_no_retry_once_the_key_may_be_forgotten_only_lookups(s: Stamper) -> None:
    log = [s.started(), s.intended(1), s.attempted(1, 1), s.settled(1, Outcome.UNKNOWN, attempt=1)]
    first = log[2].started_at
    late = first + timedelta(seconds=86_400 - 60 - 5) + S  # the attempt could outlive the key
    log.append(checked(s, late))
    assert next_action(effect_of(log), KEYED, late - S) == Wait(late)
    assert next_action(effect_of(log), KEYED, late) == Lookup()
    # When lookups run out too, the executor journals a check with no next one: the step is
    # unknown, needs an operator, and the harness makes no further move on its own.
    log.append(StepChecked(**s.stamp() | {"at": late}, step_id="renewal-8812:1",
                           next_check_at=None))
    assert fold(log).needs_attention
    assert fold(log).step(1).status is StepStatus.UNKNOWN
    assert next_action(effect_of(log), KEYED, late + S) == Nothing()


def test_unkeyed_is_never_retried(s: Stamper) -> None:
    policy = StepPolicy(EffectClass.UNKEYED, timeout_s=5)
    log = [s.started(), s.intended(1), s.attempted(1, 1), s.settled(1, Outcome.UNKNOWN, attempt=1),
           checked(s, s.now + S)]
    assert next_action(effect_of(log), policy, s.now + S) == Lookup()
    no_lookup = StepPolicy(EffectClass.UNKEYED, timeout_s=5, has_lookup=False)
    action = next_action(effect_of(log[:4]), no_lookup, s.now)
    assert isinstance(action, Escalate)
    assert "takes no key" in action.reason


def test_a_step_decided_unkeyed_is_never_resent_by_a_tool_redeclared_idempotent(
        s: Stamper) -> None:
    """A redeploy that relaxes a tool's class moves no step decided before it by the new
    class: the stricter of the journaled and the declared governs (`governing`)."""
    relaxed = StepPolicy(EffectClass.IDEMPOTENT, timeout_s=5, has_lookup=False)
    log = [s.started(), s.intended(1), s.attempted(1, 1), s.settled(1, Outcome.UNKNOWN, attempt=1)]
    assert next_action(effect_of(log), relaxed, s.now + 60 * S) == Call(2)  # as declared now
    policy = governing(relaxed, EffectClass.UNKEYED)  # as the decision journaled it
    assert policy.effect_class is EffectClass.UNKEYED
    assert isinstance(next_action(effect_of(log), policy, s.now + 60 * S), Escalate)
    # Keyed without a key's lifetime to keep within: sent at most once, too.
    assert governing(relaxed, EffectClass.KEYED).effect_class is EffectClass.UNKEYED
    assert governing(KEYED, EffectClass.IDEMPOTENT) is KEYED  # a stricter tool now: as is
    assert governing(KEYED, None) is KEYED  # an undo journals no class

def test_without_lookup_a_keyed_step_retries_after_a_backoff(s: Stamper) -> None:
    policy = StepPolicy(EffectClass.KEYED, timeout_s=5, key_ttl_s=3600, has_lookup=False)
    log = [s.started(), s.intended(1), s.attempted(1, 1), s.settled(1, Outcome.UNKNOWN, attempt=1)]
    unknown_at = log[-1].at
    assert next_action(effect_of(log), policy, unknown_at) == Wait(unknown_at + S / 2)
    assert next_action(effect_of(log), policy, unknown_at + S) == Call(2)


def test_attempts_are_bounded(s: Stamper) -> None:
    policy = StepPolicy(EffectClass.IDEMPOTENT, timeout_s=5, attempts_max=2, has_lookup=False)
    log = [s.started(), s.intended(1)]
    for n in (1, 2):
        log += [s.attempted(1, n), s.settled(1, Outcome.UNKNOWN, attempt=n)]
    action = next_action(effect_of(log), policy, s.now + 60 * S)
    assert isinstance(action, Escalate)
    assert "2 attempts" in action.reason


def test_reads_are_retried_within_limits_then_not_done_never_unknown(s: Stamper) -> None:
    policy = StepPolicy(EffectClass.READ, timeout_s=1, read_attempts_max=2)
    log = [s.started(), s.intended(1), s.attempted(1, 1)]
    assert next_action(effect_of(log), policy, s.now) == Call(2)
    log.append(s.attempted(1, 2))
    action = next_action(effect_of(log), policy, s.now)
    assert isinstance(action, SettleNotDone)
    assert "2 times" in action.reason


def test_the_check_schedule_backs_off_and_ends(s: Stamper) -> None:
    policy = StepPolicy(EffectClass.UNKEYED, timeout_s=5, lookup_window_s=10,
                        check_delays_s=(1, 4))
    log = [s.started(), s.intended(1), s.attempted(1, 1), s.settled(1, Outcome.UNKNOWN, attempt=1)]
    start = log[2].started_at
    assert plan_check(effect_of(log), policy, start) == start + S
    log.append(checked(s, start + S))
    assert plan_check(effect_of(log), policy, start + S) == start + 5 * S
    log.append(checked(s, start + 5 * S))
    assert plan_check(effect_of(log), policy, start + 7 * S) is None  # 11 s > the 10 s window


# ---------------------------------------------------------------------------------------------
# Simulation: one keyed charge, driven only by next_action, against a provider that behaves like
# Stripe (keys remembered for a lifetime, 409 while in flight, saved responses replayed), with
# slow processing, lost replies, 5xx before and after commit, refused connections, crashes of
# the executor between any two writes, and redelivered journal records.


@dataclass
class Provider:
    key_ttl_s: float
    now: datetime
    keys: dict[str, tuple[datetime, datetime, object]] = field(default_factory=dict)
    charges: list[tuple[str, datetime]] = field(default_factory=list)  # (key, lands at)
    requests: list[tuple[str, datetime]] = field(default_factory=list)

    def charge(self, key: str, delay_s: float, fault: str, timeout_s: float):
        self.requests.append((key, self.now))
        known = self.keys.get(key)
        if known and self.now < known[0] + timedelta(seconds=self.key_ttl_s):
            _first, done_at, saved = known
            if self.now < done_at:
                return Replied(409, "idempotency_key_in_use")
            return saved
        if fault == "refused":
            self.requests.pop()
            return NotSent("connection refused")
        done_at = self.now + timedelta(seconds=delay_s)
        if fault == "500_before":
            saved: object = Replied(500, "api_error")
        else:
            self.charges.append((key, done_at))
            saved = Replied(500, "api_error") if fault == "500_after" else ("ok", len(self.charges))
        self.keys[key] = (self.now, done_at, saved)
        if delay_s > timeout_s:
            return TimedOut(timeout_s)
        if fault == "lost_reply":
            return ConnectionLost("reset")
        return saved

    def lookup(self, key: str) -> int | None:
        for i, (k, lands) in enumerate(self.charges):
            if k == key and lands <= self.now:
                return i + 1
        return None


faults = st.sampled_from(["none", "refused", "500_before", "500_after", "lost_reply"])


@given(st.data())
@settings(max_examples=300, deadline=None)
def test_no_effect_ever_happens_twice(data: st.DataObject) -> None:
    ttl_s = data.draw(st.sampled_from([30.0, 3600.0]))
    policy = StepPolicy(EffectClass.KEYED, timeout_s=5, key_ttl_s=ttl_s, key_ttl_margin_s=5,
                        attempts_max=20, lookup_window_s=120)
    s = Stamper("sim")
    log: list[Event] = [s.started(), s.intended(1)]
    provider = Provider(ttl_s, s.now)
    key = log[1].key
    journaled_before_sent = True
    settled_done_with: int | None = None

    def write(event: Event) -> bool:
        """Append, unless the executor crashes first (then the rest of the move is lost)."""
        if data.draw(st.integers(0, 9)) == 0:
            return False
        log.append(event)
        if data.draw(st.integers(0, 9)) == 0:  # at-least-once: a record delivered twice
            log.append(event)
        return True

    for _ in range(120):
        s.now = provider.now = max(s.now, provider.now) + timedelta(milliseconds=100)
        effect = fold(log).step(1).effect
        action = next_action(effect, policy, s.now)
        match action:
            case Nothing() | Escalate():
                break
            case Wait(until=until):
                s.now = provider.now = until
            case SettleUnknown(attempt=n, reason=why):
                write(s.settled(1, Outcome.UNKNOWN, attempt=n, reason=why))
            case Lookup():
                found = provider.lookup(key)
                if found is not None:
                    if write(s.settled(1, Outcome.DONE, source=SettlementSource.LOOKUP,
                                       evidence={"charge": found})):
                        settled_done_with = settled_done_with or found
                else:
                    write(checked(s, plan_check(effect, policy, s.now)))
            case Call(attempt=n):
                if not write(s.attempted(1, n)):
                    continue
                journaled_before_sent &= any(e.type == "step.attempted" and e.attempt == n
                                             for e in log)
                delay_s = data.draw(st.sampled_from([0.1, 0.1, 6.2, 40.0]))
                reply = provider.charge(key, delay_s, data.draw(faults), policy.timeout_s)
                if isinstance(reply, tuple):
                    write(s.settled(1, Outcome.DONE, attempt=n, evidence={"charge": reply[1]}))
                else:
                    verdict = classify(reply, attempt=n)
                    write(s.settled(1, verdict.outcome, attempt=n, reason=verdict.reason))
            case _:
                raise AssertionError(f"unexpected action {action}")

    final = fold(log).step(1)
    assert journaled_before_sent
    assert len(provider.charges) <= 1, "the customer paid twice"
    if provider.requests:  # never a request after the provider may have forgotten the key
        first_sent = provider.requests[0][1]
        assert all(at <= first_sent + timedelta(seconds=ttl_s) for _, at in provider.requests)
    if final.outcome is Outcome.DONE:
        assert len(provider.charges) == 1
    if final.outcome is Outcome.NOT_DONE:
        assert provider.charges == [], "not_done, but the charge happened"


def test_a_replayed_answer_spends_no_retry_and_lookups_go_on(s: Stamper) -> None:
    """A 5xx saved under the key and replayed (`Idempotent-Replayed`) is the same answer for
    every retry with that key: retrying only burns attempts."""
    verdict = classify(Replied(500, code="api_error", replayed=True), attempt=1)
    assert "replayed this saved answer" in verdict.reason
    log = [s.started(), s.intended(1), s.attempted(1, 1),
           s.settled(1, Outcome.UNKNOWN, attempt=1, reason=verdict.reason).model_copy(
               update={"replayed": True})]
    assert next_action(effect_of(log), KEYED, s.now) == Lookup()
    log.append(checked(s, s.now + 2 * S))
    assert next_action(effect_of(log), KEYED, s.now + 3 * S) == Lookup()  # not Call(2)
    log.append(checked(s, None))
    action = next_action(effect_of(log), KEYED, s.now + 4 * S)
    assert action == Nothing()  # escalated: lookups over, no retry spent
    fresh = [s.started(), s.intended(1), s.attempted(1, 1),
             s.settled(1, Outcome.UNKNOWN, attempt=1), checked(s, s.now + 2 * S)]
    assert next_action(effect_of(fresh), KEYED, s.now + 3 * S) == Call(2)  # not replayed: retry
