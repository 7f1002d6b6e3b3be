"""A real Apache Kafka 4.x broker for development and tests: KRaft, one combined broker+controller
node on loopback, run from Maven Central jars (no Docker, no tarball, no shell scripts).

Theory of operation (`up`, under a per-component file lock):

1. `HALFWAY_KAFKA_BOOTSTRAP` set: an external broker; only check that it answers.
2. Our broker already running (pid file, process alive, command line names our
   server.properties) and answering: nothing to do ("already running"). Alive but not answering
   yet (another `up` is starting it): wait for it within the readiness budget.
3. Otherwise: the client and controller ports must be free (a foreign listener is an error, not
   something to talk to); the jars are fetched by `mvn` only when the libs folder is missing or
   infra/kafka/pom.xml changed (sha256 stamp); the storage is formatted only when the data folder
   has no meta.properties; then `kafka.Kafka` starts detached in its own session and we poll a
   metadata request until it answers, failing with the log tails if the JVM exits first.

Security (docs/security.md): clients connect over SASL_PLAINTEXT with SCRAM-SHA-512, and the
`StandardAuthorizer` refuses whatever no ACL allows (`allow.everyone.if.no.acl.found=false`).
One principal per kind of process (`halfway.settings.KAFKA_KINDS`), with a random password each,
generated on the first `up` into `kafka/credentials.json` (0600; a later `up` adds kinds it
lacks and keeps the rest). `admin` is the super user. On every start, after the broker is up:

4. the SCRAM users are created or updated (`halfway.infra.scram`) over the controller listener,
   which authenticates the admin with SASL/PLAIN from server.properties (0600): the same path
   on a fresh machine and on a used one whose storage was formatted before SCRAM, so a used
   machine is upgraded in place, its topics kept, with no reformat;
5. readiness is a metadata request as the admin, over SCRAM;
6. the ACLs of the default topic prefix (`HALFWAY_TOPIC_PREFIX`, `halfway.`) are created
   (`halfway.journal.acls`; other prefixes get theirs with their topics).

A broker that is already running is never restarted by `up`. One started by an older halfway
(plaintext, no ACLs) is reported with a note: `infra/dev down kafka` then `up` restarts it with
SCRAM and ACLs, data kept; until then clients keep connecting to it in plaintext, because no
credentials file exists.

`down` sends SIGTERM to the broker's process group (a controlled shutdown), waits a bounded time,
then SIGKILLs it. Data stays: the next `up` reuses the formatted storage and its topics.

Format uses `--standalone` (a KIP-853 dynamic quorum), which pairs with
`controller.quorum.bootstrap.servers`; mixing it with the static `controller.quorum.voters`
fails with "Cannot set kraft.version to 0 if KIP-853 configuration is present" (KAFKA-18987).
The voter's controller endpoint is written into the metadata log at format time, so the
controller port is recorded in format.json and a later change of it is refused.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from halfway import settings
from halfway.infra import ComponentStatus, InfraError, paths
from halfway.settings import HOST

# The first start on a 2-core machine measured ~4 s; 90 s leaves room for a loaded CI machine.
READY_TIMEOUT_S = 90.0
READY_POLL_S = 0.25
# One metadata round trip to a local broker takes milliseconds; more than this means "not yet".
PROBE_TIMEOUT_S = 5.0
# A single-node controlled shutdown takes a few seconds; after this the group is SIGKILLed.
STOP_TIMEOUT_S = 60.0
KILL_TIMEOUT_S = 10.0
# A fresh machine with an empty ~/.m2 downloads ~45 MB of jars from Maven Central.
MVN_TIMEOUT_S = 900.0
FORMAT_TIMEOUT_S = 120.0
JAVA_VERSION_TIMEOUT_S = 30.0
JAVA_MAJOR_MIN = 17  # the Kafka 4.x broker needs Java 17 (KIP-1013)

# Heap sized for a 2-core, shared CI machine, not the scripts' default 1 GiB; GC flags are those
# of kafka-run-class.sh (KAFKA_JVM_PERFORMANCE_OPTS).
JVM_HEAP = ["-Xms256m", "-Xmx512m"]
JVM_FLAGS = [
    "-server",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:InitiatingHeapOccupancyPercent=35",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-XX:MaxInlineLevel=15",
    # Fail fast and visibly rather than limp along in GC thrash.
    "-XX:+ExitOnOutOfMemoryError",
    "-Djava.awt.headless=true",
]
# StorageTool is a short-lived CLI: kafka-run-class.sh gives tools 256 MB.
JVM_TOOL_HEAP = ["-Xmx256m"]

# Started brokers whose Popen objects must outlive `up` (a collected Popen whose process still
# runs emits a ResourceWarning); the processes themselves are detached either way.
_spawned: list[subprocess.Popen[bytes]] = []


# Addresses come from halfway.settings, the one place that reads the environment.
port = settings.kafka_port
controller_port = settings.kafka_controller_port
is_external = settings.kafka_is_external
bootstrap_servers = settings.kafka_bootstrap


@dataclass(frozen=True)
class Layout:
    home: Path
    libs: Path
    data: Path
    logs: Path
    properties: Path
    pid_file: Path
    format_record: Path
    credentials: Path
    lock: Path

    @property
    def classpath(self) -> str:
        return f"{self.libs}/*"


def layout() -> Layout:
    home = paths.kafka_home()
    return Layout(
        home=home,
        libs=home / "libs",
        data=home / "data",
        logs=home / "logs",
        properties=home / "server.properties",
        pid_file=home / "kafka.pid",
        format_record=home / "format.json",
        credentials=settings.kafka_dev_credentials_file(),
        lock=paths.halfway_home() / "kafka.lock",
    )


def render_server_properties(client_port: int, ctl_port: int, data_dir: Path,
                             admin_password: str) -> str:
    """server.properties for one combined broker+controller on loopback (tech.md 1.3), with
    SCRAM for clients and ACLs (it holds the admin's password: written 0600).

    Java .properties files have no end-of-line comments, so every comment is on its own line.
    """
    return f"""\
# Generated by halfway.infra.kafka on every start; edits here are overwritten.
process.roles=broker,controller
node.id=1
# Dynamic (KIP-853) quorum: pairs with `StorageTool format --standalone`. Never add
# controller.quorum.voters as well.
controller.quorum.bootstrap.servers={HOST}:{ctl_port}
listeners=CLIENT://{HOST}:{client_port},CONTROLLER://{HOST}:{ctl_port}
advertised.listeners=CLIENT://{HOST}:{client_port},CONTROLLER://{HOST}:{ctl_port}
inter.broker.listener.name=CLIENT
controller.listener.names=CONTROLLER
listener.security.protocol.map=CONTROLLER:SASL_PLAINTEXT,CLIENT:SASL_PLAINTEXT
# Clients: SCRAM-SHA-512 only (the password never crosses the wire). The broker talks to itself
# as the admin.
listener.name.client.sasl.enabled.mechanisms={SCRAM}
sasl.mechanism.inter.broker.protocol={SCRAM}
listener.name.client.scram-sha-512.sasl.jaas.config={_jaas(SCRAM_MODULE, admin_password)}
# The controller listener: PLAIN with the admin's password from this file, because KRaft
# controllers cannot take SCRAM (its credentials live in the metadata they serve), and it is
# how `up` creates the SCRAM users, the admin's included, on a fresh or a used machine.
listener.name.controller.sasl.enabled.mechanisms=PLAIN
sasl.mechanism.controller.protocol=PLAIN
listener.name.controller.plain.sasl.jaas.config={_jaas(PLAIN_MODULE, admin_password)}
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=false
super.users=User:{ADMIN}
log.dirs={data_dir}
num.partitions=1
# Topics are part of the contract: services create them explicitly, a typo must not create one.
auto.create.topics.enable=false
# One node: every internal topic has one replica.
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
# Defaults are 50 partitions each; 1 makes the first group join and first transaction cheap.
offsets.topic.num.partitions=1
transaction.state.log.num.partitions=1
# Default 3000 ms: every first consumer-group join in a test would wait that long.
group.initial.rebalance.delay.ms=0
# Two cores: the default thread counts only add contention.
num.network.threads=2
num.io.threads=2
"""


ADMIN = "admin"
SCRAM = "SCRAM-SHA-512"
SCRAM_MODULE = "org.apache.kafka.common.security.scram.ScramLoginModule"
PLAIN_MODULE = "org.apache.kafka.common.security.plain.PlainLoginModule"
PASSWORD_BYTES = 24  # 192 random bits, URL-safe: no quoting issue in JAAS or JSON


def _jaas(module: str, admin_password: str) -> str:
    extra = f' user_{ADMIN}="{admin_password}"' if module == PLAIN_MODULE else ""
    return f'{module} required username="{ADMIN}" password="{admin_password}"{extra};'


def ensure_credentials(lay: Layout) -> dict[str, str]:
    """The password of every principal kind: read from the credentials file, with any kind it
    lacks added (random); the file is replaced atomically and is readable by its owner only."""
    existing = settings.kafka_dev_credentials(lay.credentials) or {}
    passwords = {kind: existing.get(kind) or secrets.token_urlsafe(PASSWORD_BYTES)
                 for kind in settings.KAFKA_KINDS}
    if passwords != existing:
        _write_private(lay.credentials, json.dumps({"passwords": passwords}, indent=2) + "\n")
    return passwords


def _write_private(path: Path, text: str) -> None:
    """Write `text` to `path` so that no moment exists when others may read it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(path.name + ".new")
    staging.unlink(missing_ok=True)
    fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    staging.replace(path)


def runs_secured(lay: Layout) -> bool:
    """Whether the running broker was started with SCRAM and ACLs (by this version of `up`)."""
    try:
        return "sasl.enabled.mechanisms" in lay.properties.read_text()
    except OSError:
        return False


def admin_security(lay: Layout) -> dict[str, object]:
    """How `up` and `status` talk to the local broker: as the admin when it runs secured."""
    if not runs_secured(lay):
        return {}
    passwords = settings.kafka_dev_credentials(lay.credentials) or {}
    if ADMIN not in passwords:
        raise InfraError(f"the broker runs with SCRAM but {lay.credentials} has no admin "
                         "password: `infra/dev down kafka` and `up` write a new one")
    return settings.dev_security(ADMIN, passwords)


def _provision(lay: Layout, pid: int, passwords: dict[str, str], timeout_s: float) -> None:
    """Create or update every kind's SCRAM user once the controller listens (retried: the
    controller accepts it only once it leads its quorum); fail early if the broker exits."""
    from halfway.infra import scram

    deadline = time.monotonic() + timeout_s
    last = "the controller port never opened"
    while time.monotonic() < deadline:
        if not paths.pid_alive(pid):
            raise InfraError(f"the Kafka broker (pid {pid}) exited while starting\n"
                             f"{_log_tails(lay)}")
        if paths.port_open(controller_port()):
            try:
                paths.run_coroutine(lambda: scram.upsert_users(
                    HOST, controller_port(), ADMIN, passwords[ADMIN], passwords))
                return
            except Exception as exc:  # not leading yet, or a real refusal: reported at the end
                last = f"{type(exc).__name__}: {exc}"
        time.sleep(READY_POLL_S)
    _terminate(pid)
    lay.pid_file.unlink(missing_ok=True)
    raise InfraError(f"could not create the SCRAM users within {timeout_s:.0f} s ({last}), so "
                     f"the broker was stopped\n{_log_tails(lay)}")


def _grant_default_prefix(lay: Layout) -> str:
    """The ACLs of the default topic prefix (a used machine's topics predate them)."""
    from halfway.journal.acls import ensure_acls

    prefix = os.environ.get("HALFWAY_TOPIC_PREFIX", "halfway.")
    target = settings.KafkaSettings(bootstrap_servers(), prefix, 1, security=admin_security(lay))
    try:
        count = paths.run_coroutine(lambda: ensure_acls(target))
    except Exception as exc:
        raise InfraError(f"creating the ACLs of {prefix}* failed: {type(exc).__name__}: {exc}\n"
                         f"{_log_tails(lay)}") from None
    return f"{prefix}*:{count}"


# --- the steps of `up` ------------------------------------------------------------------------


def _java() -> str:
    """The `java` to run the broker with (JAVA_HOME first, then PATH), installed if missing."""
    java_home = os.environ.get("JAVA_HOME")
    java = str(Path(java_home) / "bin" / "java") if java_home else None
    if java is None or not Path(java).is_file():
        java = shutil.which("java")
    if java is None:
        paths.apt_install(["openjdk-17-jre-headless"], "no `java` found for the Kafka broker")
        java = shutil.which("java")
        if java is None:
            raise InfraError("installed openjdk-17-jre-headless but `java` is still not on PATH")
    try:
        out = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=JAVA_VERSION_TIMEOUT_S
        ).stderr
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InfraError(f"`{java} -version` failed: {exc}") from None
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    if match is None:
        raise InfraError(f"cannot read the Java version from `{java} -version`:\n{out}")
    major = int(match[1]) if match[1] != "1" else int(match[2] or 0)
    if major < JAVA_MAJOR_MIN:
        raise InfraError(
            f"{java} is Java {major}; the Kafka 4.x broker needs Java {JAVA_MAJOR_MIN}+ "
            "(set JAVA_HOME or install openjdk-17-jre-headless)"
        )
    return java


