"""Tracing: spans for a task's steps, off by default, exported over OTLP when configured.

In memory first (what a span carries, and the trace id every process derives from the task
id), then over the wire: an OTLP http/protobuf export reaches a tiny receiver of ours (aiohttp,
`/v1/traces`, decoded with the OTLP protobuf classes), from this process and from a decider,
an executor and a reconciler running as child processes on a task whose charge goes unknown.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from halfway import tracing
from halfway.contract import Outcome, SettlementSource, StepSettled
from halfway.journal.records import stamp
from halfway.settings import KafkaSettings

pytest.register_assert_rewrite("tests.processes")

from tests.processes import CLUSTER_KEY, cluster, renewal_request  # noqa: E402

pytest_plugins = ["tests.processes"]

WAIT_S = 90.0
OTEL_VARIABLES = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                  "HALFWAY_TRACING", "OTEL_SDK_DISABLED", "OTEL_SERVICE_NAME")


@pytest.fixture(autouse=True)
def untraced(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test starts with tracing unresolved and no OTLP variables, and leaves it off."""
    for name in OTEL_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    tracing.shutdown()
    yield
    tracing.shutdown()


def settled(task_id: str, outcome: Outcome = Outcome.UNKNOWN) -> StepSettled:
    done = outcome is Outcome.DONE
    return StepSettled(**stamp(task_id), step_id=f"{task_id}:1", outcome=outcome,
                       source=SettlementSource.CALL, attempt=1,
                       evidence={"charge_id": "ch_1"} if done else None,
                       reason=None if done else "no reply within 5 s")


def test_tracing_is_off_by_default_and_a_hook_then_does_nothing() -> None:
    assert tracing.enabled() is False
    with tracing.span("halfway.attempt", "t-1", "t-1:1", tool="charge") as span:
        assert span.is_recording() is False
        tracing.record(settled("t-1"))  # no current span: nothing to put it on
    # Off, the SDK is not even imported.
    code = ("import sys; from halfway import tracing\n"
            "with tracing.span('halfway.attempt', 't-1', 't-1:1'): pass\n"
            "print('opentelemetry.sdk' in sys.modules)")
    environ = {k: v for k, v in __import__("os").environ.items() if k not in OTEL_VARIABLES}
    out = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    assert out.strip() == "False"


