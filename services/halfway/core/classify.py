"""classify: what a failed call proves. Pure.

An adapter turns whatever its client library raised into one `CallFailure` (what was observed,
not what it means); `classify` decides the outcome. The rule is one sentence: **`not_done` needs
proof**. There are exactly three proofs:

- the provider answered and refused: a 4xx other than 408 (timeout), 409 (conflict, e.g. the
  same key still in flight), 424 (failed dependency), 425 (too early) and 429 (rate limited:
  Stripe's limiter runs before its idempotency layer, so it says nothing about an earlier
  request). Within a key's lifetime a keyed provider replays the saved result of an earlier
  attempt, so a refusal of a retry with the same key speaks for every attempt;
- an app tool raised `Refused("why")`: its author states the effect did not happen;
- the request provably never left (connection refused, name not resolved, connect timeout), and
  this is the step's first attempt. On a later attempt it proves nothing about the earlier ones.
  Not for an effect that must happen (an undo, a saga's step past its pivot: `must_happen`):
  it did not happen yet, and it is retried with its key like an unknown one, not given up.

An app tool's exception is read as if it came from the tool's effect request (its only one).
When the tool also declares a lookup, an exception that would prove `not_done` is only a lead
(`Unproven`, unknown): it may come from a later request than the effect's (a receipt fetched
after the charge), and the lookup tells. Only `Refused` is the author's word.

Everything else (a timeout after sending, a reset, a 5xx, a 409, a 429, a redirect, a crash,
any exception nobody foresaw) is `unknown`: it may have happened. `unknown` is never rounded
to failure.
"""

from __future__ import annotations

from dataclasses import dataclass

from halfway.contract.events import Outcome

# 4xx statuses that do not prove a refusal.
# 424 (Failed Dependency: Stripe's answer when a request it depends on failed) says nothing
# about whether this one took effect either.
AMBIGUOUS_4XX = frozenset({408, 409, 424, 425, 429})


@dataclass(frozen=True, slots=True)
class Replied:
    """The provider answered with a non-2xx status."""

    status: int
    code: str | None = None  # the provider's error code, e.g. card_declined
    message: str = ""
    # The provider answered from its idempotency store (`Idempotent-Replayed`): the answer to
    # an earlier attempt with this key, which every retry with the key gets again.
    replayed: bool = False


@dataclass(frozen=True, slots=True)
class ToolRefused:
    """The tool's own code said no (`raise Refused("why")` in an app tool): its author states
    the effect did not happen, which is proof like a provider's refusal."""

    reason: str


@dataclass(frozen=True, slots=True)
class NotSent:
    """The request provably never reached the provider (refused, unresolvable, connect timeout)."""

    why: str


@dataclass(frozen=True, slots=True)
class TimedOut:
    """The request left (or may have) and no reply came within the tool's timeout."""

    timeout_s: float


@dataclass(frozen=True, slots=True)
class ConnectionLost:
    """The connection broke after the request may have left (reset, EOF, broken pipe)."""

    why: str


@dataclass(frozen=True, slots=True)
class Crashed:
    """Our process died mid-call: found on restart as an attempt with no settlement."""

    why: str = "the harness stopped while the call was in flight"


@dataclass(frozen=True, slots=True)
class Unexpected:
    """Anything nobody foresaw. It proves nothing, so it is unknown."""

    what: str


@dataclass(frozen=True, slots=True)
class Unproven:
    """What would prove `not_done` (`lead`, a failure as classified), said by an exception of a
    tool that has a lookup: the exception may not be about the effect's request."""

    lead: str


CallFailure = (Replied | ToolRefused | NotSent | TimedOut | ConnectionLost | Crashed | Unexpected
               | Unproven)


@dataclass(frozen=True, slots=True)
class Verdict:
    outcome: Outcome
    reason: str

    def __post_init__(self) -> None:
        assert self.outcome is not Outcome.DONE, "done rests on evidence, never on a failure"


def classify(failure: CallFailure, *, attempt: int = 1, must_happen: bool = False) -> Verdict:
    """The outcome a failed attempt proves about its step. `attempt` counts from 1."""
    if attempt < 1:
        raise ValueError(f"attempt numbers start at 1, got {attempt}")
    match failure:
        case Replied(status=status) if 200 <= status < 300:
            raise ValueError(f"HTTP {status} is not a failure: the adapter settles it done")
        case Replied(status=status, code=code, message=message) if (
            400 <= status < 500 and status not in AMBIGUOUS_4XX
        ):
            detail = " ".join(p for p in (code, message) if p)
            return Verdict(Outcome.NOT_DONE, f"refused by the provider: HTTP {status}"
                           + (f" {detail}" if detail else ""))
        case Replied(status=status, code=code, replayed=replayed):
            what = {408: "request timeout", 409: "conflict (the same key may still be in flight)",
                    424: "failed dependency", 425: "too early",
                    429: "rate limited"}.get(status) or _family(status)
            again = "; the provider replayed this saved answer" if replayed else ""
            return Verdict(Outcome.UNKNOWN, f"HTTP {status} {what}"
                           + (f" ({code})" if code else "") + again + "; it may have happened")
        case ToolRefused(reason=reason):
            return Verdict(Outcome.NOT_DONE, f"refused: {reason}")
        case NotSent(why=why) if attempt == 1 and must_happen:
            return Verdict(Outcome.UNKNOWN, f"never reached the provider ({why}); it must "
                           "happen, so it is tried again with its key")
        case NotSent(why=why) if attempt == 1:
            return Verdict(Outcome.NOT_DONE, f"never reached the provider: {why}")
        case NotSent(why=why):
            return Verdict(Outcome.UNKNOWN, f"attempt {attempt} never reached the provider "
                           f"({why}), but an earlier attempt may have happened")
        case TimedOut(timeout_s=timeout_s):
            return Verdict(Outcome.UNKNOWN, f"no reply within {timeout_s:g} s; "
                           "the provider may have processed it")
        case ConnectionLost(why=why):
            return Verdict(Outcome.UNKNOWN, f"connection lost after sending ({why}); "
                           "the provider may have processed it")
        case Crashed(why=why):
            return Verdict(Outcome.UNKNOWN, f"{why}; it may have happened")
        case Unexpected(what=what):
            return Verdict(Outcome.UNKNOWN, f"unexpected failure ({what}); it may have happened")
        case Unproven(lead=lead):
            return Verdict(Outcome.UNKNOWN, f"the tool's exception says {lead}, but it may come "
                           "from another of its requests than the effect's: its lookup tells")
    raise TypeError(f"not a CallFailure: {failure!r}")


def _family(status: int) -> str:
    if 500 <= status < 600:
        return "server error"
    if 300 <= status < 400:
        return "redirect"
    return "unexpected status"