def _mvn() -> str:
    mvn = shutil.which("mvn")
    if mvn is None:
        paths.apt_install(["maven"], "no `mvn` found to fetch the Kafka broker jars")
        mvn = shutil.which("mvn")
        if mvn is None:
            raise InfraError("installed maven but `mvn` is still not on PATH")
    return mvn


def ensure_libs(lay: Layout) -> float | None:
    """Fetch the broker jars with Maven unless the libs folder matches the pom; return the
    seconds Maven took, or None when the cached folder was reused.

    Maven copies into a sibling folder which then replaces libs/ whole, with the pom's sha256
    written inside it last: a folder with a matching stamp is always complete.
    """
    pom = paths.kafka_pom()
    if not pom.is_file():
        raise InfraError(f"{pom} is missing: is this a complete checkout?")
    want = paths.sha256_file(pom)
    stamp = lay.libs / ".pom.sha256"
    if lay.libs.is_dir() and stamp.is_file() and stamp.read_text().strip() == want:
        return None
    mvn = _mvn()
    staging = lay.home / "libs.partial"
    shutil.rmtree(staging, ignore_errors=True)
    took_s = paths.run_logged(
        [mvn, "-B", "-q", "-Dstyle.color=never", "-f", str(pom), "package",
         f"-Dlibs.dir={staging}"],
        lay.logs / "mvn.log",
        MVN_TIMEOUT_S,
        "mvn (fetching the Kafka broker jars from Maven Central)",
        cwd=paths.repo_root(),
    )
    if not any(staging.glob("kafka_2.13-*.jar")):
        raise InfraError(f"mvn finished but {staging} has no kafka_2.13 jar\n"
                         f"{paths.tail(lay.logs / 'mvn.log')}")
    (staging / ".pom.sha256").write_text(want + "\n")
    retired = lay.home / "libs.old"
    shutil.rmtree(retired, ignore_errors=True)
    if lay.libs.exists():
        lay.libs.rename(retired)
    staging.rename(lay.libs)
    shutil.rmtree(retired, ignore_errors=True)
    return took_s


