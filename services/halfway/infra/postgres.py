"""A private PostgreSQL cluster for the read model: Debian's server binaries, our own data folder,
port 15432 (`HALFWAY_PG_PORT`) on 127.0.0.1 only, trust auth, superuser `postgres`, and a
database `halfway`. It is not the Debian system cluster on 5432, which is left alone.

Where the cluster lives, and why:
- initdb and postgres refuse to run as root. As root (CI, the dev machines) they run as the
  `postgres` system user through `runuser`, and that user must own the data folder and be able
  to traverse every parent of it. The checkout may sit under a 0700 folder such as /root, so as
  root the cluster lives in /var/lib/halfway/postgres-<port> (owned by postgres), and
  `$HALFWAY_HOME/postgres/cluster` is a symlink to it so its log is in a known place.
- Not as root, it lives in `$HALFWAY_HOME/postgres/` and runs as the current user.
Each holds `data/` (the cluster), `run/` (the unix socket, never Debian's /var/run/postgresql)
and `postgres.log`.

`up`: install the Debian package `postgresql` if no server binary exists (root only), initdb once
(when data/PG_VERSION is missing), `pg_ctl start -w`, then poll `select 1` through asyncpg and
create the `halfway` database if missing. Already running and answering: nothing to do.
`down`: `pg_ctl stop -m fast`. Every wait is bounded.
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path

from halfway import settings
from halfway.infra import ComponentStatus, InfraError, paths
from halfway.settings import HOST
from halfway.settings import PG_DATABASE as DATABASE
from halfway.settings import PG_USER as USER

PG_SYSTEM_USER = "postgres"  # the Debian package's system user, which owns the cluster as root
ROOT_CLUSTERS = Path("/var/lib/halfway")

INITDB_TIMEOUT_S = 120.0
# pg_ctl's own wait (-t) for the server to accept connections; the call itself gets a margin.
PG_CTL_WAIT_S = 60
PG_CTL_TIMEOUT_S = PG_CTL_WAIT_S + 30.0
READY_TIMEOUT_S = 60.0
READY_POLL_S = 0.2
CONNECT_TIMEOUT_S = 5.0
# How long a killed postmaster may stay a zombie before its postmaster.pid is removed for it.
STALE_PID_WAIT_S = 10.0
# Unix socket paths are limited to 107 bytes (sun_path); ".s.PGSQL.NNNNN" takes 14 of them.
SOCKET_DIR_MAX_CHARS = 90


# Addresses come from halfway.settings, the one place that reads the environment.
port = settings.pg_port
is_external = settings.pg_is_external
dsn = settings.pg_dsn


@dataclass(frozen=True)
class Layout:
    home: Path  # $HALFWAY_HOME/postgres: the lock, pg_ctl.log and (as root) the symlink
    base: Path  # the cluster's own folder: data/, run/, postgres.log
    data: Path
    socket_dir: Path
    log: Path
    lock: Path
    as_root: bool


def layout() -> Layout:
    home = paths.postgres_home()
    as_root = paths.is_root()
    base = ROOT_CLUSTERS / f"postgres-{port()}" if as_root else home
    socket_dir = base / "run"
    if len(str(socket_dir)) > SOCKET_DIR_MAX_CHARS:
        # A deep checkout path would overflow sun_path; the socket only needs a private folder.
        socket_dir = Path(f"/tmp/halfway-pg-{os.geteuid()}-{port()}")
    return Layout(
        home=home, base=base, data=base / "data", socket_dir=socket_dir,
        log=base / "postgres.log", lock=paths.halfway_home() / "postgres.lock", as_root=as_root,
    )


def _as_cluster_owner(argv: list[str], lay: Layout) -> list[str]:
    return ["runuser", "-u", PG_SYSTEM_USER, "--", *argv] if lay.as_root else argv


def bin_dir(lay: Layout, install: bool) -> Path:
    """The server binaries: those of the version that made the cluster (data/PG_VERSION) when
    present, else the newest installed; installs the Debian package if there are none."""
    def installed() -> dict[int, Path]:
        found = {}
        for postgres in glob.glob("/usr/lib/postgresql/*/bin/postgres"):
            version = Path(postgres).parent.parent.name
            if version.isdigit():
                found[int(version)] = Path(postgres).parent
        return found

    versions = installed()
    if not versions and install:
        paths.apt_install(["postgresql"], "no PostgreSQL server in /usr/lib/postgresql/*/bin")
        versions = installed()
    if not versions:
        raise InfraError("no PostgreSQL server found in /usr/lib/postgresql/*/bin: install the "
                         "Debian package postgresql (apt-get install -y postgresql)")
    try:
        made_with = int((lay.data / "PG_VERSION").read_text().strip())
    except (OSError, ValueError):
        made_with = None
    if made_with is not None:
        if made_with not in versions:
            raise InfraError(f"{lay.data} was made by PostgreSQL {made_with}, which is not "
                             f"installed (found {sorted(versions)}): install postgresql-"
                             f"{made_with}, or delete {lay.base} to start over")
        return versions[made_with]
    return versions[max(versions)]


def postmaster_pid(lay: Layout) -> int | None:
    """The pid of our cluster's postmaster, or None (stale postmaster.pid files included)."""
    pid = paths.read_pid(lay.data / "postmaster.pid")
    if pid is None or not paths.pid_alive(pid):
        return None
    argv = paths.cmdline(pid)
    if not argv or "postgres" not in Path(argv[0]).name or str(lay.data) not in " ".join(argv):
        return None
    return pid


