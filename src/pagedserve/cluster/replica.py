"""One replica as the router sees it: where it is, what it may hold, and its live state."""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field


@dataclass(slots=True)
class Replica:
    name: str
    url: str
    region: str = "local"
    tags: frozenset[str] = frozenset()  # residency tags, e.g. {"eu"}
    kv_role: str = "both"  # prefill replicas only compute prompts for the others (disaggregation)
    healthy: bool = False  # unknown until the first probe answers
    ejected_reason: str = "not probed yet"
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    ejections: int = 0  # a probe begun before the latest ejection is stale: it cannot re-admit
    inflight_requests: int = 0
    inflight_tokens: int = 0
    latency_ms: float | None = None  # EWMA of measured probe round-trips
    models: list[str] = field(default_factory=list)
    kv_tokens: int | None = None  # size of its KV pool, from its /metrics
    kv_layout: tuple[str, int, str] | None = None  # (model, block size, KV format), when disaggregated

    @property
    def tag(self) -> str:
        """8 hex digits naming this replica in the ids of the responses it makes (/v1/responses), by which a
        later previous_response_id is routed back to it."""
        return hashlib.sha256(self.name.encode()).hexdigest()[:8]

    def start_request(self, tokens: int) -> None:
        self.inflight_requests += 1
        self.inflight_tokens += tokens

    def finish_request(self, tokens: int) -> None:
        self.inflight_requests -= 1
        self.inflight_tokens -= tokens

    def observe_latency(self, ms: float, alpha: float = 0.3) -> None:
        self.latency_ms = ms if self.latency_ms is None else (1 - alpha) * self.latency_ms + alpha * ms

    def describe(self) -> dict:
        return {
            "name": self.name, "url": self.url, "region": self.region, "tags": sorted(self.tags),
            "healthy": self.healthy, "reason": "" if self.healthy else self.ejected_reason,
            "inflight_requests": self.inflight_requests, "inflight_tokens": self.inflight_tokens,
            "latency_ms": None if self.latency_ms is None else round(self.latency_ms, 2),
            "models": self.models, "kv_tokens": self.kv_tokens, "kv_role": self.kv_role,
        }
