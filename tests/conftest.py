"""Shared fixtures. Tests marked `broker` use the real Kafka broker and PostgreSQL.

`infra/dev test` starts both before pytest runs; a bare `pytest` starts them here (it is a
no-op when they run). When they cannot be started the tests fail, never skip.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest
from hypothesis import settings

from halfway import settings as env
from halfway.contract.topics import ALL_TOPICS
from halfway.journal import JournalWriter, ensure_topics
from halfway.journal.admin import delete_topics
from halfway.projector import store
from halfway.settings import KafkaSettings

# Before any test module (or the chaos benchmark a test imports) imports it: its asserts are
# what the broker tests' failure messages are made of.
pytest.register_assert_rewrite("tests.processes")

# No timing assertions, Hypothesis's per-example deadline included: the suite runs in several
# processes on a 2-core machine, where an example's time says nothing about the code.
settings.register_profile("halfway", deadline=None)
settings.load_profile("halfway")


@pytest.fixture(scope="session")
def infrastructure() -> None:
    from halfway.infra import kafka, postgres

    for component in (kafka, postgres):
        if not component.is_external():
            component.up()  # raises InfraError, failing the test, when it cannot start


@pytest.fixture(scope="session")
def kafka_settings(infrastructure: None) -> KafkaSettings:
    # A fresh topic prefix per test session: tests never see records of an earlier run.
    base = KafkaSettings.from_env()
    return base.with_prefix(f"test-{uuid.uuid4().hex[:8]}.")


@pytest.fixture(scope="session")
async def topics(kafka_settings: KafkaSettings) -> AsyncIterator[KafkaSettings]:
    created = await ensure_topics(kafka_settings, ALL_TOPICS)
    assert len(created) == len(ALL_TOPICS)
    yield kafka_settings
    await delete_topics(kafka_settings, ALL_TOPICS)  # a shared dev broker does not fill up


@pytest.fixture
async def own_deployment(kafka_settings: KafkaSettings) -> AsyncIterator[KafkaSettings]:
    """Every topic under a prefix of this test's own. For tests that run whole services: a
    decider or executor acts on every task it sees, and on the session's shared topics it would
    act on other tests' tasks (and they on its)."""
    settings = kafka_settings.with_prefix(f"own-{uuid.uuid4().hex[:8]}.")
    await ensure_topics(settings, ALL_TOPICS)
    yield settings
    await delete_topics(settings, ALL_TOPICS)


@pytest.fixture(scope="session")
async def writer(topics: KafkaSettings) -> AsyncIterator[JournalWriter]:
    async with JournalWriter(topics) as w:
        yield w


@pytest.fixture
async def pg(kafka_settings: KafkaSettings) -> AsyncIterator[asyncpg.Connection]:
    """A connection to the read model's PostgreSQL (kafka_settings: the infrastructure is up)."""
    conn = await store.connect(env.pg_dsn())
    yield conn
    await conn.close()


@pytest.fixture
async def schema(pg: asyncpg.Connection) -> AsyncIterator[str]:
    """A schema name of this test's own; it, its rebuild and its old copy are dropped after."""
    name = f"t_{uuid.uuid4().hex[:8]}"
    yield name
    for suffix in ("", "_rebuild", "_old"):
        await store.drop_schema(pg, name + suffix)


@pytest.fixture(autouse=True)
async def _close_unstarted_followers() -> AsyncIterator[None]:
    yield
    from tests.followers import close_made

    await close_made()
