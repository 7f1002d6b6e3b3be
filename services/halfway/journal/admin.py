"""Topic creation with configs, from the one declaration in halfway.contract.topics; and what a
service checks at start before it serves: that the broker answers, that its topics exist, that
the broker accepts its credentials and that its principal has the rights its kind needs."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.conn import AIOKafkaConnection
from aiokafka.errors import (
    ClusterAuthorizationFailedError,
    GroupAuthorizationFailedError,
    IncompatibleBrokerVersion,
    KafkaConnectionError,
    KafkaError,
    KafkaTimeoutError,
    TopicAuthorizationFailedError,
    TransactionalIdAuthorizationFailed,
    UnsupportedSaslMechanismError,
    for_code,
)
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.coordination import FindCoordinatorRequest
from aiokafka.protocol.types import Array, Boolean, Int16, Int32, Schema, String

from halfway import log
from halfway.contract.topics import ALL_TOPICS, TASK_KEYED, TopicSpec
from halfway.journal.acls import (
    AUTHENTICATION_ERRORS,
    GROUPS,
    READ,
    READS,
    WRITE,
    WRITES,
    connect,
)
from halfway.settings import (
    KafkaSettings,
    SettingsError,
    kafka_credentials_source,
)

TOPIC_ALREADY_EXISTS = 36
CREATE_TIMEOUT_MS = 30_000
# A service that starts while its broker is down waits for it: first retry after this long,
# doubling up to BROKER_WAIT_S_MAX between tries (forever: waiting is not crashing).
BROKER_WAIT_S_MIN = 0.5
BROKER_WAIT_S_MAX = 10.0
# One connection of our own to a broker, to ask what aiokafka's clients do not say (why a login
# failed, what this principal may do): at most this long per broker of the bootstrap list.
CONNECT_TIMEOUT_S = 10.0
ERROR_CHARS_MAX = 300

# The broker refuses this principal a right: neither would it.
AUTHORIZATION_ERRORS = (TopicAuthorizationFailedError, GroupAuthorizationFailedError,
                        ClusterAuthorizationFailedError, TransactionalIdAuthorizationFailed)


class KafkaAccessError(SettingsError):
    """The broker refuses this process: its credentials, or a right its principal lacks. The
    message says which user, what and which settings to check, never the password; like any
    setting halfway cannot use, it stops the process with that line (exit 2)."""


async def ensure_topics(settings: KafkaSettings,
                        specs: tuple[TopicSpec, ...] = ALL_TOPICS) -> list[str]:
    """Create every topic that does not exist yet; return the names of those created.

    Existing topics are left as they are (their configs are not overwritten): changing a
    journal's retention is an operator's decision, not a side effect of a deploy. On a broker
    with authentication, the prefix's ACLs are created with its topics (`halfway.journal.acls`):
    only a principal allowed to create topics and ACLs (the admin) gets this far.
    """
    admin = AIOKafkaAdminClient(**settings.client())
    try:  # closed also when it never started (the broker did not answer, or a stop)
        await admin.start()
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
    while the broker is down waits for it instead of exiting in a loop). A broker that refuses
    the credentials is not waited for: KafkaAccessError."""
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
            await check_login(settings)
            logger.warning("waiting for the broker", bootstrap=settings.bootstrap,
                           error=str(exc)[:ERROR_CHARS_MAX], retry_in_s=delay_s)
            await asyncio.sleep(delay_s)
            delay_s = min(BROKER_WAIT_S_MAX, delay_s * 2)


async def unless_stopped(stop: asyncio.Event, work: Awaitable[object]) -> bool:
    """Await `work` unless `stop` is set first, which cancels it: whether it finished (its
    error is raised). For a process whose signal handlers set an event (to let requests in
    flight finish once it serves): a stop must also end its wait for a broker that may never
    answer."""
    working = asyncio.ensure_future(work)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait((working, stopping), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for future in (working, stopping):
            future.cancel()  # a no-op on one that is done
        await asyncio.gather(working, stopping, return_exceptions=True)  # its cleanup, done
    if working.cancelled():
        return False
    working.result()
    return True


# --- credentials and rights ---------------------------------------------------------------------


async def _connect(settings: KafkaSettings) -> AIOKafkaConnection:
    """`acls.connect`, a refused login as KafkaAccessError; no broker answering,
    KafkaConnectionError."""
    try:
        return await connect(settings, timeout_s=CONNECT_TIMEOUT_S)
    except AUTHENTICATION_ERRORS as exc:
        raise _login_refused(settings, settings.bootstrap, exc) from None


async def check_login(settings: KafkaSettings) -> None:
    """Raise KafkaAccessError if a broker refuses these credentials. aiokafka's clients log
    why a connection failed and raise a bare KafkaConnectionError ("Unable to bootstrap"), so a
    wrong password looks like a broker that is down: ask one broker over a connection of ours."""
    if "sasl_mechanism" not in settings.security:
        return  # no login to refuse
    try:
        conn = await _connect(settings)
    except KafkaConnectionError:
        return  # nobody answers: waiting is right
    conn.close()


def _login_refused(settings: KafkaSettings, address: str, exc: KafkaError) -> KafkaAccessError:
    user, mechanism = settings.principal, settings.security.get("sasl_mechanism")
    if isinstance(exc, UnsupportedSaslMechanismError):
        why, check = (f"does not offer the SASL mechanism {mechanism} (user {user})",
                      "HALFWAY_KAFKA_SASL_MECHANISM")
    else:
        why, check = (f"refused user {user} over {mechanism}: a wrong password, or no such "
                      "user", kafka_credentials_source())
    return KafkaAccessError(f"the Kafka broker at {address} {why} ({type(exc).__name__}); "
                            f"check {check}")


# A topic's authorized operations have bit 1 << code set for each ACL operation allowed.
OPERATION_NAMES = {READ: "READ", WRITE: "WRITE"}
NOT_ASKED = -(2**31)  # the authorized operations of a broker that did not compute them


class _MetadataResponseV8(Response):
    API_KEY = 3
    API_VERSION = 8
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        ("brokers", Array(("node_id", Int32), ("host", String("utf-8")), ("port", Int32),
                          ("rack", String("utf-8")))),
        ("cluster_id", String("utf-8")),
        ("controller_id", Int32),
        ("topics", Array(
            ("error_code", Int16), ("topic", String("utf-8")), ("is_internal", Boolean),
            ("partitions", Array(("error_code", Int16), ("partition", Int32), ("leader", Int32),
                                 ("leader_epoch", Int32), ("replicas", Array(Int32)),
                                 ("isr", Array(Int32)), ("offline_replicas", Array(Int32)))),
            ("authorized_operations", Int32))),
        ("cluster_authorized_operations", Int32),
    )


