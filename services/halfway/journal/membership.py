"""Which app each member of a consumer group serves, told through the group protocol itself.

Every member puts its app label (`name@fingerprint`, `halfway.app.App.label`) in the user data
of its subscription. The group's leader, which computes the assignment, sees every member's
label and hands the set back to every member in the user data of its assignment. So at each
rebalance every instance learns whether its group serves one app or several: no extra topic,
no clock, and nobody can miss a member the broker counts.

Several is reported loudly, by every member, at every rebalance, until it is resolved:
instances with different tools in one group split the tasks between them, and a step for a
tool one of them lacks waits for an instance that has it (`step.unserved` says so in the
task's status). It is not refused outright, because a rolling upgrade that adds a tool passes
through exactly this state for a moment.

The assignment itself is Kafka's range assignment (still named "range", so a member without a
label joins the same group protocol): one instance gets the same partition number of every
topic it follows. Members are ranked by the process they run in (`PROCESS`, carried after the
label) before their member id: a process that runs a decider and an executor (`halfway run
worker`) is given the same partitions in both groups, so each acts on the other's appends
without a fetch round trip.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from aiokafka.coordinator.assignors.range import RangePartitionAssignor
from aiokafka.coordinator.protocol import (
    ConsumerProtocolMemberAssignment,
    ConsumerProtocolMemberMetadata,
)

LABEL_BYTES_MAX = 200  # of one member's label
LABELS_MAX = 32  # distinct labels handed back to members

OnLabels = Callable[[dict[str, int]], None]
# This process, as its group members rank it: the same in every group it joins.
PROCESS = os.urandom(8).hex()
_SEP = b"\0"  # between the label and the process in a member's user data


def labelled_range(label: str, on_labels: OnLabels) -> type[RangePartitionAssignor]:
    """A range assignor that carries this member's `label` and calls `on_labels` with every
    label of the group (label -> members) at each assignment this member receives."""
    data = label.encode()[:LABEL_BYTES_MAX].replace(_SEP, b"") + _SEP + PROCESS.encode()

    class LabelledRange(RangePartitionAssignor):
        @classmethod
        def metadata(cls, topics: Iterable[str]) -> ConsumerProtocolMemberMetadata:
            return ConsumerProtocolMemberMetadata(cls.version, list(topics), data)

        @classmethod
        def assign(cls, cluster: Any, members: Mapping[str, ConsumerProtocolMemberMetadata]
                   ) -> dict[str, ConsumerProtocolMemberAssignment]:
            counts = Counter(_label_of(m.user_data) for m in members.values())
            note = json.dumps(dict(counts.most_common(LABELS_MAX))).encode()
            # Range assignment ranks members by name: rank them by process first.
            ranked = {f"{_process_of(m.user_data)}/{member}": member
                      for member, m in members.items()}
            assigned = super().assign(cluster, {name: members[member]
                                                for name, member in ranked.items()})
            return {ranked[name]: ConsumerProtocolMemberAssignment(a.version, a.assignment, note)
                    for name, a in assigned.items()}

        @classmethod
        def on_assignment(cls, assignment: ConsumerProtocolMemberAssignment) -> None:
            try:
                labels = json.loads(assignment.user_data or b"{}")
            except ValueError:
                return  # a leader of another version: it told us nothing
            if isinstance(labels, dict):
                on_labels({str(k): int(v) for k, v in labels.items()
                           if isinstance(v, int)})

    return LabelledRange


def _label_of(user_data: bytes | None) -> str:
    if not user_data:
        return "(no label)"
    return user_data.split(_SEP, 1)[0][:LABEL_BYTES_MAX].decode(errors="replace")


def _process_of(user_data: bytes | None) -> str:
    _, _, process = (user_data or b"").partition(_SEP)
    return process[:64].decode(errors="replace")
