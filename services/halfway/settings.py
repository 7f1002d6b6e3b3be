"""Where things are: the one place that reads halfway's environment variables.

The local setup (`infra/dev`, `halfway.infra`), the tests and docker-compose.yml all configure
the services through these same variables.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import math
import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HOST = "127.0.0.1"
DEFAULT_KAFKA_PORT = 19092
DEFAULT_KAFKA_CONTROLLER_PORT = 19093
DEFAULT_PG_PORT = 15432
PG_USER = "postgres"
PG_DATABASE = "halfway"


class SettingsError(ValueError):
    """An environment variable halfway reads holds a value it cannot use: the message names the
    variable, the value and what it takes (the CLI prints it and exits 2, no traceback)."""


PORT_MAX = 65535


def _port(name: str, default: int, *, any_free: bool = False) -> int:
    """A port from the environment; with `any_free`, 0 means "pick a free one"."""
    return int(number_from_env(name, default, whole=True, low=0 if any_free else 1,
                               high=PORT_MAX))


def number_from_env(name: str, default: float, *, whole: bool = False, low: float = 0.0,
                    high: float = math.inf, above_low: bool = False) -> float:
    """A finite number from the environment (a whole one with `whole`) within low..high (above
    `low` with `above_low`); unset or blank: `default`."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw) if whole else float(raw)
    except ValueError:
        kind = "a whole number" if whole else "a number"
        raise SettingsError(f"{name}={raw[:40]!r} is not {kind}") from None
    if not math.isfinite(value) or value < low or value > high or (above_low and value == low):
        if high != math.inf:
            raise SettingsError(f"{name}={raw[:40]} is outside {low:g}..{high:g}")
        floor = f"above {low:g}" if above_low else f"at least {low:g}"
        raise SettingsError(f"{name}={raw[:40]} must be {floor}")
    return value


def kafka_port() -> int:
    return _port("HALFWAY_KAFKA_PORT", DEFAULT_KAFKA_PORT)


def kafka_controller_port() -> int:
    return _port("HALFWAY_KAFKA_CONTROLLER_PORT", DEFAULT_KAFKA_CONTROLLER_PORT)


BOOTSTRAP_ENV = "HALFWAY_KAFKA_BOOTSTRAP"
HOST_CHARS_MAX = 253  # the longest DNS name
SHOWN_CHARS_MAX = 80  # of a bad value, in its error
_HOST_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # a DNS name or an IPv4 address
_PORT = re.compile(r"[0-9]{1,5}")


def kafka_is_external() -> bool:
    """`HALFWAY_KAFKA_BOOTSTRAP` names a broker someone else runs: never start or stop one."""
    return bool(os.environ.get(BOOTSTRAP_ENV))


def kafka_bootstrap() -> str:
    """Where clients connect: `HALFWAY_KAFKA_BOOTSTRAP` if set (checked: a bad one is a
    SettingsError here, not a traceback from deep inside aiokafka), else the local broker."""
    raw = os.environ.get(BOOTSTRAP_ENV)
    if not raw:
        return f"{HOST}:{kafka_port()}"
    bootstrap_addresses(raw)
    return raw


def bootstrap_addresses(bootstrap: str) -> list[tuple[str, int]]:
    """(host, port) of each broker of a bootstrap list: `host:port` separated by commas, an
    IPv6 address in brackets (`[::1]:9092`, returned without them). Raises SettingsError."""
    out = []
    for given in bootstrap.split(","):
        entry = given.strip()
        if entry.startswith("["):
            host, bracket, port = entry[1:].partition("]:")
            valid = bool(bracket) and _is_ipv6(host)
        else:
            host, colon, port = entry.partition(":")
            valid = (bool(colon) and len(host) <= HOST_CHARS_MAX
                     and bool(_HOST_NAME.fullmatch(host)))
        if not (valid and _PORT.fullmatch(port) and 1 <= int(port) <= PORT_MAX):
            which = "" if entry == bootstrap.strip() else f": {entry[:SHOWN_CHARS_MAX]!r}"
            raise SettingsError(
                f"{BOOTSTRAP_ENV}={bootstrap[:SHOWN_CHARS_MAX]!r}{which} is not host:port "
                f"(brokers separated by commas, ports 1..{PORT_MAX}, an IPv6 address in "
                "brackets: [::1]:9092)")
        out.append((host, int(port)))
    return out


