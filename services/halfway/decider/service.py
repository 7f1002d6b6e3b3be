"""The decider service: a thin loop around `halfway.core.decide`.

It follows the tasks topic and the journal (JournalFollower), and for each task whose state
changed asks `decide` for the next move: start or reject a requested task, ask the model for
the next step, finish. The model is asked only for a step that is not in the journal yet, and
at most once at a time per step in this process; `step.intended` is appended (acks=all) before
anything else can happen to it. Model calls run as their own tasks, so a slow model never
blocks other tasks on the same partition.

A step with a subject is placed only once the subject guard grants its claim (GuardView), and
names its claim (`claim_id`). A proposal blocked by a subject another step holds is journaled
as a refusal that names the holder, and the task waits for the holder's release (the guard
view tells this service when one is folded), bounded by the task's deadline; a proposal
blocked for good (a once-per-subject effect already done) is a refusal like any other.

Claims are released here too (`guard_moves`): when their step settles, or, for a claim that
never became its step, only after the task's journal accepted its withdrawal
(`claim.withdrawn`), which fences a paused decider's late `step.intended` placed on it (see
`halfway.core.guard`). A failing saga's undos are journaled here (`Compensate`); the executor
performs them.

In a worker the decider hands each step it decides to the executor of its process first
(`hand`, `Executor.place`), which journals it together with the step's first attempt when it
would attempt it at once: a step then costs one append less. And with a model that answers
without I/O (`immediate`: the scripted model, a workflow), a worker's decider makes the next
move at once on what is about to be journaled, a `task.started` of its own or a settlement its
executor brings (`follow`), and journals them together (`Carry`): a 3-step task takes 4
appends in series instead of 11.

Nothing one task holds stops the others (`JournalFollower.for_each`): a task whose move keeps
failing is tried again with backoff, and after FAILURES_MAX failures finished
`needs_attention` with the error. A request too large to copy into the journal is rejected.
"""


from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from aiokafka.errors import KafkaError
from aiokafka.structs import RecordMetadata

from halfway import log, metrics, tracing
from halfway import settings as env
from halfway.contract import (
    ClaimWithdrawn,
    CompensationIntended,
    DecidedBy,
    EffectClass,
    Event,
    FinalState,
    ModelFailed,
    ProposedCall,
    StepIntended,
    StepRefused,
    SubjectHeld,
    TaskAborted,
    TaskFinished,
    TaskRejected,
    TaskStarted,
    Usage,
    encode_event,
    mint_undo_key,
    step_id,
)
from halfway.contract.events import TOKENS_PER_QUESTION_MAX, new_event_id
from halfway.contract.guards import GuardRecord, SubjectClaimed, SubjectReleased
from halfway.contract.ids import parse_step_id
from halfway.contract.topics import TASKS
from halfway.core import saga
from halfway.core.decide import (
    ARGS_BYTES_MAX,
    Abort,
    Ask,
    Compensate,
    Finish,
    Refused,
    Reject,
    RetryAt,
    Start,
    WaitFor,
    accept_call,
    args_bytes,
    decide,
    finish_for,
)
from halfway.core.fold import TaskState, apply
from halfway.core.guard import Blocked, Release, Withdraw, guard_moves
from halfway.failpoints import failpoint
from halfway.journal import JournalWriter
from halfway.journal.follower import JournalFollower
from halfway.journal.guards import GuardView
from halfway.journal.records import stamp
from halfway.journal.shared_fold import shared_folds
from halfway.loops import run_until_cancelled
from halfway.models import Model, ModelUnavailable, ProposeCall, ProposeFinish, history_of
from halfway.models import Usage as ModelUsage
from halfway.settings import KafkaSettings
from halfway.tools.registry import Registry

