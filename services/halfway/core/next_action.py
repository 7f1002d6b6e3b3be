"""next_action: what to do next with one step. Pure: the caller passes the clock.

Theory of operation
-------------------
The executor calls `next_action(step, policy, now)` for every step it does not have a call in
flight for, whenever the step's events change or a timer it was given fires. The answer depends
only on the journal (the fold) and the tool's policy, so any executor instance, restarted at any
point, makes the same move.

- A settled step (`done`, `not_done`) is replayed, never re-run: `Nothing`.
- A step never attempted is called: `Call(1)`. The attempt is journaled before it is sent.
- An attempt with no settlement, seen by an executor that is not running it, is a crash mid-call
  (or a lost owner after a rebalance): it is settled `unknown` first (`SettleUnknown`), so users
  see the truth, then handled like any unknown. Reads have no effect, so they are just retried.
- An unknown step is looked up first (`Lookup`): a lookup after the last unknown, and only
  then a retry. A retry is sent only with the same key, only for `keyed` or `idempotent` tools,
  only while the key is alive for the whole attempt (`now + timeout_s` before the provider
  forgets the key, less a margin), and only within `attempts_max`. `unkeyed` tools are never
  retried.
- When a lookup found nothing, the next move waits for the check's `next_check_at` (the
  schedule of lookups, `plan_check`), and then retries (if a retry is still safe) or looks up
  again. When the schedule is exhausted and no safe retry is left, the step stays unknown and
  needs an operator (`Escalate`); it is never rounded to failure.
- Reads are never unknown: a read that fails is retried up to `read_attempts_max` times, then
  settled `not_done` (a read that did not happen changed nothing).
- A provider that replays its saved answer (`Idempotent-Replayed`: a 5xx saved under the key)
  gives the same answer to every retry with that key: no retry is spent on it; lookups go on.
- An attempt leaves within `send_window_s` of its journaled start or never (the executor
  checks just before sending): a paused executor that wakes up later does not send. Proofs
  that rest on "everything sent has finished" (`completes_within_s`) count that window too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta

from halfway.contract import EffectClass, Outcome
from halfway.core.fold import EffectState

# Delays between lookups of one unknown effect, by how many checks were made before: fast at
# first (a slow provider usually lands within seconds), then backing off to ten minutes.
CHECK_DELAYS_S: tuple[float, ...] = (0.5, 1, 2, 4, 8, 15, 30, 60, 120, 300, 600)
CRASH_REASON = "the harness stopped while the call was in flight; it may have happened"
# An attempt is sent within this long of its journaled start, or not at all.
SEND_WINDOW_S = 5.0


@dataclass(frozen=True, slots=True)
class StepPolicy:
    """The facts of a tool that decide what may be done with its steps (from its ToolSpec)."""

    effect_class: EffectClass
    timeout_s: float
    key_ttl_s: float | None = None  # keyed tools: how long the provider remembers our key
    key_ttl_margin_s: float = 60.0
    has_lookup: bool = True
    attempts_max: int = 10
    read_attempts_max: int = 3
    lookup_window_s: float = 86_400.0  # after the first attempt; then lookups stop
    # The provider finishes every request within this bound: past it, a lookup that finds
    # nothing proves `not_done`. None: nothing found proves nothing.
    completes_within_s: float | None = None
    check_delays_s: tuple[float, ...] = CHECK_DELAYS_S
    send_window_s: float = SEND_WINDOW_S

    def __post_init__(self) -> None:
        # Raised, not asserted (`python -O` drops asserts), each saying what is wrong; a tool's
        # declaration is checked in full earlier, by its ToolSpec.
        if self.effect_class is EffectClass.KEYED and not self.key_ttl_s:
            raise ValueError("a keyed tool's policy needs key_ttl_s")
        if not self.attempts_max >= 1:  # `not >=`: NaN fails too
            raise ValueError(f"attempts_max must be at least 1, not {self.attempts_max!r}")
        if not self.read_attempts_max >= 1:
            raise ValueError(f"read_attempts_max must be at least 1, not "
                             f"{self.read_attempts_max!r}")
        if not self.check_delays_s:
            raise ValueError("a schedule of lookups needs at least one delay")


@dataclass(frozen=True, slots=True)
class Nothing:
    """No move for the harness: settled (replay the outcome), or waiting for an operator."""


@dataclass(frozen=True, slots=True)
class Call:
    """Send attempt `attempt` (journal it first), with the step's one key."""

    attempt: int


