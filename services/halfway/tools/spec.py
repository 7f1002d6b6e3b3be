"""ToolSpec: what a tool author declares, and the adapter that speaks to the provider.

The rules a tool author must know, in one place:

- **effect_class** says what repeating a call does. `read`: nothing (retried within
  `read_attempts_max`, never unknown). `idempotent`: repeating is naturally safe. `keyed`: the
  provider dedupes by our idempotency key for `key_ttl_s` seconds after the first request, so a
  retry with the same key inside that window cannot make a second effect; after it, no retry is
  ever sent, only lookups. `unkeyed`: no key, so at most one request is ever sent.
- **key_ttl_s** is how long the provider remembers a key (Stripe: 24 h). The executor stops
  retrying `key_ttl_margin_s` before it runs out (default: a tenth of the lifetime, at most a
  minute), because a retry that arrives after the provider forgot the key is a new request.
- **timeout_s** is how long one attempt may take before its outcome is unknown.
- **subject(args)** names the business object the call touches (`invoice:INV-2291`).
- **lookup** (on the adapter) asks the provider whether the effect named by our key exists. A
  tool without a lookup can only be settled by its reply, a webhook or an operator.
- **saga_role** says where the tool may stand in a saga (`halfway.core.saga`): `compensable`
  (declares `undo`), `pivot` (irreversible: at most one per saga, nothing undoable after it),
  `retriable` (after the pivot, retried with its key until done). None: not for sagas.
- **undo** (compensable tools): the tool that undoes the effect and its arguments, declared
  before the step runs. A string argument `"$args.NAME"` or `"$result.NAME"` is replaced by
  that field of the step's frozen arguments or of its `done` evidence (call or lookup alike).
- **once_per_subject**: a `done` effect on a subject is never repeated, by any task, however
  much later (the subject guard, `halfway.core.guard`). Every tool with a subject is guarded
  while a step on it is in flight or unknown.
- **completes_within_s**: declare it only if the provider finishes every request within that
  bound; then a lookup that finds nothing after it (counted from when the last request may
  have left: the send window and the tool's timeout past its attempt, or its call's end)
  proves `not_done`. Leave it None when the
  provider's search can lag (Stripe's can, by minutes): nothing found then proves nothing.
- **evidence_id**: the evidence field that names the effect at the provider (`charge_id`).
  Two `done` reports naming different effects under one key are a contradiction (the effect
  may have happened twice), shown to an operator instead of silently agreeing.
- **read_webhook** (on the adapter, optional): what one of the provider's events says about
  the effect (`halfway.core.reconcile.WebhookReport`), including whether its object matches
  the step's arguments. A tool without it is never settled by webhooks.

The adapter never decides outcomes: it reports what it saw (a result with evidence, or a
`CallFailure`), and the pure core classifies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Protocol

from pydantic import BaseModel

from halfway.contract import CompensationPlan, EffectClass, SagaRole
from halfway.core.classify import CallFailure
from halfway.core.decide import ToolFacts
from halfway.core.next_action import StepPolicy


@dataclass(frozen=True, slots=True)
class Succeeded:
    """The provider did it; `evidence` is what proves it (ids, amounts, references)."""

    evidence: dict[str, Any]
    replayed: bool = False  # the provider answered from its idempotency store


CallResult = Succeeded | CallFailure


@dataclass(frozen=True, slots=True)
class Found:
    """A lookup found the effect and its final state."""

    evidence: dict[str, Any]
    # False: found, and it failed (e.g. a declined charge): proof of not_done.
    succeeded: bool = True
    reason: str = ""
    # Other effects found under the same key (their provider ids): the provider did it more
    # than once (a key reused after it forgot it). Each is journaled as a contradiction.
    others: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class NotFound:
    """A lookup found nothing (yet): not proof of anything on its own."""

    detail: str = "nothing with this key yet"


@dataclass(frozen=True, slots=True)
class LookupFailed:
    """The lookup itself failed (timeout, 5xx): it says nothing about the effect."""

    detail: str


LookupResult = Found | NotFound | LookupFailed


@dataclass(frozen=True, slots=True)
class CallContext:
    """What the harness hands an adapter for one attempt."""

    step_id: str
    key: str  # send it with every attempt, in every place the provider accepts it
    attempt: int
    timeout_s: float

    @property
    def task_id(self) -> str:
        return self.step_id.rpartition(":")[0]


class Adapter(Protocol):
    async def call(self, args: BaseModel, ctx: CallContext) -> CallResult: ...

    async def lookup(self, args: BaseModel, ctx: CallContext) -> LookupResult: ...


@dataclass(frozen=True)
class ToolSpec:
    name: str
    description: str
    args_model: type[BaseModel]
    effect_class: EffectClass
    timeout_s: float
    subject: Callable[[BaseModel], str | None] = lambda _args: None
    key_ttl_s: float | None = None  # required for keyed tools
    key_ttl_margin_s: float | None = None
    has_lookup: bool = True
    read_attempts_max: int = 3
    attempts_max: int = 10  # every retry loop has a bound
    completes_within_s: float | None = None
    saga_role: SagaRole | None = None
    undo: CompensationPlan | None = None
    once_per_subject: bool = False
    evidence_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def effect_id(self, evidence: dict[str, Any] | None) -> str | None:
        """The provider's name for the effect in `evidence`, if the tool declares where."""
        if self.evidence_id is None or not evidence:
            return None
        value = evidence.get(self.evidence_id)
        return str(value)[:255] if value not in (None, "") else None

    def policy(self) -> StepPolicy:
        return self._policy

    @cached_property
    def _policy(self) -> StepPolicy:
        # Asked several times per step (the executor's every move, the reconciler's every
        # look): made once per spec, which is frozen, as is the policy.
        return StepPolicy(
            effect_class=self.effect_class, timeout_s=self.timeout_s, key_ttl_s=self.key_ttl_s,
            key_ttl_margin_s=(self.key_ttl_margin_s if self.key_ttl_margin_s is not None
                              else min(60.0, (self.key_ttl_s or 0.0) / 10)),
            has_lookup=self.has_lookup,
            attempts_max=self.attempts_max, read_attempts_max=self.read_attempts_max,
            completes_within_s=self.completes_within_s,
            **({"lookup_window_s": self.key_ttl_s} if self.key_ttl_s else {}),
        )

    def facts(self) -> ToolFacts:
        return ToolFacts(self.name, self.args_model, self.effect_class, self.subject,
                         saga_role=self.saga_role, undo=self.undo,
                         once_per_subject=self.once_per_subject)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"a tool's name must be a non-empty string, not {self.name!r:.40}")
        if self.effect_class is EffectClass.KEYED and not self.key_ttl_s:
            raise ValueError(f"tool {self.name}: a keyed tool must declare key_ttl_s")
        if self.saga_role is SagaRole.COMPENSABLE and self.undo is None:
            raise ValueError(f"tool {self.name}: a compensable tool must declare its undo")
        if self.undo is not None and self.saga_role is not SagaRole.COMPENSABLE:
            raise ValueError(f"tool {self.name}: only a compensable tool declares an undo")
        self._check_bounds()
        object.__setattr__(self, "timeout_s", float(self.timeout_s))

    def _check_bounds(self) -> None:
        # Every number is checked here, where the tool is declared: NaN, inf, a string or a
        # negative window would otherwise misbehave at run time (a negative completes_within_s
        # "proves" a charge not done, and a retry charges twice).
        tool = self.name
        _seconds(tool, "timeout_s", self.timeout_s, 0.0, TIMEOUT_MAX_S, above=True)
        if self.key_ttl_s is not None:
            _seconds(tool, "key_ttl_s", self.key_ttl_s, KEY_TTL_MIN_S, WINDOW_MAX_S)
        if self.key_ttl_margin_s is not None:
            if self.key_ttl_s is None:
                raise ValueError(f"tool {tool}: key_ttl_margin_s needs key_ttl_s")
            _seconds(tool, "key_ttl_margin_s", self.key_ttl_margin_s, 0.0, WINDOW_MAX_S)
            if self.key_ttl_margin_s >= self.key_ttl_s:
                raise ValueError(f"tool {tool}: key_ttl_margin_s ({self.key_ttl_margin_s:g} s) "
                                 f"must be less than key_ttl_s ({self.key_ttl_s:g} s)")
        if self.completes_within_s is not None:
            # 0 would let an empty lookup at the attempt's own moment prove it not done.
            _seconds(tool, "completes_within_s", self.completes_within_s, 0.0, WINDOW_MAX_S,
                     above=True)
        _count(tool, "attempts", self.attempts_max)
        _count(tool, "read_attempts", self.read_attempts_max)
        if not isinstance(self.once_per_subject, bool):
            raise TypeError(f"tool {tool}: once_per_subject must be True or False, not "
                            f"{type(self.once_per_subject).__name__}")
        if self.evidence_id is not None and (
                not isinstance(self.evidence_id, str) or not self.evidence_id.strip()
                or len(self.evidence_id) > EVIDENCE_ID_CHARS_MAX):
            raise ValueError(f"tool {tool}: evidence_id must name a field of the evidence (a "
                             f"non-blank string of at most {EVIDENCE_ID_CHARS_MAX} characters)")


