"""docker-compose.yml cannot run here (no Docker engine): check what can be checked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer.main
import yaml
from typer._click.exceptions import UsageError

from halfway.cli import app

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SOURCES = "\n".join(
    p.read_text() for d in ("services", "schemas") for p in (ROOT / d).rglob("*.py")
)


def our_services() -> dict[str, dict]:
    return {name: svc for name, svc in COMPOSE["services"].items() if "build" in svc}


def test_every_service_of_ours_names_an_existing_halfway_command() -> None:
    cli = typer.main.get_command(app)
    assert our_services(), "compose runs none of our services"
    for name, svc in our_services().items():
        program, command, *args = svc["command"]
        assert program == "halfway", name
        assert command in cli.commands, f"{name}: `halfway {command}` does not exist"
        # Parse (without running) the arguments compose passes: a wrong one raises here.
        cli.commands[command].make_context(command, list(args))


def test_a_wrong_command_line_would_be_caught() -> None:
    cli = typer.main.get_command(app)
    with pytest.raises(UsageError):
        cli.commands["demo"].make_context("demo", ["no-such-demo"])


def test_the_image_builds_from_files_that_exist() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    for source in re.findall(r"^COPY (.+?) \S+$", dockerfile, flags=re.M):
        for path in source.split():
            assert (ROOT / path).exists(), path


def test_every_halfway_variable_in_compose_is_read_by_the_code() -> None:
    for name, svc in our_services().items():
        for var in svc["environment"]:
            assert f'"{var}"' in SOURCES, f"{name}: {var} is set but nothing reads it"


def test_images_are_pinned() -> None:
    for name, svc in COMPOSE["services"].items():
        if "image" in svc and "build" not in svc:
            assert re.search(r":\d", svc["image"]), f"{name}: pin the image version"


# --- secrets and published ports -----------------------------------------------------------------

# Compose's interpolation, the forms this file uses: ${VAR}, ${VAR:-default}, ${VAR:?error}.
_VARIABLE = re.compile(r"\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:-|:\?)(?P<arg>[^}]*))?\}")
SECRET_VARIABLES = ("HALFWAY_PAYSIM_WEBHOOK_SECRET", "HALFWAY_PG_PASSWORD", "HALFWAY_API_TOKENS")
SECRET_WORDS = ("SECRET", "PASSWORD")


class Unset(Exception):
    """A required variable is not set: compose refuses to run, with this message."""


def interpolate(text: str, environ: dict[str, str]) -> str:
    def one(match: re.Match[str]) -> str:
        name, op, arg = match["name"], match["op"], match["arg"]
        value = environ.get(name, "")
        if value:
            return value
        if op == ":?":
            raise Unset(f"{name}: {arg}")
        return arg if op == ":-" else ""
    return _VARIABLE.sub(one, text)


def every_string(node: object) -> list[str]:
    if isinstance(node, dict):
        return [s for value in node.values() for s in every_string(value)]
    if isinstance(node, list):
        return [s for item in node for s in every_string(item)]
    return [node] if isinstance(node, str) else []


def test_the_interpolation_helper_knows_the_three_forms() -> None:
    assert interpolate("${A}-${B:-b}", {"A": "a"}) == "a-b"
    with pytest.raises(Unset, match="C: say so"):
        interpolate("${C:?say so}", {})


def test_no_secret_is_written_in_compose_each_is_required_from_the_environment() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    for name, svc in COMPOSE["services"].items():
        for var, value in (svc.get("environment") or {}).items():
            if any(word in var for word in SECRET_WORDS):
                assert re.fullmatch(r"\$\{[A-Z_]+:\?[^}]+\}", str(value)), (
                    f"{name}: {var} must be ${{VAR:?why}}, not a value written here")
    dsn = COMPOSE["x-halfway-env"]["HALFWAY_PG_DSN"]
    assert "${HALFWAY_PG_PASSWORD:?" in dsn
    for var in SECRET_VARIABLES:
        with pytest.raises(Unset, match=var):
            interpolate(text, {v: "x" for v in SECRET_VARIABLES if v != var})
    assert "whsec_halfway_dev" not in text  # the published dev secret, accepted only in dev mode


def test_the_webhook_secret_goes_only_to_paysim_and_the_gateway() -> None:
    holders = {name for name, svc in COMPOSE["services"].items()
               if "HALFWAY_PAYSIM_WEBHOOK_SECRET" in (svc.get("environment") or {})}
    assert holders == {"paysim", "gateway"}


def test_published_ports_bind_to_loopback_unless_told_otherwise() -> None:
    published = {name: svc["ports"] for name, svc in COMPOSE["services"].items()
                 if svc.get("ports")}
    assert set(published) == {"api", "gateway"}
    secrets = {v: "x" for v in SECRET_VARIABLES}
    for name, ports in published.items():
        for port in ports:
            assert port.startswith("${HALFWAY_PUBLISH_HOST:-127.0.0.1}:"), f"{name}: {port}"
            host, outside, inside = interpolate(port, secrets).split(":")
            assert (host, outside == inside) == ("127.0.0.1", True)
            assert interpolate(port, secrets | {"HALFWAY_PUBLISH_HOST": "0.0.0.0"}).startswith(
                "0.0.0.0:")


def test_a_service_that_adds_variables_keeps_the_shared_ones() -> None:
    # A service's own `environment:` replaces the anchor's whole map unless it merges it back.
    shared = set(COMPOSE["x-halfway-env"])
    for name, svc in our_services().items():
        assert shared <= set(svc["environment"]), f"{name} lost {shared - set(svc['environment'])}"


def test_every_variable_compose_needs_is_documented_in_its_header() -> None:
    text = (ROOT / "docker-compose.yml").read_text()
    header = text.split("\nx-halfway-env:")[0]
    needed = {m["name"] for s in every_string(COMPOSE) for m in _VARIABLE.finditer(s)}
    assert needed == {*SECRET_VARIABLES, "HALFWAY_PUBLISH_HOST"}
    for name in needed:
        assert name in header, name