def new_cluster_id() -> str:
    """What `StorageTool random-uuid` prints: a type-4 UUID as 22 URL-safe base64 characters,
    never starting with "-" (Kafka's `Uuid.randomUuid` draws again: the storage tool's
    `--cluster-id -x...` would read it as an option; one fresh machine in 64 failed to format)."""
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cluster_id.startswith("-"):
            return cluster_id


# What `StorageTool format` itself writes: a data folder holding only these was never finished.
_FORMAT_OUTPUTS = {"bootstrap.checkpoint", "__cluster_metadata-0"}


def ensure_formatted(lay: Layout, java: str) -> float | None:
    """Format the KRaft storage unless the data folder has meta.properties; return the seconds
    formatting took, or None when the storage was already formatted."""
    if (lay.data / "meta.properties").is_file():
        try:
            record = json.loads(lay.format_record.read_text())
        except (OSError, ValueError):
            record = {}
        formatted_port = record.get("controller_port")
        if formatted_port is not None and formatted_port != controller_port():
            raise InfraError(
                f"{lay.data} was formatted with controller port {formatted_port}, which is stored "
                f"in its metadata log; it cannot run on {controller_port()}. Unset "
                f"HALFWAY_KAFKA_CONTROLLER_PORT, or delete {lay.data} (losing its topics)."
            )
        return None
    if lay.data.exists():
        leftovers = {p.name for p in lay.data.iterdir()}
        if not leftovers <= _FORMAT_OUTPUTS:
            raise InfraError(
                f"{lay.data} has no meta.properties but holds {sorted(leftovers)}; "
                "refusing to format over it: move it away or delete it"
            )
        shutil.rmtree(lay.data)  # an interrupted format: nothing of value in it
    lay.data.mkdir(parents=True)
    cluster_id = new_cluster_id()
    took_s = paths.run_logged(
        [
            java, *JVM_TOOL_HEAP,
            f"-Dkafka.logs.dir={lay.logs}",
            f"-Dlog4j2.configurationFile={paths.kafka_log4j_config()}",
            "-cp", lay.classpath,
            "kafka.tools.StorageTool", "format", "--standalone",
            "--cluster-id", cluster_id, "--config", str(lay.properties),
        ],
        lay.logs / "format.log",
        FORMAT_TIMEOUT_S,
        "formatting the KRaft storage (kafka.tools.StorageTool format --standalone)",
    )
    lay.format_record.write_text(
        json.dumps({"cluster_id": cluster_id, "controller_port": controller_port()}) + "\n"
    )
    return took_s


