"""The pure core: decisions with no I/O. Services are thin shells around it."""

from halfway.contract.ids import mint_key, mint_undo_key
from halfway.core.classify import Verdict, classify
from halfway.core.fold import (
    EffectState,
    StepState,
    StepStatus,
    TaskState,
    TaskStatus,
    apply,
    fold,
    fold_all,
)

__all__ = [
    "EffectState",
    "StepState",
    "StepStatus",
    "TaskState",
    "TaskStatus",
    "Verdict",
    "apply",
    "classify",
    "fold",
    "fold_all",
    "mint_key",
    "mint_undo_key",
]
