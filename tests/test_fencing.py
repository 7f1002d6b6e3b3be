"""Fencing against the real broker: a paused process wakes up and writes, and nothing it wrote
may cause an effect (issue 10, part 1).

The frozen decider: decider A claims invoice Z for task X, and stops (SIGSTOP, at the exact
moment through a failpoint: claim granted, step not yet journaled). Its session expires, X's
partition moves to decider B, which withdraws A's claim in X's journal and releases it; task Y
charges Z. Then A thaws and journals its step for X. Exactly one charge: the fold refuses A's
late step (its claim was withdrawn earlier in the log), so no executor ever runs it.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from halfway.contract import (
    DecidedBy,
    EffectClass,
    FinalState,
    Outcome,
    StepIntended,
    mint_key,
)
from halfway.contract.topics import JOURNAL
from halfway.core.fold import fold
from halfway.journal.records import partition_of
from halfway.resolve import abort_task
from halfway.settings import KafkaSettings

pytest.register_assert_rewrite("tests.processes")

from tests.processes import (  # noqa: E402
    CLUSTER_KEY,
    Cluster,
    Proc,
    charges_for,
    cluster,
    journal_now,
    renewal_request,
)

pytest_plugins = ["tests.processes"]
pytestmark = pytest.mark.broker

WAIT_S = 120.0
POLL_S = 0.05
PARTITIONS = JOURNAL.partitions


@pytest.fixture
async def c(kafka_settings: KafkaSettings, tmp_path: Path,
            request: pytest.FixtureRequest) -> AsyncIterator[Cluster]:
    async with cluster(kafka_settings, tmp_path, charge_timeout_s=2.0) as out:
        request.node.stash[CLUSTER_KEY] = out
        yield out


def new_id(prefix: str, partitions: set[int]) -> str:
    """A task id whose journal partition is one of `partitions`."""
    while True:
        task_id = f"{prefix}-{uuid.uuid4().hex[:8]}"
        if partition_of(task_id.encode(), PARTITIONS) in partitions:
            return task_id


def assigned(proc: Proc, group: str = "decider") -> set[int]:
    """The partitions `proc` holds in `group` (of its deployment), once it read them to the
    end (a worker holds some in its decider's group and in its executor's)."""
    def logged(event: str) -> list[dict[str, Any]]:
        return [e for e in proc.logged(event) if e.get("group", "").endswith(f".{group}")]

    lines, revoked = logged("partitions assigned"), logged("partitions revoked")
    if not lines or (revoked and revoked[-1]["timestamp"] > lines[-1]["timestamp"]):
        return set()
    since = lines[-1]["timestamp"]
    caught_up = {e["partition"] for e in logged("caught up")
                 if e["timestamp"] >= since and e["topic"].endswith(".journal")}
    held = set(lines[-1]["partitions"])
    return held if held <= caught_up else set()


def shared(a: Proc, b: Proc, groups: tuple[str, ...]) -> set[int]:
    """A's partitions, once A and B split them alike in every group."""
    mine = assigned(a, groups[0])
    theirs = assigned(b, groups[0])
    alike = all(assigned(a, g) == mine and assigned(b, g) == theirs for g in groups)
    return mine if mine and theirs and alike and mine | theirs == set(range(PARTITIONS)) \
        else set()


async def until(probe, what: str, timeout_s: float = WAIT_S):  # type: ignore[no-untyped-def]
    try:
        async with asyncio.timeout(timeout_s):
            while True:  # a log file and /proc have no notification: polled, bounded
                if found := probe():
                    return found
                await asyncio.sleep(POLL_S)
    except TimeoutError:
        raise AssertionError(f"no {what} within {timeout_s:g} s") from None


def stopped(proc: Proc) -> bool:
    """The process is stopped by a signal (state T in /proc)."""
    stat = Path(f"/proc/{proc.pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.parametrize(("kind", "freeze_at"), [("decider", "decider.claimed"),
                                                  ("worker", "executor.placing")])
