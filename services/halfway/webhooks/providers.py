"""Webhook providers, declared as data: a signature format, the endpoint secrets, and a mapping
from the provider's events to our keys and outcomes (`mapping.EventMapping`).

    {"name": "hotels", "format": "standardwebhooks", "secret_env": "HOTELS_WEBHOOK_SECRET",
     "mapping": {"events": {"booking.confirmed": "done", "booking.failed": "not_done"},
                 "key": "data.metadata.halfway_key", "object_id": "data.id"}}

- `name` is the path the provider posts to: `/webhooks/{name}`;
- `format` is how its deliveries are signed: `stripe` (`Stripe-Signature`, `signature.py`) or
  `standardwebhooks` (`webhook-id`, `webhook-timestamp`, `webhook-signature`, `standard.py`);
- `secret_env` names the environment variable holding its endpoint secret, or several separated
  by commas while a secret is rolled (any one verifies). Secrets live only in the environment,
  never in the declaration; every message here names the variable, never its value.

The gateway serves the built-in providers (`paysim`, Stripe's format) and those declared in the
JSON or TOML file named by `HALFWAY_WEBHOOK_PROVIDERS` (`{"providers": [...]}`; a declared
provider replaces a built-in of the same name). A declared provider without its secret, or any
declaration that does not validate, stops the gateway at start with the reason. A built-in
provider without its secret is not served, except in dev mode (`HALFWAY_DEV_MODE=1`), where
paysim's published dev secret stands in; that secret is refused anywhere else, even when set
explicitly. With no provider left to serve, the gateway does not start.
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    model_validator,
)

from halfway.journal.records import describe
from halfway.settings import (
    DEFAULT_PAYSIM_WEBHOOK_SECRET,
    DEV_MODE_ENV,
    PAYSIM_WEBHOOK_SECRET_ENV,
    WEBHOOK_PROVIDERS_ENV,
    dev_mode,
)
from halfway.webhooks import standard
from halfway.webhooks.mapping import EventMapping

Format = Literal["stripe", "standardwebhooks"]
PROVIDERS_MAX = 32
SECRETS_MAX = 4  # per provider: the current one and a few being rolled out or in
DECLARATIONS_BYTES_MAX = 256 * 1024
SECRET_CHARS_MAX = 512

ProviderName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9][a-z0-9_-]{0,39}$")]
EnvName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,99}$")]


class ProviderError(ValueError):
    """A provider cannot be served: the reason, for the operator (never a secret)."""


class ProviderDeclaration(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: ProviderName
    format: Format
    secret_env: EnvName
    mapping: EventMapping

    @model_validator(mode="after")
    def _stripe_events_carry_their_id(self) -> ProviderDeclaration:
        if self.format == "stripe" and self.mapping.event_id is None:
            raise ValueError("a stripe-format delivery carries no id header: say where the "
                             'event\'s id is (mapping.event_id, Stripe\'s is "id")')
        return self


class Declarations(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    providers: list[ProviderDeclaration] = Field(max_length=PROVIDERS_MAX)

    @model_validator(mode="after")
    def _names_are_unique(self) -> Declarations:
        names = [p.name for p in self.providers]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"provider declared more than once: {', '.join(twice)}")
        return self


# paysim speaks Stripe's wire format and sends charge events (simulators/payments.py).
PAYSIM = ProviderDeclaration(
    name="paysim", format="stripe", secret_env=PAYSIM_WEBHOOK_SECRET_ENV,
    mapping=EventMapping(events={"charge.succeeded": "done", "charge.failed": "not_done"},
                         key="data.object.metadata.halfway_key", object_id="data.object.id",
                         event_id="id"))
BUILTIN: tuple[ProviderDeclaration, ...] = (PAYSIM,)
# Only the built-in paysim has a dev secret, which is also the simulator's default.
DEV_SECRETS = {PAYSIM.name: DEFAULT_PAYSIM_WEBHOOK_SECRET}


@dataclass(frozen=True, slots=True)
class Provider:
    """A provider the gateway serves: its declaration and its secrets (never shown)."""

    declaration: ProviderDeclaration
    secrets: tuple[str, ...] = field(repr=False)

    def __post_init__(self) -> None:
        assert self.secrets, f"provider {self.declaration.name} has no secret"

    @property
    def name(self) -> str:
        return self.declaration.name

    @property
    def format(self) -> Format:
        return self.declaration.format

    @property
    def mapping(self) -> EventMapping:
        return self.declaration.mapping


def paysim(*secrets: str) -> Provider:
    """The built-in paysim provider with these secrets (tests, benchmarks)."""
    return Provider(PAYSIM, secrets)


@dataclass(frozen=True, slots=True)
class Loaded:
    providers: dict[str, Provider]
    not_served: list[str]  # built-ins left out, and why (for the start-up log)


def _secret_problem(fmt: Format, secret: str) -> str | None:
    """Why `secret` cannot be used, as a clause ("it is empty"); never quotes it."""
    if len(secret) > SECRET_CHARS_MAX:
        return f"it is longer than {SECRET_CHARS_MAX} characters"
    if any(c.isspace() for c in secret):
        return "it contains whitespace"
    problem = standard.secret_problem(secret) if fmt == "standardwebhooks" else None
    return None if problem is None else f"it is {problem}"


def secrets_of(declaration: ProviderDeclaration, raw: str, *, dev: bool) -> tuple[str, ...]:
    """The secrets in `raw` (the value of the declaration's secret_env); ProviderError if
    they are not usable. The reason names the variable and the secret's place, not its text."""
    env = declaration.secret_env
    secrets = tuple(part.strip() for part in raw.split(",") if part.strip())
    if not secrets:
        raise ProviderError(f"{env} holds no secret for webhook provider {declaration.name}")
    if len(secrets) > SECRETS_MAX:
        raise ProviderError(f"{env} holds {len(secrets)} secrets; at most {SECRETS_MAX} (the "
                            f"current one and those being rolled)")
    for n, secret in enumerate(secrets, start=1):
        problem = _secret_problem(declaration.format, secret)
        if problem is not None:
            raise ProviderError(f"{env}: secret {n} of {len(secrets)} for webhook provider "
                                f"{declaration.name} cannot be used: {problem}")
        if secret == DEFAULT_PAYSIM_WEBHOOK_SECRET and not dev:
            raise ProviderError(f"{env}: secret {n} of {len(secrets)} is the published dev "
                                f"secret, accepted only in dev mode ({DEV_MODE_ENV}=1): set "
                                f"the secret the provider signs with")
    return secrets


def read_declarations(path: Path) -> list[ProviderDeclaration]:
    """The providers declared in a JSON or TOML (by its suffix) file; ProviderError saying
    what is wrong with it."""
    where = f"{WEBHOOK_PROVIDERS_ENV}={path}"
    try:
        with path.open("rb") as f:
            raw = f.read(DECLARATIONS_BYTES_MAX + 1)
    except OSError as exc:
        raise ProviderError(f"{where}: cannot read it: {exc.strerror or exc}") from None
    if len(raw) > DECLARATIONS_BYTES_MAX:
        raise ProviderError(f"{where}: larger than {DECLARATIONS_BYTES_MAX} bytes")
    try:
        text = raw.decode()
        document = tomllib.loads(text) if path.suffix == ".toml" else json.loads(text)
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, ValueError, RecursionError) as exc:
        kind = "TOML" if path.suffix == ".toml" else "JSON"
        # The parsers' messages give a place (line, column), never a secret of ours: none is
        # supposed to be in the file, and the value itself is not quoted.
        raise ProviderError(f"{where}: not {kind}: {str(exc)[:200]}") from None
    try:
        return list(Declarations.model_validate(document).providers)
    except ValidationError as exc:
        raise ProviderError(describe(exc, f"{where}: ")) from None


