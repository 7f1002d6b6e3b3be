"""A service at start: a stop while it waits for the broker is a normal stop, and what waiting
would not mend (a bad bootstrap, credentials the broker refuses, a principal without the rights
its kind needs) stops it at once with one line saying what to fix (exit 2), never the password,
never a traceback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiokafka.errors import GroupAuthorizationFailedError

from halfway.contract.topics import ALL_TOPICS
from halfway.journal import ensure_topics
from halfway.journal.acls import READS, WRITES
from halfway.journal.admin import KafkaAccessError, access_refused, check_access, delete_topics
from halfway.settings import KafkaSettings, SettingsError, bootstrap_addresses
from tests.test_cli_hostile import halfway, one_line, plain_line

WAIT_S = 60.0  # for a cold interpreter to import everything and log its first wait
STOP_WAIT_S = 30.0  # a generous bound on a stop, as a test timeout: no timing is asserted
NOTHING_LISTENS = "127.0.0.1:9"
DOES_NOT_RESOLVE = "not.a.host.invalid:9092"
GATEWAY_ENV = {"HALFWAY_PAYSIM_WEBHOOK_SECRET": "whsec_startup", "HALFWAY_GATEWAY_PORT": "0"}
REPO = Path(__file__).resolve().parents[1]
CREDENTIALS_ENV = tuple(f"HALFWAY_KAFKA_{name}" for name in (
    "SECURITY_PROTOCOL", "SASL_MECHANISM", "USERNAME", "PASSWORD", "PASSWORD_FILE", "SSL_CAFILE",
    "SSL_CERTFILE", "SSL_KEYFILE"))


def environ(prefix: str, **extra: str) -> dict[str, str]:
    """This process's environment without any Kafka credentials, on topics of `prefix`."""
    base = {k: v for k, v in os.environ.items() if k not in CREDENTIALS_ENV}
    return base | GATEWAY_ENV | {"HALFWAY_TOPIC_PREFIX": prefix, "HALFWAY_LOG_FORMAT": "json",
                                 "PYTHONUNBUFFERED": "1"} | extra


def own_prefix() -> str:
    return f"startup-{uuid.uuid4().hex[:8]}."


# --- a stop while waiting for the broker ---------------------------------------------------------


async def logged(proc: asyncio.subprocess.Process, event: str) -> str:
    """stderr up to and including the first JSON log line of `event`."""
    assert proc.stderr is not None
    seen: list[str] = []
    try:
        async with asyncio.timeout(WAIT_S):
            while True:
                raw = await proc.stderr.readline()
                if not raw:
                    raise AssertionError(f"exited before logging {event!r}:\n{''.join(seen)}")
                line = raw.decode(errors="replace")
                seen.append(line)
                with contextlib.suppress(ValueError, AttributeError):
                    if json.loads(line).get("event") == event:
                        return "".join(seen)
    except TimeoutError:
        raise AssertionError(f"did not log {event!r}:\n{''.join(seen)}") from None


SERVICES = [["run", s] for s in ("gateway", "decider", "executor", "reconciler", "outcomes",
                                 "worker", "projector")]
SERVICES.append(["mcp", "serve", "--transport", "http", "--port", "0"])


