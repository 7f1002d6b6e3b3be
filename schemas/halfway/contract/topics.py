"""Every topic halfway uses: its name, partition count, key and configs, in one place.

Journal topics keep everything: `cleanup.policy=delete` with infinite retention, never
compaction, because replay needs the whole history. Only derived latest-state topics may be
compacted. Topic names carry a prefix (`halfway.` unless settings say otherwise) so tests and
several deployments can share one cluster without seeing each other's records.
"""

from __future__ import annotations

from dataclasses import dataclass, field

KEEP_FOREVER = {"cleanup.policy": "delete", "retention.ms": "-1", "retention.bytes": "-1"}


@dataclass(frozen=True, slots=True)
class TopicSpec:
    suffix: str
    partitions: int
    key: str  # what the record key is, in words: it decides ordering
    configs: dict[str, str] = field(default_factory=dict)
    about: str = ""
    # `partitions` is the default; a new deployment sets its own count for every topic that
    # scales (`HALFWAY_PARTITIONS`). Topics keyed by task id must agree on it: a key goes to
    # partition murmur2(key) % count, and one service instance reads the same partition
    # number of each.
    scales: bool = True

    def name(self, prefix: str = "halfway.") -> str:
        return prefix + self.suffix


# Partition counts bound how many instances of a service share the work; 6 divides evenly
# among 1, 2, 3 or 6 instances and is cheap on a single local broker. A bigger deployment sets
# its own when it creates its topics (HALFWAY_PARTITIONS); an existing topic keeps its count,
# because a task's history stays where its key hashed (see docs/architecture.md).
TASKS = TopicSpec(
    "tasks", 6, "task_id", KEEP_FOREVER, "task.requested, published by callers"
)
JOURNAL = TopicSpec(
    "journal",
    6,
    "task_id",
    KEEP_FOREVER,
    "the system of record: every task, step and compensation event",
)
WEBHOOKS = TopicSpec(
    "webhooks",
    6,
    "provider object id",
    KEEP_FOREVER,
    "verified provider webhooks, keyed so one effect's events stay in order",
)
OUTCOMES = TopicSpec(
    "outcomes",
    6,
    "task_id",
    KEEP_FOREVER,
    "user-facing three-state outcomes, derived from the journal (rebuildable by replay)",
)
GUARDS = TopicSpec(
    "guards",
    6,
    "subject",
    KEEP_FOREVER,
    "subject guard claims and releases: one subject's claims are ordered in one partition",
)
DEAD_LETTERS = TopicSpec(
    "deadletters",
    1,
    "source topic/partition/offset (the original key is inside)",
    KEEP_FOREVER,
    "records no service could apply: the reason, where the original lives, its size and digest, "
    "and a bounded excerpt",
    scales=False,  # few records, read by people: one partition keeps them in one order
)
# Topics keyed by task id: partition n of each holds the same tasks (the same count).
TASK_KEYED: tuple[TopicSpec, ...] = (TASKS, JOURNAL, WEBHOOKS, OUTCOMES)

# Snapshots are disposable (halfway.journal.snapshots): a week of them is kept, and a follower
# refreshes its own daily, so the one its group's commit points to is always there.
SNAPSHOTS = TopicSpec(
    "snapshots",
    6,
    "consumer group / journal partition",
    {"cleanup.policy": "delete", "retention.ms": str(7 * 86_400_000)},
    "followers' images of their journal partitions, so a restart reads only the journal after "
    "them; never a source of truth",
)

ALL_TOPICS: tuple[TopicSpec, ...] = (TASKS, JOURNAL, WEBHOOKS, OUTCOMES, GUARDS, DEAD_LETTERS,
                                     SNAPSHOTS)
