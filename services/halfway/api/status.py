"""Tasks and steps in words, for people (`halfway tasks`, `halfway status`) and for `--json`.

Pure functions of what `halfway.api.queries` returns. Three states, never two: a step is done
(with its evidence), not done and safe to try again (with the reason), or unknown and being
checked (with the reference to quote and when the next check comes). An unknown step is never
called failed: the effect may well have happened, and saying otherwise invites a second one.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from halfway.render import one_line

CELL_CHARS_MAX = 60  # a table cell; the JSON has everything
EVIDENCE_ITEMS_MAX = 8

STEP_WORDS = {
    "done": "done",
    "not_done": "not done, safe to try again",
    "unknown": "unknown, being checked",
    "in_flight": "in flight",
    "intended": "decided, not yet attempted",
}
UNKNOWN_UNCHECKED = "unknown, an operator must resolve it"

TASK_WORDS = {
    "needs_attention": "needs attention: an operator must resolve a step",
    "unknown": "waiting: a step is unknown and being checked",
    "requested": "requested",
    "running": "running",
    "rejected": "rejected",
    "succeeded": "succeeded",
    "failed": "failed",
    "compensated": "compensated: its effects were undone",
}


def at(value: datetime | None, now: datetime | None = None) -> str:
    """A time in UTC, to the second; with `now`, also how far away it is."""
    if value is None:
        return "-"
    text = value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    if now is None:
        return text
    seconds = round((value - now).total_seconds())
    return f"{text} ({'in ' + _span(seconds) if seconds >= 0 else _span(-seconds) + ' ago'})"


def _span(seconds: int) -> str:
    minutes, s = divmod(seconds, 60)
    hours, m = divmod(minutes, 60)
    if hours:
        return f"{hours}h {m}m"
    return f"{m}m {s}s" if m else f"{s}s"


def evidence_text(evidence: Mapping[str, Any] | None) -> str:
    items = list((evidence or {}).items())
    text = ", ".join(f"{k}={v}" for k, v in items[:EVIDENCE_ITEMS_MAX])
    return text + (", …" if len(items) > EVIDENCE_ITEMS_MAX else "")


def step_state(step: Mapping[str, Any]) -> str:
    """The step's state in words (STEP_WORDS; an unknown nobody will check says so)."""
    status = step["status"]
    if status == "unknown" and step.get("next_check_at") is None and step.get("needs_attention"):
        return UNKNOWN_UNCHECKED
    return STEP_WORDS.get(status, status)


def next_check(value: datetime | None, now: datetime | None = None) -> str:
    """When the next check comes; one in the past is due (run as soon as the checker can)."""
    if value is not None and now is not None and value < now:
        return f"{at(value)} (due {_span(round((now - value).total_seconds()))} ago)"
    return at(value, now)


def step_detail(step: Mapping[str, Any], now: datetime | None = None, *,
                with_next_check: bool = True) -> str:
    """What the state rests on: the evidence, the reason, or what the checks found so far."""
    status = step["status"]
    if status == "done":
        return f"evidence {evidence_text(step.get('evidence'))}"
    if status == "not_done":
        return step.get("reason") or "no reason recorded"
    if status == "unknown":
        parts = [step.get("reason") or "no reply"]
        if step.get("checks"):
            parts.append(f"{step['checks']} checks, last found {step.get('last_check') or '-'}")
        if step.get("next_check_at") is not None:
            if with_next_check:
                parts.append(f"next check at {next_check(step['next_check_at'], now)}")
        elif step.get("needs_attention"):
            parts.append("no further check is planned")
        else:
            parts.append("the harness is checking")
        parts.append("do not start another one")
        return "; ".join(parts)
    if status == "in_flight":
        text = f"attempt {step.get('attempts', 0)} sent, no reply yet"
        if with_next_check and step.get("next_check_at") is not None:
            text += f"; next check at {next_check(step['next_check_at'], now)}"
        return text
    return ""


def step_sentence(step: Mapping[str, Any], now: datetime | None = None) -> str:
    """One line a person (or a model) cannot misread, reference included."""
    what = f"{step['tool']} {step.get('subject') or ''}".strip()
    return (f"{step_state(step)}: {what} (reference {step['key']}); "
            f"{step_detail(step, now)}").rstrip("; ")


def _cell(value: Any, chars_max: int | None = CELL_CHARS_MAX) -> str:
    # One line per row and no control characters, whatever the data holds; made printable
    # before measuring, so that the columns line up as shown.
    text = one_line(value)
    if chars_max is None or len(text) <= chars_max:
        return text
    return text[:chars_max - 1] + "…"


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], *,
          last_unbounded: bool = False) -> str:
    """Plain aligned columns; with `last_unbounded` the last one is never cut (it ends the
    line, so its length disturbs no other column)."""
    last = len(headers) - 1
    cells = [[_cell(v, None if last_unbounded and i == last else CELL_CHARS_MAX)
              for i, v in enumerate(row)] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip()
                     for line in [list(headers), *cells])


