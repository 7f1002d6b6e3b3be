"""Where things are: the one place that reads halfway's environment variables.

The local setup (`infra/dev`, `halfway.infra`), the tests and docker-compose.yml all configure
the services through these same variables.
"""

from __future__ import annotations

import dataclasses
import os
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

HOST = "127.0.0.1"
DEFAULT_KAFKA_PORT = 19092
DEFAULT_KAFKA_CONTROLLER_PORT = 19093
DEFAULT_PG_PORT = 15432
PG_USER = "postgres"
PG_DATABASE = "halfway"


def _port(name: str, default: int, *, any_free: bool = False) -> int:
    """A port from the environment; with `any_free`, 0 means "pick a free one"."""
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        port = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a port number") from None
    if not (0 if any_free else 1) <= port <= 65535:
        raise ValueError(f"{name}={port} is outside 1..65535")
    return port


def kafka_port() -> int:
    return _port("HALFWAY_KAFKA_PORT", DEFAULT_KAFKA_PORT)


def kafka_controller_port() -> int:
    return _port("HALFWAY_KAFKA_CONTROLLER_PORT", DEFAULT_KAFKA_CONTROLLER_PORT)


def kafka_is_external() -> bool:
    """`HALFWAY_KAFKA_BOOTSTRAP` names a broker someone else runs: never start or stop one."""
    return bool(os.environ.get("HALFWAY_KAFKA_BOOTSTRAP"))


def kafka_bootstrap() -> str:
    """Where clients connect: `HALFWAY_KAFKA_BOOTSTRAP` if set, else the local broker."""
    return os.environ.get("HALFWAY_KAFKA_BOOTSTRAP") or f"{HOST}:{kafka_port()}"


def pg_port() -> int:
    return _port("HALFWAY_PG_PORT", DEFAULT_PG_PORT)


def pg_is_external() -> bool:
    """`HALFWAY_PG_DSN` names a database someone else runs: never start or stop one."""
    return bool(os.environ.get("HALFWAY_PG_DSN"))


def pg_dsn(database: str = PG_DATABASE) -> str:
    """The DSN of `database`: `HALFWAY_PG_DSN` if set (with its database replaced when another
    one is asked for), else the local private cluster, superuser over trust auth."""
    external = os.environ.get("HALFWAY_PG_DSN")
    if external:
        if database == PG_DATABASE:
            return external
        return urllib.parse.urlsplit(external)._replace(path=f"/{database}").geturl()
    return f"postgresql://{PG_USER}@{HOST}:{pg_port()}/{database}"


@dataclass(frozen=True, slots=True)
class KafkaSettings:
    bootstrap: str
    topic_prefix: str
    replication_factor: int
    # How clients authenticate and encrypt, as aiokafka's keyword arguments
    # (`security_protocol`, `sasl_mechanism`, ...); empty: plaintext, no authentication.
    security: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_env(cls) -> KafkaSettings:
        return cls(
            bootstrap=kafka_bootstrap(),
            topic_prefix=os.environ.get("HALFWAY_TOPIC_PREFIX", "halfway."),
            replication_factor=int(os.environ.get("HALFWAY_REPLICATION_FACTOR", "1")),
        )

    def client(self) -> dict[str, Any]:
        """The keyword arguments every aiokafka client of halfway is made with: where the
        broker is and how to authenticate to it (the one place for both)."""
        return {"bootstrap_servers": self.bootstrap, **self.security}

    def with_prefix(self, topic_prefix: str) -> KafkaSettings:
        """The same broker and credentials, other topics (tests and benchmarks)."""
        return dataclasses.replace(self, topic_prefix=topic_prefix)


def paysim_url() -> str:
    """The payment provider the `charge_customer` tool talks to (the simulator by default)."""
    return os.environ.get("HALFWAY_PAYSIM_URL", f"http://{HOST}:18080")


def tripsim_url() -> str:
    """The flight, hotel and email providers the travel tools talk to (the simulator)."""
    return os.environ.get("HALFWAY_TRIPSIM_URL", f"http://{HOST}:18081")


