"""Topic creation with configs, from the one declaration in halfway.contract.topics."""

from __future__ import annotations

import asyncio

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaTimeoutError,
    TopicAuthorizationFailedError,
    for_code,
)

from halfway import log
from halfway.contract.topics import ALL_TOPICS, TASK_KEYED, TopicSpec
from halfway.settings import KafkaSettings

TOPIC_ALREADY_EXISTS = 36
CREATE_TIMEOUT_MS = 30_000
# A service that starts while its broker is down waits for it: first retry after this long,
# doubling up to BROKER_WAIT_S_MAX between tries (forever: waiting is not crashing).
BROKER_WAIT_S_MIN = 0.5
BROKER_WAIT_S_MAX = 10.0


async def ensure_topics(settings: KafkaSettings,
                        specs: tuple[TopicSpec, ...] = ALL_TOPICS) -> list[str]:
    """Create every topic that does not exist yet; return the names of those created.

    Existing topics are left as they are (their configs are not overwritten): changing a
    journal's retention is an operator's decision, not a side effect of a deploy. On a broker
    with authentication, the prefix's ACLs are created with its topics (`halfway.journal.acls`):
    only a principal allowed to create topics and ACLs (the admin) gets this far.
    """
    admin = AIOKafkaAdminClient(**settings.client())
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        wanted = [s for s in specs if s.name(settings.topic_prefix) not in existing]
        if not wanted:
            return []
        response = await admin.create_topics(
            [NewTopic(name=s.name(settings.topic_prefix),
                      num_partitions=settings.partitions if s.scales else s.partitions,
                      replication_factor=settings.replication_factor, topic_configs=s.configs)
             for s in wanted],
            timeout_ms=CREATE_TIMEOUT_MS,
        )
        created = []
        for topic, code, *message in response.topic_errors:
            if code == 0:
                created.append(topic)
            elif code != TOPIC_ALREADY_EXISTS:  # another process won the race: fine
                raise for_code(code)(f"creating topic {topic}"
                                     f"{f' as {settings.principal}' if settings.principal else ''}"
                                     f": {message[0] if message else ''}")
        log.get("halfway.journal").info("topics created", topics=created)
        if settings.security:
            from halfway.journal.acls import ensure_acls

            await ensure_acls(settings)
        return created
    finally:
        await admin.close()


async def ensure_topics_once_up(settings: KafkaSettings,
                                specs: tuple[TopicSpec, ...] = ALL_TOPICS) -> list[str]:
    """`ensure_topics`, waiting for the broker if it cannot be reached yet (a service restarted
    while the broker is down waits for it instead of exiting in a loop)."""
    logger = log.get("halfway.journal")
    delay_s = BROKER_WAIT_S_MIN
    while True:
        try:
            created = await ensure_topics(settings, specs)
            await check_layout(settings, tuple(s for s in specs if s in TASK_KEYED))
            return created
        except TopicAuthorizationFailedError as exc:
            # A service may not create topics: the admin (`halfway topics`, `halfway dev`,
            # `infra/dev up`) has not created this prefix's yet.
            logger.warning("waiting for the topics: this principal may not create them",
                           principal=settings.principal, prefix=settings.topic_prefix,
                           error=str(exc)[:300], retry_in_s=delay_s)
            await asyncio.sleep(delay_s)
            delay_s = min(BROKER_WAIT_S_MAX, delay_s * 2)
        except (KafkaConnectionError, KafkaTimeoutError, OSError) as exc:
            logger.warning("waiting for the broker", bootstrap=settings.bootstrap,
                           error=str(exc)[:300], retry_in_s=delay_s)
            await asyncio.sleep(delay_s)
            delay_s = min(BROKER_WAIT_S_MAX, delay_s * 2)


class TopicLayoutError(ValueError):
    """The topics cannot work together (their partition counts differ): an operator's
    decision, never something a service can wait out."""


async def check_layout(settings: KafkaSettings, specs: tuple[TopicSpec, ...]) -> None:
    """Topics keyed by task id must have one partition count: partition n of each holds the
    same tasks, and a service instance reads the same numbers of all of them."""
    if len(specs) < 2:
        return
    counts = {}
    for spec in specs:
        name = spec.name(settings.topic_prefix)
        counts[name] = len(await topic_partitions(settings, name))
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{name}: {n}" for name, n in counts.items())
        raise TopicLayoutError(
            f"topics keyed by task id have different partition counts ({listed}); they must "
            f"agree: recreate them under a new HALFWAY_TOPIC_PREFIX with HALFWAY_PARTITIONS "
            f"set (an existing journal's count cannot change, see docs/architecture.md)")


async def delete_topics(settings: KafkaSettings, specs: tuple[TopicSpec, ...] = ALL_TOPICS) -> None:
    """Delete a prefix's topics (and, on a broker with authentication, its ACLs once none of
    its topics is left): for tests and benchmarks that made their own, never journals in use
    (there is no undo)."""
    admin = AIOKafkaAdminClient(**settings.client())
    await admin.start()
    try:
        existing = set(await admin.list_topics())
        names = [s.name(settings.topic_prefix) for s in specs]
        await admin.delete_topics([n for n in names if n in existing], timeout_ms=CREATE_TIMEOUT_MS)
    finally:
        await admin.close()
    left = {s.name(settings.topic_prefix) for s in ALL_TOPICS} & existing - set(names)
    if settings.security and not left:
        from halfway.journal.acls import delete_acls

        await delete_acls(settings)


async def topic_partitions(settings: KafkaSettings, topic: str) -> set[int]:
    """The partition numbers a topic has now. A consumer's own metadata covers only what it
    subscribed to, and the producer spreads keys over the real count: ask the cluster."""
    admin = AIOKafkaAdminClient(**settings.client())
    await admin.start()
    try:
        (described,) = await admin.describe_topics([topic])
    finally:
        await admin.close()
    if described["error_code"] != 0 or not described["partitions"]:
        raise LookupError(f"topic {topic} does not exist (error {described['error_code']})")
    return {p["partition"] for p in described["partitions"]}


async def cluster_id(settings: KafkaSettings) -> str:
    """The Kafka cluster's id: offsets are only comparable within one cluster."""
    admin = AIOKafkaAdminClient(**settings.client())
    await admin.start()
    try:
        return str((await admin.describe_cluster())["cluster_id"])
    finally:
        await admin.close()