def _clear_dead_lock_file(lay: Layout) -> None:
    """Make a postmaster.pid left by a killed server harmless before `pg_ctl start`.

    postgres itself treats the pid in that file as running while kill(pid, 0) succeeds, which
    includes a zombie. A killed postmaster was reparented to PID 1, and an init that reaps
    slowly (seconds, on these machines) or never would make the start fail with "lock file
    postmaster.pid already exists". Wait a bounded time for the reaping; then, since a zombie
    holds nothing, remove the file. (Old backends still attached to the shared memory would
    still block the start, through postgres's own shared-memory interlock.)
    """
    lock_file = lay.data / "postmaster.pid"
    old_pid = paths.read_pid(lock_file)
    if old_pid is None or paths.pid_alive(old_pid):
        return
    deadline = time.monotonic() + STALE_PID_WAIT_S
    while Path(f"/proc/{old_pid}").exists() and time.monotonic() < deadline:
        time.sleep(READY_POLL_S)
    if Path(f"/proc/{old_pid}").exists():
        lock_file.unlink(missing_ok=True)


def _prepare_dirs(lay: Layout) -> None:
    lay.home.mkdir(parents=True, exist_ok=True)
    if not lay.as_root:
        for folder in (lay.base, lay.socket_dir):
            folder.mkdir(parents=True, exist_ok=True)
        return
    try:
        owner = pwd.getpwnam(PG_SYSTEM_USER)
    except KeyError:
        raise InfraError(f"no `{PG_SYSTEM_USER}` system user: reinstall the Debian package "
                         "postgresql-common") from None
    # Parents root-owned and world-traversable; the cluster folder private to postgres.
    ROOT_CLUSTERS.mkdir(mode=0o755, parents=True, exist_ok=True)
    for folder in (lay.base, lay.socket_dir):
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chown(folder, owner.pw_uid, owner.pw_gid)
    link = lay.home / "cluster"
    if not (link.is_symlink() and Path(os.readlink(link)) == lay.base):
        link.unlink(missing_ok=True)
        link.symlink_to(lay.base)


def _initdb(lay: Layout, bindir: Path) -> float | None:
    if (lay.data / "PG_VERSION").is_file():
        return None
    if lay.data.exists():
        # An initdb that was interrupted leaves a folder initdb refuses to reuse; nothing in a
        # cluster without PG_VERSION is data.
        shutil.rmtree(lay.data)
    return paths.run_logged(
        _as_cluster_owner([
            str(bindir / "initdb"), "-D", str(lay.data), "-U", USER, "--auth=trust",
            "--encoding=UTF8", "--locale=C.UTF-8",
        ], lay),
        lay.home / "pg_ctl.log", INITDB_TIMEOUT_S, "initdb",
        # The postgres user may not be able to enter the caller's working directory (/root/...).
        cwd=lay.base,
    )


def _pg_ctl_start(lay: Layout, bindir: Path) -> None:
    # Settings passed on every start, not written into postgresql.conf, so the port and socket
    # always follow the current environment.
    options = (f"-c listen_addresses={HOST} -p {port()} "
               f"-c unix_socket_directories={lay.socket_dir}")
    try:
        paths.run_logged(
            _as_cluster_owner([
                str(bindir / "pg_ctl"), "start", "-D", str(lay.data), "-l", str(lay.log),
                "-w", "-t", str(PG_CTL_WAIT_S), "-o", options,
            ], lay),
            lay.home / "pg_ctl.log", PG_CTL_TIMEOUT_S, "pg_ctl start", cwd=lay.base,
        )
    except InfraError as exc:
        raise InfraError(f"{exc}\n{paths.tail(lay.log)}") from None


def _pg_ctl_stop(lay: Layout, bindir: Path, mode: str) -> None:
    paths.run_logged(
        _as_cluster_owner([
            str(bindir / "pg_ctl"), "stop", "-D", str(lay.data), "-m", mode,
            "-w", "-t", str(PG_CTL_WAIT_S),
        ], lay),
        lay.home / "pg_ctl.log", PG_CTL_TIMEOUT_S, f"pg_ctl stop -m {mode}", cwd=lay.base,
    )


