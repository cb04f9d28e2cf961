"""One admitted request on its way through the gateway's stages (see app.py for the order)."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pagedserve.gateway.auth import ApiKey
from pagedserve.gateway.budget import BudgetHold
from pagedserve.gateway.gateway_config import RouteConfig, Target
from pagedserve.gateway.protocol import GatewayRequest
from pagedserve.gateway.semantic_cache import Lookup
from pagedserve.gateway.tracing import Trace


@dataclass(slots=True)
class Call:
    kind: str  # "chat" or "completions"
    key: ApiKey
    route: RouteConfig
    request: GatewayRequest
    body: dict
    trace: Trace
    tokens_estimate: int  # prompt_bound + every choice's completion limit: reserved from the tpm bucket
    prompt_bound: int
    hold: BudgetHold | None = None
    headers: dict[str, str] = field(default_factory=dict)  # the rate limiter's, returned to the client
    forward_headers: dict[str, str] = field(default_factory=dict)
    query: str | None = None
    scope: str | None = None
    vector: np.ndarray | None = None
    versions: dict[str, str] = field(default_factory=dict)
    lookup: Lookup | None = None
    tier: str = "small"

    def response_headers(self, target: Target | None) -> dict[str, str]:
        headers = {**self.headers, "x-gateway-trace-id": self.trace.trace_id, "x-gateway-cache": str(self.trace.cache),
                   "x-gateway-tier": self.tier}
        if target is not None:
            headers["x-gateway-provider"] = target.label
        return headers