def _is_ipv6(host: str) -> bool:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        return False
    return True


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


# --- how clients authenticate to Kafka (docs/security.md) ---------------------------------------

# One principal per kind of process: each has only the rights its kind needs
# (halfway.journal.acls). `admin` creates topics and ACLs (tests, `halfway topics`, `halfway dev`).
KAFKA_KINDS = ("admin", "caller", "decider", "executor", "reconciler", "outcomes", "projector",
               "gateway", "api", "operator")
SECURITY_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
SASL_MECHANISMS = ("SCRAM-SHA-512", "SCRAM-SHA-256", "PLAIN")
DEFAULT_SASL_MECHANISM = "SCRAM-SHA-512"
PASSWORD_FILE_BYTES_MAX = 4096
_SECURITY_ENV = tuple(f"HALFWAY_KAFKA_{name}" for name in (
    "SECURITY_PROTOCOL", "SASL_MECHANISM", "USERNAME", "PASSWORD", "PASSWORD_FILE", "SSL_CAFILE",
    "SSL_CERTFILE", "SSL_KEYFILE"))


class KafkaSecurityError(ValueError):
    """The Kafka security settings cannot work together; the message says which and why (it
    never quotes a password)."""


def kafka_dev_credentials_file() -> Path:
    """Where `infra/dev up` keeps the local broker's generated passwords (one per kind, 0600)."""
    from halfway.infra import paths  # stdlib only; imported late to keep this module light

    return paths.kafka_home() / "credentials.json"


def kafka_dev_credentials(path: Path | None = None) -> dict[str, str] | None:
    """The local dev broker's passwords by kind (from `path`, default the one under
    HALFWAY_HOME), or None when it runs without them."""
    path = path or kafka_dev_credentials_file()
    try:
        raw = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise KafkaSecurityError(f"cannot read {path}: {exc.strerror}") from None
    try:
        found = json.loads(raw)["passwords"]
        if not isinstance(found, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in found.items()):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        raise KafkaSecurityError(f"{path} is not a credentials file of `infra/dev up` "
                                 "(delete it and run `infra/dev down kafka` and `up`)") from None
    return found


def _env(name: str) -> str | None:
    value = os.environ.get(name, "").strip()
    return value or None


def _read_password_file(path: str) -> str:
    try:
        with open(path, "rb") as f:
            raw = f.read(PASSWORD_FILE_BYTES_MAX + 1)
    except OSError as exc:
        raise KafkaSecurityError(f"HALFWAY_KAFKA_PASSWORD_FILE={path}: {exc.strerror}") from None
    if len(raw) > PASSWORD_FILE_BYTES_MAX:
        raise KafkaSecurityError(f"HALFWAY_KAFKA_PASSWORD_FILE={path} is over "
                                 f"{PASSWORD_FILE_BYTES_MAX} bytes: not a password file")
    password = raw.decode("utf-8", errors="strict").rstrip("\r\n")
    if not password:
        raise KafkaSecurityError(f"HALFWAY_KAFKA_PASSWORD_FILE={path} is empty")
    return password