class _MetadataRequestV8(RequestStruct):
    API_KEY = 3
    API_VERSION = 8
    RESPONSE_TYPE = _MetadataResponseV8
    SCHEMA = Schema(
        ("topics", Array(String("utf-8"))), ("allow_auto_topic_creation", Boolean),
        ("include_cluster_authorized_operations", Boolean),
        ("include_topic_authorized_operations", Boolean),
    )


class _AuthorizedOperations(Request[_MetadataRequestV8]):
    """A metadata request that asks what the principal may do on each topic (KIP-430):
    aiokafka's own stops at version 5, before the question was added."""

    API_KEY = 3

    def __init__(self, topics: list[str]) -> None:
        self._topics = topics

    def build(self, request_struct_class: type[_MetadataRequestV8]) -> _MetadataRequestV8:
        return request_struct_class(self._topics, False, False, True)


def needed_topics(kind: str) -> tuple[TopicSpec, ...]:
    """The topics a process of `kind` reads or writes (halfway.journal.acls)."""
    return tuple(s for s in ALL_TOPICS if s in WRITES.get(kind, ()) + READS.get(kind, ()))


async def check_access(settings: KafkaSettings, kind: str) -> None:
    """Raise KafkaAccessError, naming every right missing, if this process's principal lacks
    one that `kind` needs (halfway.journal.acls): a process run with another kind's credentials
    stops at start with why, instead of dying at its first fetch or refusing each write as if it
    were temporary. Nothing is written: the broker says what the principal may do on each topic
    (a metadata request) and whether it may use its consumer group (finding its coordinator
    takes the right to describe it). A broker too old to say is not checked."""
    prefix = settings.topic_prefix
    needs = ([(WRITE, s.name(prefix)) for s in WRITES.get(kind, ())]
             + [(READ, s.name(prefix)) for s in READS.get(kind, ())])
    missing = []
    conn = await _connect(settings)
    try:
        try:
            response = await conn.send(_AuthorizedOperations(sorted({t for _, t in needs})))
        except (IncompatibleBrokerVersion, NotImplementedError):
            return
        allowed = {topic: operations if code == 0 else 0
                   for code, topic, _, _, operations in response.topics}
        for operation, topic in needs:
            operations = allowed.get(topic, 0)
            if operations != NOT_ASKED and not operations >> operation & 1:
                missing.append(f"{OPERATION_NAMES[operation]} topic {topic}")
        if kind in GROUPS:
            group = f"{prefix}{kind}"
            found = await conn.send(FindCoordinatorRequest(group, 0))
            if found.error_code == GroupAuthorizationFailedError.errno:
                missing.append(f"READ consumer group {group}")
    finally:
        conn.close()
    if missing:
        raise KafkaAccessError(f"{_who(settings)} may not {', '.join(missing)}, which a {kind} "
                               f"needs: {_remedy(settings, kind)}")


def access_refused(settings: KafkaSettings, kind: str, exc: KafkaError) -> KafkaAccessError:
    """The line for an authorization error a running process of `kind` met (AUTHORIZATION_ERRORS:
    the right is missing, or was taken away, after `check_access`)."""
    what = {GroupAuthorizationFailedError: "its consumer group",
            ClusterAuthorizationFailedError: "the cluster",
            TransactionalIdAuthorizationFailed: "a transactional id"}.get(type(exc), "a topic")
    detail = str(exc.args[0])[:ERROR_CHARS_MAX] if exc.args else ""
    return KafkaAccessError(f"{_who(settings)} lacks a right a {kind} needs on {what} "
                            f"({type(exc).__name__}: {detail}): {_remedy(settings, kind)}")


def _who(settings: KafkaSettings) -> str:
    user = settings.principal
    return f"the Kafka principal User:{user}" if user else "this process's Kafka principal"


def _remedy(settings: KafkaSettings, kind: str) -> str:
    principal = f"User:{settings.principal}" if settings.principal else "it"
    return (f"run it with a {kind}'s credentials (check {kafka_credentials_source()}), or give "
            f"{principal} a {kind}'s ACLs on the prefix {settings.topic_prefix} "
            f"(docs/security.md, \"Which principal a process uses\")")


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
