"""Tracing: OpenTelemetry spans for a task's steps, exported over OTLP when configured.

Three kinds of span, each with `halfway.task_id` and `halfway.step_id` as attributes:

- `halfway.decision` (decider): the question to the model for step n and what was placed
  (an intended step, a refusal, a finish, a failed question);
- `halfway.attempt` (executor): one move on an effect, the request and its outcome;
- `halfway.settlement` (reconciler, and operators through `halfway.resolve`): a lookup or a
  webhook that settles (or does not yet settle) an unknown step, or a settlement by hand.

What each span wrote to the journal is on it as span events (`step.intended`, `step.settled`
with its outcome, ...; `record`).

One trace per task, across processes, without passing context through Kafka: the trace id is
derived from the task id (the first 16 bytes of SHA-256 of `halfway-task:{task_id}`), and every
span of a step has the same parent, a span id derived from the step id. That parent is never
exported (no process owns a step from start to end), so a trace view shows the step's spans
side by side under a parent it calls missing; searching by trace id, or by the `task_id`
attribute, finds the whole task. `trace_id_of(task_id)` gives the id to look for.

Configuration is the standard one. Tracing is on when `HALFWAY_TRACING=otlp`, or when
`OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set; then spans go in
batches over OTLP http/protobuf (`opentelemetry-exporter-otlp-proto-http`, which reads the other
`OTEL_EXPORTER_OTLP_*` variables itself) and `OTEL_SERVICE_NAME` names the process (default
`halfway`). `HALFWAY_TRACING=off` or `OTEL_SDK_DISABLED=true` turns it off. Off is the default,
and costs one global check per hook: `span` hands back a shared no-op context, and the SDK is
not even imported.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from opentelemetry import trace

from halfway import log
from halfway import settings as env

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

TRACER_NAME = "halfway"
DEFAULT_SERVICE_NAME = "halfway"
ATTRIBUTE_CHARS_MAX = 500  # a reason or a name on a span, not a payload
_OFF: contextlib.nullcontext[trace.Span] = contextlib.nullcontext(trace.INVALID_SPAN)


class _Tracing:
    """The process's tracer, resolved from the environment once (or installed by `configure`)."""

    resolved = False
    tracer: trace.Tracer | None = None
    provider: TracerProvider | None = None


def configure(exporter: SpanExporter | None = None, *, batch: bool = True) -> None:
    """Turn tracing on with this exporter (default: OTLP http/protobuf from the environment).
    `batch=False` exports each span as it ends (tests with an in-memory exporter)."""
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()
    shutdown()
    # Resource.create reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES; ours is only the
    # default for the SDK's `unknown_service`.
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: DEFAULT_SERVICE_NAME}))
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter) if batch
                                else SimpleSpanProcessor(exporter))
    _Tracing.provider = provider
    _Tracing.tracer = provider.get_tracer(TRACER_NAME)
    _Tracing.resolved = True


def shutdown() -> None:
    """Export what is pending and turn tracing off (the provider also does this at exit)."""
    if _Tracing.provider is not None:
        _Tracing.provider.shutdown()
    _Tracing.provider = None
    _Tracing.tracer = None
    _Tracing.resolved = False


def force_flush(timeout_ms: int = 30_000) -> bool:
    """Export every ended span now (blocking: call it from a thread in async code)."""
    return _Tracing.provider.force_flush(timeout_ms) if _Tracing.provider is not None else True


def enabled() -> bool:
    if not _Tracing.resolved:
        _Tracing.resolved = True
        try:
            mode = env.tracing_mode()
        except ValueError as exc:  # said once, loudly; the work goes on untraced
            log.get("halfway.tracing").error("tracing is off", reason=str(exc))
            mode = "off"
        if mode == "otlp":
            configure()
    return _Tracing.tracer is not None


def trace_id_of(task_id: str) -> int:
    """The trace id of a task's spans (as a 128-bit int; `format(id, "032x")` prints it)."""
    return int.from_bytes(hashlib.sha256(f"halfway-task:{task_id}".encode()).digest()[:16])


def _span_id_of(step_id: str) -> int:
    return int.from_bytes(hashlib.sha256(f"halfway-step:{step_id}".encode()).digest()[:8]) or 1


def _parent(task_id: str, step_id: str | None) -> Any:
    parent = trace.SpanContext(trace_id=trace_id_of(task_id) or 1,
                               span_id=_span_id_of(step_id or task_id), is_remote=True,
                               trace_flags=trace.TraceFlags(trace.TraceFlags.SAMPLED))
    return trace.set_span_in_context(trace.NonRecordingSpan(parent))


def _value(value: Any) -> Any:
    if isinstance(value, bool | int | float):
        return value
    return str(value)[:ATTRIBUTE_CHARS_MAX]


def span(name: str, task_id: str, step_id: str | None = None,
         **attributes: Any) -> contextlib.AbstractContextManager[trace.Span]:
    """A span for one move on a task (the current span inside the `with`); a no-op when
    tracing is off. Attributes are prefixed `halfway.`; None values are left out."""
    if not enabled():
        return _OFF
    return _started(name, task_id, step_id, attributes)


@contextlib.contextmanager
def _started(name: str, task_id: str, step_id: str | None,
             attributes: dict[str, Any]) -> Iterator[trace.Span]:
    assert _Tracing.tracer is not None
    fields = {"halfway.task_id": task_id, **({"halfway.step_id": step_id} if step_id else {}),
              **{f"halfway.{k}": _value(v) for k, v in attributes.items() if v is not None}}
    with _Tracing.tracer.start_as_current_span(name, context=_parent(task_id, step_id),
                                               attributes=fields) as current:
        yield current


def record(event: Any) -> None:
    """Put a journal event the current span's move wrote on that span (its type, and the
    outcome, source and attempt of a settlement)."""
    current = trace.get_current_span()
    if not current.is_recording():
        return
    fields = {f"halfway.{name}": _value(value) for name in ("outcome", "source", "attempt",
                                                            "tool", "key", "state", "found")
              if (value := getattr(event, name, None)) is not None}
    current.add_event(str(event.type), fields)
    if "halfway.outcome" in fields:
        current.set_attribute("halfway.outcome", fields["halfway.outcome"])
