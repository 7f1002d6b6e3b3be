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
