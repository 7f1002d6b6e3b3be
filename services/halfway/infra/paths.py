"""Where the local infrastructure keeps its state, and the process helpers both components use.

Layout under `halfway_home()` (env `HALFWAY_HOME`, default `<repo root>/.halfway`, git-ignored):

    kafka/libs/            broker jars copied by Maven (+ .pom.sha256, the cache key)
    kafka/data/            KRaft metadata and topic logs (meta.properties once formatted)
    kafka/logs/            server.log (log4j2), kafka.out (JVM stdout/stderr), mvn.log, format.log
    kafka/server.properties  generated on every start from the current ports (0600: it holds
                           the admin's password)
    kafka/credentials.json   one random password per principal kind (0600; docs/security.md)
    kafka/kafka.pid
    postgres/              data, socket and log when not root; when root, a symlink `cluster`
                           to /var/lib/halfway/postgres-<port> (see postgres.py for why)
    *.lock                 one flock per component, so two `up`s at once do not race

Everything here is stdlib only and does no waiting without a bound.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import fcntl
import hashlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

from halfway.infra import InfraError

T = TypeVar("T")

# A first `apt-get install postgresql` (or a JDK) on a fresh machine downloads ~50-150 MB.
APT_TIMEOUT_S = 900.0
# Waiting for another `up`/`down` of the same component, which may itself be running Maven.
LOCK_TIMEOUT_S = 900.0
LOCK_POLL_S = 0.2


def repo_root() -> Path:
    """The nearest parent of this file holding both pyproject.toml and infra/ (the checkout this
    code runs from, also when installed editable); the current directory if there is none, e.g.
    when installed as a wheel."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "pyproject.toml").is_file() and (parent / "infra").is_dir():
            return parent
    return Path.cwd()


def halfway_home() -> Path:
    env = os.environ.get("HALFWAY_HOME")
    return Path(env).resolve() if env else repo_root() / ".halfway"


def kafka_home() -> Path:
    return halfway_home() / "kafka"


def postgres_home() -> Path:
    return halfway_home() / "postgres"


def kafka_pom() -> Path:
    return repo_root() / "infra" / "kafka" / "pom.xml"


def kafka_log4j_config() -> Path:
    return repo_root() / "infra" / "kafka" / "log4j2.properties"


def is_root() -> bool:
    return os.geteuid() == 0


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def tail(path: Path, lines: int = 40) -> str:
    """The last `lines` lines of a log file, or a note that it is missing; reads at most 64 KiB
    so a huge log cannot stall an error report."""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 65536))
            text = f.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return f"(no {path}: {exc.strerror})"
    body = "\n".join(text.splitlines()[-lines:])
    return f"--- last {lines} lines of {path} ---\n{body}"


# --- processes --------------------------------------------------------------------------------


def pid_alive(pid: int) -> bool:
    """True if `pid` exists and is not a zombie (a zombie has exited; only its parent's wait is
    missing, which happens when the broker was started by this same Python process)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    # Field 3, after the parenthesised command name (which may itself contain spaces).
    state = stat.rsplit(")", 1)[-1].split()[0]
    if state in ("Z", "X"):
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)
        return False
    return True


def cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part]


def read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def port_open(port: int, host: str = "127.0.0.1", timeout_s: float = 0.5) -> bool:
    """True if something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def who_listens(port: int) -> str:
    """Best-effort description of the process listening on a TCP port, for error messages."""
    ss = shutil.which("ss")
    if ss is None:
        return "unknown process (install iproute2 for `ss` to see which)"
    try:
        out = subprocess.run(
            [ss, "-Hltnp", f"sport = :{port}"], capture_output=True, text=True, timeout=5
        ).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return "unknown process"
    return out or "unknown process"


def wait_gone(pid: int, timeout_s: float, poll_s: float = 0.1) -> bool:
    """Wait until `pid` has exited, at most `timeout_s`; True if it did."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(poll_s)
    return not pid_alive(pid)


@contextlib.contextmanager
def file_lock(path: Path, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Exclusive flock on `path`, waited for at most `timeout_s` (two `infra/dev up`s at once, e.g.
    a test run and a shell, must not both format storage or both start a broker)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise InfraError(
                        f"another halfway.infra command held {path} for over {timeout_s:.0f} s"
                    ) from None
                time.sleep(LOCK_POLL_S)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def run_logged(
    argv: list[str],
    log: Path,
    timeout_s: float,
    what: str,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> float:
    """Run a command to completion with its output appended to `log`; return its wall time in
    seconds, or raise InfraError with the log's tail. Output goes to a file, not a pipe, because
    some commands (pg_ctl start) leave a daemon behind that would hold a pipe open."""
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with log.open("ab") as out:
        out.write(f"\n$ {' '.join(argv)}\n".encode())
        out.flush()
        try:
            rc = subprocess.run(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                timeout=timeout_s, cwd=cwd, env=env, check=False,
            ).returncode
        except subprocess.TimeoutExpired:
            raise InfraError(f"{what} took over {timeout_s:.0f} s\n{tail(log)}") from None
        except FileNotFoundError:
            raise InfraError(f"{what}: {argv[0]} not found") from None
    if rc != 0:
        raise InfraError(f"{what} failed (exit {rc})\n{tail(log)}")
    return time.monotonic() - started


def apt_install(packages: list[str], why: str) -> None:
    """Install Debian packages when running as root; otherwise say exactly what to install."""
    if not is_root():
        raise InfraError(
            f"{why}: install the Debian package(s) {' '.join(packages)} "
            f"(sudo apt-get install -y {' '.join(packages)}) and run this again"
        )
    if shutil.which("apt-get") is None:
        raise InfraError(f"{why}, and there is no apt-get to install {' '.join(packages)} with")
    log = halfway_home() / "apt.log"
    # No debconf questions: CI has no standard input.
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    print(f"halfway.infra: {why}; installing {' '.join(packages)} with apt-get (log: {log})")
    run_logged(["apt-get", "update"], log, APT_TIMEOUT_S, "apt-get update", env=env)
    run_logged(
        ["apt-get", "install", "-y", *packages],
        log, APT_TIMEOUT_S, f"apt-get install {' '.join(packages)}", env=env,
    )


def run_coroutine(factory: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine to completion from synchronous code, also when the caller is itself inside a
    running event loop (a test): then it runs on a fresh loop in a worker thread. The up/down
    functions are synchronous because most of what they do is blocking process management."""
    async def main() -> T:
        return await factory()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, main()).result()
