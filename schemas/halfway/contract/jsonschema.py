"""Generate the committed JSON Schema files from the pydantic models.

    python -m halfway.contract.jsonschema          # rewrite schemas/json/
    python -m halfway.contract.jsonschema --check  # exit 1 if the committed files are stale

One file per event type (named by its `type`), one for the whole union, one for dead letters,
one for the verified webhooks the gateway publishes, one for the user-facing outcomes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from pydantic import BaseModel

from halfway.contract.events import EVENT_ADAPTER, EVENT_TYPES, DeadLetter, event_type_name
from halfway.contract.guards import SubjectClaimed, SubjectReleased
from halfway.contract.outcomes import OutcomeChanged
from halfway.contract.webhooks import WebhookReceived

JSON_DIR = Path(__file__).resolve().parents[2] / "json"
SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def _document(schema: dict, schema_id: str) -> str:
    doc = {"$schema": SCHEMA_DIALECT, "$id": schema_id, **schema}
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def render() -> dict[str, str]:
    """File name -> file text, for every schema we publish."""
    files: dict[str, str] = {}
    models: list[tuple[str, type[BaseModel]]] = [(event_type_name(m), m) for m in EVENT_TYPES]
    models.append(("dead_letter", DeadLetter))
    models.append(("webhook.received", WebhookReceived))
    models.append(("outcome.changed", OutcomeChanged))
    models.append(("subject.claimed", SubjectClaimed))
    models.append(("subject.released", SubjectReleased))
    for name, model in models:
        file = f"{name}.schema.json"
        files[file] = _document(model.model_json_schema(mode="validation"), file)
    files["event.schema.json"] = _document(
        EVENT_ADAPTER.json_schema(mode="validation"), "event.schema.json"
    )
    return files


def stale_files(json_dir: Path = JSON_DIR) -> list[str]:
    """Names of schema files that are missing, different, or no longer generated."""
    wanted = render()
    stale = [
        name
        for name, text in wanted.items()
        if not (json_dir / name).is_file() or (json_dir / name).read_text() != text
    ]
    present = {p.name for p in json_dir.glob("*.schema.json")} if json_dir.is_dir() else set()
    stale += sorted(present - wanted.keys())
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the files are stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for name in stale:
            print(f"stale: schemas/json/{name}", file=sys.stderr)
        return 1 if stale else 0
    JSON_DIR.mkdir(exist_ok=True)
    for old in JSON_DIR.glob("*.schema.json"):
        old.unlink()
    for name, text in render().items():
        (JSON_DIR / name).write_text(text)
    print(f"wrote {len(render())} schema files to {JSON_DIR}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
