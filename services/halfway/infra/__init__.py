"""Local infrastructure: a real Apache Kafka broker (KRaft, single node) and a private PostgreSQL.

Both run as plain processes on loopback, owned by this checkout, with their state under
`$HALFWAY_HOME` (default `<repo>/.halfway`): no Docker, no system services, nothing installed
by hand. `infra/dev up` (or `python -m halfway.infra up`) starts them; they keep running until
`down`, so the tests, the demo and a developer's shell all share one broker and one database.

- `halfway.infra.kafka`: `bootstrap_servers()`, and `up` / `down` / `status` for the broker.
- `halfway.infra.postgres`: `dsn()`, and `up` / `down` / `status` for the database.
- `halfway.infra.paths`: where everything lives, and the small process helpers both share.

Setting `HALFWAY_KAFKA_BOOTSTRAP` or `HALFWAY_PG_DSN` points at an external service instead:
then nothing is started or stopped for that component.

This module holds only the types both components report with; it imports neither of them, so
`kafka` and `postgres` can import it without a cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, field


class InfraError(RuntimeError):
    """A component could not be brought to the requested state; the message says why and what
    to do, and includes the tail of the relevant log when there is one."""


@dataclass(frozen=True)
class ComponentStatus:
    """What one component is doing, as `up`, `down` and `status` report it.

    `state` is one of: "started", "already running", "running", "stopped", "external".
    `start_s` is set only when this call started the component: the wall time it took.
    `details` are extra key=value facts for the one-line report (address, log file, timings).
    """

    component: str
    state: str
    pid: int | None = None
    start_s: float | None = None
    details: dict[str, str] = field(default_factory=dict)

    def line(self) -> str:
        """One line per component, for people and for tests that grep `pid=(\\d+)`."""
        head = f"{self.component}: {self.state}"
        if self.start_s is not None:
            head += f" in {self.start_s:.2f} s"
        facts = ([f"pid={self.pid}"] if self.pid is not None else []) + [
            f"{key}={value}" for key, value in self.details.items()
        ]
        return f"{head} ({' '.join(facts)})" if facts else head
