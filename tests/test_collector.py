"""Every long-running command sets the cycle collector's thresholds (`halfway.collector`)."""

from __future__ import annotations

import gc
import subprocess
import sys
from collections.abc import Iterator

import pytest
import typer.main

from halfway import cli, collector

TUNED = (collector.YOUNG_ALLOCATIONS, collector.MIDDLE_EVERY, collector.FULL_EVERY_AT_LEAST)


@pytest.fixture
def thresholds() -> Iterator[list[tuple[int, ...]]]:
    """What the collector's thresholds were when a command reached its service; the test
    process's own are put back after."""
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)  # CPython's defaults, whatever the test process had
    seen: list[tuple[int, ...]] = []
    try:
        yield seen
    finally:
        gc.set_threshold(*before)


@pytest.mark.parametrize("service", ["worker", "projector", "gateway"])
def test_run_tunes_the_collector_before_the_service_starts(
        service: str, thresholds: list[tuple[int, ...]], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cli, "_run_service",
                        lambda *args: thresholds.append(gc.get_threshold()))
    command = typer.main.get_command(cli.app)
    with pytest.raises(SystemExit) as exit_:
        command.main(["run", service], standalone_mode=True)
    assert exit_.value.code == 0
    assert thresholds == [TUNED]


# Runs the installed `halfway` script's entry (or `python -m halfway`) in a fresh interpreter
# and prints the collector's thresholds at the moment `halfway.cli` starts being imported.
_SPY = """
import gc, importlib.abc, runpy, sys
from importlib.metadata import entry_points
entry = sys.argv[1]
seen = []
class Spy(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "halfway.cli":
            seen.append(gc.get_threshold())
sys.meta_path.insert(0, Spy())
sys.argv = ["halfway", "--help"]
try:
    if entry == "script":
        entry_points(group="console_scripts")["halfway"].load()()
    else:
        runpy.run_module("halfway", run_name="__main__", alter_sys=True)
except SystemExit as exit_:
    assert exit_.code in (0, None), exit_.code
print("frozen", gc.get_freeze_count() > 0)
print("thresholds", seen)
"""


@pytest.mark.parametrize("entry", ["script", "module"])
def test_the_command_tunes_the_collector_before_importing_itself_and_freezes_after(
        entry: str) -> None:
    """Importing the command's modules builds ~100,000 lasting objects: with CPython's
    thresholds the collector walked them ~140 times for nothing, and the first young
    collection after (halfway/__main__.py). Tuned before, frozen after."""
    done = subprocess.run([sys.executable, "-c", _SPY, entry], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Usage" in done.stdout  # the command ran
    assert done.stdout.splitlines()[-2:] == ["frozen True", f"thresholds {[TUNED]}"]