def broker_pid(lay: Layout) -> int | None:
    """The pid of our running broker, or None. A live pid whose command line does not name our
    server.properties is a recycled pid, not our broker."""
    pid = paths.read_pid(lay.pid_file)
    if pid is None or not paths.pid_alive(pid):
        return None
    argv = paths.cmdline(pid)
    if "kafka.Kafka" not in argv or str(lay.properties) not in argv:
        return None
    return pid


async def probe(bootstrap: str, timeout_s: float = PROBE_TIMEOUT_S,
                security: dict[str, object] | None = None) -> int:
    """One metadata round trip through aiokafka's admin client (authenticated with `security`,
    aiokafka's keyword arguments); return the number of brokers the cluster reports. Raises on
    any failure or after `timeout_s`."""
    # Imported here so that `bootstrap_servers()` stays cheap for importers that never probe.
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000), **(security or {})
    )
    try:
        async with asyncio.timeout(timeout_s):
            await admin.start()
            cluster = await admin.describe_cluster()
            await admin.list_topics()
    finally:
        await admin.close()
    brokers = len(cluster.get("brokers", []))
    if brokers < 1:
        raise InfraError(f"{bootstrap} answered a metadata request with no brokers")
    return brokers


def answering(bootstrap: str, timeout_s: float = PROBE_TIMEOUT_S,
              security: dict[str, object] | None = None) -> bool:
    try:
        paths.run_coroutine(lambda: probe(bootstrap, timeout_s, security))
    except Exception:  # any failure to answer is "no"; `up` reports the logs, not this error
        return False
    return True