# Questions asked (and their answers placed) at once; more wait for a slot, in order, each a
# key in a queue (not a task), bounded by the tasks owned that are waiting for a decision.
MODEL_CALLS_MAX = 64
MODEL_TIMEOUT_S = 150.0  # a bound beyond the model adapter's own (openai_chat: 120 s)
ALSO_PROPOSED_MAX = 15  # further calls of one answer kept with its step (not run)
# A move that failed outside the model (the journal unreachable): the task is tried again after
# PLACE_RETRY_S_BASE * 2**k, at most PLACE_RETRY_S_MAX, never in a tight loop.
PLACE_RETRY_S_BASE = 0.5
PLACE_RETRY_S_MAX = 30.0
# Questions whose failure counts are kept (for that backoff): past it the oldest is forgotten.
PLACE_FAILURES_KEPT = 10_000
# A move that fails this often in a row for another reason than the journal (a bug, a tool's
# schema that raises) ends the task needing attention: each try asks the model anew.
PLACE_FAILURES_MAX = 8
# The journal not answering: tried again for as long as it takes, never given up on.
JOURNAL_UNREACHABLE = (KafkaError, OSError, TimeoutError)
# A request is copied into `task.started`; past this it could not be journaled with room.
TASK_REQUEST_BYTES_MAX = 256 * 1024
TOOL_NAME_CHARS_MAX = 200  # of a proposed tool name, as journaled in a refusal
ERROR_CHARS_MAX = 1000  # of an error, in the summary of a task given up on
# A released subject wakes one of the tasks here waiting for it (the first to wait), not all:
# woken together, each would ask the model and claim, one would win and the rest be refused
# and wait again, N(N-1)/2 questions for N tasks on one subject. The next is woken once the
# woken one has moved (placed its step, finished, waits again) and the subject is free, or
# this long after it was woken, whichever comes first (a question may take long, or the task
# may have moved to another decider).
TURN_S_MAX = 120.0


class Hand(Protocol):
    """Who may journal a decided step for the decider, with its first attempt (a worker's
    executor), after the events `before` it: the decision's record, or None to let the
    decider journal it alone."""

    async def place(self, intent: StepIntended,
                    before: tuple[Event, ...] = ()) -> RecordMetadata | None: ...


@dataclass
class Carry:
    """Events of a task that this process is about to journal (its start, a settlement),
    carried by the decider's next move for the task: both go in one append. `journaled`: the
    record of that append's last event, once it went; None: their owner journals them alone
    (and one that holds the task until its fold has them waits for this record)."""

    events: tuple[Event, ...]
    journaled: RecordMetadata | None = None


