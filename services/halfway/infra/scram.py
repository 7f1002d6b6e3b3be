"""SCRAM users of the local broker, created or updated in place (AlterUserScramCredentials).

aiokafka authenticates with SCRAM but has no request to create SCRAM users, and the Kafka
distribution's `kafka-configs` is a JVM per user that takes the password on its command line
(visible to every local user in /proc). This is the one request, defined on aiokafka's own
protocol types (KIP-554, API key 51, flexible from version 0).

The request goes to the controller listener, which authenticates the admin with SASL/PLAIN
from the broker's own configuration: the admin's SCRAM credential cannot be a precondition
for creating it, and a broker formatted before SCRAM (a used dev machine) has none. The broker
accepts the salted password only (RFC 5802 `Hi()`: PBKDF2-HMAC with the mechanism's hash), so
the password itself never leaves this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
from collections.abc import Iterator
from typing import Any

from aiokafka.conn import create_conn
from aiokafka.errors import for_code
from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import (
    CompactArray,
    CompactBytes,
    CompactString,
    Int8,
    Int16,
    Int32,
    Schema,
    TaggedFields,
)

SCRAM_SHA_512 = 2  # org.apache.kafka.clients.admin.ScramMechanism
# Kafka's minimum for SCRAM-SHA-512 is 4096; the broker rejects fewer.
ITERATIONS = 8192
SALT_BYTES = 32
REQUEST_TIMEOUT_MS = 30_000
CONNECT_TIMEOUT_S = 30.0


class AlterUserScramCredentialsResponse_v0(Response):
    API_KEY = 51
    API_VERSION = 0
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        ("results", CompactArray(
            ("user", CompactString("utf-8")),
            ("error_code", Int16),
            ("error_message", CompactString("utf-8")),
            ("tags", TaggedFields),
        )),
        ("tags", TaggedFields),
    )


class AlterUserScramCredentialsRequest_v0(RequestStruct):
    API_KEY = 51
    API_VERSION = 0
    FLEXIBLE_VERSION = True
    RESPONSE_TYPE = AlterUserScramCredentialsResponse_v0
    SCHEMA = Schema(
        ("deletions", CompactArray(
            ("name", CompactString("utf-8")),
            ("mechanism", Int8),
            ("tags", TaggedFields),
        )),
        ("upsertions", CompactArray(
            ("name", CompactString("utf-8")),
            ("mechanism", Int8),
            ("iterations", Int32),
            ("salt", CompactBytes),
            ("salted_password", CompactBytes),
            ("tags", TaggedFields),
        )),
        ("tags", TaggedFields),
    )


class AlterUserScramCredentials(Request[AlterUserScramCredentialsRequest_v0]):
    API_KEY = 51

    def __init__(self, upsertions: list[tuple[Any, ...]]) -> None:
        self._upsertions = upsertions

    def build(self, request_struct_class: type[AlterUserScramCredentialsRequest_v0],
              ) -> AlterUserScramCredentialsRequest_v0:
        return request_struct_class([], self._upsertions, {})


def upsertion(user: str, password: str) -> tuple[Any, ...]:
    """One user's SCRAM-SHA-512 credential, salted here (RFC 5802 Hi())."""
    salt = os.urandom(SALT_BYTES)
    salted = hashlib.pbkdf2_hmac("sha512", password.encode(), salt, ITERATIONS)
    return (user, SCRAM_SHA_512, ITERATIONS, salt, salted, {})


class _KnownPlain(logging.Filter):
    """aiokafka warns that PLAIN sends the password in the clear: here it is the controller's
    loopback listener, by design (see above), so `up` does not print it every start."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "in the clear" not in record.getMessage()


@contextlib.contextmanager
def _plain_expected() -> Iterator[None]:
    logger, quiet = logging.getLogger("aiokafka.conn"), _KnownPlain()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


async def upsert_users(host: str, port: int, admin: str, admin_password: str,
                       passwords: dict[str, str]) -> None:
    """Create or update the SCRAM-SHA-512 user of every entry, over the controller listener
    as `admin` (SASL/PLAIN). Raises the broker's error for the first user it refused."""
    with _plain_expected():
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            conn = await create_conn(host, port, security_protocol="SASL_PLAINTEXT",
                                     sasl_mechanism="PLAIN", sasl_plain_username=admin,
                                     sasl_plain_password=admin_password,
                                     request_timeout_ms=REQUEST_TIMEOUT_MS)
    try:
        response = await conn.send(AlterUserScramCredentials(
            [upsertion(user, password) for user, password in sorted(passwords.items())]))
    finally:
        conn.close()
    for user, code, message, _tags in response.results:
        if code:
            raise for_code(code)(f"SCRAM user {user}: {message}")