def _log_tails(lay: Layout) -> str:
    return "\n".join(
        [paths.tail(lay.logs / "kafka.out", 20), paths.tail(lay.logs / "server.log", 40)]
    )


def _check_ports_free(lay: Layout) -> None:
    for name, p in (("client", port()), ("controller", controller_port())):
        if paths.port_open(p):
            raise InfraError(
                f"the Kafka {name} port {HOST}:{p} is taken by something that is not this "
                f"checkout's broker (no live broker in {lay.pid_file}): {paths.who_listens(p)}\n"
                "Stop that process, or choose other ports with HALFWAY_KAFKA_PORT and "
                "HALFWAY_KAFKA_CONTROLLER_PORT."
            )


def _spawn(lay: Layout, java: str) -> subprocess.Popen[bytes]:
    argv = [
        java, *JVM_HEAP, *JVM_FLAGS,
        f"-Dkafka.logs.dir={lay.logs}",
        f"-Dlog4j2.configurationFile={paths.kafka_log4j_config()}",
        "-cp", lay.classpath,
        "kafka.Kafka", str(lay.properties),
    ]
    with (lay.logs / "kafka.out").open("ab") as out:
        out.write(f"\n$ {' '.join(argv)}\n".encode())
        out.flush()
        # Own session and process group: the broker outlives this command, ignores the
        # terminal's Ctrl-C, and `down` can signal the whole group.
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
            cwd=lay.home, start_new_session=True,
        )
    _spawned.append(proc)
    lay.pid_file.write_text(f"{proc.pid}\n")
    return proc


