"""Who may write what: one Kafka principal per kind of process, and the ACLs of a topic prefix.

Theory of operation
-------------------
Kafka authenticates a client (SASL/SCRAM or a TLS certificate) and authorizes each request
against ACLs. Every process of halfway connects as the principal of its kind
(`halfway.settings.KAFKA_KINDS`: `User:decider`, `User:caller`, ...), and each kind is allowed
only the writes it needs (`WRITES`); `allow.everyone.if.no.acl.found=false` makes everything
else a refusal. Callers write the tasks topic only; only the decider, executor, reconciler and
the operator tools (`operator`, and `api` acting for an operator) write the journal; only the
gateway writes webhooks; only the outcomes service writes outcomes; only deciders write guards.
Reads are wider (`READS`): reading is not how the audit's forgeries worked.

Topic names are `prefix + suffix`, and ACLs cannot match a suffix, so every prefix (a
deployment, or a test's own topics) gets its own LITERAL bindings, created with its topics by
the admin (`ensure_topics`) and deleted with them (`delete_topics`). Every kind may describe
every topic of its prefix (one PREFIXED binding), so a service that starts finds its topics
instead of trying to create them.

The journal's trust boundary is the topic, by decision
-----------------------------------------------------
Kafka does not stamp a record with its writer, so the journal (several writers, one order per
task) has three options: accept the topic-level boundary, sign events per writer kind (HMAC), or
split topics. We accept the topic-level boundary, because:

- The journal's writers (decider, executor, reconciler, operator tools) are one trust domain:
  the executor already acts on whatever the decider intends, and holds the provider
  credentials; a compromised writer can charge a customer directly, with or without forging a
  journal event. A per-kind HMAC would need every reader (each folds every event) to hold every
  kind's key, and a symmetric key a reader holds is a key it can forge with; asymmetric
  signatures would add a key service and a signature check per event to the fold's hot path
  for no reduction of what a compromised writer can already do.
- Splitting the journal by writer loses the one total order per task the fold relies on
  (first in log wins, fencing of stale deciders, write-before-acting).
- What the audit did (a forged `step.intended`, `step.settled`, `outcome.changed` from a client
  that could merely reach the broker) is refused by the broker: those clients are no longer
  journal writers. Inside the boundary the fold still refuses what no honest writer journals
  (`halfway.core.fold`): a decision for a task that never started, and a settlement written
  before its step was decided, each kept with the reason in the task's state.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from aiokafka.conn import AIOKafkaConnection, create_conn
from aiokafka.errors import (
    AuthenticationFailedError,
    AuthenticationMethodNotSupported,
    IllegalSaslStateError,
    KafkaConnectionError,
    KafkaError,
    SaslAuthenticationFailed,
    UnsupportedSaslMechanismError,
    for_code,
)
from aiokafka.protocol.admin import (
    CreateAclsRequest_v1,
    DeleteAclsRequest_v1,
    DescribeAclsRequest,
)
from aiokafka.protocol.api import Request

from halfway.contract.topics import (
    DEAD_LETTERS,
    GUARDS,
    JOURNAL,
    OUTCOMES,
    SNAPSHOTS,
    TASKS,
    WEBHOOKS,
    TopicSpec,
)
from halfway.settings import KafkaSettings, bootstrap_addresses

# Kafka's protocol codes (org.apache.kafka.common.resource / acl).
ANY_RESOURCE, TOPIC, GROUP = 1, 2, 3
ANY_PATTERN, LITERAL, PREFIXED = 1, 3, 4
ANY_OPERATION, READ, WRITE, DESCRIBE = 1, 3, 4, 8
ANY_PERMISSION, ALLOW = 1, 3
ANY_HOST = "*"
REQUEST_TIMEOUT_MS = 30_000
CONNECT_TIMEOUT_S = 30.0
# CreateAcls answers once the controller has them; each broker's authorizer applies them from
# the metadata log a moment later. ensure_acls waits for that, at most this long.
PROPAGATION_TIMEOUT_S = 30.0
PROPAGATION_POLL_S = 0.05

FOLLOWER = (SNAPSHOTS,)  # a journal follower keeps its images there (halfway.journal.snapshots)

# The writes each kind needs, and nothing more (dead letters: every consumer that meets a
# record it cannot apply sets it aside there).
WRITES: dict[str, tuple[TopicSpec, ...]] = {
    "caller": (TASKS,),
    "decider": (JOURNAL, GUARDS, DEAD_LETTERS, *FOLLOWER),
    "executor": (JOURNAL, DEAD_LETTERS, *FOLLOWER),
    "reconciler": (JOURNAL, DEAD_LETTERS, *FOLLOWER),
    "outcomes": (OUTCOMES, DEAD_LETTERS, *FOLLOWER),
    "projector": (DEAD_LETTERS, *FOLLOWER),  # snapshots, as a follower
    "gateway": (WEBHOOKS,),
    # The HTTP API acts for people: starts tasks, and aborts and resolves as an operator tool.
    "api": (TASKS, JOURNAL),
    "operator": (JOURNAL,),  # `halfway resolve` and `halfway abort`
}
READS: dict[str, tuple[TopicSpec, ...]] = {
    "caller": (JOURNAL, OUTCOMES),  # task_state, wait_finished, the outcome stream
    "decider": (JOURNAL, TASKS, GUARDS, *FOLLOWER),
    "executor": (JOURNAL, *FOLLOWER),
    "reconciler": (JOURNAL, WEBHOOKS, *FOLLOWER),
    "outcomes": (JOURNAL, OUTCOMES, *FOLLOWER),
    "projector": (JOURNAL, *FOLLOWER),
    "gateway": (JOURNAL,),  # where a task's journal ends, to order a webhook after it
    "api": (JOURNAL, TASKS, OUTCOMES),
    "operator": (JOURNAL, TASKS, WEBHOOKS, OUTCOMES, GUARDS, DEAD_LETTERS),
}
# Consumer groups, `{prefix}{kind}`: the services that share work in a group.
GROUPS = ("decider", "executor", "reconciler", "outcomes", "projector")


@dataclass(frozen=True, slots=True)
class Binding:
    """One ACL: `principal` may do `operation` on the resource."""

    resource_type: int
    resource_name: str
    pattern: int
    principal: str
    operation: int

    def as_creation(self) -> tuple[Any, ...]:
        return (self.resource_type, self.resource_name, self.pattern, self.principal, ANY_HOST,
                self.operation, ALLOW)


def bindings(prefix: str) -> list[Binding]:
    """Every ACL of one topic prefix, from the tables above."""
    out: list[Binding] = []
    for kind in sorted(set(WRITES) | set(READS)):
        user = f"User:{kind}"
        out.append(Binding(TOPIC, prefix, PREFIXED, user, DESCRIBE))
        out += [Binding(TOPIC, s.name(prefix), LITERAL, user, WRITE) for s in WRITES.get(kind, ())]
        out += [Binding(TOPIC, s.name(prefix), LITERAL, user, READ) for s in READS.get(kind, ())]
        if kind in GROUPS:
            out.append(Binding(GROUP, f"{prefix}{kind}", LITERAL, user, READ))
    return out


def may_write(kind: str, spec: TopicSpec) -> bool:
    return spec in WRITES.get(kind, ())


class _CreateAcls(Request[CreateAclsRequest_v1]):
    """aiokafka's CreateAclsRequest carries one ACL; this one carries them all."""

    API_KEY = 30

    def __init__(self, creations: list[tuple[Any, ...]]) -> None:
        self._creations = creations

    def build(self, request_struct_class: type[CreateAclsRequest_v1]) -> CreateAclsRequest_v1:
        return request_struct_class(self._creations)


