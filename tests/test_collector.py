"""Every long-running command sets the cycle collector's thresholds (`halfway.collector`)."""

from __future__ import annotations

import gc
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

