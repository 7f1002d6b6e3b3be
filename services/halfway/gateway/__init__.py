"""The webhook gateway: verifies provider webhooks and publishes them to the webhooks topic."""

from halfway.gateway.app import make_app, serve_gateway

__all__ = ["make_app", "serve_gateway"]