def tasks_table(rows: Sequence[Mapping[str, Any]], now: datetime | None = None) -> str:
    """`halfway tasks`: one line per task (rows from `queries.list_tasks`)."""
    if not rows:
        return "no tasks"
    return table(
        ["TASK", "STATE", "DONE", "NOT DONE", "UNKNOWN", "NEXT CHECK", "UPDATED"],
        [[r["task_id"], r["state"], r["step_counts"]["done"], r["step_counts"]["not_done"],
          r["step_counts"]["unknown"], next_check(r.get("next_check_at"), now),
          at(r["updated_at"])]
         for r in rows])


def status_table(task: Mapping[str, Any], now: datetime | None = None) -> str:
    """`halfway status TASK`: the task, then every step with its state and what it rests on."""
    head = [one_line(f"task {task['task_id']}: {TASK_WORDS.get(task['state'], task['state'])}")]
    times = [f"started {at(task.get('started_at'))}"]
    if task.get("finished_at") is not None:
        times.append(f"finished {at(task['finished_at'])}")
    times.append(f"updated {at(task['updated_at'])}")
    details = [", ".join(times)]
    if task.get("aborted_reason") and task.get("finished_at") is None:
        details.append(f"called off by {task.get('aborted_by')}: {task['aborted_reason']}; "
                       f"steps in flight settle, and a saga undoes what is done")
    if task.get("summary"):
        details.append(f"summary: {task['summary']}")
    if task.get("attention"):
        details.append(f"needs attention: {task['attention']}")
    if task.get("model_unavailable"):
        details.append(f"the model is unavailable: {task['model_unavailable']}")
    if task.get("model_questions"):
        details.append(f"model: {task['model_questions']} question(s), "
                       f"{task.get('tokens_in', 0)} tokens in, {task.get('tokens_out', 0)} out")
    for refused in task.get("not_accepted") or []:
        tool = f" ({refused['tool']})" if refused.get("tool") else ""  # a settlement names none
        details.append(f"not accepted: {refused.get('type')} {refused.get('step_id')}{tool}: "
                       f"{refused.get('reason')}")
    head += ["  " + one_line(d) for d in details]  # each one line, whatever the data holds
    steps = task.get("steps") or []
    if not steps:
        return "\n".join([*head, "no steps yet"])
    body = table(
        ["STEP", "TOOL", "STATE", "REFERENCE", "ATTEMPTS", "NEXT CHECK", "EVIDENCE OR REASON"],
        [[s["n"], f"{s['tool']} {s.get('subject') or ''}".strip(), step_state(s), s["key"],
          s["attempts"], next_check(s.get("next_check_at"), now),
          step_detail(s, with_next_check=False)] for s in steps],
        last_unbounded=True)
    notes = []
    for s in steps:
        if s.get("contradictions"):
            notes.append(f"step {s['n']}: {s['contradictions']} later report(s) disagreed with "
                         f"this outcome (a contradiction, kept in the journal): check "
                         f"{s['key']} with the provider")
        if s.get("waiting"):
            notes.append(f"step {s['n']}: waiting: {s['waiting']}")
        undo = s.get("compensation")
        if undo is not None:
            notes.append(f"step {s['n']} undo: {_undo_words(undo, now)} "
                         f"(reference {undo['key']})")
    notes = [one_line(n) for n in notes]
    return "\n".join([*head, "", body, *(["", *notes] if notes else [])])


def _undo_words(undo: Mapping[str, Any], now: datetime | None) -> str:
    state = STEP_WORDS.get(undo["status"], undo["status"])
    if undo["status"] == "done":
        return f"{state}; evidence {evidence_text(undo.get('evidence'))}"
    if undo.get("needs_attention"):
        # Nobody checks it any more: not "being checked", and the operator's move is named.
        state = "unknown" if undo["status"] == "unknown" else state
        words = f"{state}; {undo['reason']}" if undo.get("reason") else state
        return (f"{words}; no further check is planned: an operator must say whether it "
                f"happened (halfway resolve {undo['key']} done|not_done) or undo it by hand")
    words = f"{state}; {undo['reason']}" if undo.get("reason") else state
    if undo["status"] == "unknown":
        return f"{words}; next check {next_check(undo.get('next_check_at'), now)}"
    return words


# --- JSON ----------------------------------------------------------------------------------------


def jsonable(value: Any) -> Any:
    """Plain JSON values: times as ISO 8601 strings, everything else as it is."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Mapping):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value


def tasks_json(rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """`halfway tasks --json` and `GET /api/tasks`: each row, with its state in words."""
    return [{**jsonable(r), "state_words": TASK_WORDS.get(r["state"], r["state"])} for r in rows]


def task_json(task: Mapping[str, Any]) -> dict[str, Any]:
    """`halfway status --json` and `GET /api/tasks/{id}`: each step also says what it is."""
    out = jsonable(task)
    out["state_words"] = TASK_WORDS.get(task["state"], task["state"])
    for step, source in zip(out.get("steps") or [], task.get("steps") or [], strict=True):
        step["state_words"] = step_state(source)
        step["says"] = step_sentence(source)
    return out


# JSON escapes C0 controls itself; DEL and C1 (0x9b is CSI to some terminals) it leaves raw.
_JSON_CONTROLS = {c: f"\\u{c:04x}" for c in (0x7F, *range(0x80, 0xA0))}


def as_json(value: Any) -> str:
    """Indented JSON for a terminal: no control character raw (escaped, the same value)."""
    return json.dumps(jsonable(value), indent=2, ensure_ascii=False).translate(_JSON_CONTROLS)
