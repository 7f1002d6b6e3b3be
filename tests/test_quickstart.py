"""The README's quickstart, run exactly as written: the shell block under "### Quickstart".

The commands run in bash from the repository's root, as a new user would run them after
cloning; only the environment is the test's own (a topic prefix and a read-model schema of
its own, so the run shares nothing with other tests). Background jobs (the helpdesk and
`halfway dev`) are stopped when the block ends. The block passes when its last command,
`halfway start ... --follow`, exits 0: the task succeeded.
"""

from __future__ import annotations

import asyncio
import os
import re
import uuid
from pathlib import Path

import pytest

from halfway import settings as env
from halfway.contract.topics import ALL_TOPICS
from halfway.journal.admin import delete_topics
from halfway.projector import store
from halfway.settings import KafkaSettings

pytestmark = pytest.mark.broker

ROOT = Path(__file__).resolve().parent.parent
RUN_S = 300.0  # a cold `infra/dev up` is a no-op here: the suite's setup already ran it


def quickstart_block() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Quickstart", 1)[1]
    found = re.search(r"```sh\n(.*?)```", section, re.S)
    assert found is not None, "the README's quickstart has no ```sh block"
    return found.group(1)


def test_the_quickstart_names_the_public_commands() -> None:
    block = quickstart_block()
    assert "halfway dev --app ticketagent:app" in block
    assert "halfway start tkt-1 --app ticketagent:app --follow" in block


async def test_the_readme_quickstart_runs_as_written(kafka_settings: KafkaSettings,
                                                     tmp_path: Path) -> None:
    suffix = uuid.uuid4().hex[:8]
    environ = dict(os.environ) | {
        "HALFWAY_TOPIC_PREFIX": f"quick-{suffix}.",
        "HALFWAY_PG_SCHEMA": f"quick_{suffix}",
        "HALFWAY_KAFKA_BOOTSTRAP": kafka_settings.bootstrap,
    }
    for name in ("HALFWAY_APP", "HALFWAY_MODEL", "VIRTUAL_ENV"):
        environ.pop(name, None)
    script = tmp_path / "quickstart.sh"
    script.write_text("set -e\ntrap 'kill $(jobs -p) 2>/dev/null; wait' EXIT\n"
                      + quickstart_block())
    output = tmp_path / "quickstart.out"
    try:
        with output.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                "bash", str(script), cwd=ROOT, env=environ, stdin=asyncio.subprocess.DEVNULL,
                stdout=out, stderr=asyncio.subprocess.STDOUT)
            try:
                code = await asyncio.wait_for(proc.wait(), RUN_S)
            except TimeoutError:
                proc.kill()
                await proc.wait()
                raise AssertionError("the quickstart did not finish:\n"
                                     + output.read_text(errors="replace")[-4000:]) from None
    finally:  # what the run made on the shared broker and database goes with it
        await delete_topics(kafka_settings.with_prefix(f"quick-{suffix}."), ALL_TOPICS)
        conn = await store.connect(env.pg_dsn())
        try:
            await store.drop_schema(conn, f"quick_{suffix}")
        finally:
            await conn.close()
    text = output.read_text(errors="replace")
    assert code == 0, text[-4000:]
    # The caller's lines share the file with the background jobs' logs. CI once saw exit 0
    # (the follower saw the task succeed) with no line *starting* "task: succeeded": a log
    # line was then written in two pieces, and ours landed between them (one write per line
    # since: test_render_and_log). The lines are searched for in order, and the whole tail
    # is shown when one is missing.
    done = text.find("step tkt-1:1: done: open_ticket ticket:ACME-42")
    assert done >= 0, text[-4000:]
    assert text.find("task: succeeded", done) > done, text[-4000:]