@dataclass(frozen=True, slots=True)
class SettleUnknown:
    """An attempt nobody is running has no settlement: journal it `unknown`."""

    attempt: int
    reason: str = CRASH_REASON


@dataclass(frozen=True, slots=True)
class SettleNotDone:
    """Give up on a read: it had no effect, so `not_done` is the truth."""

    reason: str


@dataclass(frozen=True, slots=True)
class Lookup:
    """Ask the provider whether the effect named by our key exists."""


@dataclass(frozen=True, slots=True)
class Wait:
    """Nothing to do before `until`; ask again then."""

    until: datetime


@dataclass(frozen=True, slots=True)
class Escalate:
    """Unknown, no lookup left, no safe retry: an operator must resolve it."""

    reason: str


Action = Nothing | Call | SettleUnknown | SettleNotDone | Lookup | Wait | Escalate


# How much repeating a call may cost, least first: a step is moved by the stricter of the
# class its decision journaled and the one its tool declares now.
_STRICTNESS = {EffectClass.READ: 0, EffectClass.IDEMPOTENT: 1, EffectClass.KEYED: 2,
               EffectClass.UNKEYED: 3}


def governing(policy: StepPolicy, journaled: EffectClass | None) -> StepPolicy:
    """The policy that moves a step decided as `journaled` (None: an undo, which journals no
    class) by a tool whose policy is now `policy`. A redeploy that relaxes a tool's class
    (unkeyed to idempotent) must not resend a step decided when it was sent at most once:
    the stricter class governs. A keyed class without the key's lifetime is never resent."""
    if journaled is None or journaled is policy.effect_class:  # every step, but a redeploy's
        return policy
    return _stricter(policy, journaled)


@functools.lru_cache(maxsize=256)  # a few (policy, class) pairs per app: tools by classes
def _stricter(policy: StepPolicy, journaled: EffectClass) -> StepPolicy:
    if _STRICTNESS[journaled] <= _STRICTNESS[policy.effect_class]:
        return policy
    if journaled is EffectClass.KEYED and not policy.key_ttl_s:
        journaled = EffectClass.UNKEYED
    return replace(policy, effect_class=journaled)


def next_action(effect: EffectState, policy: StepPolicy, now: datetime) -> Action:
    if effect.outcome in (Outcome.DONE, Outcome.NOT_DONE) or effect.needs_attention:
        return Nothing()  # settled, or escalated: only an operator moves it now
    if not effect.attempts:
        return Call(1)
    last = effect.attempts[-1]
    if policy.effect_class is EffectClass.READ:
        return _next_read(effect, policy)
    if last.attempt not in effect.attempts_settled:
        return SettleUnknown(last.attempt)

    # Unknown. Look it up before anything else, once per unknown attempt.
    assert effect.settlement is not None
    assert effect.settlement.outcome is Outcome.UNKNOWN
    check = effect.last_check
    looked_up = check is not None and check.at >= effect.settlement.at
    if policy.has_lookup and not looked_up:
        return Lookup()

    retry_why_not = _why_no_retry(effect, policy, now)
    if not policy.has_lookup:
        if retry_why_not:
            return Escalate(f"no lookup, and {retry_why_not}")
        due = effect.settlement.at + timedelta(seconds=_delay_s(policy, len(effect.attempts) - 1))
        return Call(last.attempt + 1) if now >= due else Wait(due)

    assert check is not None
    due = check.next_check_at
    if retry_why_not is None:
        return Call(last.attempt + 1) if due is None or now >= due else Wait(due)
    if due is None:
        return Escalate(f"lookups found nothing and {retry_why_not}")
    return Lookup() if now >= due else Wait(due)


def _next_read(effect: EffectState, policy: StepPolicy) -> Action:
    # Reads change nothing: an unsettled or failed read is simply read again, within a bound.
    attempts = len(effect.attempts)
    if attempts < policy.read_attempts_max:
        return Call(effect.attempts[-1].attempt + 1)
    reason = effect.settlement.reason if effect.settlement and effect.settlement.reason else ""
    return SettleNotDone(f"the read failed {attempts} times" + (f": {reason}" if reason else ""))


