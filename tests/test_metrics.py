"""`/metrics` of the services, scraped as Prometheus would, after a task went through them."""

from __future__ import annotations

import asyncio
import socket
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from halfway import settings as env
from halfway.contract import FinalState
from halfway.projector import store

pytest.register_assert_rewrite("tests.processes")

from tests.processes import Cluster, renewal_request, stop  # noqa: E402

pytest_plugins = ["tests.processes"]
pytestmark = pytest.mark.broker

WAIT_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def scrape(port: int) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Every sample by name, once the endpoint answers (the process may still be starting)."""
    async with httpx.AsyncClient(timeout=5.0) as client, asyncio.timeout(WAIT_S):
        while True:
            try:
                response = await client.get(f"http://127.0.0.1:{port}/metrics")
                break
            except httpx.ConnectError:
                await asyncio.sleep(0.1)
    assert response.status_code == 200
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def total(samples: dict, name: str, **labels: str) -> float:
    return sum(value for got, value in samples.get(name, [])
               if all(got.get(k) == v for k, v in labels.items()))


async def test_each_service_serves_its_metrics(core: Cluster) -> None:
    ports = {name: free_port()
             for name in ("decider", "executor", "reconciler", "outcomes", "projector")}
    schema = f"metrics_{uuid.uuid4().hex[:8]}"  # the projector's read model, dropped after
    procs = {name: await core.start(name, "--metrics-port", str(port),
                                    HALFWAY_SNAPSHOT_EVERY_S="0",  # one after each batch
                                    HALFWAY_PG_SCHEMA=schema)
             for name, port in ports.items()}
    task_id = f"metrics-{uuid.uuid4().hex[:8]}"
    await core.publish(renewal_request(task_id, reask=False))
    state = (await core.journal.until_finished([task_id]))[task_id]
    assert state.final_state is FinalState.SUCCEEDED

    await procs["decider"].until_logged("snapshot written")
    decider = await scrape(ports["decider"])
    group = f"{core.settings.topic_prefix}decider"
    assert total(decider, "halfway_events_applied_total", group=group) >= 5
    assert total(decider, "halfway_model_question_seconds_count", result="answered") >= 2
    assert decider["halfway_model_questions_waiting"] == [({}, 0.0)]  # none left queued
    assert total(decider, "halfway_tasks_in_memory", group=group) >= 1
    caught_up = [v for labels, v in decider["halfway_partition_caught_up"]
                 if labels["group"] == group]
    assert caught_up
    assert all(v == 1 for v in caught_up)
    assert "halfway_consumer_lag" in decider
    (age,) = [v for labels, v in decider["halfway_snapshot_age_seconds"]
              if labels["group"] == group]
    assert age >= 0  # -1 until its first snapshot, then its age

    # The executor counts a settlement when its follower folds it, which may be a moment
    # after the task finished: scraped until it has.
    async with asyncio.timeout(WAIT_S):
        while total(executor := await scrape(ports["executor"]),  # noqa: ASYNC110 (polled)
                    "halfway_steps_settled_total", outcome="done") < 1:
            await asyncio.sleep(0.1)
    assert total(executor, "halfway_tool_call_seconds_count", tool="charge_customer",
                 result="Succeeded") == 1
    assert total(executor, "halfway_steps_settled_total", outcome="done") >= 1
    assert total(executor, "halfway_steps_by_status", status="done") >= 1

    reconciler = await scrape(ports["reconciler"])
    assert total(reconciler, "halfway_tasks_in_memory") >= 1

    # The outcomes publisher folds the journal at its own pace (a busy CI machine saw it
    # behind when the task finished): scraped until it has folded the task's events.
    group = f"{core.settings.topic_prefix}outcomes"
    async with asyncio.timeout(WAIT_S):
        while total(outcomes := await scrape(ports["outcomes"]),  # noqa: ASYNC110 (polled)
                    "halfway_events_applied_total", group=group) < 5:
            await asyncio.sleep(0.1)
    assert total(outcomes, "halfway_events_applied_total", group=group) >= 5
    assert total(outcomes, "halfway_tasks_in_memory", group=group) >= 1

    # The projector: records folded, rows not stored yet (0 once caught up), its tasks.
    group = f"{core.settings.topic_prefix}projector"
    try:
        async with asyncio.timeout(WAIT_S):
            while True:
                projector = await scrape(ports["projector"])
                lags = [v for labels, v in projector.get("halfway_consumer_lag", [])
                        if labels["group"] == group]
                if (total(projector, "halfway_events_applied_total", group=group) >= 5
                        and lags and not any(lags)):
                    break
                await asyncio.sleep(0.1)  # polled: a scrape has no notification
        assert total(projector, "halfway_tasks_in_memory", group=group) >= 1
        assert total(projector, "halfway_steps_by_status", group=group, status="done") >= 1
        await procs["projector"].until_logged("snapshot written")
        (age,) = [v for labels, v in (await scrape(ports["projector"]))[
            "halfway_snapshot_age_seconds"] if labels["group"] == group]
        assert age >= 0
    finally:
        await stop(procs["projector"])  # before its schema goes
        conn = await store.connect(env.pg_dsn())
        try:
            await store.drop_schema(conn, schema)
        finally:
            await conn.close()
