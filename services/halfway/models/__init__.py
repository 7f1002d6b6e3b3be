"""Models behind one small interface: `decide(history) -> call | finish`."""

from halfway.models.base import (
    CallView,
    History,
    Model,
    ModelUnavailable,
    Proposal,
    ProposeCall,
    ProposeFinish,
    RefusalView,
    StepView,
    ToolInfo,
    Usage,
    history_of,
)
from halfway.models.scripted import ScriptedModel

__all__ = ["CallView", "History", "Model", "ModelUnavailable", "Proposal", "ProposeCall",
           "ProposeFinish", "RefusalView", "ScriptedModel", "StepView", "ToolInfo", "Usage",
           "history_of"]