def test_on_by_the_standard_variable_off_by_ours(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    assert tracing.enabled() is True
    tracing.shutdown()
    monkeypatch.setenv("HALFWAY_TRACING", "off")
    assert tracing.enabled() is False
    tracing.shutdown()
    monkeypatch.setenv("HALFWAY_TRACING", "loud")
    assert tracing.enabled() is False  # a wrong value is logged and leaves it off


def test_a_span_carries_the_task_and_step_and_what_it_journaled() -> None:
    exporter = InMemorySpanExporter()
    tracing.configure(exporter, batch=False)
    with tracing.span("halfway.attempt", "renewal-8812", "renewal-8812:1",
                      tool="charge_customer", undo=False, absent=None):
        tracing.record(settled("renewal-8812"))
    with tracing.span("halfway.settlement", "renewal-8812", "renewal-8812:1", source="lookup"):
        tracing.record(settled("renewal-8812", Outcome.DONE))
    with tracing.span("halfway.decision", "other-task", "other-task:1"):
        pass
    attempt, settlement, other = exporter.get_finished_spans()

    assert attempt.name == "halfway.attempt"
    assert dict(attempt.attributes) == {
        "halfway.task_id": "renewal-8812", "halfway.step_id": "renewal-8812:1",
        "halfway.tool": "charge_customer", "halfway.undo": False, "halfway.outcome": "unknown"}
    [event] = attempt.events
    assert event.name == "step.settled"
    assert dict(event.attributes) == {"halfway.outcome": "unknown", "halfway.source": "call",
                                      "halfway.attempt": 1}
    assert settlement.attributes["halfway.outcome"] == "done"

    # One trace per task, whichever process made the span: the id is the task's.
    assert attempt.context.trace_id == settlement.context.trace_id == \
        tracing.trace_id_of("renewal-8812")
    assert attempt.parent.span_id == settlement.parent.span_id  # the step
    assert other.context.trace_id == tracing.trace_id_of("other-task") != \
        attempt.context.trace_id


def test_an_exception_in_the_move_marks_its_span_and_goes_on() -> None:
    exporter = InMemorySpanExporter()
    tracing.configure(exporter, batch=False)
    with pytest.raises(RuntimeError), tracing.span("halfway.attempt", "t-1", "t-1:1"):
        raise RuntimeError("the journal is unreachable")
    [span] = exporter.get_finished_spans()
    assert span.status.status_code.name == "ERROR"
    assert "the journal is unreachable" in span.status.description


# --- over the wire -----------------------------------------------------------------------------


class Receiver:
    """A tiny OTLP/HTTP traces endpoint: every span it was sent, decoded."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self._news = asyncio.Event()

    async def traces(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        message = ExportTraceServiceRequest()
        message.ParseFromString(await request.read())
        for resource_spans in message.resource_spans:
            service = {a.key: a.value.string_value
                       for a in resource_spans.resource.attributes}.get("service.name")
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self.spans.append({
                        "service": service, "name": span.name,
                        "trace_id": int.from_bytes(span.trace_id),
                        "attributes": {a.key: _value(a.value) for a in span.attributes},
                        "events": [(e.name, {a.key: _value(a.value) for a in e.attributes})
                                   for e in span.events]})
        self._news.set()
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    async def until(self, probe: Any, what: str) -> None:
        try:
            async with asyncio.timeout(WAIT_S):
                while not probe(self.spans):
                    self._news.clear()
                    await self._news.wait()
        except TimeoutError:
            raise AssertionError(f"the receiver never got {what}: "
                                 f"{[(s['service'], s['name']) for s in self.spans]}") from None


def _value(value: Any) -> Any:
    return getattr(value, value.WhichOneof("value")) if value.WhichOneof("value") else None


@contextlib.asynccontextmanager
async def receiving() -> AsyncIterator[tuple[Receiver, str]]:
    receiver = Receiver()
    app = web.Application()
    app.router.add_post("/v1/traces", receiver.traces)
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        yield receiver, str(server.make_url("")).rstrip("/")
    finally:
        await server.close()


async def test_an_otlp_http_export_reaches_a_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    async with receiving() as (receiver, url):
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", url)  # the exporter adds /v1/traces
        monkeypatch.setenv("OTEL_SERVICE_NAME", "halfway-test")
        with tracing.span("halfway.attempt", "t-otlp", "t-otlp:1", tool="charge_customer"):
            tracing.record(settled("t-otlp"))
        # The exporter posts from a thread (blocking); the receiver answers in this loop.
        assert await asyncio.to_thread(tracing.force_flush) is True
        [span] = receiver.spans
    assert (span["service"], span["name"]) == ("halfway-test", "halfway.attempt")
    assert span["trace_id"] == tracing.trace_id_of("t-otlp")
    assert span["attributes"]["halfway.step_id"] == "t-otlp:1"
    assert span["events"] == [("step.settled", {"halfway.outcome": "unknown",
                                                "halfway.source": "call", "halfway.attempt": 1})]


@pytest.mark.broker
async def test_the_services_trace_a_task_decision_attempt_and_settlement(
        kafka_settings: KafkaSettings, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    async with receiving() as (receiver, url), cluster(kafka_settings, tmp_path) as c:
        request.node.stash[CLUSTER_KEY] = c
        # The charge lands at 2.2 s; the executor gives up at 1 s; the reconciler looks it up.
        await c.faults({"match": {"nth": 1}, "action": {"delay_s": 2.2}})
        for service in ("decider", "executor", "reconciler"):
            await c.start(service, OTEL_EXPORTER_OTLP_ENDPOINT=url,
                          OTEL_SERVICE_NAME=f"halfway-{service}", OTEL_BSP_SCHEDULE_DELAY="100")
        task_id = f"traced-{uuid.uuid4().hex[:8]}"
        await c.publish(renewal_request(task_id, reask=False))
        await c.journal.until_finished([task_id])

        def spans(name: str) -> list[dict[str, Any]]:
            return [s for s in receiver.spans if s["name"] == name
                    and s["attributes"].get("halfway.task_id") == task_id]

        await receiver.until(lambda _: spans("halfway.decision") and spans("halfway.attempt")
                             and spans("halfway.settlement"), "the task's three kinds of span")
        step = f"{task_id}:1"
        decision = next(s for s in spans("halfway.decision")
                        if s["attributes"]["halfway.step_id"] == step)
        assert decision["service"] == "halfway-decider"
        assert ("step.intended", {"halfway.tool": "charge_customer",
                                  "halfway.key": step}) in decision["events"]
        attempt = next(s for s in spans("halfway.attempt")
                       if s["attributes"]["halfway.step_id"] == step)
        assert attempt["service"] == "halfway-executor"
        assert attempt["attributes"]["halfway.outcome"] == "unknown"  # it timed out
        settlement = spans("halfway.settlement")[0]
        assert settlement["service"] == "halfway-reconciler"
        assert (settlement["attributes"]["halfway.source"],
                settlement["attributes"]["halfway.step_id"]) == ("lookup", step)
        # Three processes, one trace: the task's.
        assert {s["trace_id"] for s in receiver.spans
                if s["attributes"].get("halfway.task_id") == task_id} == {
            tracing.trace_id_of(task_id)}
