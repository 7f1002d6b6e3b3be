"""After the renewal and trip demos, the read model equals a fresh replay of the topics, row
for row."""

from __future__ import annotations

import pytest

from halfway import settings as env
from halfway.api import queries
from halfway.api.status import status_table
from halfway.demo import renewal, trip
from halfway.projector.rebuild import rebuild
from halfway.settings import KafkaSettings

pytestmark = pytest.mark.broker


async def test_after_the_demos_the_read_model_equals_a_fresh_replay(
        own_deployment: KafkaSettings, pg, schema: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The demo runs its own projector into the read model named by HALFWAY_PG_SCHEMA.
    monkeypatch.setenv("HALFWAY_PG_SCHEMA", schema)
    ours, naive = await renewal.run(own_deployment)
    assert (ours.charges, naive.charges) == (1, 2)
    assert ours.read_model_state == "succeeded"

    trips = await trip.run(own_deployment)
    assert trip.verdict_ok(trips), trip.as_text(trips)

    report = await rebuild(own_deployment, env.pg_dsn(), check_only=True, live=schema)
    assert report.live_existed
    assert report.equal, "\n".join(report.lines())

    # What an operator sees of the renewal: done, with the charge id, never "failed".
    task_id = ours.steps[0]["step_id"].rsplit(":", 1)[0]
    found = await queries.get_task(pg, schema, task_id)
    assert found is not None
    table = status_table(found)
    assert "done" in table
    assert ours.steps[0]["evidence"]["charge_id"] in table
    assert "failed" not in table
    assert ours.status_table in renewal.as_text(ours, naive)  # the demo printed it

    # The trip whose hotel was full: compensated, its hold's undo done, in three states.
    full = trips.trips[1]
    found = await queries.get_task(pg, schema, full.task_id)
    assert found is not None
    assert found["final_state"] == "compensated"
    table = status_table(found)
    assert "not done" in table
    assert "step 1 undo: done" in table
    assert full.status_table in trip.as_text(trips)