def _wait_ready(lay: Layout, pid: int, timeout_s: float) -> None:
    """Poll until the broker answers a metadata request; fail early if its process exits."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not paths.pid_alive(pid):
            raise InfraError(f"the Kafka broker (pid {pid}) exited while starting\n"
                             f"{_log_tails(lay)}")
        # A cheap TCP check first: the admin client logs errors while nothing listens.
        if paths.port_open(port()) and answering(bootstrap_servers(),
                                                 security=admin_security(lay)):
            return
        time.sleep(READY_POLL_S)
    _terminate(pid)
    lay.pid_file.unlink(missing_ok=True)
    raise InfraError(
        f"the Kafka broker did not answer on {bootstrap_servers()} within {timeout_s:.0f} s, "
        f"so it was stopped\n{_log_tails(lay)}"
    )


def _terminate(pid: int) -> None:
    """SIGTERM the broker's process group (controlled shutdown), SIGKILL it after a bound."""
    try:
        group = os.getpgid(pid)
    except ProcessLookupError:
        return
    # The broker leads its own group (start_new_session); never signal a group it does not lead,
    # which could be the caller's own.
    target = group if group == pid else None
    for sig, wait_s in ((signal.SIGTERM, STOP_TIMEOUT_S), (signal.SIGKILL, KILL_TIMEOUT_S)):
        try:
            if target is not None:
                os.killpg(target, sig)
            else:
                os.kill(pid, sig)
        except ProcessLookupError:
            return
        if paths.wait_gone(pid, wait_s):
            return
    raise InfraError(f"the Kafka broker (pid {pid}) survived SIGKILL for {KILL_TIMEOUT_S:.0f} s")


# --- the component's verbs --------------------------------------------------------------------


