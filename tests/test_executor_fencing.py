"""The executor's fences, in-process: a paused executor does not send late, and an attempt
goes out only from the executor whose record of it is first in the log, while the effect is
still open for it there (not settled for good, its task not called off before it).

The journal here is a stand-in (a writer that records, a follower that answers): what is under
test is the executor's own decision to send or not, which no broker can show deterministically.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

from halfway.contract import EffectClass, Event, Outcome, StepIntended
from halfway.core.effects import effects_to_work
from halfway.core.fold import TaskState, fold
from halfway.core.next_action import Call, StepPolicy
from halfway.executor.service import Executor, NotPlaced
from halfway.settings import KafkaSettings
from halfway.tools.registry import Registry, Tool
from halfway.tools.spec import CallContext, Succeeded, ToolSpec
from tests.factories import Stamper

SETTINGS = KafkaSettings(bootstrap="127.0.0.1:1", topic_prefix="unit.", replication_factor=1)


class Args(BaseModel):
    model_config = ConfigDict(extra="forbid")
    to: str


@dataclass(frozen=True)
class Spec(ToolSpec):
    send_window_s: float = 5.0

    def policy(self) -> StepPolicy:
        return dataclasses.replace(super().policy(), send_window_s=self.send_window_s)


@dataclass
class Provider:
    sent: list[str] = field(default_factory=list)

    async def call(self, args: BaseModel, ctx: CallContext) -> Succeeded:
        self.sent.append(ctx.key)
        return Succeeded({"message_id": f"m-{ctx.key}"})

    async def lookup(self, args: BaseModel, ctx: CallContext) -> Any:
        raise AssertionError("not here")


@dataclass
class Meta:
    partition: int
    offset: int


@dataclass
class Writer:
    """Records appends; `pause_s` holds each append that long (a process paused in it)."""

    events: list[Event] = field(default_factory=list)
    pause_s: float = 0.0
    appends: list[int] = field(default_factory=list)  # events per append
    fails: Exception | None = None
    entered: asyncio.Event = field(default_factory=asyncio.Event)  # an append has begun

    async def append_all(self, events: Sequence[Event]) -> list[Meta]:
        self.entered.set()
        await asyncio.sleep(self.pause_s)
        if self.fails is not None:
            raise self.fails
        self.appends.append(len(events))
        self.events.extend(events)
        return [Meta(0, len(self.events) - len(events) + i) for i in range(len(events))]


@dataclass
class Follower:
    """Answers `applied` as the real one does, from a log the test controls."""

    log: list[Event]
    first: Callable[[], list[Event]] = lambda: []  # what another executor wrote first
    applied_ok: bool = True
    states: dict[str, TaskState] = field(default_factory=dict)
    cut: int = 1  # the last records of the log, which came after what another wrote first

    async def applied(self, partition: int, offset: int, timeout_s: float) -> bool:
        cut = len(self.log) - self.cut
        self.states = {"mail-1": fold([*self.log[:cut], *self.first(), *self.log[cut:]])}
        return self.applied_ok

    def holds(self, task_id: str) -> bool:
        return True

    def note_write(self, task_id: str, partition: int, offset: int) -> None:
        pass

    def touch(self, task_id: str) -> None:
        pass


def executor(effect_class: EffectClass, *, send_window_s: float = 5.0,
             pause_s: float = 0.0) -> tuple[Executor, Writer, Provider, Stamper]:
    spec = Spec(name="send_mail", description="Send a mail.", args_model=Args,
                effect_class=effect_class, timeout_s=2.0, send_window_s=send_window_s,
                key_ttl_s=3600 if effect_class is EffectClass.KEYED else None)
    provider = Provider()
    writer = Writer(pause_s=pause_s)
    out = Executor(SETTINGS, Registry([Tool(spec, provider)]), writer)  # type: ignore[arg-type]
    UNUSED.append(out.follower)
    s = Stamper("mail-1")
    writer.events += [s.started(), s.intended(1, tool="send_mail", args={"to": "a@b.c"},
                                               effect_class=effect_class, subject=None)]
    out.follower = Follower(writer.events)  # type: ignore[assignment]
    return out, writer, provider, s


UNUSED: list[Any] = []  # the real followers the stand-ins replaced: closed after each test


@pytest.fixture(autouse=True)
async def close_unused() -> AsyncIterator[None]:
    yield
    while UNUSED:
        await UNUSED.pop().stop()


async def call_once(ex: Executor, writer: Writer) -> None:
    (effect,) = effects_to_work(fold(writer.events), Stamper("mail-1").now)
    tool = ex.registry.get("send_mail")
    settled = await ex._perform(effect, tool, Call(1))
    if settled is not None:
        await ex._settle(settled)


async def test_an_unkeyed_attempt_is_sent_only_when_its_record_is_first_in_the_log() -> None:
    ex, writer, provider, s = executor(EffectClass.UNKEYED)
    await call_once(ex, writer)
    assert provider.sent == ["mail-1:1"]

    ex, writer, provider, s = executor(EffectClass.UNKEYED)
    # Another executor (this one was paused; that one took over) journaled attempt 1 first.
    other = s.attempted(1, 1)
    ex.follower.first = lambda: [other]  # type: ignore[attr-defined]
    await call_once(ex, writer)
    assert provider.sent == []

    ex, writer, provider, s = executor(EffectClass.UNKEYED)
    ex.follower.applied_ok = False  # type: ignore[attr-defined]  # the partition moved away
    await call_once(ex, writer)
    assert provider.sent == []


@pytest.mark.parametrize("effect_class", [EffectClass.KEYED, EffectClass.IDEMPOTENT])
async def test_a_keyed_attempt_is_read_back_too_the_key_does_not_cover_a_stale_fold(
        effect_class: EffectClass) -> None:
    """The chaos suite's case: this executor was paused, its successor attempted, the
    request never reached the provider, and the step was settled not_done. The provider
    never saw the key, so a late copy would be the first request under it."""
    ex, writer, provider, s = executor(effect_class)
    other = [s.attempted(1, 1), s.settled(1, Outcome.NOT_DONE, attempt=1)]
    ex.follower.first = lambda: other  # type: ignore[attr-defined]
    await call_once(ex, writer)
    assert provider.sent == []
    assert fold(writer.events).step(1).effect.settlement is None  # the successor's stands

    ex, writer, provider, s = executor(effect_class)
    await call_once(ex, writer)
    assert provider.sent == ["mail-1:1"]  # read back as the first: sent


async def test_an_attempt_is_not_sent_once_the_step_was_settled_for_good_meanwhile() -> None:
    ex, writer, provider, s = executor(EffectClass.KEYED)
    # An operator settled the step while this executor was paused before its attempt.
    settled = s.settled(1, Outcome.NOT_DONE)
    ex.follower.first = lambda: [settled]  # type: ignore[attr-defined]
    await call_once(ex, writer)
    assert provider.sent == []
    assert fold([*writer.events[:-1], settled, writer.events[-1]]).step(1).effect.outcome \
        is Outcome.NOT_DONE


@pytest.mark.parametrize("effect_class", [EffectClass.KEYED, EffectClass.UNKEYED])
async def test_a_first_attempt_is_not_sent_once_the_task_was_aborted_and_says_so(
        effect_class: EffectClass) -> None:
    """A step not sent before its task was called off is never sent. Its first attempt is
    this record alone (read back as the first), so it is settled as never sent: `not_done`,
    which the saga and the user can rely on."""
    ex, writer, provider, s = executor(effect_class)
    aborted = s.aborted()
    ex.follower.first = lambda: [aborted]  # type: ignore[attr-defined]
    await call_once(ex, writer)
    assert provider.sent == []
    settled = writer.events[-1]
    assert settled.type == "step.settled"
    assert settled.outcome is Outcome.NOT_DONE  # type: ignore[attr-defined]
    assert "called off before its first attempt went out" in settled.reason  # type: ignore[attr-defined]


async def test_an_attempt_paused_past_the_send_window_is_never_sent() -> None:
    ex, writer, provider, _ = executor(EffectClass.UNKEYED, send_window_s=0.05, pause_s=0.2)
    await call_once(ex, writer)
    assert provider.sent == []
    settled = fold(writer.events).step(1).effect.settlement
    assert settled is not None
    assert settled.outcome is Outcome.NOT_DONE  # attempt 1 of an unkeyed tool: proof
    assert "paused" in (settled.reason or "")

    ex, writer, provider, _ = executor(EffectClass.KEYED, send_window_s=0.05, pause_s=0.2)
    await call_once(ex, writer)
    assert provider.sent == []
    # Another executor may have sent this attempt with the key: nothing is claimed about it.
    assert fold(writer.events).step(1).effect.settlement is None


async def test_executors_that_lack_a_tool_say_so_once_and_do_not_answer_each_other() -> None:
    """The journal keeps a step's latest `step.unserved`. Two executors of apps that both lack
    the tool each see the other's record as the latest: without a memory of what they said
    themselves they would answer each other for ever (a hot loop that fills the journal)."""
    s = Stamper("mail-1")
    log = [s.started(), s.intended(1, tool="hold_flight", args={"to": "a@b.c"})]
    executors = []
    for app in ("flights@1", "hotels@2"):
        ex = Executor(SETTINGS, Registry([]), Writer(log), app_label=app)  # type: ignore[arg-type]
        UNUSED.append(ex.follower)
        ex.follower = Follower(log)  # type: ignore[assignment]
        executors.append(ex)
    for _ in range(5):  # every write is a change each executor looks at again
        for ex in executors:
            ex.follower.states = {"mail-1": fold(log)}  # type: ignore[misc]
            await ex._advance("mail-1", s.now)
            await asyncio.gather(*ex._moves.values())
    said = [(e.app, e.undo) for e in log if e.type == "step.unserved"]
    assert said == [("flights@1", False), ("hotels@2", False)]
    assert fold(log).step(1).unserved.app == "hotels@2"  # type: ignore[union-attr]


def handed(effect_class: EffectClass) -> tuple[Executor, Writer, Provider, StepIntended]:
    """An executor whose fold has the task started, and a decision its decider hands over."""
    ex, writer, provider, s = executor(effect_class)
    del writer.events[1:]  # the decision is not journaled yet
    ex.follower.states = {"mail-1": fold(writer.events)}  # type: ignore[misc]
    ex.follower.cut = 2  # type: ignore[attr-defined]  # the pair
    intent = s.intended(1, tool="send_mail", args={"to": "a@b.c"}, effect_class=effect_class,
                        subject=None)
    return ex, writer, provider, intent


async def moves_done(ex: Executor) -> None:
    await asyncio.gather(*ex._moves.values(), return_exceptions=True)


@pytest.mark.parametrize("effect_class", [EffectClass.KEYED, EffectClass.UNKEYED])
async def test_a_decision_handed_over_is_journaled_with_its_first_attempt_in_one_append(
        effect_class: EffectClass) -> None:
    ex, writer, provider, intent = handed(effect_class)
    meta = await ex.place(intent)
    assert meta is not None
    assert meta.offset == 1  # the decision's record, for the decider
    await moves_done(ex)
    assert writer.appends == [2, 1]  # decision + attempt together; then the settlement
    assert [e.type for e in writer.events[1:3]] == ["step.intended", "step.attempted"]
    assert provider.sent == ["mail-1:1"]
    step = fold(writer.events).step(1)
    assert step is not None
    assert step.effect.outcome is Outcome.DONE
    assert step.effect.attempts[0].intent_id == intent.event_id


@pytest.mark.parametrize("effect_class", [EffectClass.KEYED, EffectClass.UNKEYED])
@pytest.mark.parametrize("meanwhile", ["another decision of the step", "the task finished"])
async def test_a_paused_workers_pair_is_never_sent_when_the_log_did_not_take_its_decision(
        effect_class: EffectClass, meanwhile: str) -> None:
    """The worker paused between deciding and its append; meanwhile another decider placed
    the step (rule 2: the first decision is the decision) or finished the task. Its pair lands
    late: the attempt is not sent, and the fold never counts it as the step's."""
    ex, writer, provider, intent = handed(effect_class)
    s = Stamper("mail-1")
    other = s.intended(1, tool="send_mail", args={"to": "x@y.z"}, effect_class=effect_class,
                       subject=None)
    first = [other] if meanwhile == "another decision of the step" else [s.finished()]
    ex.follower.first = lambda: first  # type: ignore[attr-defined]
    assert await ex.place(intent) is not None
    await moves_done(ex)
    assert provider.sent == []
    state = fold([writer.events[0], *first, *writer.events[1:]])
    step = state.step(1)
    assert step is None or (step.intent.event_id == other.event_id
                            and not step.effect.attempts)
    assert not state.orphans  # nothing waits to be adopted by a later decision
    assert any("never counted" in a for a in state.anomalies)