def _explicit_security() -> dict[str, Any]:
    """aiokafka's keyword arguments from the HALFWAY_KAFKA_* variables, checked together."""
    username = _env("HALFWAY_KAFKA_USERNAME")
    password = os.environ.get("HALFWAY_KAFKA_PASSWORD") or None
    password_file = _env("HALFWAY_KAFKA_PASSWORD_FILE")
    mechanism = _env("HALFWAY_KAFKA_SASL_MECHANISM")
    ssl_files = {name: _env(f"HALFWAY_KAFKA_SSL_{name.upper()}")
                 for name in ("cafile", "certfile", "keyfile")}
    protocol = (_env("HALFWAY_KAFKA_SECURITY_PROTOCOL")
                or ("SASL_PLAINTEXT" if username else "PLAINTEXT")).upper()
    if protocol not in SECURITY_PROTOCOLS:
        raise KafkaSecurityError(f"HALFWAY_KAFKA_SECURITY_PROTOCOL={protocol}: one of "
                                 f"{', '.join(SECURITY_PROTOCOLS)}")
    out: dict[str, Any] = {"security_protocol": protocol}
    if protocol.startswith("SASL_"):
        mechanism = (mechanism or DEFAULT_SASL_MECHANISM).upper()
        if mechanism not in SASL_MECHANISMS:
            raise KafkaSecurityError(f"HALFWAY_KAFKA_SASL_MECHANISM={mechanism}: one of "
                                     f"{', '.join(SASL_MECHANISMS)}")
        if not username:
            raise KafkaSecurityError(f"{protocol} needs HALFWAY_KAFKA_USERNAME")
        if password and password_file:
            raise KafkaSecurityError("set HALFWAY_KAFKA_PASSWORD or HALFWAY_KAFKA_PASSWORD_FILE, "
                                     "not both")
        if password_file:
            password = _read_password_file(password_file)
        if not password:
            raise KafkaSecurityError(f"{protocol} needs HALFWAY_KAFKA_PASSWORD or "
                                     "HALFWAY_KAFKA_PASSWORD_FILE")
        out |= {"sasl_mechanism": mechanism, "sasl_plain_username": username,
                "sasl_plain_password": password}
    else:
        given = [n for n, v in (("HALFWAY_KAFKA_USERNAME", username),
                                ("HALFWAY_KAFKA_PASSWORD", password),
                                ("HALFWAY_KAFKA_PASSWORD_FILE", password_file),
                                ("HALFWAY_KAFKA_SASL_MECHANISM", mechanism)) if v]
        if given:
            raise KafkaSecurityError(f"{', '.join(given)} set, but HALFWAY_KAFKA_SECURITY_PROTOCOL"
                                     f" is {protocol}: use SASL_PLAINTEXT or SASL_SSL")
    if protocol.endswith("SSL"):
        if ssl_files["keyfile"] and not ssl_files["certfile"]:
            raise KafkaSecurityError("HALFWAY_KAFKA_SSL_KEYFILE needs HALFWAY_KAFKA_SSL_CERTFILE "
                                     "(the client certificate it belongs to)")
        for name, path in ssl_files.items():
            if path and not os.path.isfile(path):
                raise KafkaSecurityError(f"HALFWAY_KAFKA_SSL_{name.upper()}={path}: no such file")
        from aiokafka.helpers import create_ssl_context

        try:
            out["ssl_context"] = create_ssl_context(**ssl_files)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            raise KafkaSecurityError(f"the TLS files do not load: {exc}") from None
    else:
        given = [f"HALFWAY_KAFKA_SSL_{n.upper()}" for n, v in ssl_files.items() if v]
        if given:
            raise KafkaSecurityError(f"{', '.join(given)} set, but HALFWAY_KAFKA_SECURITY_PROTOCOL"
                                     f" is {protocol}: use SSL or SASL_SSL")
    return out


def kafka_security(kind: str) -> dict[str, Any]:
    """How a process of `kind` authenticates: the HALFWAY_KAFKA_* variables when any is set
    (they always win); else, against the local dev broker, `kind`'s password from the file
    `infra/dev up` generated; else nothing (plaintext). Raises KafkaSecurityError."""
    if kind not in KAFKA_KINDS:
        raise KafkaSecurityError(f"no Kafka principal kind {kind!r}: one of "
                                 f"{', '.join(KAFKA_KINDS)}")
    if kafka_security_is_explicit():
        return _explicit_security()
    if kafka_bootstrap() != f"{HOST}:{kafka_port()}":
        return {}  # not the local dev broker (HALFWAY_KAFKA_BOOTSTRAP may name it too)
    passwords = kafka_dev_credentials()
    return {} if passwords is None else dev_security(kind, passwords)