class _DeleteAcls(Request[DeleteAclsRequest_v1]):
    API_KEY = 31

    def __init__(self, filters: list[tuple[Any, ...]]) -> None:
        self._filters = filters

    def build(self, request_struct_class: type[DeleteAclsRequest_v1]) -> DeleteAclsRequest_v1:
        return request_struct_class(self._filters)


# The broker refuses these credentials: every broker checks the same ones, and waiting would
# not mend it.
AUTHENTICATION_ERRORS = (SaslAuthenticationFailed, UnsupportedSaslMechanismError,
                         IllegalSaslStateError, AuthenticationFailedError,
                         AuthenticationMethodNotSupported)
ERROR_CHARS_MAX = 300  # of one broker's error, in the error of none answering


async def connect(settings: KafkaSettings, *, timeout_s: float = CONNECT_TIMEOUT_S,
                  ) -> AIOKafkaConnection:
    """One authenticated connection to a broker of the bootstrap list (the first that
    answers): for the requests aiokafka's clients do not offer, or whose answers they do not
    pass on. A refused login raises its AUTHENTICATION_ERRORS at once; no broker answering
    within `timeout_s` each, KafkaConnectionError."""
    errors = []
    for host, port in bootstrap_addresses(settings.bootstrap):
        try:
            async with asyncio.timeout(timeout_s):
                return await create_conn(host, port, request_timeout_ms=REQUEST_TIMEOUT_MS,
                                         **settings.security)
        except AUTHENTICATION_ERRORS:
            raise
        except (KafkaError, OSError, TimeoutError) as exc:  # the next broker may answer
            errors.append(f"{host}:{port}: {type(exc).__name__}: {exc}"[:ERROR_CHARS_MAX])
    raise KafkaConnectionError(f"no broker of {settings.bootstrap} answered: "
                               f"{'; '.join(errors)}")


