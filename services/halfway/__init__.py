"""halfway: a journaled effects harness for AI agents, event-sourced on Apache Kafka.

    from halfway import App, Refused

The package spans two source roots (schemas/halfway: the event contract; services/halfway:
what runs); `extend_path` joins them. The public names load on first use, so importing the
contract alone stays light.
"""

from pkgutil import extend_path
from typing import Any

__path__ = extend_path(__path__, __name__)

__all__ = ["App", "CallContext", "Refused"]


def __getattr__(name: str) -> Any:
    if name in ("App", "Refused"):
        import halfway.app as app

        return getattr(app, name)
    if name == "CallContext":
        from halfway.tools.spec import CallContext

        return CallContext
    raise AttributeError(f"module 'halfway' has no attribute {name!r}")
