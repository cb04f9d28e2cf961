"""What the gateway console's pages read: the gateway's parts (never the Gateway object itself, so these modules do
not import app.py, which mounts them), the console's web kit and the read-only reports."""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from pagedserve.cluster.ui.web import Console
from pagedserve.gateway.auth import ApiKey
from pagedserve.gateway.budget import BudgetKeeper
from pagedserve.gateway.gateway_config import GatewayConfig
from pagedserve.gateway.providers import ProviderPool
from pagedserve.gateway.retrieval.library import Library
from pagedserve.gateway.semantic_cache import SemanticCache
from pagedserve.gateway.store import Store
from pagedserve.gateway.ui.reports import Reports

KEY_ID = re.compile(r"[0-9a-f]{12}")


@dataclass(slots=True)
class GatewayUI:
    config: GatewayConfig
    store: Store
    budgets: BudgetKeeper
    providers: ProviderPool
    library: Library | None
    cache: SemanticCache | None
    status: Callable[[], dict]
    web: Console
    reports: Reports

    async def key(self, key_id: str) -> ApiKey | None:
        if not KEY_ID.fullmatch(key_id):
            return None
        return next((k for k in await self.store.list_keys() if k.key_id == key_id), None)

    def key_budget(self, key: ApiKey) -> float | None:
        """The key's daily budget as admission applies it: its own, else key_defaults'."""
        own = key.daily_budget_usd
        return own if own is not None else self.config.key_defaults.daily_budget_usd

    async def spend(self, day: str | None = None) -> dict[str, dict[str, float]]:
        """scope (key:ID, user:NAME) -> day -> dollars spent, from the store (what budgets are checked against)."""
        out: dict[str, dict[str, float]] = {}
        for row in await self.budgets.usage(day):
            out.setdefault(row["scope"], {})[row["day"]] = row["spend_usd"]
        return out