class Decider:
    def __init__(self, settings: KafkaSettings, registry: Registry, model: Model,
                 writer: JournalWriter, *, group: str | None = None, instructions: str = "",
                 app_label: str | None = None, gather_ms: int = 0,
                 hand: Hand | None = None) -> None:
        """`gather_ms`: how long the broker may hold a fetch of the journal to gather records
        (a worker's decider: it folds its executor's appends as they are acknowledged); new
        requests on the tasks topic are fetched at once either way. `hand`: the executor of
        this process, offered each decided step first."""
        self.registry = registry
        self.hand = hand
        self.model = model
        self.writer = writer
        self.instructions = instructions  # the app's system prompt
        self.app_label = app_label  # journaled with each decision: which app decided it
        # Consecutive failures of a move outside the model, per question: for the backoff.
        self._place_failures: dict[tuple[str, int], int] = {}
        # One group per deployment (topic prefix): two deployments on one cluster must not
        # rebalance each other.
        group = group or f"{settings.topic_prefix}decider"
        self.follower = JournalFollower(settings, group=group, writer=writer,
                                        on_change=self._on_change, side=TASKS,
                                        app_label=app_label,
                                        seal_after_s=env.seal_after_s(), snapshots=True,
                                        gather_ms=gather_ms, side_at_once=True,
                                        on_revoke=self._forget_revoked,
                                        # a task over that still holds a claim has a move left
                                        wake_on_catch_up=lambda _: self.guards.book.holders())
        self.follower.on_give_up = self._give_up
        self.guards = GuardView(settings, writer, on_record=self._on_guard_record)
        # Questions asked or waiting for a slot (None: queued in `_queued`), by (task, step).
        self._asking: dict[tuple[str, int], asyncio.Task[None] | None] = {}
        self._queued: deque[tuple[str, int]] = deque()
        self._asks_running = 0  # `_ask` tasks: at most MODEL_CALLS_MAX
        # Claims (event ids) this process released, per task, while the guard still lists them.
        self._released: dict[str, set[str]] = {}
        # Tasks waiting for a subject held by another step: (tool, subject) -> task ids, in
        # the order they began to wait. Bounded by the tasks waiting; each is also woken at its
        # deadline by a timer.
        self._waiting: dict[tuple[str, str], dict[str, None]] = {}
        self._waits_on: dict[str, tuple[str, str]] = {}  # the other way round
        # The task woken for a released subject, per subject, until it moves (TURN_S_MAX):
        # (task id, the step it was woken to ask for, the timer that ends its turn).
        self._turns: dict[tuple[str, str], tuple[str, int, asyncio.TimerHandle]] = {}
        self._turn_of: dict[str, tuple[str, str]] = {}  # the other way round
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._log = log.get("halfway.decider")

    async def run(self) -> None:
        await self.guards.start()
        await self.follower.start()
        try:
            # The guard must be read to its end before any task moves: a subject that looks
            # free on a half-read guard is not.
            await run_until_cancelled(self.guards.run(), self._follow_once_guarded())
        finally:
            for task in self._asking.values():
                if task is not None:
                    task.cancel()
            metrics.MODEL_QUESTIONS_WAITING.dec(len(self._queued))
            self._queued.clear()
            for timer in self._timers.values():
                timer.cancel()
            for _, _, timer in self._turns.values():
                timer.cancel()
            await self.follower.stop()
            await self.guards.stop()

    async def _follow_once_guarded(self) -> None:
        await self.guards.caught_up()
        await self.follower.run()

    def _state(self, task_id: str) -> TaskState:
        state = self.follower.states.get(task_id) or TaskState(task_id=task_id)
        request = self.follower.requests.get(task_id)
        return apply(state, request) if request is not None and state.request is None else state

    def _decide(self, state: TaskState) -> Any:
        return decide(state, known_tools=self.registry.names(),
                      requested=state.task_id in self.follower.requests, now=datetime.now(UTC),
                      still_held=self._still_held)

    def _still_held(self, held: SubjectHeld) -> bool:
        holder = self.guards.book.holder_of(held.tool, held.subject)
        return holder is not None and holder.step_id == held.holder

    def _on_guard_record(self, record: GuardRecord) -> None:
        """The guard view folded a record: wake the tasks it concerns."""
        if self.follower.owns(record.task_id):
            self.follower.touch(record.task_id)  # a claim of one of ours: is it abandoned?
        if isinstance(record, SubjectReleased):
            self._next_turn((record.tool, record.subject))

    def _next_turn(self, subject: tuple[str, str]) -> None:
        """Wake the first task here waiting for `subject` (TURN_S_MAX), unless one woken for
        it has not moved yet."""
        waiting = self._waiting.get(subject)
        if subject in self._turns or not waiting:
            return
        task_id = next(iter(waiting))
        self._stop_waiting(task_id)
        timer = asyncio.get_running_loop().call_later(TURN_S_MAX, self._turn_over, subject)
        self._turns[subject] = (task_id, self._state(task_id).next_step_n, timer)
        self._turn_of[task_id] = subject
        self.follower.touch(task_id)

    def _turn_over(self, subject: tuple[str, str]) -> None:
        """The woken task has moved (or had its time): the next one is woken if the subject
        is still free."""
        turn = self._turns.pop(subject, None)
        if turn is None:
            return
        task_id, _, timer = turn
        timer.cancel()
        self._turn_of.pop(task_id, None)
        if self.guards.book.holder_of(*subject) is None:
            self._next_turn(subject)

    def _moved(self, task_id: str, state: TaskState) -> None:
        """End the turn of a woken task once it moved: its step placed (on that subject or
        another), or it is over."""
        subject = self._turn_of.get(task_id)
        if subject is None:
            return
        _, n, _ = self._turns[subject]
        if state.next_step_n > n or state.finished is not None or state.rejected is not None:
            self._turn_over(subject)

    async def _on_change(self, task_ids: set[str]) -> None:
        await self.follower.for_each(task_ids, self._advance)

    async def _advance(self, task_id: str) -> None:
        if task_id in self.follower.sealed:
            if (subject := self._turn_of.get(task_id)) is not None:
                self._turn_over(subject)
            return  # over for good: nothing to decide, and no claim of it to move
        with log.bound(task_id=task_id):
            state = self._state(task_id)
            self._moved(task_id, state)
            if state.finished is not None or state.rejected is not None:
                self._stop_waiting(task_id)  # over: no step of it waits for a subject
            if await self._move_claims(state):
                return  # a withdrawal is journaled: nothing is asked until the fold has it
            await self._make(task_id, self._decide(state))

    async def _make(self, task_id: str, move: Any) -> None:
        match move:
            case Start():
                request = self.follower.requests[task_id]
                size_bytes = len(encode_event(request))
                if size_bytes > TASK_REQUEST_BYTES_MAX:
                    await self._write(TaskRejected(
                        **stamp(task_id), reason=f"the request is {size_bytes} bytes; at most "
                        f"{TASK_REQUEST_BYTES_MAX} are accepted (its input is copied into the "
                        f"journal)"))
                    return
                started = TaskStarted(**stamp(task_id), input=request.input,
                                      allowed_tools=request.allowed_tools,
                                      policy=request.policy)
                carry = Carry((started,))
                await self._carry_on(task_id, carry)
                if carry.journaled is None:
                    await self._write(started)
            case Reject(reason=reason):
                await self._write(TaskRejected(**stamp(task_id), reason=reason))
            case Abort(reason=reason):
                await self._write(TaskAborted(**stamp(task_id), reason=reason, by=saga.HARNESS))
                self._log.info("the saga failed; it is called off", reason=reason)
            case Compensate(undos=undos, why=why):
                for n, tool, args, generation in undos:  # last step first
                    sid = step_id(task_id, n)
                    await self._write(CompensationIntended(
                        **stamp(task_id), step_id=sid, tool=tool, args=args,
                        key=mint_undo_key(sid, generation), generation=generation))
                self._log.info("undoing the saga", why=why, steps=[n for n, *_ in undos])
            case Finish(state=final, summary=summary):
                await self._write(TaskFinished(**stamp(task_id), state=final, summary=summary))
            case WaitFor(held=held, until=until):
                self._wait(task_id, held, until)
            case RetryAt(at=at, why=why):
                self._wake_at(task_id, at)
                self._log.info("waiting for the model", why=why)
            case Ask(n=n) if (task_id, n) not in self._asking:
                self._asking[(task_id, n)] = None
                self._queued.append((task_id, n))
                metrics.MODEL_QUESTIONS_WAITING.inc()
                self._ask_queued()
            case _:
                pass  # Hold, Idle, or a question already in flight

    async def follow(self, settled: Event) -> RecordMetadata | None:
        """This worker's executor has `settled` to journal. When the task's next move, on the
        fold plus `settled`, can be made at once, it is journaled with it in one append:
        returns the record of that append's last event. None: the executor journals it."""
        carry = Carry((settled,))
        with log.bound(task_id=settled.task_id):
            await self._carry_on(settled.task_id, carry)
        return carry.journaled

    async def _carry_on(self, task_id: str, carry: Carry) -> None:
        """Make the task's next move on its fold plus `carry`, journaled together, when that
        move needs nothing but this process: the finish, or a question to a model that answers
        without I/O. Anything else (claims to move, a model to wait for) is left to the usual
        path, once the fold has `carry`."""
        if self.hand is None or not getattr(self.model, "immediate", False) or \
                not self.follower.holds(task_id) or task_id in self.follower.sealed or \
                self.follower.write_pending(task_id) or self.guards.book.held_by(task_id):
            return
        state = self._state(task_id)
        for event in carry.events:
            # Shared: the executor's `place` and this process's followers fold it onto the
            # same state again.
            state = shared_folds.apply(state, event)
        match self._decide(state):
            case Finish(state=final, summary=summary):
                await self._write(TaskFinished(**stamp(task_id), state=final, summary=summary),
                                  carry)
            case Ask(n=n) if (task_id, n) not in self._asking:
                current = asyncio.current_task()
                assert current is not None
                self._asking[(task_id, n)] = current  # the usual path does not ask it too
                try:
                    with tracing.span("halfway.decision", task_id, f"{task_id}:{n}",
                                      model=self.model.name):
                        answer = await self._question(history_of(
                            state, n, self.registry.infos(), self.instructions))
                        if isinstance(answer, ModelUnavailable):
                            await self._model_failed(task_id, n, answer, state, carry)
                        else:
                            await self._place(task_id, n, answer, state, carry)
                finally:
                    del self._asking[(task_id, n)]
                    self.follower.touch(task_id)
            case _:
                pass

    def _forget_revoked(self, partitions: set[int]) -> None:
        """What this process kept about tasks of partitions now another's: their owner keeps
        its own (the follower has dropped their states already)."""
        gone = {t for t, _ in self._place_failures} | set(self._released) | set(self._timers)
        gone |= {t for waiting in self._waiting.values() for t in waiting}
        gone = {t for t in gone if not self.follower.owns(t)}
        for key in [k for k in self._place_failures if k[0] in gone]:
            del self._place_failures[key]
        gone |= {t for t in self._turn_of if not self.follower.owns(t)}
        for task_id in gone:
            self._released.pop(task_id, None)
            self._stop_waiting(task_id)
            if (subject := self._turn_of.get(task_id)) is not None:
                self._turn_over(subject)  # its new owner moves it; the next here is woken
            if (timer := self._timers.pop(task_id, None)) is not None:
                timer.cancel()

    def _stop_waiting(self, task_id: str) -> None:
        subject = self._waits_on.pop(task_id, None)
        if subject is not None and (waiting := self._waiting.get(subject)) is not None:
            waiting.pop(task_id, None)
            if not waiting:
                del self._waiting[subject]

    def _wait(self, task_id: str, held: SubjectHeld, until: datetime) -> None:
        """Wake the task when the subject is released (the guard view says so), or at `until`."""
        self._stop_waiting(task_id)  # one subject at a time: the one it was refused for last
        if (turn := self._turn_of.get(task_id)) is not None:
            self._turn_over(turn)  # woken, it lost the subject again: its turn has passed
        self._waits_on[task_id] = (held.tool, held.subject)
        self._waiting.setdefault((held.tool, held.subject), {})[task_id] = None
        self._wake_at(task_id, until)
        self._log.info("waiting for a subject", subject=held.subject, holder=held.holder,
                       until=until.isoformat())

    def _wake_at(self, task_id: str, at: datetime) -> None:
        """Touch the task at `at` (one timer per task: a later call replaces it)."""
        self._wake_in(task_id, (at - datetime.now(UTC)).total_seconds())

    def _wake_in(self, task_id: str, delay_s: float) -> None:
        if (old := self._timers.pop(task_id, None)) is not None:
            old.cancel()

        def wake() -> None:
            self._timers.pop(task_id, None)
            self.follower.touch(task_id)

        self._timers[task_id] = asyncio.get_running_loop().call_later(max(0.0, delay_s), wake)

    def _ask_queued(self) -> None:
        """Ask the queued questions, oldest first, while a slot is free."""
        while self._queued and self._asks_running < MODEL_CALLS_MAX:
            key = self._queued.popleft()
            metrics.MODEL_QUESTIONS_WAITING.dec()
            if key in self._asking and self._asking[key] is None:
                self._asks_running += 1
                self._asking[key] = asyncio.create_task(self._ask(*key))

    async def _ask(self, task_id: str, n: int) -> None:
        retry_in_s = None
        with log.bound(task_id=task_id, step_id=f"{task_id}:{n}"), tracing.span(
                "halfway.decision", task_id, f"{task_id}:{n}", model=self.model.name):
            try:
                if not self.follower.owns(task_id):
                    return  # revoked between the change and this task starting
                history = history_of(self._state(task_id), n, self.registry.infos(),
                                     self.instructions)
                answer = await self._question(history)
                if isinstance(answer, ModelUnavailable):
                    await self._model_failed(task_id, n, answer)
                else:
                    await self._place(task_id, n, answer)
                self._place_failures.pop((task_id, n), None)
            except Exception as exc:
                # Not the model's failure (that is journaled above): the journal could not be
                # written, say. Try again later, never in a tight loop (each try asks anew).
                failures = self._place_failures.pop((task_id, n), 0) + 1
                while len(self._place_failures) >= PLACE_FAILURES_KEPT:
                    # The oldest count forgotten: that question's next backoff starts over.
                    del self._place_failures[next(iter(self._place_failures))]
                self._place_failures[(task_id, n)] = failures
                retry_in_s = min(PLACE_RETRY_S_MAX, PLACE_RETRY_S_BASE * 2 ** (failures - 1))
                # The traceback once; a repeat is one line (a failure can be megabytes long).
                self._log.error("placing the model's answer failed; the step stays undecided",
                                retry_in_s=retry_in_s, failures=failures,
                                error=f"{type(exc).__name__}: {exc}"[:ERROR_CHARS_MAX],
                                exc_info=exc if failures == 1 else None)
                if failures >= PLACE_FAILURES_MAX and not isinstance(exc, JOURNAL_UNREACHABLE):
                    retry_in_s = await self._give_up_asking(task_id, n, exc, retry_in_s)
            finally:
                del self._asking[(task_id, n)]
                self._asks_running -= 1
                self._ask_queued()
                if not self.follower.owns(task_id):
                    self._place_failures.pop((task_id, n), None)  # another decider's now
                if retry_in_s is None:
                    self.follower.touch(task_id)
                else:
                    self._wake_in(task_id, retry_in_s)

    async def _give_up_asking(self, task_id: str, n: int, exc: Exception,
                              retry_in_s: float) -> float | None:
        """End the task needing attention (None: nothing to retry), or, when that cannot be
        journaled either, when to try again."""
        try:
            await self._give_up(task_id, exc)
        except Exception as again:
            self._log.error("giving up on the task failed too; it is tried again later",
                            error=f"{type(again).__name__}: {again}"[:ERROR_CHARS_MAX])
            return retry_in_s
        self._place_failures.pop((task_id, n), None)
        return None

    async def _question(self, history: Any) -> Any:
        """The model's answer, or why there is none (ModelUnavailable): it never raises."""
        started = time.perf_counter()
        answer: Any
        try:
            async with asyncio.timeout(MODEL_TIMEOUT_S):
                answer = await self.model.decide(history)
        except ModelUnavailable as exc:
            answer = exc
        except TimeoutError:
            answer = ModelUnavailable(f"no answer within {MODEL_TIMEOUT_S:g} s", transient=True)
        except Exception as exc:  # a model of the app's own that raised: worth asking again
            answer = ModelUnavailable(f"{type(exc).__name__}: {exc}", transient=True)
        result = "failed" if isinstance(answer, ModelUnavailable) else "answered"
        metrics.MODEL_QUESTIONS.labels(result=result).observe(time.perf_counter() - started)
        return answer

    async def _model_failed(self, task_id: str, n: int, failure: ModelUnavailable,
                            state: TaskState | None = None, carry: Carry | None = None) -> None:
        """Journal the failed question: the fold counts it, `decide` backs off or ends.
        `state`: the task's fold plus `carry` (None: the follower's fold)."""
        if not self._still_asking(task_id, n, state):
            return
        retry_after_s = failure.retry_after_s
        await self._write(ModelFailed(
            **stamp(task_id), n=n, model=str(self.model.name)[:200] or "?",
            error=(failure.error or "no answer")[:ERROR_CHARS_MAX], status=failure.status,
            transient=failure.transient,
            retry_after_s=None if retry_after_s is None else min(max(0.0, retry_after_s),
                                                                   86_400.0)), carry)
        self._log.warning("the model failed", error=failure.error, transient=failure.transient,
                          status=failure.status)

    def _decided_by(self, usage: ModelUsage | None) -> DecidedBy:
        def tokens(n: int) -> int:  # what an endpoint reports, within the contract's bounds
            return min(TOKENS_PER_QUESTION_MAX, max(0, n))

        return DecidedBy(
            model=str(self.model.name)[:200] or "?", version=self.model.version,
            usage=None if usage is None else Usage(input_tokens=tokens(usage.input_tokens),
                                                   output_tokens=tokens(usage.output_tokens)),
            app=self.app_label)

    def _still_asking(self, task_id: str, n: int, state: TaskState | None = None) -> bool:
        """The task is still ours and still waits for step `n` (it may have moved on while the
        model thought, or while the guard's verdict came). `state`: a fold plus what is
        carried with the answer."""
        if not self.follower.holds(task_id):  # a task being started has no event yet
            self._log.info("the task moved to another decider; answer dropped")
            return False
        if self._decide(self._state(task_id) if state is None else state) != Ask(n):
            self._log.warning("the task moved on while the model thought; answer dropped")
            return False
        return True

    async def _place(self, task_id: str, n: int, proposal: Any,
                     state: TaskState | None = None, carry: Carry | None = None) -> None:
        """Journal the model's answer for step `n`. `state`: the task's fold plus `carry`,
        journaled with the answer (None: the follower's fold, nothing carried)."""
        if not self._still_asking(task_id, n, state):
            return
        if state is None:
            state = self._state(task_id)
        decided_by = self._decided_by(proposal.usage)
        if isinstance(proposal, ProposeFinish):
            end = finish_for(state, proposal.summary[:ERROR_CHARS_MAX])
            await self._write(TaskFinished(**stamp(task_id), state=end.state,
                                           summary=end.summary[:ERROR_CHARS_MAX],
                                           decided_by=decided_by), carry)
            return
        if proposal.malformed:
            await self._refuse(task_id, n, proposal, f"refused: {proposal.malformed}",
                               decided_by, carry=carry)
            return
        tool = self.registry.get(proposal.tool)
        fields = accept_call(state, n, tool.spec.facts() if tool else None, proposal.tool,
                             proposal.args)
        if isinstance(fields, Refused):
            await self._refuse(task_id, n, proposal, fields.reason, decided_by, carry=carry)
            return
        fields["also_proposed"] = also_proposed(proposal)
        if fields["subject"] is not None and fields["effect_class"] is not EffectClass.READ:
            assert tool is not None
            if carry is not None:
                # A claim goes on the guards topic only once the task's journal has what came
                # before it (its start, the last settlement), as when nothing is carried.
                await self._write_carried(carry)
                carry = None
            claim = SubjectClaimed(event_id=new_event_id(), at=datetime.now(UTC),
                                   subject=fields["subject"], tool=tool.spec.name,
                                   step_id=fields["step_id"], task_id=task_id,
                                   once_per_subject=tool.spec.once_per_subject)
            verdict = await self.guards.claim(claim)
            if isinstance(verdict, Blocked):
                if verdict.own:
                    # An older claim of this very step still holds the subject: it is
                    # withdrawn and released first, then the model is asked again.
                    self._log.info("an earlier claim of this step holds the subject",
                                   subject=claim.subject)
                    return
                held = None if verdict.holder is None else SubjectHeld(
                    subject=claim.subject, tool=claim.tool, holder=verdict.holder)
                await self._refuse(task_id, n, proposal, verdict.reason, decided_by,
                                   blocked=held, carry=carry)
                return
            fields["claim_id"] = claim.event_id
            # The log fences a stale write anyway (a withdrawn claim voids the step); this
            # only spares writing one. Asked of the fold as it is now (it has what was
            # carried): the task may have moved on while the guard answered.
            if not self._still_asking(task_id, n):
                return
            failpoint("decider.claimed", task_id)  # tests: a pause right here
        intent = StepIntended(**stamp(task_id), **fields, decided_by=decided_by)
        before = () if carry is None else carry.events
        placed = None if self.hand is None else await self.hand.place(intent, before)
        if placed is None:
            await self._write(intent, carry)
        else:
            if carry is not None:
                carry.journaled = placed
            self._wrote(intent, placed)
        self._log.info("step decided", tool=intent.tool, key=intent.key,
                       attempted=placed is not None)

    async def _refuse(self, task_id: str, n: int, proposal: Any, reason: str,
                      decided_by: DecidedBy, blocked: SubjectHeld | None = None,
                      carry: Carry | None = None) -> None:
        """Nothing is placed. The refusal is journaled so the model, asked again, reads why."""
        args = proposal.args if isinstance(proposal.args, dict) and \
            args_bytes(proposal.args) <= ARGS_BYTES_MAX else {}
        await self._write(StepRefused(**stamp(task_id), n=n,
                                      tool=str(proposal.tool)[:TOOL_NAME_CHARS_MAX] or "?",
                                      args=args, reason=reason, decided_by=decided_by,
                                      blocked=blocked), carry)
        self._log.warning("proposal refused", reason=reason, waits=blocked is not None)

    async def _move_claims(self, state: TaskState) -> bool:
        """Release the task's claims whose step settled; withdraw, then release, those that
        never became their step. True while a withdrawal waits for the fold."""
        task_id = state.task_id
        held = self.guards.book.held_by(task_id)
        if not held:  # the usual case: no claim to move, none of ours still listed
            self._released.pop(task_id, None)
            return False
        released = self._released.setdefault(task_id, set())
        released &= {claim.event_id for claim in held.values()}  # what the guard still lists
        if not released:
            del self._released[task_id]
        # Its claims' steps being asked now (a lookup per claim, not a scan of every question).
        placing = {n for n in (parse_step_id(c.step_id)[1] for c in held.values())
                   if (task_id, n) in self._asking}
        withdrew = False
        for move in guard_moves(held.values(), state, placing):
            match move:
                case Withdraw(claims=claims, reason=reason):
                    first = claims[0]
                    await self._write(ClaimWithdrawn(
                        **stamp(task_id), step_id=first.step_id, subject=first.subject,
                        tool=first.tool, claim_ids=[c.event_id for c in claims], reason=reason))
                    self._log.info("claims withdrawn", step_id=first.step_id, reason=reason)
                    withdrew = True
                case Release(claim=claim, release=kind) if claim.event_id not in released:
                    await self.guards.release(claim, kind)
                    self._released.setdefault(task_id, set()).add(claim.event_id)
        return withdrew

    async def _give_up(self, task_id: str, exc: BaseException) -> None:
        """The task's moves kept failing: end it visibly instead of retrying in silence."""
        state = self._state(task_id)
        if state.finished is not None or state.rejected is not None:
            return
        error = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS_MAX]
        if state.started is None:
            await self._write(TaskRejected(**stamp(task_id),
                                           reason=f"halfway could not start it: {error}"))
            return
        await self._write(TaskFinished(**stamp(task_id), state=FinalState.NEEDS_ATTENTION,
                                       summary=f"halfway could not move this task: {error}"))

    async def _write_carried(self, carry: Carry) -> None:
        """Journal what `carry` brings, alone."""
        events = carry.events
        metas = await self.writer.append_all(events)
        carry.journaled = metas[-1]
        self._wrote(events[-1], metas[-1])

    async def _write(self, event: Event, carry: Carry | None = None) -> None:
        """Journal `event`, after what `carry` brings (one append)."""
        if carry is None:
            self._wrote(event, await self.writer.append(event))
            return
        metas = await self.writer.append_all((*carry.events, event))
        carry.journaled = metas[-1]
        self._wrote(event, metas[-1])

    def _wrote(self, event: Event, meta: RecordMetadata) -> None:
        """`event` is journaled at `meta`: the task is held until the fold has it."""
        self.follower.note_write(event.task_id, meta.partition, meta.offset)
        tracing.record(event)  # on the decision's span, when traced


def also_proposed(proposal: ProposeCall) -> list[ProposedCall]:
    """The further calls of a parallel answer, kept with the step as not run. Why not run them
    as consecutive steps: each step is decided only once the one before it settled (an
    unknown must hold the task), and the model, told they did not run, proposes again what it
    still needs, knowing how the first came out. Bounded in number and in bytes."""
    kept: list[ProposedCall] = []
    budget = ARGS_BYTES_MAX
    for tool, args in proposal.also[:ALSO_PROPOSED_MAX]:
        size = args_bytes(args)
        fits = isinstance(args, dict) and size <= budget
        budget -= size if fits else 0
        kept.append(ProposedCall(tool=str(tool)[:TOOL_NAME_CHARS_MAX] or "?",
                                 args=args if fits else {}))
    return kept
