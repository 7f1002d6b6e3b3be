"""Finding the app and the model a process serves: `--app MODULE:ATTR`, `--model NAME`.

The app is imported from the current directory first (so `halfway run decider --app
ticketagent:app` works where ticketagent.py is), then from the installed packages. Without one,
a process serves the built-in app (`halfway.builtin:app`), which the demos use.

The model: `--model` (env HALFWAY_MODEL) wins, then the app's own `model`, then `scripted`
(the deterministic model the demos and tests use). `openai:NAME` asks any OpenAI-compatible
chat-completions endpoint through the official client, configured by the client's own
OPENAI_BASE_URL and OPENAI_API_KEY.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from halfway.app.app import App
from halfway.models.base import Model

BUILTIN = "halfway.builtin:app"
APP_ENV = "HALFWAY_APP"
MODEL_ENV = "HALFWAY_MODEL"


class AppNotFound(Exception):
    """The reference names no app: what was tried and why it failed, in words."""


def load_app(ref: str | None = None) -> App:
    """The app named by `ref` (or HALFWAY_APP, or the built-in one)."""
    ref = ref or os.environ.get(APP_ENV) or BUILTIN
    module_name, _, attr = ref.partition(":")
    if not module_name or not attr:
        raise AppNotFound(f"--app {ref!r}: expected MODULE:ATTR, e.g. ticketagent:app")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and module_name.startswith(exc.name):
            raise AppNotFound(f"--app {ref}: no module {module_name!r} in {cwd} or on the "
                              f"Python path") from exc
        raise  # the module exists and one of its own imports is missing: show the real error
    found: Any = module
    for part in attr.split("."):
        try:
            found = getattr(found, part)
        except AttributeError:
            raise AppNotFound(f"--app {ref}: module {module_name} has no {attr}") from None
    if not isinstance(found, App):
        raise AppNotFound(f"--app {ref}: {attr} is a {type(found).__name__}, not a "
                          f"halfway.App")
    return found


def load_model(name: str | None, app: App | None = None) -> Model:
    """The model named by `name` (or HALFWAY_MODEL), else the app's, else `scripted`."""
    name = name or os.environ.get(MODEL_ENV)
    if not name:
        if app is not None and app.model is not None:
            return app.model
        name = "scripted"
    kind, _, model = name.partition(":")
    if kind == "scripted" and not model:
        from halfway.models import ScriptedModel

        return ScriptedModel()
    if kind == "openai" and model:
        from halfway.models.openai_chat import OpenAIModel

        return OpenAIModel(model)
    raise ValueError(f"--model {name!r}: expected scripted or openai:MODEL_NAME "
                     f"(e.g. openai:gpt-4o-mini)")