async def test_a_frozen_decider_that_thaws_after_another_task_charged_causes_no_charge(
        c: Cluster, kind: str, freeze_at: str) -> None:
    """A worker's executor journals its decider's step together with the step's first
    attempt: the worker frozen just before that append writes the pair late, and it is
    fenced the same way (the step is refused, its attempt never counts, nothing is sent)."""
    invoice = f"INV-frozen-{uuid.uuid4().hex[:6]}"
    frozen = await c.start(kind, HALFWAY_FAILPOINTS=f"{freeze_at}=stop@frozen-")
    groups = ("decider",) if kind == "decider" else ("decider", "executor")
    await until(lambda: assigned(frozen) == set(range(PARTITIONS)), "first assignment")
    other = await c.start(kind)
    # Both share the partitions (range assignment): X must land on the frozen one's.
    mine = await until(lambda: shared(frozen, other, groups),
                       f"the partitions shared by both {kind}s")
    for service in ("executor", "reconciler") if kind == "decider" else ("reconciler",):
        await c.start(service)

    x = new_id("frozen", mine)
    request = renewal_request(x, invoice=invoice, reask=False)
    # B, asking the model again for X once it took X over, gets its answer late: Y charges
    # the invoice meanwhile, the race of the issue.
    request.input["script"][0]["second_ask_delay_s"] = 20
    await c.publish(request)
    await until(lambda: stopped(frozen), "decider A frozen right after its claim was granted")
    # A's session expires, X's partition moves to B, which withdraws A's claim and releases it.
    withdrawn = await c.journal.first(lambda e: e.task_id == x and e.type == "claim.withdrawn",
                                      "the withdrawal of A's claim", WAIT_S)
    y = new_id("thawed-after", set(range(PARTITIONS)))
    await c.publish(renewal_request(y, invoice=invoice, reask=False))
    finished_y = await c.journal.until_finished([y], WAIT_S)
    assert finished_y[y].final_state is FinalState.SUCCEEDED

    frozen.process.send_signal(signal.SIGCONT)
    late = await c.journal.first(lambda e: e.task_id == x and e.type == "step.intended",
                                 "A's late step", WAIT_S)
    assert late.claim_id in withdrawn.claim_ids
    # X ends: B asks again, and the invoice is charged already (once per subject).
    await c.journal.until_finished([x], WAIT_S)
    # Anything the executor would have done for A's step it did before X finished (the log
    # of one partition is in order, and the executor acts on it in order).
    events = await journal_now(c.settings)
    state = fold([e for e in events if e.task_id == x], x)
    assert late.event_id in {n.event.event_id for n in state.not_accepted}
    assert state.step(1) is None
    # A worker may have journaled its attempt with the late step: it names that step, and the
    # fold never counted it.
    attempts = [e for e in events if e.task_id == x and e.type == "step.attempted"]
    assert all(a.intent_id == late.event_id for a in attempts), attempts
    assert len(attempts) == (kind == "worker"), attempts
    assert len(attempts) == sum("never counted" in a for a in state.anomalies)
    assert state.final_state is FinalState.FAILED
    assert "already did charge_customer" in state.finished.summary
    charges = [ch for ch in await c.ledger() if (ch.get("metadata") or {}).get("invoice")
               == invoice]
    assert len(charges) == 1, charges
    assert charges_for(charges, f"{y}:1") == charges
    assert not [r for r in await c.sim_requests() if r["idempotency_key"] == mint_key(f"{x}:1")]


async def test_a_step_journaled_after_its_task_finished_is_never_executed(c: Cluster) -> None:
    for service in ("decider", "executor", "reconciler"):
        await c.start(service)
    task_id = new_id("finished", set(range(PARTITIONS)))
    await c.publish(renewal_request(task_id))
    await c.journal.until_finished([task_id], WAIT_S)
    # A stale decider's decision for a second charge, written after the task finished.
    assert c.writer is not None
    step_id = f"{task_id}:2"
    await c.writer.append(StepIntended(
        event_id=uuid.uuid4().hex, task_id=task_id, at=datetime.now(UTC), step_id=step_id, n=2,
        tool="charge_customer", key=mint_key(step_id), subject=f"invoice:INV-{task_id}-2",
        args={"invoice": f"INV-{task_id}-2", "customer": "cus_1", "amount_cents": 4900,
              "currency": "usd"},
        effect_class=EffectClass.KEYED, decided_by=DecidedBy(model="stale")))
    # A task behind it on the same partition: once it is done, the executor has read past it.
    behind = new_id("behind", {partition_of(task_id.encode(), PARTITIONS)})
    await c.publish(renewal_request(behind))
    await c.journal.until_finished([behind], WAIT_S)
    events = await journal_now(c.settings)
    state = fold([e for e in events if e.task_id == task_id], task_id)
    assert 2 not in state.steps
    (refused,) = state.not_accepted
    assert "written after the task finished (succeeded) by a stale decider" in refused.reason
    assert not [e for e in events if getattr(e, "step_id", None) == step_id
                and e.type != "step.intended"]
    assert not charges_for(await c.ledger(), step_id)


