"""The tools a deployment offers: name -> (spec, adapter)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from halfway import settings
from halfway.models.base import ToolInfo
from halfway.tools.spec import Adapter, ToolSpec


@dataclass(frozen=True)
class Tool:
    spec: ToolSpec
    adapter: Adapter


class Registry:
    def __init__(self, tools: list[Tool],
                 closers: list[Callable[[], Awaitable[None]]] | None = None) -> None:
        self._tools = {t.spec.name: t for t in tools}
        self._closers = list(closers or [])  # the app's own clean-up, run after the adapters
        assert len(self._tools) == len(tools), "tool names must be unique"
        self._infos: list[ToolInfo] | None = None

    def names(self) -> set[str]:
        return set(self._tools)

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def check_undos(self) -> None:
        """Every declared undo names a tool of this registry: a saga must be able to run it."""
        missing = [f"{t.spec.name} -> {t.spec.undo.tool}" for t in self._tools.values()
                   if t.spec.undo is not None and t.spec.undo.tool not in self._tools]
        if missing:
            raise ValueError(f"undo tools missing from the registry: {', '.join(missing)}")

    def specs(self) -> list[ToolSpec]:
        return [t.spec for t in self._tools.values()]

    def infos(self) -> list[ToolInfo]:
        """What the model reads of each tool (built once: a JSON schema costs CPU)."""
        if self._infos is None:
            self._infos = [ToolInfo(t.spec.name, t.spec.description,
                                    t.spec.args_model.model_json_schema())
                           for t in self._tools.values()]
        return self._infos

    async def aclose(self) -> None:
        for tool in self._tools.values():
            close = getattr(tool.adapter, "aclose", None)
            if close is not None:
                await close()
        for closer in self._closers:
            await closer()


def builtin_tools() -> list[Tool]:
    """The built-in tools, configured from the environment: the payment tool and the travel
    tools (flight hold, hotel booking, email; each undo is a tool too)."""
    from halfway.tools.payments import PaymentsAdapter, charge_customer_spec
    from halfway.tools.travel import travel_tools

    spec = charge_customer_spec(timeout_s=settings.charge_timeout_s(),
                                key_ttl_s=settings.charge_key_ttl_s(),
                                completes_within_s=settings.charge_completes_within_s())
    travel = travel_tools(settings.tripsim_url(), timeout_s=settings.travel_timeout_s(),
                          key_ttl_s=settings.travel_key_ttl_s(),
                          completes_within_s=settings.travel_completes_within_s())
    return [Tool(spec, PaymentsAdapter(settings.paysim_url())), *(Tool(s, a) for s, a in travel)]


def default_registry() -> Registry:
    """The built-in tools as a registry (the demos' app: `halfway.builtin:app`)."""
    registry = Registry(builtin_tools())
    registry.check_undos()
    return registry
