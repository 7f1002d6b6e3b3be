"""Where things are: the one place that reads halfway's environment variables.

The local setup (`infra/dev`), the tests and docker-compose.yml all configure the services
through these same variables.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_KAFKA_PORT = 19092
DEFAULT_PG_PORT = 15432


def kafka_port() -> int:
    return int(os.environ.get("HALFWAY_KAFKA_PORT", DEFAULT_KAFKA_PORT))


def kafka_bootstrap() -> str:
    """`HALFWAY_KAFKA_BOOTSTRAP` names an external broker; else the local one on its port."""
    return os.environ.get("HALFWAY_KAFKA_BOOTSTRAP") or f"127.0.0.1:{kafka_port()}"


def pg_port() -> int:
    return int(os.environ.get("HALFWAY_PG_PORT", DEFAULT_PG_PORT))


def pg_dsn(database: str = "halfway") -> str:
    """`HALFWAY_PG_DSN` names an external PostgreSQL; else the local private cluster."""
    return (os.environ.get("HALFWAY_PG_DSN")
            or f"postgresql://postgres@127.0.0.1:{pg_port()}/{database}")


@dataclass(frozen=True, slots=True)
class KafkaSettings:
    bootstrap: str
    topic_prefix: str
    replication_factor: int

    @classmethod
    def from_env(cls) -> KafkaSettings:
        return cls(
            bootstrap=kafka_bootstrap(),
            topic_prefix=os.environ.get("HALFWAY_TOPIC_PREFIX", "halfway."),
            replication_factor=int(os.environ.get("HALFWAY_REPLICATION_FACTOR", "1")),
        )