def up() -> ComponentStatus:
    if is_external():
        bootstrap = bootstrap_servers()
        # As whoever HALFWAY_KAFKA_* names (the admin's kind when nothing says otherwise).
        if not answering(bootstrap, PROBE_TIMEOUT_S, settings.kafka_security(ADMIN)):
            raise InfraError(f"the external broker HALFWAY_KAFKA_BOOTSTRAP={bootstrap} "
                             f"did not answer a metadata request within {PROBE_TIMEOUT_S:.0f} s")
        return ComponentStatus("kafka", "external", details={"bootstrap": bootstrap})
    lay = layout()
    with paths.file_lock(lay.lock):
        pid = broker_pid(lay)
        if pid is not None:
            # Alive but not answering yet means another `up` is still starting it: wait for it.
            _wait_ready(lay, pid, READY_TIMEOUT_S)
            details = {"bootstrap": bootstrap_servers()}
            stamp = lay.libs / ".pom.sha256"
            if stamp.is_file() and stamp.read_text().strip() != paths.sha256_file(
                paths.kafka_pom()
            ):
                details["note"] = "infra/kafka/pom.xml changed: down and up to use the new jars"
            if not runs_secured(lay):
                # Never restarted behind the back of whoever uses it: say how to upgrade.
                details["security"] = "none"
                details["note"] = ("started without SCRAM and ACLs by an older halfway: "
                                   "`infra/dev down kafka` then `up` restarts it with them, "
                                   "topics kept")
            return ComponentStatus("kafka", "already running", pid=pid, details=details)

        lay.pid_file.unlink(missing_ok=True)  # stale: its process is gone
        _check_ports_free(lay)
        started = time.monotonic()
        for folder in (lay.home, lay.logs):
            folder.mkdir(parents=True, exist_ok=True)
        java = _java()
        jars_s = ensure_libs(lay)
        passwords = ensure_credentials(lay)
        _write_private(lay.properties, render_server_properties(
            port(), controller_port(), lay.data, passwords[ADMIN]))
        format_s = ensure_formatted(lay, java)
        broker_started = time.monotonic()
        proc = _spawn(lay, java)
        _provision(lay, proc.pid, passwords, READY_TIMEOUT_S)
        _wait_ready(lay, proc.pid, READY_TIMEOUT_S)
        acls = _grant_default_prefix(lay)
        now = time.monotonic()
        return ComponentStatus(
            "kafka", "started", pid=proc.pid, start_s=now - started,
            details={
                "bootstrap": bootstrap_servers(),
                "broker_s": f"{now - broker_started:.2f}",
                "format_s": "cached" if format_s is None else f"{format_s:.2f}",
                "jars_s": "cached" if jars_s is None else f"{jars_s:.2f}",
                "security": "scram+acls",
                "acls": acls,
                "credentials": str(lay.credentials),
                "logs": str(lay.logs),
            },
        )


def down() -> ComponentStatus:
    if is_external():
        return ComponentStatus("kafka", "external",
                               details={"bootstrap": bootstrap_servers(), "note": "not stopped"})
    lay = layout()
    with paths.file_lock(lay.lock):
        pid = broker_pid(lay)
        if pid is None:
            lay.pid_file.unlink(missing_ok=True)
            return ComponentStatus("kafka", "stopped", details={"port": str(port())})
        started = time.monotonic()
        _terminate(pid)
        lay.pid_file.unlink(missing_ok=True)
        return ComponentStatus(
            "kafka", "stopped",
            details={"was_pid": str(pid), "stop_s": f"{time.monotonic() - started:.2f}"},
        )


def status() -> ComponentStatus:
    """Read-only: never creates files, never waits longer than one probe."""
    if is_external():
        bootstrap = bootstrap_servers()
        return ComponentStatus("kafka", "external", details={
            "bootstrap": bootstrap, "answering": "yes" if answering(bootstrap) else "no",
        })
    lay = layout()
    pid = broker_pid(lay)
    if pid is None:
        details = {"port": str(port())}
        if paths.port_open(port()):
            details["note"] = f"port in use by another process: {paths.who_listens(port())}"
        return ComponentStatus("kafka", "stopped", details=details)
    return ComponentStatus("kafka", "running", pid=pid, details={
        "bootstrap": bootstrap_servers(),
        "security": "scram+acls" if runs_secured(lay) else "none",
        "answering": "yes" if paths.port_open(port()) else "no",
        "logs": str(lay.logs),
    })
