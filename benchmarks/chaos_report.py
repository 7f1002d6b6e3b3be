"""The chaos run's report: what it counted besides the oracle, and how it is shown.

`render` is the text `benchmarks/chaos.py` prints; `Report.to_json()` is its `--json`.
`write_findings` writes, for every duplicate, lost, wrong or stuck task, its journal as a
timeline, the ledger's charges for its invoice and the service log lines that name it: what the
engineer fixing it needs first.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.chaos_oracle import Verdict, charge_invoice, charge_key, reason_group

from halfway.contract import CompensationIntended, CompensationSettled, Event, StepSettled

FINDINGS_SHOWN = 10  # per category, printed; all of them are in findings.txt
LOG_LINES_PER_TASK = 40  # service log lines quoted per finding in findings.txt
LOG_LINE_CHARS = 400
REASONS_SHOWN = 6  # most frequent settlement reasons per outcome
ATTENTION_SHOWN = 5  # tasks per needs-attention reason written to findings.txt, for context
EVENT_FIELD_CHARS = 200
# What a harness that could not reach the provider says (halfway.tools.http's NotSent): the
# refused connections that the relay's shut windows caused, as the services saw them.
REFUSED_MARK = "ConnectError"
ASSIGNED = '"partitions assigned"'  # the follower's log event for an assignment


@dataclass
class Report:
    """What a run measured; `to_json()` is what --json prints."""

    config: dict[str, Any]
    run_dir: str
    verdict: Verdict | None = None
    figures: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"run_dir": self.run_dir, "config": self.config,
                               **self.figures, "error": self.error}
        if self.verdict is not None:
            out |= self.verdict.to_json()
        return out


# The fold's notes on a late write by a process that slept or lost its partitions: the log
# took the write and fenced it (it changed nothing). Any other note is worth a look.
FENCED_NOTES = ("void: ", "not accepted: ", "which the log did not take")


def is_fenced(note: str) -> bool:
    return any(marker in note for marker in FENCED_NOTES)


def fault_counts(requests: list[dict[str, Any]], names: Mapping[str, dict[str, Any]],
                 ) -> dict[str, Any]:
    """Which armed faults paysim applied, from its request log. A delay, 5xx or decline shapes
    an execution only (a replay or a 409 ignores it); a 429 or a lost reply applies to any."""
    hits: Counter[str] = Counter()
    ignored: Counter[str] = Counter()
    for r in requests:
        fault = r.get("fault")
        if not fault:
            continue
        name = _fault_name(fault, names)
        executed = not r.get("replayed") and r.get("status") not in (400, 409)
        if "lose_reply" in fault or fault.get("status") == 429 or executed:
            hits[name] += 1
        else:
            ignored[name] += 1
    return {"applied": dict(sorted(hits.items())), "no_effect": dict(sorted(ignored.items())),
            "charge_requests": len(requests),
            "replayed": sum(1 for r in requests if r.get("replayed")),
            "answered_409": sum(1 for r in requests if r.get("status") == 409)}


def _fault_name(fault: dict[str, Any], names: Mapping[str, dict[str, Any]]) -> str:
    for name, action in names.items():
        if action == fault:
            return name
    return json.dumps(fault, sort_keys=True)


def webhook_counts(log: dict[str, Any]) -> dict[str, Any]:
    attempts = log.get("attempts", [])
    finals = [a for a in attempts if a.get("final")]
    delivered = [a for a in finals if a.get("status") is not None
                 and (200 <= a["status"] < 300 or a["status"] == 409)]
    return {"attempts": len(attempts), "deliveries": len(finals),
            "second_deliveries": sum(1 for a in finals if a.get("delivery") == 2),
            "delivered": len(delivered),
            "given_up": len(finals) - len(delivered),
            "failed_attempts": sum(1 for a in attempts if not a.get("final")),
            "pending_at_end": log.get("pending", 0)}


def settlement_counts(events: Iterable[Event]) -> dict[str, Any]:
    """Step settlements by source and outcome, why steps were settled not_done and unknown
    (grouped, the most frequent first), and the attempts refused a connection; undo
    settlements by source and outcome, and the undos intended again under a successor key."""
    by: Counter[str] = Counter()
    undos: Counter[str] = Counter()
    why: dict[str, Counter[str]] = {"not_done": Counter(), "unknown": Counter()}
    refused = successors = 0
    for e in events:
        if isinstance(e, CompensationSettled):
            undos[f"{e.source}/{e.outcome}"] += 1
        elif isinstance(e, CompensationIntended):
            successors += e.generation > 1
        elif isinstance(e, StepSettled):
            by[f"{e.source}/{e.outcome}"] += 1
            refused += REFUSED_MARK in (e.reason or "")
            if str(e.outcome) in why:
                why[str(e.outcome)][reason_group(e.reason or "")] += 1
    return {"by_source_outcome": dict(sorted(by.items())), "connection_refused": refused,
            "undos_by_source_outcome": dict(sorted(undos.items())),
            "undos_sent_again": successors,
            **{f"{outcome}_reasons": dict(counts.most_common(REASONS_SHOWN))
               for outcome, counts in why.items()}}


def assignments(run_dir: Path, kinds: Iterable[str]) -> dict[str, int]:
    """How often each kind of service logged "partitions assigned": each is a rebalance (or a
    start) that moved partitions to it."""
    return {kind: sum(assignments_logged(log) for log in run_dir.glob(f"{kind}-*.log"))
            for kind in kinds}


def assignments_logged(log_path: Path) -> int:
    """How many times a service's log says "partitions assigned" (a start or a rebalance)."""
    try:
        with log_path.open(errors="replace") as f:
            return sum(1 for line in f if ASSIGNED in line)
    except FileNotFoundError:
        return 0


