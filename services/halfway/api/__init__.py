"""The operators' surfaces over the read model: the HTTP API, the web page, and the text tables
of `halfway tasks` and `halfway status`."""

from halfway.api.app import make_app, serve_api

__all__ = ["make_app", "serve_api"]
