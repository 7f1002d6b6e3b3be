"""Prometheus metrics of every service, served at `/metrics` (prometheus-client).

Set HALFWAY_METRICS_PORT (or `halfway run SERVICE --metrics-port N`) to serve them; `0` picks a
free port, which the service logs ("metrics listening"). Unset: nothing is served (several
services on one machine would otherwise fight over one default port).

What an operator reads here, per consumer group (`group` label: one per service kind and
deployment; the projector's too, where the lag counts records whose rows PostgreSQL does not
hold yet and the tasks in memory count its folded and dormant ones):
- `halfway_events_applied_total{group,topic}`: records folded (a restart's replay counts too:
  its slope is the catch-up speed);
- `halfway_consumer_lag{group,topic,partition}`: records between the group's position and the
  partition's end, and `halfway_partition_caught_up{...}` (0 while a replay runs);
- `halfway_tasks_in_memory{group}`: task states the process holds;
- `halfway_steps_by_status{group,status}`, `halfway_oldest_unknown_step_seconds{group}`:
  computed from the states at scrape time (a scrape costs O(tasks held), nothing else does);
- `halfway_steps_settled_total{group,outcome,source}`: settlements folded;
- `halfway_model_question_seconds{result}`, `halfway_tool_call_seconds{tool,result}`: latency
  of each model question and each provider call, as histograms, and
  `halfway_model_questions_waiting`: questions queued for one of the decider's model slots;
- the gateway's `halfway_webhooks_answered_total{provider,status}` and
  `halfway_webhooks_serving`.
"""

from __future__ import annotations

import os
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

import prometheus_client
from prometheus_client import REGISTRY, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from halfway import log
from halfway.core.fold import StepStatus
from halfway.settings import SettingsError, number_from_env

METRICS_PORT_ENV = "HALFWAY_METRICS_PORT"
METRICS_HOST_ENV = "HALFWAY_METRICS_HOST"

MODEL_QUESTIONS = Histogram("halfway_model_question_seconds", "One model question, end to end",
                            ["result"], buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60,
                                                 120))
MODEL_QUESTIONS_WAITING = Gauge("halfway_model_questions_waiting",
                                "Questions waiting for a model slot (decider)")
# The gateway: each webhook's answer, by provider (`unknown` for a name it does not serve: a
# caller's path must not make new series) and HTTP status; and the requests it serves now.
WEBHOOKS_ANSWERED = prometheus_client.Counter(
    "halfway_webhooks_answered", "Webhooks answered by the gateway", ["provider", "status"])
WEBHOOKS_SERVING = Gauge("halfway_webhooks_serving", "Webhooks the gateway is serving now")
TOOL_CALLS = Histogram("halfway_tool_call_seconds", "One provider call (an attempt)",
                       ["tool", "result"], buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                                                    1, 2.5, 5, 10, 30))