@pytest.mark.parametrize(("args", "signum", "bootstrap"), [
    *((args, signal.SIGTERM, NOTHING_LISTENS) for args in SERVICES),
    (["run", "gateway"], signal.SIGINT, NOTHING_LISTENS),
    (["run", "reconciler"], signal.SIGINT, NOTHING_LISTENS),
    (["run", "projector"], signal.SIGINT, NOTHING_LISTENS),
    (["run", "gateway"], signal.SIGTERM, DOES_NOT_RESOLVE),
])
async def test_a_service_waiting_for_the_broker_stops_on_a_signal_as_it_would_serving(
        args: list[str], signum: signal.Signals, bootstrap: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "halfway", *args,
        env=environ(own_prefix(), HALFWAY_KAFKA_BOOTSTRAP=bootstrap),
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    try:
        before = await logged(proc, "waiting for the broker")
        proc.send_signal(signum)
        try:
            rest = await asyncio.wait_for(proc.stderr.read(), STOP_WAIT_S)
            await asyncio.wait_for(proc.wait(), STOP_WAIT_S)
        except TimeoutError:
            raise AssertionError(f"halfway {' '.join(args)} went on after {signum.name}:\n"
                                 f"{before}") from None
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    err = before + rest.decode(errors="replace")
    assert proc.returncode == 0, err  # a normal stop, as when serving
    assert "Traceback" not in err, err


# --- a bad bootstrap -----------------------------------------------------------------------------


@pytest.mark.parametrize("bootstrap", [
    "::::", "127.0.0.1:notaport", "127.0.0.1", "broker:0", "broker:65536", "::1:9092",
    "[::1]", "[not-v6]:9092", "a:1,,b:2", "a:1,", "bro ker:9092", "broker:٩٠٩٢",
])
async def test_a_bootstrap_that_is_not_host_port_is_one_line_naming_the_variable(
        bootstrap: str) -> None:
    code, err = await halfway("run", "reconciler", environ=environ(
        own_prefix(), HALFWAY_KAFKA_BOOTSTRAP=bootstrap))
    one_line(code, err, "HALFWAY_KAFKA_BOOTSTRAP=")
    assert "is not host:port" in err, err
    with pytest.raises(SettingsError, match="HALFWAY_KAFKA_BOOTSTRAP"):
        bootstrap_addresses(bootstrap)


def test_a_bootstrap_list_is_read_as_aiokafka_reads_it() -> None:
    assert bootstrap_addresses(" kafka-1:9094, 10.0.0.7:1,[::1]:65535,[fe80::1%eth0]:9092 ") == [
        ("kafka-1", 9094), ("10.0.0.7", 1), ("::1", 65535), ("fe80::1%eth0", 9092)]


# --- credentials the broker refuses --------------------------------------------------------------


@pytest.fixture(scope="module")
async def deployment(kafka_settings: KafkaSettings) -> AsyncIterator[KafkaSettings]:
    """Topics of this module's own, with their ACLs, as the admin."""
    settings = kafka_settings.with_prefix(own_prefix())
    await ensure_topics(settings, ALL_TOPICS)
    yield settings
    await delete_topics(settings, ALL_TOPICS)


def password_of(settings: KafkaSettings, kind: str) -> str:
    return str(settings.as_kind(kind).security["sasl_plain_password"])


@pytest.mark.broker
@pytest.mark.parametrize("service", ["reconciler", "gateway", "worker", "projector"])
@pytest.mark.parametrize(("user", "mechanism", "words"), [
    ("reconciler", "SCRAM-SHA-512", "refused user reconciler over SCRAM-SHA-512"),
    ("nobody", "SCRAM-SHA-512", "refused user nobody over SCRAM-SHA-512"),
    ("reconciler", "PLAIN", "does not offer the SASL mechanism PLAIN (user reconciler)"),
])
async def test_credentials_the_broker_refuses_stop_the_service_with_one_line(
        deployment: KafkaSettings, service: str, user: str, mechanism: str,
        words: str) -> None:
    password = f"not-it-{uuid.uuid4().hex}"
    code, err = await halfway("run", service, environ=environ(
        deployment.topic_prefix, HALFWAY_KAFKA_BOOTSTRAP=deployment.bootstrap,
        HALFWAY_KAFKA_USERNAME=user, HALFWAY_KAFKA_PASSWORD=password,
        HALFWAY_KAFKA_SASL_MECHANISM=mechanism, HALFWAY_PG_SCHEMA="startup_never_used"))
    assert code == 2, err
    assert "Traceback" not in err, err
    line = plain_line(err)  # beside aiokafka's own log line of the refusal
    assert words in line, line
    variable = "HALFWAY_KAFKA_SASL_MECHANISM" if mechanism == "PLAIN" else "HALFWAY_KAFKA_PASSWORD"
    assert variable in line, line
    assert password not in err


@pytest.mark.broker
async def test_a_dev_credentials_file_the_broker_refuses_is_named(
        deployment: KafkaSettings, tmp_path: Path) -> None:
    (tmp_path / "kafka").mkdir()
    password = f"stale-{uuid.uuid4().hex}"
    (tmp_path / "kafka" / "credentials.json").write_text(
        json.dumps({"passwords": {"reconciler": password}}))
    code, err = await halfway("run", "reconciler", environ=environ(
        deployment.topic_prefix, HALFWAY_KAFKA_BOOTSTRAP=deployment.bootstrap,
        HALFWAY_HOME=str(tmp_path)))
    assert code == 2, err
    line = plain_line(err)
    assert "refused user reconciler" in line, line
    assert str(tmp_path / "kafka" / "credentials.json") in line, line
    assert password not in err


@pytest.mark.broker
@pytest.mark.parametrize("command", [["abort", "t-1", "--reason", "because"],
                                     ["resolve", "t-1:1", "not_done", "--reason", "because"],
                                     ["replay", "--task", "t-1"]])
async def test_an_operators_command_the_broker_refuses_says_so_not_that_no_broker_answers(
        deployment: KafkaSettings, command: list[str]) -> None:
    """aiokafka says "Unable to bootstrap" for refused credentials too: the command asks."""
    password = f"not-it-{uuid.uuid4().hex}"
    code, err = await halfway(*command, environ=environ(
        deployment.topic_prefix, HALFWAY_KAFKA_BOOTSTRAP=deployment.bootstrap,
        HALFWAY_KAFKA_USERNAME="operator", HALFWAY_KAFKA_PASSWORD=password))
    assert code == 2, err
    line = plain_line(err)
    assert "refused user operator over SCRAM-SHA-512" in line, line
    assert "no Kafka broker answers" not in err
    assert password not in err


# --- a principal without the rights its kind needs -----------------------------------------------


@pytest.mark.broker
@pytest.mark.parametrize(("service", "user", "words"), [
    ("reconciler", "gateway", ["User:gateway may not WRITE topic {p}journal",
                               "READ consumer group {p}reconciler", "which a reconciler needs"]),
    ("gateway", "caller", ["User:caller may not WRITE topic {p}webhooks, which a gateway needs"]),
    ("projector", "gateway", ["READ consumer group {p}projector", "which a projector needs"]),
    ("worker", "executor", ["READ consumer group {p}decider", "which a decider needs"]),
])
async def test_a_service_run_as_another_kind_says_what_it_may_not_do(
        deployment: KafkaSettings, service: str, user: str, words: list[str]) -> None:
    password = password_of(deployment, user)
    code, err = await halfway("run", service, environ=environ(
        deployment.topic_prefix, HALFWAY_KAFKA_BOOTSTRAP=deployment.bootstrap,
        HALFWAY_KAFKA_USERNAME=user, HALFWAY_KAFKA_PASSWORD=password,
        HALFWAY_PG_SCHEMA="startup_never_used"))
    assert code == 2, err
    assert "Traceback" not in err, err
    line = plain_line(err)
    for expected in words:
        assert expected.format(p=deployment.topic_prefix) in line, line
    assert "docs/security.md" in line, line
    assert password not in err


@pytest.mark.broker
async def test_every_kind_has_the_rights_it_is_checked_for(deployment: KafkaSettings) -> None:
    for kind in sorted(set(WRITES) | set(READS)):
        await check_access(deployment.as_kind(kind), kind)
    with pytest.raises(KafkaAccessError, match="may not WRITE topic"):
        await check_access(deployment.as_kind("caller"), "gateway")


def test_a_right_refused_while_running_is_one_line_too() -> None:
    """What the check at start did not ask (a right taken away since): `halfway run` says it
    in the same words, without the password."""
    settings = KafkaSettings("127.0.0.1:1", "p.", 1, security={
        "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": "gateway",
        "sasl_plain_password": "s3cret-password"})
    refused = access_refused(settings, "projector", GroupAuthorizationFailedError("p.projector"))
    assert isinstance(refused, SettingsError)  # the CLI's one line, exit 2
    line = str(refused)
    assert line.startswith("the Kafka principal User:gateway lacks a right a projector needs on "
                           "its consumer group (GroupAuthorizationFailedError: p.projector)"), line
    assert "docs/security.md" in line
    assert "s3cret-password" not in line


# --- the table in docs/security.md is the ACLs' --------------------------------------------------


def test_the_documented_table_of_rights_is_the_acls() -> None:
    words = {"dead letters": "deadletters"}
    every = {s.suffix for s in ALL_TOPICS}
    documented: dict[str, tuple[set[str], set[str]]] = {}
    for row in (REPO / "docs" / "security.md").read_text().splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        kind = re.fullmatch(r"`(\w+)`", cells[0]) if len(cells) == 4 else None
        if kind is None or kind[1] not in set(WRITES) | set(READS):
            continue

        def topics(cell: str) -> set[str]:
            if cell == "all but snapshots":
                return every - {"snapshots"}
            return {words.get(t.strip(), t.strip()) for t in cell.split(",")}

        documented[kind[1]] = (topics(cells[2]), topics(cells[3]))
    assert documented == {kind: ({s.suffix for s in WRITES.get(kind, ())},
                                 {s.suffix for s in READS.get(kind, ())})
                          for kind in set(WRITES) | set(READS)}