def _why_no_retry(effect: EffectState, policy: StepPolicy, now: datetime) -> str | None:
    """None if one more attempt with the same key is safe now; else why not, in words."""
    if policy.effect_class is EffectClass.UNKEYED:
        return "the provider takes no key, so a retry could do it twice"
    if effect.unknowns and effect.unknowns[-1].replayed:
        return ("the provider replays its saved answer to this key, so a retry would only "
                "get the same answer")
    if len(effect.attempts) >= policy.attempts_max:
        return f"all {policy.attempts_max} attempts are used"
    if policy.effect_class is EffectClass.KEYED:
        assert policy.key_ttl_s is not None
        first = effect.attempts[0].started_at
        forgets = first + timedelta(seconds=policy.key_ttl_s - policy.key_ttl_margin_s)
        if now + timedelta(seconds=policy.timeout_s) > forgets:
            return "the provider may have forgotten the key, so a retry could do it twice"
    return None


def on_nothing_found(effect: EffectState, policy: StepPolicy, now: datetime, *,
                     must_happen: bool = False) -> SettleNotDone | datetime | None:
    """After a lookup that found nothing: proof of `not_done` if the provider has certainly
    finished every attempt, else when to look again (None: lookups are over).

    An effect that must happen (an undo, a saga's step past its pivot) is not given up on
    that proof while a retry with its key is safe: it did not happen, so the check says "now"
    and `next_action` sends the retry (a refund that timed out and never landed is sent
    again, not left to a person)."""
    proves_at = _proof_at(effect, policy)
    if proves_at is not None and now >= proves_at:
        if must_happen and _why_no_retry(effect, policy, now) is None:
            return now
        last_sent = max(a.started_at for a in effect.attempts)
        return SettleNotDone(
            f"nothing found {(now - last_sent).total_seconds():.0f} s after the last "
            f"attempt, and every attempt leaves within {_leaves_within_s(policy):g} s of "
            f"being journaled (or before its call ended) and the provider finishes every "
            f"request within {policy.completes_within_s:g} s")
    return _next_check(effect, policy, now, proves_at)


def on_lookup_failed(effect: EffectState, policy: StepPolicy, now: datetime) -> datetime | None:
    """After a lookup that itself failed (refused, timed out, a 5xx): it saw nothing, so it
    proves nothing, however long after the last attempt it came; when to look again (None:
    lookups are over)."""
    return _next_check(effect, policy, now, _proof_at(effect, policy))


def _proof_at(effect: EffectState, policy: StepPolicy) -> datetime | None:
    """From when an empty lookup proves `not_done` (the tool declares `completes_within_s`):
    the provider has finished every request, each sent by `_leaves_within_s` after its attempt
    was journaled or, for a call whose code ran on past its timeout (an app's thread, a tool
    that would not stop: it may send until it ends), by its unknown settlement, which is
    written only once that code has ended."""
    if policy.completes_within_s is None or not effect.attempts:
        return None
    last_sent = max(a.started_at for a in effect.attempts)
    sent_by = max([last_sent + timedelta(seconds=_leaves_within_s(policy)),
                   *(u.at for u in effect.unknowns)])
    return sent_by + timedelta(seconds=policy.completes_within_s)


def _leaves_within_s(policy: StepPolicy) -> float:
    """An attempt is sent within the send window of its journaling, or not at all; a tool's
    code may send its request at any point before its timeout (an app's function prepares it
    first), after which it is cancelled."""
    return policy.send_window_s + policy.timeout_s


def _next_check(effect: EffectState, policy: StepPolicy, now: datetime,
                proves_at: datetime | None) -> datetime | None:
    """`plan_check`, but while a lookup is yet to prove the answer (`proves_at` ahead, within
    the lookup window), the checks run until then and never past it: one lookup then settles
    what the schedule would otherwise answer later, or leave to an operator (its next delay
    overshot the window). Past the window a lookup is not trusted (the provider may have
    forgotten the key it looks up by), so the proof is never sought there."""
    planned = plan_check(effect, policy, now)
    if proves_at is None or proves_at <= now or proves_at > _lookups_end(effect, policy):
        return planned
    return proves_at if planned is None or planned > proves_at else planned


def plan_check(effect: EffectState, policy: StepPolicy, now: datetime) -> datetime | None:
    """When to look up again after a check that found nothing (None: no more lookups)."""
    checks_done = effect.checks
    at = now + timedelta(seconds=_delay_s(policy, checks_done))
    return None if at > _lookups_end(effect, policy) else at


def _lookups_end(effect: EffectState, policy: StepPolicy) -> datetime:
    """When the lookup window closes: `lookup_window_s` after the first attempt."""
    if not effect.attempts:
        return datetime.max.replace(tzinfo=UTC)
    return effect.attempts[0].started_at + timedelta(seconds=policy.lookup_window_s)


def _delay_s(policy: StepPolicy, index: int) -> float:
    return policy.check_delays_s[min(index, len(policy.check_delays_s) - 1)]