async def probe(database: str = "postgres", timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Connect through asyncpg and run `select 1`; raises on failure or after `timeout_s`."""
    import asyncpg  # imported here so that `dsn()` stays cheap for importers that never probe

    conn = await asyncpg.connect(dsn(database), timeout=timeout_s)
    try:
        value = await conn.fetchval("select 1", timeout=timeout_s)
    finally:
        await conn.close(timeout=timeout_s)
    if value != 1:
        raise InfraError(f"select 1 returned {value!r}")


async def _ensure_database() -> bool:
    """Create the `halfway` database if it is missing; True if it was created."""
    import asyncpg

    conn = await asyncpg.connect(dsn("postgres"), timeout=CONNECT_TIMEOUT_S)
    try:
        exists = await conn.fetchval("select 1 from pg_database where datname = $1", DATABASE)
        if exists:
            return False
        # CREATE DATABASE takes no bind parameters; the name is our constant, quoted.
        await conn.execute(f'create database "{DATABASE}"')
        return True
    finally:
        await conn.close(timeout=CONNECT_TIMEOUT_S)


def _wait_ready(lay: Layout, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    last_error = "no attempt"
    while time.monotonic() < deadline:
        try:
            paths.run_coroutine(lambda: probe("postgres"))
            return
        except Exception as exc:  # keep polling; the last error goes into the report
            last_error = f"{type(exc).__name__}: {exc}"
        time.sleep(READY_POLL_S)
    raise InfraError(f"PostgreSQL on {HOST}:{port()} did not answer `select 1` within "
                     f"{timeout_s:.0f} s (last error: {last_error})\n{paths.tail(lay.log)}")


def redacted(url: str) -> str:
    """A DSN fit to print: any password replaced by ***."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


def _details(lay: Layout) -> dict[str, str]:
    return {"dsn": dsn(), "data": str(lay.data), "log": str(lay.log)}


# --- the component's verbs --------------------------------------------------------------------


def up() -> ComponentStatus:
    if is_external():
        try:
            paths.run_coroutine(lambda: probe(DATABASE))
        except Exception as exc:
            raise InfraError(f"the external database HALFWAY_PG_DSN did not answer select 1: "
                             f"{type(exc).__name__}: {exc}") from None
        return ComponentStatus("postgres", "external", details={"dsn": redacted(dsn())})
    lay = layout()
    with paths.file_lock(lay.lock):
        pid = postmaster_pid(lay)
        if pid is not None:
            _wait_ready(lay, READY_TIMEOUT_S)
            paths.run_coroutine(_ensure_database)
            return ComponentStatus("postgres", "already running", pid=pid, details=_details(lay))

        if paths.port_open(port()):
            raise InfraError(
                f"the PostgreSQL port {HOST}:{port()} is taken by something that is not this "
                f"checkout's cluster (no live postmaster for {lay.data}): "
                f"{paths.who_listens(port())}\nStop that process, or choose another port with "
                "HALFWAY_PG_PORT."
            )
        started = time.monotonic()
        bindir = bin_dir(lay, install=True)
        _prepare_dirs(lay)
        initdb_s = _initdb(lay, bindir)
        _clear_dead_lock_file(lay)
        server_started = time.monotonic()
        _pg_ctl_start(lay, bindir)
        _wait_ready(lay, READY_TIMEOUT_S)
        created = paths.run_coroutine(_ensure_database)
        now = time.monotonic()
        pid = postmaster_pid(lay)
        details = _details(lay)
        details.update({
            "server_s": f"{now - server_started:.2f}",
            "initdb_s": "cached" if initdb_s is None else f"{initdb_s:.2f}",
            "created_db": "yes" if created else "no",
        })
        return ComponentStatus("postgres", "started", pid=pid, start_s=now - started,
                               details=details)


def down() -> ComponentStatus:
    if is_external():
        return ComponentStatus("postgres", "external",
                               details={"dsn": redacted(dsn()), "note": "not stopped"})
    lay = layout()
    with paths.file_lock(lay.lock):
        pid = postmaster_pid(lay)
        if pid is None:
            return ComponentStatus("postgres", "stopped", details={"port": str(port())})
        started = time.monotonic()
        bindir = bin_dir(lay, install=False)
        try:
            _pg_ctl_stop(lay, bindir, "fast")
        except InfraError:
            # fast waits for nothing but running queries to be cancelled; if even that hangs,
            # immediate (crash-like, recovered by WAL replay on the next start) is the bound.
            _pg_ctl_stop(lay, bindir, "immediate")
        return ComponentStatus("postgres", "stopped", details={
            "was_pid": str(pid), "stop_s": f"{time.monotonic() - started:.2f}",
        })


def status() -> ComponentStatus:
    """Read-only: never creates files, never installs anything."""
    if is_external():
        try:
            paths.run_coroutine(lambda: probe(DATABASE))
            answer = "yes"
        except Exception:
            answer = "no"
        return ComponentStatus("postgres", "external",
                               details={"dsn": redacted(dsn()), "answering": answer})
    lay = layout()
    pid = postmaster_pid(lay)
    if pid is None:
        details = {"port": str(port())}
        if paths.port_open(port()):
            details["note"] = f"port in use by another process: {paths.who_listens(port())}"
        return ComponentStatus("postgres", "stopped", details=details)
    details = _details(lay)
    details["answering"] = "yes" if paths.port_open(port()) else "no"
    return ComponentStatus("postgres", "running", pid=pid, details=details)
