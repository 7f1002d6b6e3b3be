"""The tools a deployment offers: name -> (spec, adapter)."""

from __future__ import annotations

from dataclasses import dataclass

from halfway import settings
from halfway.models.base import ToolInfo
from halfway.tools.spec import Adapter, ToolSpec


@dataclass(frozen=True)
class Tool:
    spec: ToolSpec
    adapter: Adapter


class Registry:
    def __init__(self, tools: list[Tool]) -> None:
        self._tools = {t.spec.name: t for t in tools}
        assert len(self._tools) == len(tools), "tool names must be unique"

    def names(self) -> set[str]:
        return set(self._tools)

    def get(self, name: str) -> Tool | None:
        return self._tools.get(name)

    def infos(self) -> list[ToolInfo]:
        return [ToolInfo(t.spec.name, t.spec.description, t.spec.args_model.model_json_schema())
                for t in self._tools.values()]

    async def aclose(self) -> None:
        for tool in self._tools.values():
            close = getattr(tool.adapter, "aclose", None)
            if close is not None:
                await close()


def default_registry() -> Registry:
    """The tools of this deployment, configured from the environment."""
    from halfway.tools.payments import PaymentsAdapter, charge_customer_spec

    spec = charge_customer_spec(timeout_s=settings.charge_timeout_s(),
                                key_ttl_s=settings.charge_key_ttl_s())
    return Registry([Tool(spec, PaymentsAdapter(settings.paysim_url()))])