def load(environ: Mapping[str, str] | None = None) -> Loaded:
    """The providers to serve, from the built-ins, the declarations file and the secrets in
    `environ` (os.environ by default); ProviderError with the reason if the gateway must not
    start."""
    environ = os.environ if environ is None else environ
    dev = dev_mode(environ)
    declared: list[ProviderDeclaration] = []
    file = environ.get(WEBHOOK_PROVIDERS_ENV, "").strip()
    if file:
        declared = read_declarations(Path(file))
    names = {d.name for d in declared}
    providers: dict[str, Provider] = {}
    not_served: list[str] = []
    for builtin in BUILTIN:
        if builtin.name in names:
            continue
        raw = environ.get(builtin.secret_env, "")
        if not raw.strip():
            if dev and builtin.name in DEV_SECRETS:
                raw = DEV_SECRETS[builtin.name]
            else:
                not_served.append(f"{builtin.name}: {builtin.secret_env} is not set")
                continue
        providers[builtin.name] = Provider(builtin, secrets_of(builtin, raw, dev=dev))
    for declaration in declared:
        raw = environ.get(declaration.secret_env, "")
        if not raw.strip():
            raise ProviderError(f"webhook provider {declaration.name} has no secret: set "
                                f"{declaration.secret_env}")
        providers[declaration.name] = Provider(declaration,
                                               secrets_of(declaration, raw, dev=dev))
    if not providers:
        raise ProviderError(
            "no webhook provider to serve: no secret is set and none has a default outside dev "
            f"mode. Set {PAYSIM_WEBHOOK_SECRET_ENV} (paysim's endpoint secret), declare "
            f"providers in the file {WEBHOOK_PROVIDERS_ENV} names, or set {DEV_MODE_ENV}=1 "
            "for local development")
    return Loaded(providers, not_served)