def travel_timeout_s() -> float:
    """How long one flight, hotel or email attempt may take before its outcome is unknown."""
    return float(os.environ.get("HALFWAY_TRAVEL_TIMEOUT_S", "5"))


def charge_timeout_s() -> float:
    """How long one charge attempt may take before its outcome is unknown."""
    return float(os.environ.get("HALFWAY_CHARGE_TIMEOUT_S", "5"))


def model_call_log() -> str | None:
    """A file the scripted model appends every question to (shared across processes)."""
    return os.environ.get("HALFWAY_MODEL_CALL_LOG") or None


def reconciler_lookups() -> bool:
    """`HALFWAY_RECONCILER_LOOKUPS=off`: only webhooks (and operators) settle unknown steps."""
    return os.environ.get("HALFWAY_RECONCILER_LOOKUPS", "on").lower() not in ("off", "0", "no")


# paysim finishes every request within its longest fault delay (600 s); a margin on top.
DEFAULT_CHARGE_COMPLETES_WITHIN_S = 660.0


def charge_completes_within_s() -> float | None:
    """How long the payment provider may take to finish any request: past it, a lookup that
    finds nothing proves the charge did not happen. paysim's bound by default; `off` for a
    provider whose search lags (Stripe's does), where nothing found proves nothing."""
    raw = os.environ.get("HALFWAY_CHARGE_COMPLETES_WITHIN_S", "").strip().lower()
    if raw in ("off", "none", "0"):
        return None
    return float(raw) if raw else DEFAULT_CHARGE_COMPLETES_WITHIN_S


def charge_key_ttl_s() -> float:
    """How long the payment provider remembers an idempotency key (Stripe v1: 24 h)."""
    return float(os.environ.get("HALFWAY_CHARGE_KEY_TTL_S", "86400"))


# A task finished this long ago (by the journal's own clock) with every effect settled is
# sealed: the services keep only its end. Stripe retries webhooks for 3 days; a day covers
# late reports of all but the slowest.
DEFAULT_SEAL_AFTER_S = 86_400.0


def seal_after_s() -> float | None:
    """`HALFWAY_SEAL_AFTER_S`: how long after its end a settled task is sealed (`off`: never)."""
    raw = os.environ.get("HALFWAY_SEAL_AFTER_S", "").strip().lower()
    if raw in ("off", "none"):
        return None
    return float(raw) if raw else DEFAULT_SEAL_AFTER_S


DEFAULT_GATEWAY_PORT = 18090
DEFAULT_PAYSIM_WEBHOOK_SECRET = "whsec_halfway_dev"


def gateway_port() -> int:
    """Where the webhook gateway listens for provider webhooks (0: any free port)."""
    return _port("HALFWAY_GATEWAY_PORT", DEFAULT_GATEWAY_PORT, any_free=True)


def gateway_host() -> str:
    """The address the webhook gateway listens on (0.0.0.0 in a container)."""
    return os.environ.get("HALFWAY_GATEWAY_HOST") or HOST


def paysim_webhook_secret() -> str:
    """The endpoint secret paysim signs its webhooks with (a dev default; set it anywhere real)."""
    return os.environ.get("HALFWAY_PAYSIM_WEBHOOK_SECRET") or DEFAULT_PAYSIM_WEBHOOK_SECRET


DEFAULT_PG_SCHEMA = "halfway"


def pg_schema() -> str:
    """The schema of the live read model (a rebuild writes another one, then swaps them)."""
    return os.environ.get("HALFWAY_PG_SCHEMA") or DEFAULT_PG_SCHEMA


DEFAULT_API_PORT = 18100


def api_port() -> int:
    """Where the HTTP API and the web page listen (0: any free port)."""
    return _port("HALFWAY_API_PORT", DEFAULT_API_PORT, any_free=True)


def api_host() -> str:
    """The address the HTTP API listens on (0.0.0.0 in a container)."""
    return os.environ.get("HALFWAY_API_HOST") or HOST