async def test_an_executor_frozen_before_its_attempt_never_sends_once_the_task_was_aborted(
        c: Cluster) -> None:
    """An executor decides on its own fold, which a pause leaves stale. Frozen just before it
    journals a step's first attempt, it misses the task's abort; thawed, it journals the
    attempt anyway. Nothing has reached the provider under the key, so that request would be
    the first and charge after the journal called the task off: it is read back first, and
    settled as never sent."""
    frozen = await c.start("executor", HALFWAY_FAILPOINTS="executor.attempting=stop@frozen-")
    for service in ("decider", "reconciler"):
        await c.start(service)
    x = new_id("frozen", set(range(PARTITIONS)))
    await c.publish(renewal_request(x, reask=False))
    await until(lambda: stopped(frozen), "the executor frozen just before its attempt")
    assert c.writer is not None
    aborted = await abort_task(c.settings, x, reason="the customer cancelled", by="tester",
                               writer=c.writer)
    frozen.process.send_signal(signal.SIGCONT)
    attempt = await c.journal.first(lambda e: e.task_id == x and e.type == "step.attempted",
                                    "the thawed executor's late attempt", WAIT_S)
    await c.journal.until_finished([x], WAIT_S)
    events = await journal_now(c.settings)
    mine = [e for e in events if e.task_id == x]
    assert [e.event_id for e in mine].index(aborted.event_id) < \
        [e.event_id for e in mine].index(attempt.event_id)  # late, after the abort
    state = fold(mine, x)
    step = state.step(1)
    assert step is not None
    assert step.effect.outcome is Outcome.NOT_DONE, step.effect
    assert "called off before its first attempt went out" in (step.effect.settlement.reason
                                                               or "")
    assert state.final_state is not FinalState.SUCCEEDED
    key = mint_key(f"{x}:1")
    assert not [r for r in await c.sim_requests() if r["idempotency_key"] == key]
    assert not charges_for(await c.ledger(), f"{x}:1")


async def test_an_executor_frozen_before_its_attempt_never_sends_after_its_successor_settled(
        c: Cluster) -> None:
    """What the chaos suite found (`benchmarks/chaos.py --tasks 2000 --seed 7`): an executor
    frozen just before a step's first attempt loses the partition; its successor attempts,
    the provider refuses the connection, and the step is settled `not_done` (never reached
    it) and the task finished. Thawed, the first executor journals its own attempt 1 and,
    without reading it back, would send it: the provider never saw the key, so it would
    charge. Read back, its record is not the first of attempt 1 (or its partition has moved
    on), and nothing is sent."""
    frozen = await c.start("executor", HALFWAY_FAILPOINTS="executor.attempting=stop@frozen-")
    await until(lambda: assigned(frozen, "executor") == set(range(PARTITIONS)),
                "the first executor's assignment")
    for service in ("decider", "reconciler"):
        await c.start(service)
    x = new_id("frozen", set(range(PARTITIONS)))
    await c.publish(renewal_request(x, reask=False))
    await until(lambda: stopped(frozen), "the executor frozen just before its attempt")
    with socket.socket() as closed:  # a port nobody listens on: connections are refused
        closed.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{closed.getsockname()[1]}"
    await c.start("executor", HALFWAY_PAYSIM_URL=dead)
    finished = await c.journal.until_finished([x], WAIT_S)
    assert finished[x].final_state is FinalState.FAILED
    frozen.process.send_signal(signal.SIGCONT)
    # It reads its attempt back (not the first of attempt 1), or finds the partition gone.
    refusals = await until(lambda: [e for e in frozen.log_events()
                                    if str(e.get("event")).startswith("not sent: ")],
                           "the thawed executor's refusal to send")
    assert refusals[0]["task_id"] == x
    events = await journal_now(c.settings)
    state = fold([e for e in events if e.task_id == x], x)
    attempts = [e for e in events if e.task_id == x and e.type == "step.attempted"]
    assert len(attempts) == 2, attempts  # the successor's, then the thawed one's
    step = state.step(1)
    assert step is not None
    assert step.effect.outcome is Outcome.NOT_DONE
    assert "never reached the provider" in (step.effect.settlement.reason or "")
    key = mint_key(f"{x}:1")
    assert not [r for r in await c.sim_requests() if r["idempotency_key"] == key]
    assert not charges_for(await c.ledger(), f"{x}:1")
