"""One admitted request on its way through the gateway's stages (see app.py for the order)."""
from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import quote

import numpy as np

from pagedserve.gateway.auth import ApiKey
from pagedserve.gateway.budget import BudgetHold
from pagedserve.gateway.gateway_config import RouteConfig, Target
from pagedserve.gateway.protocol import GatewayRequest
from pagedserve.gateway.retrieval.hybrid_index import Hit
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
    index_version: str | None = None  # the route's retrieval source, as read for this request
    retrieved: list[Hit] | None = None  # None: no retrieval ran
    served_sources: list[dict] | None = None  # those of an answer served from elsewhere (the cache, a flight)

    @property
    def sources(self) -> list[dict] | None:
        """The `sources` the answer reports: the chunks retrieved now, or those a served answer was built from."""
        if self.retrieved is not None:
            return [h.public() for h in self.retrieved]
        return self.served_sources

    def response_headers(self, target: Target | None) -> dict[str, str]:
        headers = {**self.headers, "x-gateway-trace-id": self.trace.trace_id, "x-gateway-cache": str(self.trace.cache),
                   "x-gateway-tier": self.tier}
        if target is not None:
            headers["x-gateway-provider"] = target.label
        sources = self.sources
        if sources is not None:
            headers["x-gateway-sources"] = sources_header(sources)
        return headers


def sources_header(hits: list[dict]) -> str:
    """`document#heading` per chunk, percent-encoded (headers are ASCII), comma-separated, best first."""
    return ", ".join(f"{quote(h['document'], safe='/')}#{quote(h['heading'], safe='')}" for h in hits)