async def test_a_decision_is_handed_back_when_this_executor_would_not_attempt_it_now() -> None:
    ex, writer, provider, intent = handed(EffectClass.KEYED)
    assert await ex.place(intent.model_copy(update={"tool": "elsewhere"})) is None  # not served
    ex.follower.states = {}  # type: ignore[misc]  # the task is not in this executor's fold
    assert await ex.place(intent) is None
    assert writer.events[1:] == []
    assert provider.sent == []


async def test_a_failed_append_of_a_handed_over_decision_reaches_the_decider() -> None:
    ex, writer, provider, intent = handed(EffectClass.KEYED)
    writer.fails = ConnectionError("the broker is away")
    with pytest.raises(ConnectionError):
        await ex.place(intent)
    await moves_done(ex)
    assert provider.sent == []
    assert writer.events[1:] == []

    ex, writer, provider, intent = handed(EffectClass.KEYED)
    writer.pause_s = 60
    placing = asyncio.create_task(ex.place(intent))
    await asyncio.sleep(0)  # the move is made, not yet begun
    (move,) = ex._moves.values()
    move.cancel()  # the executor stops
    with pytest.raises(NotPlaced):
        await placing

    ex, writer, provider, intent = handed(EffectClass.KEYED)
    writer.pause_s = 60
    placing = asyncio.create_task(ex.place(intent))
    await writer.entered.wait()  # the move is in its append
    for move in ex._moves.values():
        move.cancel()
    with pytest.raises(NotPlaced):
        await placing
    assert provider.sent == []