TIMEOUT_MAX_S = 86_400.0  # one attempt longer than a day is a mistake
KEY_TTL_MIN_S = 1.0  # a provider that remembers a key for less is not deduping
WINDOW_MAX_S = 366 * 86_400.0  # of key_ttl_s, its margin and completes_within_s: a year
ATTEMPTS_MAX = 1_000  # of attempts and read_attempts
EVIDENCE_ID_CHARS_MAX = 255


def _seconds(tool: str, name: str, value: object, least: float, most: float, *,
             above: bool = False) -> None:
    """`value` is a number of seconds from `least` (excluded if `above`) to `most`: a bool is
    not a number, and NaN fails every comparison."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"tool {tool}: {name} must be a number of seconds, not "
                        f"{type(value).__name__}")
    if not ((value > least if above else value >= least) and value <= most):
        raise ValueError(f"tool {tool}: {name} must be {'more than' if above else 'at least'} "
                         f"{least:g} and at most {most:.0f} s, not {_shown(value)}")


def _count(tool: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"tool {tool}: {name} must be a whole number, not "
                        f"{type(value).__name__}")
    if not 1 <= value <= ATTEMPTS_MAX:
        raise ValueError(f"tool {tool}: {name} must be from 1 to {ATTEMPTS_MAX}, not "
                         f"{_shown(value)}")


def _shown(value: object) -> str:
    try:
        return f"{value!r:.40}"
    except Exception:  # an int too long to print, say
        return type(value).__name__