async def ensure_acls(settings: KafkaSettings) -> int:
    """Create every ACL of the settings' topic prefix (creating one that exists is a no-op);
    return how many were asked for. Needs a principal allowed to alter ACLs (the admin)."""
    wanted = bindings(settings.topic_prefix)
    conn = await connect(settings)
    try:
        response = await conn.send(_CreateAcls([b.as_creation() for b in wanted]))
        for code, message in response.creation_responses:
            if code:
                raise for_code(code)(f"creating the ACLs of {settings.topic_prefix}*: {message}")
        # Until the broker's authorizer has them, a service that starts now would be refused.
        try:
            async with asyncio.timeout(PROPAGATION_TIMEOUT_S):
                while True:  # polled: the broker tells no one when it applies them
                    if set(wanted) <= await _visible(conn):
                        break
                    await asyncio.sleep(PROPAGATION_POLL_S)
        except TimeoutError:
            raise TimeoutError(f"the broker did not apply the ACLs of {settings.topic_prefix}* "
                               f"within {PROPAGATION_TIMEOUT_S:g} s") from None
    finally:
        conn.close()
    return len(wanted)


async def _visible(conn: AIOKafkaConnection) -> set[Binding]:
    """The ALLOW bindings the connected broker's authorizer holds now."""
    response = await conn.send(DescribeAclsRequest(ANY_RESOURCE, None, ANY_PATTERN, None, None,
                                                   ANY_OPERATION, ANY_PERMISSION))
    if response.error_code:
        raise for_code(response.error_code)(f"describing ACLs: {response.error_message}")
    return {Binding(kind, name, pattern, principal, operation)
            for kind, name, pattern, acls in response.resources
            for principal, _host, operation, permission in acls if permission == ALLOW}


async def delete_acls(settings: KafkaSettings) -> int:
    """Delete every ACL of the settings' topic prefix (with its topics); return how many."""
    resources = sorted({(b.resource_type, b.resource_name, b.pattern)
                        for b in bindings(settings.topic_prefix)})
    conn = await connect(settings)
    try:
        response = await conn.send(_DeleteAcls(
            [(kind, name, pattern, None, None, ANY_OPERATION, ANY_PERMISSION)
             for kind, name, pattern in resources]))
    finally:
        conn.close()
    deleted = 0
    for code, message, matching in response.filter_responses:
        if code:
            raise for_code(code)(f"deleting the ACLs of {settings.topic_prefix}*: {message}")
        deleted += len(matching)
    return deleted
