"""A Kafka broker of the chaos run's own, so that killing it touches nobody else's.

It is the broker `halfway.infra.kafka` runs (same jars, same config), with its own
`HALFWAY_HOME` and its own free client and controller ports. `halfway.infra` reads those from
the environment, so it is started and stopped by `python -m halfway.infra up|down kafka` in a
child process with that environment; this process's environment is never changed (a test
session shares it). The jars are linked from this checkout's broker when they match the pom, so
no Maven run is needed.

`kill9()` SIGKILLs the broker's process group (it leads one: `halfway.infra.kafka` starts it in
its own session), found the way `halfway.infra.kafka.broker_pid` finds it: the pid file, a live
process, a command line naming our server.properties.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

from halfway.infra import paths
from halfway.settings import (
    DEFAULT_KAFKA_CONTROLLER_PORT,
    DEFAULT_KAFKA_PORT,
    HOST,
    dev_security,
    kafka_dev_credentials,
)

UP_TIMEOUT_S = 180.0  # `halfway.infra up`: a format and a start, or a restart after kill -9
DOWN_TIMEOUT_S = 90.0  # its own bounds: a 60 s controlled shutdown, then SIGKILL
KILL_TIMEOUT_S = 10.0
GONE_POLL_S = 0.05
# The environment variables halfway.infra reads to place the broker; a set bootstrap would
# make it "external" and start nothing.
PLACEMENT = ("HALFWAY_HOME", "HALFWAY_KAFKA_PORT", "HALFWAY_KAFKA_CONTROLLER_PORT")


class BrokerError(RuntimeError):
    pass


def free_ports(count: int, avoid: set[int] | None = None) -> list[int]:
    """Ports nothing listens on now, distinct (all sockets held until all are chosen)."""
    held: list[socket.socket] = []
    try:
        ports: list[int] = []
        while len(ports) < count:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((HOST, 0))
            held.append(sock)
            port = sock.getsockname()[1]
            if port not in (avoid or set()):
                ports.append(port)
        return ports
    finally:
        for sock in held:
            sock.close()


class DedicatedBroker:
    def __init__(self, home: Path) -> None:
        self.home = home.resolve()
        # Never the shared broker's ports, even when it is down right now.
        self.port, self.controller_port = free_ports(
            2, avoid={DEFAULT_KAFKA_PORT, DEFAULT_KAFKA_CONTROLLER_PORT})
        self.kafka_home = self.home / "kafka"
        self.kills = 0
        self.restarts: list[float] = []  # seconds each restart took (kill -9 to answering)

    @property
    def bootstrap(self) -> str:
        return f"{HOST}:{self.port}"

    def security(self, kind: str) -> dict[str, Any]:
        """How a process of `kind` authenticates to this broker (SCRAM, from the credentials
        file `halfway.infra` wrote into its home on the first `up`)."""
        passwords = kafka_dev_credentials(self.kafka_home / "credentials.json")
        if passwords is None:
            raise BrokerError(f"no credentials in {self.kafka_home}: is the broker up?")
        return dev_security(kind, passwords)

    def env(self) -> dict[str, str]:
        out = {k: v for k, v in os.environ.items() if k != "HALFWAY_KAFKA_BOOTSTRAP"}
        return out | {"HALFWAY_HOME": str(self.home), "HALFWAY_KAFKA_PORT": str(self.port),
                      "HALFWAY_KAFKA_CONTROLLER_PORT": str(self.controller_port)}

    def _link_jars(self) -> None:
        """Use this checkout's broker jars when they are complete and match the pom; otherwise
        `up` fetches them with Maven into our home, as it would anywhere."""
        source = paths.kafka_home() / "libs"  # the caller's HALFWAY_HOME (or .halfway)
        stamp = source / ".pom.sha256"
        target = self.kafka_home / "libs"
        if target.exists() or not stamp.is_file():
            return
        if stamp.read_text().strip() != paths.sha256_file(paths.kafka_pom()):
            return
        self.kafka_home.mkdir(parents=True, exist_ok=True)
        target.symlink_to(source, target_is_directory=True)

    async def up(self) -> str:
        """Start (or restart) it and wait until it answers; returns `halfway.infra`'s line."""
        self._link_jars()
        return await self._infra("up", UP_TIMEOUT_S)

    async def down(self) -> str:
        return await self._infra("down", DOWN_TIMEOUT_S)

    async def _infra(self, verb: str, timeout_s: float) -> str:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "halfway.infra", verb, "kafka", env=self.env(),
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        try:
            async with asyncio.timeout(timeout_s):
                out, err = await proc.communicate()
        except TimeoutError:
            proc.kill()
            await proc.wait()
            raise BrokerError(f"`halfway.infra {verb} kafka` took over {timeout_s:g} s") from None
        if proc.returncode != 0:
            raise BrokerError(f"`halfway.infra {verb} kafka` failed ({proc.returncode}): "
                              f"{err.decode(errors='replace').strip()}")
        return out.decode(errors="replace").strip()

    def pid(self) -> int | None:
        pid = paths.read_pid(self.kafka_home / "kafka.pid")
        if pid is None or not paths.pid_alive(pid):
            return None
        argv = paths.cmdline(pid)
        if "kafka.Kafka" not in argv or str(self.kafka_home / "server.properties") not in argv:
            return None  # a recycled pid, not our broker
        return pid

    async def kill9(self) -> None:
        """SIGKILL the broker (its whole process group) and wait until it is gone."""
        pid = self.pid()
        if pid is None:
            raise BrokerError(f"no running broker under {self.kafka_home}")
        if os.getpgid(pid) != pid:  # never signal a group the broker does not lead
            raise BrokerError(f"broker pid {pid} does not lead its process group")
        os.killpg(pid, signal.SIGKILL)
        self.kills += 1
        deadline = time.monotonic() + KILL_TIMEOUT_S
        while paths.pid_alive(pid):  # polled: a process we did not start cannot be awaited
            if time.monotonic() > deadline:
                raise BrokerError(f"broker pid {pid} survived SIGKILL for {KILL_TIMEOUT_S:g} s")
            await asyncio.sleep(GONE_POLL_S)

    def remove_data(self) -> None:
        """The topics and the jar link go; the broker's logs stay with the run's logs."""
        shutil.rmtree(self.kafka_home / "data", ignore_errors=True)
        link = self.kafka_home / "libs"
        if link.is_symlink():
            link.unlink()
