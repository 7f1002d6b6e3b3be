"""The built-in app: the payment tool (paysim, Stripe-like) and the travel tools (tripsim).

The demos and `halfway run` without `--app` serve it (`--app halfway.builtin:app`). Each access
to `app` builds it afresh from the environment (PAYSIM_URL, TRIPSIM_URL, the timeouts).
"""

from __future__ import annotations

from typing import Any

INSTRUCTIONS = ("You run renewals and trips: charge customers for invoices, hold flights, book "
                "hotels and send itineraries.")


def builtin_app() -> Any:
    from halfway.app import App
    from halfway.tools.registry import builtin_tools

    app = App(name="builtin", instructions=INSTRUCTIONS)
    for tool in builtin_tools():
        app.add(tool.spec, tool.adapter)
    return app


def __getattr__(name: str) -> Any:
    if name == "app":
        return builtin_app()
    raise AttributeError(name)