def kafka_security_is_explicit() -> bool:
    """Whether any HALFWAY_KAFKA_* security variable is set (then they alone say how clients
    authenticate)."""
    return any(name in os.environ for name in _SECURITY_ENV)


def kafka_credentials_source() -> str:
    """Where this process's Kafka user name and password come from, for an error to name."""
    if kafka_security_is_explicit():
        return "HALFWAY_KAFKA_USERNAME, HALFWAY_KAFKA_PASSWORD or HALFWAY_KAFKA_PASSWORD_FILE"
    return (f"the dev credentials file {kafka_dev_credentials_file()}, which `infra/dev up` "
            "writes; HALFWAY_KAFKA_* variables override it")


def dev_security(kind: str, passwords: dict[str, str]) -> dict[str, Any]:
    """aiokafka's keyword arguments for `kind` on a broker `infra/dev up` started."""
    if kind not in passwords:
        raise KafkaSecurityError(f"the dev credentials have no password for {kind}: run "
                                 "`infra/dev up` (it adds missing principals)")
    return {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": DEFAULT_SASL_MECHANISM,
            "sasl_plain_username": kind, "sasl_plain_password": passwords[kind]}


@dataclass(frozen=True, slots=True)
class KafkaSettings:
    bootstrap: str
    topic_prefix: str
    replication_factor: int
    # How clients authenticate and encrypt, as aiokafka's keyword arguments
    # (`security_protocol`, `sasl_mechanism`, ...); empty: plaintext, no authentication.
    # Never in a repr: it holds the password.
    security: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # Partitions of each topic that scales, for topics this deployment creates
    # (HALFWAY_PARTITIONS); existing topics keep theirs.
    partitions: int = field(default=6, compare=False)

    @classmethod
    def from_env(cls, kind: str = "admin") -> KafkaSettings:
        """The settings a process of `kind` (see KAFKA_KINDS) connects with. The default,
        `admin`, is for tools and tests that create topics; services name their kind."""
        return cls(
            bootstrap=kafka_bootstrap(),
            topic_prefix=os.environ.get("HALFWAY_TOPIC_PREFIX", "halfway."),
            replication_factor=int(number_from_env("HALFWAY_REPLICATION_FACTOR", 1, whole=True,
                                                   low=1, high=PARTITIONS_MAX)),
            partitions=partitions(),
            security=kafka_security(kind),
        )

    @property
    def principal(self) -> str | None:
        """The SASL user name these settings authenticate as (None: no SASL)."""
        return self.security.get("sasl_plain_username")

    def client(self) -> dict[str, Any]:
        """The keyword arguments every aiokafka client of halfway is made with: where the
        broker is and how to authenticate to it (the one place for both)."""
        return {"bootstrap_servers": self.bootstrap, **self.security}

    def with_prefix(self, topic_prefix: str) -> KafkaSettings:
        """The same broker and credentials, other topics (tests and benchmarks)."""
        return dataclasses.replace(self, topic_prefix=topic_prefix)

    def as_kind(self, kind: str) -> KafkaSettings:
        """The same broker and topics, with the credentials of `kind` (from the environment
        or the dev credentials file, as `from_env`)."""
        return dataclasses.replace(self, security=kafka_security(kind))


PARTITIONS_ENV = "HALFWAY_PARTITIONS"
DEFAULT_PARTITIONS = 6
PARTITIONS_MAX = 1000


def partitions() -> int:
    """Partitions per topic for a new deployment's topics (`HALFWAY_PARTITIONS`, default 6):
    the most instances of one service that can share the work."""
    return int(number_from_env(PARTITIONS_ENV, DEFAULT_PARTITIONS, whole=True, low=1,
                               high=PARTITIONS_MAX))


