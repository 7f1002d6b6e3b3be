"""The event contract: models, committed JSON Schemas, and the rules the models enforce."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import jsonschema
import pytest
from pydantic import ValidationError

from halfway.contract import EVENT_TYPES, Outcome, event_type_name, parse_event
from halfway.contract.events import new_event_id
from halfway.contract.ids import (
    KEY_PATTERN,
    UNDO_KEYS_MAX,
    mint_key,
    mint_undo_key,
    parse_step_id,
    parse_undo_key,
    step_id,
    step_of_key,
)
from halfway.contract.jsonschema import JSON_DIR, stale_files
from halfway.contract.topics import ALL_TOPICS, JOURNAL, SNAPSHOTS
from tests.factories import Stamper, one_of_each


def schema_for(type_name: str) -> dict:
    return json.loads((JSON_DIR / f"{type_name}.schema.json").read_text())


def test_committed_json_schemas_are_fresh() -> None:
    # If this fails: run `python -m halfway.contract.jsonschema` and commit schemas/json/.
    assert stale_files() == []


def test_the_examples_cover_every_event_type() -> None:
    assert {e.type for e in one_of_each()} == {event_type_name(m) for m in EVENT_TYPES}


@pytest.mark.parametrize("event", one_of_each(), ids=lambda e: e.type)
def test_every_event_round_trips_and_matches_its_committed_schema(event) -> None:
    wire = event.model_dump_json()
    assert parse_event(wire) == event
    doc = json.loads(wire)
    jsonschema.validate(doc, schema_for(event.type))
    jsonschema.validate(doc, schema_for("event"))


def test_the_union_schema_refuses_what_the_models_refuse() -> None:
    bad = json.loads(one_of_each()[4].model_dump_json())  # a step.attempted
    del bad["event_id"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema_for("event"))
    with pytest.raises(ValidationError):
        parse_event(json.dumps(bad))


def test_type_event_id_and_at_are_required_on_the_wire() -> None:
    for model in EVENT_TYPES:
        required = set(schema_for(event_type_name(model))["required"])
        assert {"type", "event_id", "task_id", "at"} <= required, model


@pytest.mark.parametrize(
    ("mutation", "reason"),
    [
        ({"type": "step.teleported"}, "does not match any of the expected tags"),
        ({"key": "renewal-8812:3-chosen-by-model"}, "key"),
        ({"step_id": "other-task:1"}, "does not belong to task"),
        ({"n": 2}, "is not '{task_id}:{n}'"),
        ({"effect_class": "sometimes"}, "effect_class"),
        ({"surprise": 1}, "Extra inputs are not permitted"),
        ({"at": "2026-12-02T09:00:00"}, "timezone"),
        ({"schema_version": 2}, "schema_version"),
    ],
)
def test_malformed_step_intended_is_refused_with_a_reason(mutation: dict, reason: str) -> None:
    doc = json.loads(Stamper("renewal-8812").intended(1).model_dump_json()) | mutation
    with pytest.raises(ValidationError, match=reason):
        parse_event(json.dumps(doc))


@pytest.mark.parametrize(
    ("outcome", "blank", "reason"),
    [(Outcome.DONE, "evidence", "evidence"), (Outcome.DONE, "evidence_empty", "evidence"),
     (Outcome.NOT_DONE, "reason", "reason"), (Outcome.UNKNOWN, "reason", "reason")],
)
def test_settlements_carry_what_they_rest_on(outcome: Outcome, blank: str, reason: str) -> None:
    doc = json.loads(Stamper("t-1").settled(1, outcome).model_dump_json())
    if blank == "evidence_empty":
        doc["evidence"] = {}
    else:
        doc[blank] = None
    with pytest.raises(ValidationError, match=reason):
        parse_event(json.dumps(doc))


def test_compensable_step_must_declare_its_undo_before_it_runs() -> None:
    with pytest.raises(ValidationError, match="compensation"):
        Stamper("t-1").intended(1, saga_role="compensable")


def test_keys_are_minted_from_the_step_id_alone() -> None:
    sid = step_id("renewal-8812", 3)
    assert sid == "renewal-8812:3"
    assert mint_key(sid) == "renewal-8812:3" == mint_key("renewal-8812:3")
    assert mint_undo_key(sid) == "renewal-8812:3:undo"
    assert parse_step_id(sid) == ("renewal-8812", 3)
    for bad in ("renewal-8812", "renewal-8812:0", "a:b:3", ":3", "x y:1"):
        with pytest.raises(ValueError, match="step id"):
            mint_key(bad)
    with pytest.raises(ValueError, match="task id"):
        step_id("has:colon", 1)


def test_event_ids_are_random_uuid4s_in_hex() -> None:
    ids = [new_event_id() for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    for text in ids:
        assert re.fullmatch(r"[0-9a-f]{32}", text)
        parsed = uuid.UUID(hex=text)
        assert (parsed.version, parsed.variant) == (4, uuid.RFC_4122)
    # Every other bit is random: each takes both values across the sample.
    ored = anded = int(ids[0], 16)
    for text in ids:
        ored, anded = ored | int(text, 16), anded & int(text, 16)
    fixed = (0xF000 << 64) | (0xC000 << 48)
    assert ored | fixed == (1 << 128) - 1
    assert anded & ~fixed == 0


def test_the_longest_undo_key_fits_the_strictest_provider_limit() -> None:
    longest = mint_undo_key(step_id("t" * 48, 9999), UNDO_KEYS_MAX)
    assert len(longest) <= 64  # Adyen's limit; Stripe allows 255


def test_an_undo_has_up_to_its_keys_and_each_names_its_step_and_generation() -> None:
    sid = step_id("trip-7", 2)
    keys = [mint_undo_key(sid, g) for g in range(1, UNDO_KEYS_MAX + 1)]
    assert keys == ["trip-7:2:undo", "trip-7:2:undo2", "trip-7:2:undo3"]
    for g, key in enumerate(keys, start=1):
        assert re.fullmatch(KEY_PATTERN, key)
        assert parse_undo_key(key) == (sid, g)
        assert step_of_key(key) == sid
    assert parse_undo_key(sid) is None
    assert step_of_key(sid) == sid
    for bad in (f"{sid}:undo{UNDO_KEYS_MAX + 1}", f"{sid}:undo1", f"{sid}:undo0", "x:undo"):
        assert re.fullmatch(KEY_PATTERN, bad) is None, bad
        assert parse_undo_key(bad) is None, bad
        with pytest.raises(ValueError, match="step id"):
            step_of_key(bad)
    for generation in (0, UNDO_KEYS_MAX + 1):
        with pytest.raises(ValueError, match="undo generation"):
            mint_undo_key(sid, generation)


def test_topics_are_declared_once_and_journals_keep_everything() -> None:
    names = [t.suffix for t in ALL_TOPICS]
    assert len(names) == len(set(names))
    for topic in ALL_TOPICS:
        assert topic.configs.get("cleanup.policy") == "delete", topic.suffix
        if topic is not SNAPSHOTS:  # disposable by design: never a source of truth
            assert topic.configs.get("retention.ms") == "-1", topic.suffix
    assert JOURNAL.key == "task_id"


def test_schema_files_live_in_schemas_json() -> None:
    assert Path(__file__).resolve().parents[1] / "schemas" / "json" == JSON_DIR


def test_model_usage_is_bounded() -> None:
    # A forged usage figure must not overflow the read model's sums: it is refused on read.
    s = Stamper("renewal-8812")
    event = s.intended(1)
    wire = json.loads(event.model_dump_json())
    wire["decided_by"]["usage"] = {"input_tokens": 10**30, "output_tokens": 1}
    with pytest.raises(ValidationError, match="input_tokens"):
        parse_event(json.dumps(wire))
