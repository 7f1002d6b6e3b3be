"""The event loop long-running processes run on: uvloop's by default (halfway.eventloop),
asyncio's own with HALFWAY_EVENT_LOOP=asyncio, and a clear error for anything else."""

from __future__ import annotations

import asyncio

import pytest

from halfway import eventloop
from halfway.settings import SettingsError


async def loop_module() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


def test_services_run_on_uvloop_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HALFWAY_EVENT_LOOP", raising=False)
    assert eventloop.run(loop_module()).startswith("uvloop")
    monkeypatch.setenv("HALFWAY_EVENT_LOOP", " UVLOOP ")
    assert eventloop.run(loop_module()).startswith("uvloop")


def test_asyncio_on_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HALFWAY_EVENT_LOOP", "asyncio")
    assert eventloop.run(loop_module()).startswith("asyncio")


def test_another_loop_is_refused_before_anything_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HALFWAY_EVENT_LOOP", "trio")
    started = loop_module()
    with pytest.raises(SettingsError, match="HALFWAY_EVENT_LOOP='trio' is not one of uvloop"):
        eventloop.run(started)
    started.close()  # never scheduled
