"""What users read: three states in words, and JSON logs with the ids bound."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest

from halfway import log
from halfway.contract import Outcome, SettlementSource
from halfway.core import fold
from halfway.render import step_line, task_summary
from tests.factories import Stamper


def test_unknown_reads_as_unknown_with_the_reference_and_the_next_check_never_failed() -> None:
    s = Stamper("renewal-8812")
    log_ = [s.started(), s.intended(3), s.attempted(3, 1),
            s.settled(3, Outcome.UNKNOWN, attempt=1, reason="no reply within 5 s")]
    line = step_line(fold(log_).step(3))
    assert line.startswith("unknown, being checked")
    assert "renewal-8812:3" in line
    assert "the harness is checking" in line
    check = s.checked(3, next_in=timedelta(seconds=2))
    line = step_line(fold([*log_, check]).step(3))
    assert f"next check at {check.next_check_at:%H:%M:%S}Z" in line
    assert "fail" not in line.lower()
    line = step_line(fold([*log_, s.checked(3, next_in=None)]).step(3))
    assert "an operator must resolve it" in line


def test_done_and_not_done_read_with_evidence_and_proof() -> None:
    s = Stamper("t-1")
    base = [s.started(), s.intended(1), s.attempted(1, 1)]
    done = step_line(fold([*base, s.settled(1, Outcome.DONE, evidence={"charge_id": "ch_9"})])
                     .step(1))
    assert done.startswith("done:")
    assert "charge_id=ch_9" in done
    refused = step_line(fold([*base, s.settled(1, Outcome.NOT_DONE, reason="HTTP 402")]).step(1))
    assert refused.startswith("not done, safe to try again")
    assert "HTTP 402" in refused


def test_task_summary_lists_a_steps_states_in_order() -> None:
    s = Stamper("t-1")
    state = fold([s.started(), s.intended(1), s.attempted(1, 1),
                  s.settled(1, Outcome.UNKNOWN, attempt=1),
                  s.settled(1, Outcome.DONE, source=SettlementSource.LOOKUP)])
    (step,) = task_summary(state)["steps"]
    assert step["states"] == ["unknown", "done"]
    assert step["evidence"] == {"charge_id": "ch_1"}


def test_logs_are_json_lines_with_task_and_step_ids_bound(
    capsys: pytest.CaptureFixture[str],
) -> None:
    log.configure(json=True)
    try:
        with log.bound(task_id="renewal-8812", step_id="renewal-8812:3"):
            log.get("test").info("attempt sent", attempt=1)
        log.get("test").info("outside")
        inside, outside = (json.loads(line) for line in capsys.readouterr().err.splitlines())
    finally:
        log.configure()
    assert inside["task_id"] == "renewal-8812"
    assert inside["step_id"] == "renewal-8812:3"
    assert inside["event"] == "attempt sent"
    assert inside["attempt"] == 1
    assert "task_id" not in outside


class _Writes:
    """A stand-in stderr that keeps each write separately."""

    def __init__(self) -> None:
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


@pytest.mark.parametrize("json_lines", [True, False])
def test_each_log_line_is_one_write(monkeypatch: pytest.MonkeyPatch, json_lines: bool) -> None:
    """Processes that share a terminal or a file (`halfway dev &` and `halfway start` in the
    quickstart) interleave whole writes: a line written in two pieces (print's text, then its
    newline) let another process's line land in between, glued to the end of ours."""
    stderr = _Writes()
    monkeypatch.setattr("sys.stderr", stderr)
    log.configure(json=json_lines)
    try:
        log.get("test").info("one line", detail="x" * 100)
        log.get("test").warning("another\nwith a newline inside")
    finally:
        monkeypatch.undo()
        log.configure()
    assert len(stderr.writes) == 2, stderr.writes
    assert all(w.endswith("\n") for w in stderr.writes), stderr.writes
