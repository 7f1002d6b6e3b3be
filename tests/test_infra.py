"""The local infrastructure: `python -m halfway.infra` against the real broker and PostgreSQL.

Tests marked `broker` use the shared services (started by `infra/dev test`, or by the first test
here) and leave them running for the rest of the suite. The unmarked ones need no service: they
check the generated broker config, the environment overrides, and that `up` refuses a port held
by a stranger, each in a throwaway HALFWAY_HOME on ports nobody uses.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest
from aiokafka.admin import AIOKafkaAdminClient

from halfway.infra import ComponentStatus, kafka, postgres
from halfway.settings import KafkaSettings

# A first `up` on a machine with an empty Maven cache downloads the broker; later ones take
# seconds. Both stay under pytest's 300 s per-test timeout.
CLI_TIMEOUT_S = 280.0
# Any single await on a running service: a hang fails the test, it never blocks CI.
WAIT_S = 30.0

LINE = re.compile(r"^(?P<component>kafka|postgres): (?P<state>[a-z ]+?)(?: in [\d.]+ s)?"
                  r"(?: \((?P<facts>.*)\))?$")


async def cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """Run `python -m halfway.infra ARGS`; return (exit code, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "halfway.infra", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    try:
        out, err = await asyncio.wait_for(proc.communicate(), CLI_TIMEOUT_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def parse(stdout: str) -> dict[str, tuple[str, dict[str, str]]]:
    """{component: (state, {fact: value})} from the CLI's one line per component."""
    result: dict[str, tuple[str, dict[str, str]]] = {}
    for line in stdout.splitlines():
        match = LINE.match(line)
        assert match, f"unexpected output line: {line!r}"
        facts = dict(fact.split("=", 1) for fact in (match["facts"] or "").split() if "=" in fact)
        result[match["component"]] = (match["state"], facts)
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
async def stranger() -> AsyncIterator[int]:
    """A port on which something that is neither our broker nor our database listens."""
    server = await asyncio.start_server(lambda _r, w: w.close(), "127.0.0.1", 0)
    async with server:
        yield server.sockets[0].getsockname()[1]


def scratch_env(tmp_path: Path, **ports: int) -> dict[str, str]:
    """A private HALFWAY_HOME and unused ports, so nothing touches the shared services."""
    env = {
        "HALFWAY_HOME": str(tmp_path / "home"),
        "HALFWAY_KAFKA_PORT": str(free_port()),
        "HALFWAY_KAFKA_CONTROLLER_PORT": str(free_port()),
        "HALFWAY_PG_PORT": str(free_port()),
    }
    env.update({name: str(value) for name, value in ports.items()})
    # External services would bypass the local start these tests are about.
    for name in ("HALFWAY_KAFKA_BOOTSTRAP", "HALFWAY_PG_DSN"):
        env[name] = ""
    return env


# --- against the real services ---------------------------------------------------------------


@pytest.mark.broker
async def test_up_twice_is_a_noop_with_the_same_pids() -> None:
    code, out, err = await cli("up")
    assert code == 0, err
    first = parse(out)
    code, out, err = await cli("up")
    assert code == 0, err
    second = parse(out)

    for name, component in (("kafka", kafka), ("postgres", postgres)):
        state, facts = second[name]
        if component.is_external():
            assert state == "external"
            continue
        assert first[name][0] in ("started", "already running")
        assert state == "already running", out
        assert facts["pid"] == first[name][1]["pid"], (first, second)
        assert component.status().pid == int(facts["pid"])


@pytest.mark.broker
async def test_status_reports_both_running() -> None:
    code, out, err = await cli("status")
    assert code == 0, err
    report = parse(out)
    for name, component in (("kafka", kafka), ("postgres", postgres)):
        state, facts = report[name]
        if component.is_external():
            assert (state, facts["answering"]) == ("external", "yes")
        else:
            assert state == "running"
            assert int(facts["pid"]) > 0
            assert facts["answering"] == "yes"
    assert report["kafka"][1]["bootstrap"] == kafka.bootstrap_servers()


@pytest.mark.broker
async def test_broker_answers_a_metadata_request() -> None:
    admin = AIOKafkaAdminClient(**KafkaSettings.from_env().client(),
                                request_timeout_ms=int(WAIT_S * 1000))
    try:
        async with asyncio.timeout(WAIT_S):
            await admin.start()
            cluster = await admin.describe_cluster()
            topics = await admin.list_topics()
    finally:
        await admin.close()
    assert isinstance(topics, list)
    assert len(cluster["brokers"]) >= 1
    if not kafka.is_external():
        (broker,) = cluster["brokers"]
        assert (broker["host"], broker["port"]) == (kafka.HOST, kafka.port())


@pytest.mark.broker
async def test_postgres_answers_select_one_on_the_dsn() -> None:
    conn = await asyncpg.connect(postgres.dsn(), timeout=WAIT_S)
    try:
        assert await conn.fetchval("select 1", timeout=WAIT_S) == 1
        assert await conn.fetchval("select current_database()", timeout=WAIT_S) == "halfway"
    finally:
        await conn.close(timeout=WAIT_S)


# --- no services needed ----------------------------------------------------------------------


async def test_up_refuses_a_kafka_port_held_by_a_stranger(tmp_path: Path, stranger: int) -> None:
    code, out, err = await cli("up", "kafka",
                               env=scratch_env(tmp_path, HALFWAY_KAFKA_PORT=stranger))
    assert code == 1, (out, err)
    assert f"127.0.0.1:{stranger} is taken by something that is not" in err
    assert "HALFWAY_KAFKA_PORT" in err
    # Refused before any work: no jars fetched, nothing formatted.
    assert not (tmp_path / "home" / "kafka" / "libs").exists()


async def test_up_refuses_a_postgres_port_held_by_a_stranger(
    tmp_path: Path, stranger: int
) -> None:
    code, out, err = await cli("up", "postgres",
                               env=scratch_env(tmp_path, HALFWAY_PG_PORT=stranger))
    assert code == 1, (out, err)
    assert f"127.0.0.1:{stranger} is taken by something that is not" in err
    assert "HALFWAY_PG_PORT" in err


async def test_status_and_down_of_nothing_report_stopped(tmp_path: Path) -> None:
    env = scratch_env(tmp_path)
    for action in ("status", "down"):
        code, out, err = await cli(action, env=env)
        assert code == 0, err
        report = parse(out)
        assert report["kafka"] == ("stopped", {"port": env["HALFWAY_KAFKA_PORT"]})
        assert report["postgres"] == ("stopped", {"port": env["HALFWAY_PG_PORT"]})


async def test_cli_rejects_an_unknown_component() -> None:
    code, _out, err = await cli("up", "zookeeper")
    assert code == 2
    assert "invalid choice" in err


def test_server_properties_use_the_dynamic_quorum_only() -> None:
    text = kafka.render_server_properties(29092, 29093, Path("/x/data"), "pw")
    props = dict(
        line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    # --standalone formatting needs the KIP-853 bootstrap servers; voters would conflict.
    assert props["controller.quorum.bootstrap.servers"] == "127.0.0.1:29093"
    assert "controller.quorum.voters" not in props
    assert props["listeners"] == "CLIENT://127.0.0.1:29092,CONTROLLER://127.0.0.1:29093"
    # Clients authenticate with SCRAM; what no ACL allows is refused.
    assert props["listener.security.protocol.map"] == (
        "CONTROLLER:SASL_PLAINTEXT,CLIENT:SASL_PLAINTEXT")
    assert props["listener.name.client.sasl.enabled.mechanisms"] == "SCRAM-SHA-512"
    assert props["allow.everyone.if.no.acl.found"] == "false"
    assert props["super.users"] == "User:admin"
    assert props["log.dirs"] == "/x/data"
    assert props["auto.create.topics.enable"] == "false"
    assert props["offsets.topic.num.partitions"] == "1"
    assert props["group.initial.rebalance.delay.ms"] == "0"
    for key, value in props.items():
        if key.endswith(("replication.factor", "min.isr")):
            assert value == "1", key
    # Java .properties have no end-of-line comments: a stray "#" would become part of a value.
    assert not any("#" in value for value in props.values())


def test_addresses_follow_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HALFWAY_KAFKA_BOOTSTRAP", "HALFWAY_PG_DSN", "HALFWAY_KAFKA_PORT",
                 "HALFWAY_PG_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert kafka.bootstrap_servers() == "127.0.0.1:19092"
    assert not kafka.is_external()
    assert postgres.dsn() == "postgresql://postgres@127.0.0.1:15432/halfway"
    assert not postgres.is_external()

    monkeypatch.setenv("HALFWAY_KAFKA_PORT", "29092")
    monkeypatch.setenv("HALFWAY_PG_PORT", "25432")
    assert kafka.bootstrap_servers() == "127.0.0.1:29092"
    assert postgres.dsn("other") == "postgresql://postgres@127.0.0.1:25432/other"

    monkeypatch.setenv("HALFWAY_KAFKA_BOOTSTRAP", "broker.example:9092")
    monkeypatch.setenv("HALFWAY_PG_DSN", "postgresql://app:secret@db.example:5432/halfway")
    assert kafka.is_external()
    assert kafka.bootstrap_servers() == "broker.example:9092"
    assert postgres.is_external()
    assert postgres.dsn() == "postgresql://app:secret@db.example:5432/halfway"
    assert postgres.dsn("postgres") == "postgresql://app:secret@db.example:5432/postgres"
    assert postgres.redacted(postgres.dsn()) == "postgresql://app:***@db.example:5432/halfway"


def test_a_bad_port_is_a_clear_error(monkeypatch: pytest.MonkeyPatch,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    from halfway.infra.__main__ import main

    monkeypatch.setenv("HALFWAY_KAFKA_PORT", "90000")
    with pytest.raises(ValueError, match="HALFWAY_KAFKA_PORT=90000 is outside"):
        kafka.port()
    assert main(["status", "kafka"]) == 1
    assert "HALFWAY_KAFKA_PORT=90000 is outside" in capsys.readouterr().err


def test_status_line_format() -> None:
    line = ComponentStatus("kafka", "started", pid=7, start_s=4.123,
                           details={"bootstrap": "127.0.0.1:19092"}).line()
    assert line == "kafka: started in 4.12 s (pid=7 bootstrap=127.0.0.1:19092)"
    assert parse(line)["kafka"] == ("started", {"pid": "7", "bootstrap": "127.0.0.1:19092"})
    assert ComponentStatus("postgres", "stopped").line() == "postgres: stopped"


def test_a_new_cluster_id_is_never_read_as_an_option(monkeypatch: pytest.MonkeyPatch) -> None:
    """The storage tool takes `--cluster-id ID`: an id starting with "-" (one in 64 of the
    base64 ids) failed a fresh machine's format. Such a draw is drawn again, as Kafka does."""
    import uuid as uuid_module

    from halfway.infra import kafka

    draws = iter([b"\xf8" + bytes(15), b"\x01" * 16])  # "+A..." -> "-A..." in URL-safe base64
    monkeypatch.setattr(kafka.uuid, "uuid4",
                        lambda: uuid_module.UUID(bytes=next(draws)))
    assert kafka.new_cluster_id() == "AQEBAQEBAQEBAQEBAQEBAQ"  # the second draw


def test_setup_leaves_the_projects_bytecode_compiled() -> None:
    """Processes started from an editable install import compiled modules, even where
    PYTHONDONTWRITEBYTECODE keeps every import from writing them (0.2 s of a service's start
    here otherwise): `infra/dev setup` compiles what is stale."""
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(["bash", str(root / "infra/dev"), "setup"], capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert done.returncode == 0, done.stderr
    stale = []
    for source in sorted([*(root / "schemas").rglob("*.py"), *(root / "services").rglob("*.py")]):
        cached = Path(importlib.util.cache_from_source(str(source)))
        # The header of a timestamp-checked .pyc: magic, flags, the source's mtime and size.
        header = cached.read_bytes()[:16] if cached.exists() else b""
        st = source.stat()
        if header[8:16] != (int(st.st_mtime).to_bytes(4, "little")
                            + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little")):
            stale.append(str(source.relative_to(root)))
    assert not stale, f"not compiled, or compiled from another version: {stale[:5]}"
