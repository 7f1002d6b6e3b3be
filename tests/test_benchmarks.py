"""Small runs of the benchmarks that issue 12's figures come from, so that they keep running.

Each runs its script end to end against the real broker, at a size CI can afford, and checks
what it reports besides times: a restart from snapshots (the decider's, the outcomes
publisher's, the projector's) reads them and loses no partition; the side-by-side table has a
row of figures for each halfway system and the CPU per process. No time is asserted: the
figures are for people (`benchmarks/*.py`, at their real sizes).
"""

from __future__ import annotations

import asyncio
import math
import re
import sys
import uuid
from pathlib import Path

import pytest
from benchmarks import recovery

from halfway.settings import KafkaSettings

ROOT = Path(__file__).resolve().parents[1]
SCRIPT_TIMEOUT_S = 240.0  # one benchmark script's small run

# Figures of a whole deployment, and a restart that must keep its partitions: the machine alone.
pytestmark = pytest.mark.load


@pytest.mark.broker
@pytest.mark.parametrize("service", recovery.SERVICES)
async def test_recovery_restarts_from_snapshots_without_losing_partitions(
        infrastructure: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        service: str) -> None:
    monkeypatch.setattr(recovery, "LOG_DIR", tmp_path)
    r = await recovery.one(KafkaSettings.from_env(), service, 1200)
    assert math.isfinite(r["cold_s"]), r
    assert math.isfinite(r["warm_s"]), r
    assert r["restored"] == recovery.JOURNAL.partitions, r  # every one from its snapshot
    # The last restored after the start and before the first start's bound (log clock: wall).
    assert 0 < r["all_restored_s"] < recovery.WAIT_S, r
    assert r["revoked"] == 0, r
    writer = "first" if service == "outcomes" else "cold"  # the start that wrote snapshots
    written = (tmp_path / f"{service}-1200-{writer}.log").read_text()
    assert written.count('"snapshot written"') >= 6
    if service == "outcomes":
        cold = (tmp_path / "outcomes-1200-cold.log").read_text()
        assert '"snapshot' not in cold  # the restart from zero reads and writes none


async def run_script(name: str, *args: str) -> str:
    """`benchmarks/NAME ARGS`' output, once it exited 0 (killed past SCRIPT_TIMEOUT_S)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, str(ROOT / "benchmarks" / name), *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, cwd=ROOT)
    try:
        async with asyncio.timeout(SCRIPT_TIMEOUT_S):
            out = (await proc.communicate())[0].decode(errors="replace")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode == 0, out[-3000:]
    return out


@pytest.mark.broker
async def test_side_by_side_prints_a_row_for_each_halfway_system_and_variant(
        infrastructure: None, tmp_path: Path) -> None:
    out = await run_script(
        "side_by_side.py", "--skip", "restate,dbos", "--rounds", "1", "--tasks", "4",
        "--callers", "2", "--inflight", "8", "--floor-samples", "20", "--cache", str(tmp_path),
        "--variant", "same:HALFWAY_LOG_LEVEL=ERROR")  # an A/B's second worker set, in the run
    number = r"[\d,.]+"
    for system in ("halfway", "halfway-w", "w-same"):
        row = rf"^{re.escape(system)}\s+{number}\s+{number}\s+\S+\s+{number}\s+{number}\s+{number}$"
        assert re.search(row, out, re.MULTILINE), out[-3000:]
    assert re.search(r"^restate\s+not run: skipped", out, re.MULTILINE), out[-3000:]
    assert re.search(r"^  halfway-w worker [\d.]+, reconciler [\d.]+", out, re.MULTILINE), \
        out[-3000:]
    for phase in ("sequential", "2 callers", "8 in flight"):  # each phase's CPU of its own
        assert re.search(rf"^  halfway-w\s+{phase}\s+[\d.]+ \(worker [\d.]+, reconciler ",
                         out, re.MULTILINE), out[-3000:]
    assert "floor: journal append (acks=all) p50" in out


@pytest.mark.broker
async def test_broker_cost_splits_idle_from_per_task_cpu(infrastructure: None,
                                                         tmp_path: Path) -> None:
    out = await run_script("broker_cost.py", "--skip", "halfway", "--tasks", "3",
                           "--idle-s", "0.5", "--cache", str(tmp_path))
    number = r"[\d.]+"
    for line in (rf"^no deployment, CPU ms/s: broker {number}$",
                 rf"^halfway-w idle, CPU ms/s: broker {number}, worker {number}, "
                 rf"reconciler {number}$",
                 rf"^halfway-w 3 sequential tasks in {number} s \({number} ms each\), CPU ms "
                 rf"per task: broker {number}, worker {number}, reconciler {number}$"):
        assert re.search(line, out, re.MULTILINE), out[-3000:]
    assert not re.search(r"^halfway ", out, re.MULTILINE), out[-3000:]  # skipped


@pytest.mark.broker
async def test_the_projectors_restart_restores_every_partition(
        infrastructure: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import projector as bench

    monkeypatch.setattr(bench, "LOG_DIR", tmp_path)
    await bench.restart_cost(KafkaSettings.from_env(), 1200, 60,
                             f"bench_{uuid.uuid4().hex[:8]}_restart")
    rows = {line[:34].strip(): line for line in capsys.readouterr().out.splitlines()}
    partitions = recovery.JOURNAL.partitions
    assert f"{partitions}/{partitions}" in rows["restart from snapshots"], rows
    for zero in ("restart from zero, snapshots off", "restart from zero, snapshots on"):
        assert f"0/{partitions}" in rows[zero], rows
    # The restart from snapshots read them, and folded only what came after.
    log = Path(rows["restart from snapshots"].rsplit("(", 1)[1].rstrip(")"))
    text = await asyncio.to_thread(log.read_text)
    assert text.count('"partition restored from its snapshot"') == partitions
