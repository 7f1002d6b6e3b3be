"""The outcomes topic: every visible change of a task, its steps and their compensations,
derived from the journal and published for subscribers (three states, never two)."""

from halfway.outcomes.derive import Change, Sequencer, changes, messages, visible
from halfway.outcomes.service import OutcomesPublisher, read_outcomes

__all__ = [
    "Change",
    "OutcomesPublisher",
    "Sequencer",
    "changes",
    "messages",
    "read_outcomes",
    "visible",
]
