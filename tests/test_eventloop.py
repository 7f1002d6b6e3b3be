"""A service runs on uvloop unless HALFWAY_EVENT_LOOP says asyncio (halfway.eventloop)."""

from __future__ import annotations

import asyncio
import sys

import pytest
import uvloop

from halfway import eventloop
from halfway.settings import SettingsError


async def _loop_type() -> type:
    return type(asyncio.get_running_loop())


@pytest.mark.parametrize(("choice", "expected"), [
    (None, uvloop.Loop), ("auto", uvloop.Loop), (" UVLOOP ", uvloop.Loop),
    ("asyncio", asyncio.SelectorEventLoop)])
def test_the_loop_is_the_one_asked_for(monkeypatch: pytest.MonkeyPatch, choice: str | None,
                                       expected: type) -> None:
    if choice is None:
        monkeypatch.delenv("HALFWAY_EVENT_LOOP", raising=False)
    else:
        monkeypatch.setenv("HALFWAY_EVENT_LOOP", choice)
    assert issubclass(eventloop.run(_loop_type()), expected)


def test_uvloop_asked_for_but_missing_is_a_settings_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HALFWAY_EVENT_LOOP", "uvloop")
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import fails
    with pytest.raises(SettingsError, match="uvloop is not installed"):
        eventloop.run(_loop_type())
    monkeypatch.setenv("HALFWAY_EVENT_LOOP", "auto")  # auto falls back to asyncio's
    assert issubclass(eventloop.run(_loop_type()), asyncio.SelectorEventLoop)