def write_findings(path: Path, verdict: Verdict, events: Mapping[str, list[Event]],
                   invoices: Mapping[str, str], ledger: list[dict[str, Any]],
                   guards: Mapping[str, list[Any]], run_dir: Path) -> None:
    """Every finding with the task's journal, the subject guard's records for its invoice, the
    ledger's charges for it and the service log lines that name the task."""
    flagged: dict[str, list[str]] = {}
    for category, findings in (("duplicate", verdict.duplicates), ("lost", verdict.lost),
                               ("wrong", verdict.wrong), ("stuck", verdict.stuck)):
        for f in findings:
            flagged.setdefault(f.task_id or "(no task)", []).append(f"{category}: {f.what}")
            for other in f.others:
                flagged.setdefault(other, []).append(f"{category} (with {f.task_id}): {f.what}")
    # Not findings, but what an engineer asks next: why did these need a person?
    for reason, ids in verdict.needs_attention.items():
        for task_id in sorted(ids)[:ATTENTION_SHOWN]:
            flagged.setdefault(task_id, []).append(f"needs attention: {reason}")
    # Not findings either: the fold's own notes, and reports it kept but did not believe.
    notes = [f"contradiction {f.task_id}: {f.what}" for f in verdict.contradictions]
    notes += [f"fold anomaly {f.task_id}: {f.what}" for f in verdict.anomalies]
    if not flagged and not notes:
        path.write_text("no findings\n")
        return
    lines_by_task = log_lines(run_dir, [t for t in flagged if t != "(no task)"])
    out: list[str] = [*notes]
    for task_id, whats in flagged.items():
        out.append(f"=== {task_id}")
        out += [f"  {w}" for w in whats]
        out.append("  journal:")
        out += [f"    {line}" for line in timeline(events.get(task_id, []))]
        invoice = invoices.get(task_id)
        out.append(f"  subject guard (invoice:{invoice}):")
        out += [f"    {line}" for line in guard_lines(guards.get(f"invoice:{invoice}", []))]
        charges = [c for c in ledger if charge_invoice(c) == invoice
                   or (charge_key(c) or "").startswith(task_id + ":")]
        out.append(f"  ledger (invoice {invoice}):")
        out += [f"    {c.get('id')} {c.get('status')} key={charge_key(c)} "
                f"created={c.get('created')}" for c in charges] or ["    (no charge)"]
        out.append("  service logs:")
        out += [f"    {line}" for line in lines_by_task.get(task_id, [])] or ["    (none)"]
    path.write_text("\n".join(out) + "\n")


def timeline(events: list[Event]) -> list[str]:
    """One line per journal event: seconds since the task's first event, type, what it says."""
    if not events:
        return ["(no events)"]
    t0 = events[0].at
    out = []
    for e in events:
        fields = {k: v for k, v in e.model_dump(mode="json").items()
                  if k not in ("type", "event_id", "task_id", "at", "schema_version", "input",
                               "allowed_tools", "policy", "decided_by")}
        text = " ".join(f"{k}={json.dumps(v)[:EVENT_FIELD_CHARS]}" for k, v in fields.items()
                        if v not in (None, [], {}, False))
        out.append(f"+{(e.at - t0).total_seconds():8.3f}s {e.type} {text}")
    return out


def guard_lines(records: list[Any]) -> list[str]:
    """The guards topic's claims and releases on one subject, in log order."""
    if not records:
        return ["(none)"]
    return [f"{r.at.isoformat()} {r.type} step={r.step_id}"
            + (f" release={r.release}" if getattr(r, "release", None) else "")
            + (f" claim_id={r.claim_id}" if getattr(r, "claim_id", None) else "")
            + f" event_id={r.event_id}" for r in records]


