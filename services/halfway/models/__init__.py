"""Models behind one small interface: `decide(history) -> call | finish`."""

from halfway.models.base import (
    History,
    Model,
    Proposal,
    ProposeCall,
    ProposeFinish,
    ToolInfo,
    history_of,
)
from halfway.models.scripted import ScriptedModel

__all__ = ["History", "Model", "Proposal", "ProposeCall", "ProposeFinish", "ScriptedModel",
           "ToolInfo", "history_of"]