def paysim_url() -> str:
    """The payment provider the `charge_customer` tool talks to (the simulator by default)."""
    return os.environ.get("HALFWAY_PAYSIM_URL", f"http://{HOST}:18080")


def tripsim_url() -> str:
    """The flight, hotel and email providers the travel tools talk to (the simulator)."""
    return os.environ.get("HALFWAY_TRIPSIM_URL", f"http://{HOST}:18081")


def travel_timeout_s() -> float:
    """How long one flight, hotel or email attempt may take before its outcome is unknown."""
    return number_from_env("HALFWAY_TRAVEL_TIMEOUT_S", 5.0, above_low=True)


def charge_timeout_s() -> float:
    """How long one charge attempt may take before its outcome is unknown."""
    return number_from_env("HALFWAY_CHARGE_TIMEOUT_S", 5.0, above_low=True)


def model_call_log() -> str | None:
    """A file the scripted model appends every question to (shared across processes)."""
    return os.environ.get("HALFWAY_MODEL_CALL_LOG") or None


EVENT_LOOP_ENV = "HALFWAY_EVENT_LOOP"
EVENT_LOOPS = ("uvloop", "asyncio")


def event_loop() -> str:
    """The event loop services run on (`halfway.eventloop`): uvloop's by default, `asyncio`
    for the standard library's own."""
    raw = os.environ.get(EVENT_LOOP_ENV, "").strip()
    chosen = raw.lower() or EVENT_LOOPS[0]
    if chosen not in EVENT_LOOPS:
        raise SettingsError(f"{EVENT_LOOP_ENV}={raw[:40]!r} is not one of {', '.join(EVENT_LOOPS)}")
    return chosen


def reconciler_lookups() -> bool:
    """`HALFWAY_RECONCILER_LOOKUPS=off`: only webhooks (and operators) settle unknown steps."""
    return os.environ.get("HALFWAY_RECONCILER_LOOKUPS", "on").lower() not in ("off", "0", "no")


# paysim and tripsim finish every request within their longest fault delay (600 s); a margin
# on top.
DEFAULT_COMPLETES_WITHIN_S = 660.0


def charge_completes_within_s() -> float | None:
    """How long the payment provider may take to finish any request: past it, a lookup that
    finds nothing proves the charge did not happen. paysim's bound by default; `off` for a
    provider whose search lags (Stripe's does), where nothing found proves nothing."""
    return _completes_within_s("HALFWAY_CHARGE_COMPLETES_WITHIN_S")


def travel_completes_within_s() -> float | None:
    """The same for the travel provider's holds, bookings, emails and their undos: tripsim's
    bound by default (its lookups show every effect at once); `off` for one whose search lags
    (Mailgun's event search does)."""
    return _completes_within_s("HALFWAY_TRAVEL_COMPLETES_WITHIN_S")


def _completes_within_s(name: str) -> float | None:
    if os.environ.get(name, "").strip().lower() in ("off", "none", "0"):
        return None
    return number_from_env(name, DEFAULT_COMPLETES_WITHIN_S, above_low=True)


def charge_key_ttl_s() -> float:
    """How long the payment provider remembers an idempotency key (Stripe v1: 24 h)."""
    return number_from_env("HALFWAY_CHARGE_KEY_TTL_S", 86_400.0, above_low=True)


def travel_key_ttl_s() -> float:
    """How long the travel providers remember an idempotency key (tripsim's default: 24 h)."""
    return number_from_env("HALFWAY_TRAVEL_KEY_TTL_S", 86_400.0, above_low=True)


# A task finished this long ago (by the journal's own clock) with every effect settled is
# sealed: the services keep only its end. Stripe retries webhooks for 3 days; a day covers
# late reports of all but the slowest.
DEFAULT_SEAL_AFTER_S = 86_400.0