def log_lines(run_dir: Path, task_ids: list[str]) -> dict[str, list[str]]:
    """The service log lines that name each task (by its quoted id or a step id of it)."""
    needles = {t: (f'"{t}"', f'"{t}:') for t in task_ids}
    found: dict[str, list[str]] = {t: [] for t in task_ids}
    for log in sorted(run_dir.glob("*.log")):
        with log.open(errors="replace") as f:
            for line in f:
                for task_id, (whole, step) in needles.items():
                    if (whole in line or step in line) and \
                            len(found[task_id]) < LOG_LINES_PER_TASK:
                        found[task_id].append(f"{log.stem}: {line.strip()[:LOG_LINE_CHARS]}")
    return found


def render(report: Report) -> str:
    """The figures, for people: counts first, then what happened, then the first findings."""
    j = report.to_json()
    out = [f"chaos run: {report.run_dir}"]
    if report.verdict is None:
        out.append(f"no verdict: {report.error}")
        return "\n".join(out)
    v = report.verdict
    sec = j.get("seconds", {})
    lat = j["unknown_to_settled_s"]

    def s(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f} s"

    out += [
        f"tasks            {v.tasks} requested ({j['pairs']} pairs on one invoice), "
        f"{j['publish_failed']} could not be published, {j['publish_retries']} re-sends",
        f"duplicates       {len(v.duplicates)}",
        f"lost             {len(v.lost)}",
        f"wrong            {v.wrong_tasks}",
        f"stuck            {len(v.stuck)}",
        f"needs attention  {v.needs_attention_tasks}",
    ]
    for reason, ids in sorted(v.needs_attention.items(), key=lambda kv: -len(kv[1])):
        out.append(f"  {len(ids):5d}  {reason}")
    out += [
        f"final states     {dict(sorted(v.final_states.items()))}",
        f"unknown->settled p50 {s(lat['p50'])}  p99 {s(lat['p99'])}  max {s(lat['max'])}  "
        f"({lat['count']} steps; {v.unknown_never_settled} unknown never settled)",
        f"ledger           {v.charges_succeeded} succeeded, {v.charges_failed} failed charges",
        *([f"trips            {j['trips']}"] if j.get("trips", {}).get("requested") else []),
        f"contradictions   {len(v.contradictions)}   fold anomalies {len(v.anomalies)} "
        f"({sum(1 for f in v.anomalies if is_fenced(f.what))} of them late writes the log "
        f"fenced: void withdrawals, refused decisions and their attempts)",
        f"faults applied   {j['faults']['applied']}",
        f"  ({j['faults']['charge_requests']} charge requests, {j['faults']['replayed']} "
        f"replayed, {j['faults']['answered_409']} answered 409; rules hit without effect: "
        f"{j['faults']['no_effect']})",
        f"webhooks         {j['webhooks']}",
        f"refused windows  {j['refused_windows']}; attempts refused a connection: "
        f"{j['settlements']['connection_refused']}",
        f"settlements      {j['settlements']['by_source_outcome']}",
        f"  not_done why   {j['settlements']['not_done_reasons']}",
        f"  unknown why    {j['settlements']['unknown_reasons']}",
        f"undo settlements {j['settlements']['undos_by_source_outcome']}; undos sent again "
        f"under a new key (the last proven to have done nothing): "
        f"{j['settlements']['undos_sent_again']}",
        f"kills            {j['kills']}  broker kills {j['broker_kills']} "
        f"(down {j['broker_down_s']} s)",
        f"pauses           {j['pauses']}",
        f"assignments      {j['assignments']} (\"partitions assigned\", starts included)",
        f"unexpected exits {len(j['unexpected_exits'])} "
        f"({sum(1 for e in j['unexpected_exits'] if e['broker_down'])} while the broker was "
        f"down) {dict(Counter(e['slot'].rsplit('-', 1)[0] for e in j['unexpected_exits']))}",
        f"journal          {j['journal']}  outcomes invalid {j['outcomes_invalid']}",
        f"drained          {j['drained']}   outcomes caught up {j['outcomes_settled']}",
        f"seconds          {sec}",
        f"cpu seconds      {j.get('cpu_s')} (services: those stopped by the end; not the broker)",
    ]
    for name, findings in (("duplicates", v.duplicates), ("lost", v.lost),
                           ("wrong", v.wrong), ("stuck", v.stuck),
                           ("contradictions", v.contradictions),
                           ("fold anomalies", v.anomalies)):
        if findings:
            out.append(f"{name} (first {FINDINGS_SHOWN}; all in findings.txt and --json):")
            out += [f"  {f.task_id}: {f.what}" for f in findings[:FINDINGS_SHOWN]]
    if report.error:
        out.append(f"note: {report.error}")
    out.append(f"logs, chaos.jsonl, findings.txt: {report.run_dir}")
    return "\n".join(out)
