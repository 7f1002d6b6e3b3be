"""The app API: bring your own agent (tools, instructions, model) without forking halfway."""

from halfway.app.app import App, FunctionTool, fingerprint_of
from halfway.app.functions import Refused
from halfway.app.loading import AppNotFound, load_app, load_model

__all__ = ["App", "AppNotFound", "FunctionTool", "Refused", "fingerprint_of", "load_app",
           "load_model"]