def seal_after_s() -> float | None:
    """`HALFWAY_SEAL_AFTER_S`: how long after its end a settled task is sealed (`off`: never)."""
    name = "HALFWAY_SEAL_AFTER_S"
    if os.environ.get(name, "").strip().lower() in ("off", "none"):
        return None
    return number_from_env(name, DEFAULT_SEAL_AFTER_S)


DEFAULT_GATEWAY_PORT = 18090
# Published in the source: the gateway accepts it only in dev mode (webhooks/providers.py).
DEFAULT_PAYSIM_WEBHOOK_SECRET = "whsec_halfway_dev"
PAYSIM_WEBHOOK_SECRET_ENV = "HALFWAY_PAYSIM_WEBHOOK_SECRET"
WEBHOOK_PROVIDERS_ENV = "HALFWAY_WEBHOOK_PROVIDERS"
DEV_MODE_ENV = "HALFWAY_DEV_MODE"


def dev_mode(environ: Mapping[str, str] | None = None) -> bool:
    """`HALFWAY_DEV_MODE=1` (or true, yes, on): local development and tests, where published
    dev secrets stand in for missing ones. Anything else, unset included, is off."""
    raw = (os.environ if environ is None else environ).get(DEV_MODE_ENV, "")
    return raw.strip().lower() in ("1", "true", "yes", "on")


def gateway_port() -> int:
    """Where the webhook gateway listens for provider webhooks (0: any free port)."""
    return _port("HALFWAY_GATEWAY_PORT", DEFAULT_GATEWAY_PORT, any_free=True)


def gateway_host() -> str:
    """The address the webhook gateway listens on (0.0.0.0 in a container)."""
    return os.environ.get("HALFWAY_GATEWAY_HOST") or HOST


def paysim_webhook_secret() -> str:
    """The secret the paysim simulator signs its webhooks with: `HALFWAY_PAYSIM_WEBHOOK_SECRET`,
    else the published dev secret, which the gateway accepts only in dev mode."""
    return os.environ.get(PAYSIM_WEBHOOK_SECRET_ENV) or DEFAULT_PAYSIM_WEBHOOK_SECRET


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


# --- the HTTP API's trust settings and tracing (docs/operator-api.md) -------------------------


def api_tokens() -> str:
    """`HALFWAY_API_TOKENS`: bearer tokens in the short form `NAME:SCOPE+SCOPE:TOKEN`,
    comma-separated (`halfway.api.auth` parses them)."""
    return os.environ.get("HALFWAY_API_TOKENS", "")


def api_tokens_file() -> str | None:
    """`HALFWAY_API_TOKENS_FILE`: a JSON Lines or TOML file of tokens (names, scopes)."""
    return os.environ.get("HALFWAY_API_TOKENS_FILE") or None


def api_allowed_hosts() -> list[str] | None:
    """`HALFWAY_API_ALLOWED_HOSTS`: the names the API answers to in the Host header,
    comma-separated (None: the loopback names and the address it listens on)."""
    names = [n.strip() for n in os.environ.get("HALFWAY_API_ALLOWED_HOSTS", "").split(",")]
    return [n for n in names if n] or None


def api_dev_mode() -> bool:
    """`HALFWAY_API_DEV=1`: with no tokens configured, every request may do everything (local
    development only)."""
    return os.environ.get("HALFWAY_API_DEV", "").strip().lower() in ("1", "true", "yes", "on")


def tracing_mode() -> str:
    """`otlp` or `off`: `HALFWAY_TRACING` if set, else `otlp` when the standard
    `OTEL_EXPORTER_OTLP_ENDPOINT` (or its traces variant) names a collector. Off by default;
    `OTEL_SDK_DISABLED=true` turns it off whatever else says."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return "off"
    raw = os.environ.get("HALFWAY_TRACING", "").strip().lower()
    if raw:
        if raw not in ("otlp", "off"):
            raise ValueError(f"HALFWAY_TRACING={raw!r}: otlp or off")
        return raw
    endpoint = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
                or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    return "otlp" if endpoint else "off"