class _FollowersCollector(Collector):
    """Gauges read from every live follower of this process when Prometheus scrapes."""

    def __init__(self) -> None:
        self.followers: weakref.WeakSet[Any] = weakref.WeakSet()

    def collect(self) -> Iterable[Metric]:
        # A follower here has `group`, `states`, `partition_lags()` and its counts
        # (JournalFollower, or the projector). Counts of followers of one group (a test's)
        # add up.
        lag = GaugeMetricFamily("halfway_consumer_lag", "Records behind the partition's end",
                                labels=["group", "topic", "partition"])
        caught_up = GaugeMetricFamily("halfway_partition_caught_up",
                                      "1 once the partition's replay reached its end",
                                      labels=["group", "topic", "partition"])
        tasks = GaugeMetricFamily("halfway_tasks_in_memory", "Task states held",
                                  labels=["group"])
        steps = GaugeMetricFamily("halfway_steps_by_status", "Steps of the tasks held",
                                  labels=["group", "status"])
        oldest = GaugeMetricFamily("halfway_oldest_unknown_step_seconds",
                                   "Age of the oldest step that is unknown", labels=["group"])
        snapshot_age = GaugeMetricFamily(
            "halfway_snapshot_age_seconds",
            "Since this process last wrote a snapshot (-1: none yet)", labels=["group"])
        restored = GaugeMetricFamily(
            "halfway_partition_restored_offset",
            "Journal offset a partition's snapshot restored it at (absent: replayed from zero)",
            labels=["group", "partition"])
        applied_total: Counter[tuple[str, str]] = Counter()
        settled_total: Counter[tuple[str, str, str]] = Counter()
        now = datetime.now(UTC)
        for follower in list(self.followers):
            group = follower.group
            for topic, n in list(follower.applied_by_topic.items()):
                applied_total[group, topic] += n
            for (outcome, source), n in list(getattr(follower, "settled_by", {}).items()):
                settled_total[group, outcome, source] += n
            for topic, partition, behind, done in follower.partition_lags():
                lag.add_metric([group, topic, str(partition)], behind)
                caught_up.add_metric([group, topic, str(partition)], 1 if done else 0)
            states = list(follower.states.values())
            tasks.add_metric([group], len(states) + len(getattr(follower, "dormant", ())))
            counts: Counter[str] = Counter()
            oldest_s = 0.0
            for state in states:
                for step in state.steps.values():
                    counts[str(step.status)] += 1
                    if step.status is StepStatus.UNKNOWN:
                        oldest_s = max(oldest_s, (now - step.intent.at).total_seconds())
            for status in StepStatus:
                steps.add_metric([group, str(status)], counts[str(status)])
            oldest.add_metric([group], oldest_s)
            if getattr(follower, "snapshots", False):
                written_s = follower.snapshot_written_s
                snapshot_age.add_metric(
                    [group], -1.0 if written_s is None else time.monotonic() - written_s)
                for number, offset in list(follower.restored.items()):
                    restored.add_metric([group, str(number)], offset)
        applied = CounterMetricFamily("halfway_events_applied",
                                      "Records folded, by group and topic",
                                      labels=["group", "topic"])
        for labels, n in applied_total.items():
            applied.add_metric(list(labels), n)
        settled = CounterMetricFamily("halfway_steps_settled", "Step settlements folded",
                                      labels=["group", "outcome", "source"])
        for labels, n in settled_total.items():
            settled.add_metric(list(labels), n)
        yield from (applied, settled, lag, caught_up, tasks, steps, oldest, snapshot_age,
                    restored)


_COLLECTOR = _FollowersCollector()
REGISTRY.register(_COLLECTOR)


def watch(follower: Any) -> None:
    """Report this follower's gauges while it lives."""
    _COLLECTOR.followers.add(follower)


def timed(histogram: Histogram, **labels: str) -> Callable[[str, float], None]:
    """A recorder: `record(result, seconds)` with the fixed labels."""
    def record(result: str, seconds: float) -> None:
        histogram.labels(**labels, result=result).observe(seconds)
    return record


def serve_from_env(port: int | None = None) -> int | None:
    """Serve /metrics on `port` (or HALFWAY_METRICS_PORT); None: not configured. Returns the
    port it listens on (0 picks a free one)."""
    if port is None:
        if not os.environ.get(METRICS_PORT_ENV, "").strip():
            return None
        port = int(number_from_env(METRICS_PORT_ENV, 0, whole=True, high=65535))
    host = os.environ.get(METRICS_HOST_ENV, "127.0.0.1")
    try:
        server, _thread = start_http_server(port, addr=host)
    except OSError as exc:  # in use, or an address this machine does not have
        raise SettingsError(f"cannot serve metrics on {host}:{port}: {exc.strerror or exc}") \
            from None
    bound = server.server_address[1]
    log.get("halfway.metrics").info("metrics listening", url=f"http://{host}:{bound}/metrics")
    return bound