@dataclass
class Partner:
    """A worker's decider, as the executor sees it: `follow` journals the settlement with the
    next move (its record), declines (None), or fails."""

    carries: bool = True
    fails: Exception | None = None
    followed: list[Event] = field(default_factory=list)

    async def follow(self, settled: Event) -> Meta | None:
        if self.fails is not None:
            raise self.fails
        self.followed.append(settled)
        return Meta(0, 99) if self.carries else None


@pytest.mark.parametrize("partner", [Partner(), Partner(carries=False),
                                     Partner(fails=ConnectionError("the broker is away"))],
                         ids=["carried", "declined", "failed"])
async def test_a_settlement_goes_with_the_next_move_or_alone_but_always_goes(
        partner: Partner) -> None:
    ex, writer, provider, _ = executor(EffectClass.KEYED)
    ex.partner = partner  # type: ignore[assignment]
    noted: list[tuple[str, int, int]] = []
    ex.follower.note_write = lambda *args: noted.append(args)  # type: ignore[method-assign]
    await call_once(ex, writer)
    assert provider.sent == ["mail-1:1"]
    alone = [e for e in writer.events if e.type == "step.settled"]
    if partner.carries and partner.fails is None:
        assert [e.type for e in partner.followed] == ["step.settled"]
        assert alone == []  # the decider's writer journaled it, with its next move
        assert noted[-1] == ("mail-1", 0, 99)  # held until this fold has it too
    else:
        assert len(alone) == 1
        assert alone[0].outcome is Outcome.DONE


@pytest.mark.parametrize("provider_says", [None, "from-its-store"])
async def test_a_done_answer_keeps_the_providers_own_replayed_field(
        provider_says: str | None) -> None:
    """The harness's "the provider replayed its saved answer" is on the settlement; in the
    evidence only where the provider's answer has no field of that name."""
    from halfway.contract import StepSettled

    ex, writer, provider, _ = executor(EffectClass.KEYED)
    evidence = {"message_id": "m-1"} | ({"replayed": provider_says} if provider_says else {})

    async def replayed_call(args: BaseModel, ctx: CallContext) -> Succeeded:
        return Succeeded(evidence, replayed=True)

    provider.call = replayed_call  # type: ignore[method-assign]
    await call_once(ex, writer)
    [settled] = [e for e in writer.events if isinstance(e, StepSettled)]
    assert settled.replayed is True
    assert settled.evidence == {"message_id": "m-1", "replayed": provider_says or True}
