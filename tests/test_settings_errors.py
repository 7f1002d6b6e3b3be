"""A setting halfway cannot use stops a service at once with one line naming the variable, the
value and what it takes (exit 2): never a traceback, never a service that runs on a guess, and
nothing left open behind it."""

from __future__ import annotations

import asyncio
import os
import sys
import uuid

import pytest

from halfway.settings import (
    SettingsError,
    charge_timeout_s,
    partitions,
    travel_completes_within_s,
)
from halfway.tools.registry import builtin_tools

BAD = [
    ("HALFWAY_PARTITIONS", "abc", "is not a whole number"),
    ("HALFWAY_PARTITIONS", "0", "1..1000"),
    ("HALFWAY_REPLICATION_FACTOR", "two", "is not a whole number"),
    ("HALFWAY_CHARGE_TIMEOUT_S", "soon", "is not a number"),
    ("HALFWAY_CHARGE_TIMEOUT_S", "nan", "above 0"),
    ("HALFWAY_CHARGE_TIMEOUT_S", "-1", "above 0"),
    ("HALFWAY_METRICS_PORT", "99999", "--metrics-port"),  # checked by the option itself
    # Read by the journal's follower, and checked before the service waits for the broker and
    # its topics (this test's prefix has none: a late check would wait here until the timeout).
    ("HALFWAY_SNAPSHOT_EVERY_S", "-5", "must be at least 0"),
    ("HALFWAY_SEAL_AFTER_S", "soon", "is not a number"),
    ("HALFWAY_EVENT_LOOP", "trio", "is not one of uvloop, asyncio"),
]


@pytest.mark.parametrize(("name", "value", "says"), BAD)
async def test_a_service_started_with_a_bad_setting_says_which_and_exits_2(
        name: str, value: str, says: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "halfway", "run", "worker",
        env=dict(os.environ) | {name: value,
                                "HALFWAY_TOPIC_PREFIX": f"no-topics-{uuid.uuid4().hex[:8]}."},
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 60)
    text = out.decode(errors="replace")
    assert proc.returncode == 2, text
    assert name in text, text
    assert says in text, text
    assert "Traceback" not in text, text
    assert "Unclosed" not in text, text  # nothing was made that is then left open


def test_unset_or_blank_settings_take_their_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HALFWAY_PARTITIONS", " ")
    monkeypatch.delenv("HALFWAY_CHARGE_TIMEOUT_S", raising=False)
    assert partitions() == 6
    assert charge_timeout_s() == 5.0
    monkeypatch.setenv("HALFWAY_CHARGE_TIMEOUT_S", "0.25")
    assert charge_timeout_s() == 0.25
    monkeypatch.setenv("HALFWAY_CHARGE_TIMEOUT_S", "0")
    with pytest.raises(SettingsError, match="HALFWAY_CHARGE_TIMEOUT_S"):
        charge_timeout_s()


def test_a_provider_bound_is_660_s_by_default_and_off_turns_it_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    name = "HALFWAY_TRAVEL_COMPLETES_WITHIN_S"
    monkeypatch.delenv(name, raising=False)
    assert travel_completes_within_s() == 660.0
    monkeypatch.setenv(name, "30")
    assert travel_completes_within_s() == 30.0
    for off in ("off", "none", "0", " OFF "):
        monkeypatch.setenv(name, off)
        assert travel_completes_within_s() is None
    monkeypatch.setenv(name, "soon")
    with pytest.raises(SettingsError, match=name):
        travel_completes_within_s()


def test_the_builtin_tools_take_their_bounds_from_the_environment(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HALFWAY_TRAVEL_COMPLETES_WITHIN_S", "30")
    monkeypatch.setenv("HALFWAY_CHARGE_COMPLETES_WITHIN_S", "off")
    bounds = {tool.spec.name: tool.spec.completes_within_s for tool in builtin_tools()}
    assert bounds.pop("charge_customer") is None
    assert set(bounds.values()) == {30.0}, bounds
