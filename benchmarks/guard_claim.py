"""What the subject guard costs a step: one claim, from append to the log's verdict.

    .venv/bin/python benchmarks/guard_claim.py [--claims 2000] [--warmup 200]

Before the decider places a step with a subject, it appends a claim to the guards topic and
waits until its own fold of that topic has applied the claim (`GuardView.claim`). Printed
beside the baseline measured in the same run: a plain journal append (acks=all), which every
step pays anyway. The ratio is the guard's price. A second figure folds the whole guards topic
from the start, as every decider does when it starts (claims per second).
Figures only; nothing here passes or fails on time.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path

from halfway.contract.guards import SubjectClaimed
from halfway.contract.topics import GUARDS, JOURNAL
from halfway.journal import JournalWriter, ensure_topics
from halfway.journal.admin import delete_topics
from halfway.journal.guards import GuardView
from halfway.settings import KafkaSettings

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark's helpers
from produce_rtt import describe, sample_event, timed


def claim(i: int) -> SubjectClaimed:
    task = f"bench-{i}"
    return SubjectClaimed(event_id=uuid.uuid4().hex, at=datetime.now(UTC),
                          subject=f"invoice:INV-{i}", tool="charge_customer",
                          step_id=f"{task}:1", task_id=task, once_per_subject=True)


async def main(claims: int, warmup: int) -> None:
    base = KafkaSettings.from_env()
    settings = base.with_prefix(f"bench-guard-{uuid.uuid4().hex[:6]}.")
    await ensure_topics(settings, (JOURNAL, GUARDS))
    try:
        async with JournalWriter(settings) as writer:
            append = await timed(claims, warmup, lambda i: writer.append(sample_event(i)))
            view = GuardView(settings, writer)
            await view.start()
            fold = asyncio.create_task(view.run())
            try:
                await view.caught_up()
                offset = warmup + claims  # distinct subjects: every claim is granted
                claimed = await timed(claims, warmup,
                                      lambda i: view.claim(claim(offset + i)))
            finally:
                fold.cancel()
                await view.stop()
            print(f"{claims} timed after {warmup} warm-up, each: journal appends, then claims "
                  f"on distinct subjects (every claim granted)")
            a = describe("journal append (baseline)", append)
            c = describe("guard claim -> verdict", claimed)
            print(f"ratio claim/append: median {c['median'] / a['median']:.2f}x, "
                  f"p99 {c['p99'] / a['p99']:.2f}x")

            # A decider starting up folds the whole guards topic before any task moves.
            cold = GuardView(settings, writer)
            started = time.perf_counter()
            await cold.start()
            task = asyncio.create_task(cold.run())
            try:
                await cold.caught_up()
            finally:
                task.cancel()
                await cold.stop()
            elapsed = time.perf_counter() - started
            records = claims + warmup
            print(f"cold fold of the guards topic: {records} claims in {elapsed:.2f} s "
                  f"({records / elapsed:,.0f} claims/s, start-up included)")
    finally:
        await delete_topics(settings, (JOURNAL, GUARDS))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--claims", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=200)
    args = parser.parse_args()
    asyncio.run(main(args.claims, args.warmup))
