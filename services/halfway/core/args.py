"""How a step's arguments are read back into its tool's argument model. Pure.

Arguments travel as JSON (the model's answer, the journal), so they are validated the way JSON
is, in one place for the decider, the executor and the reconciler: a strict model then takes
`"2026-12-03"` as a date but never `"49.00"` as an integer number of cents.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)


def parse_args(model: type[M], args: Any) -> M:
    """Raises pydantic.ValidationError (or TypeError for what is not JSON) with the reason."""
    return model.model_validate_json(json.dumps(args))
