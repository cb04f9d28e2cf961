"""Each replica's engine as its /metrics tells it: KV usage, running and waiting requests, the admission queue,
preemptions, tokens per second, prefix-cache hit rate and KV transfers. Read when the console asks (at most once
a second, however many people watch), with a short history per replica for the charts."""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.cluster.replica import Replica

HISTORY = 150  # samples per replica: five minutes at the console's pace of one every two seconds
SUMMED = {  # sample name -> field; series of one name (one per label set) are added up
    "pagedserve_kv_blocks_used": "blocks_used", "pagedserve_kv_blocks_total": "blocks_total",
    "pagedserve_num_requests_running": "running", "pagedserve_num_requests_waiting": "waiting",
    "pagedserve_admission_queued_tokens": "queued_tokens", "pagedserve_num_preemptions_total": "preemptions",
    "pagedserve_generation_tokens_total": "generation_tokens", "pagedserve_prompt_tokens_total": "prompt_tokens",
    "pagedserve_prefix_cache_hit_tokens_total": "prefix_hit_tokens",
    "pagedserve_prefix_cache_query_tokens_total": "prefix_query_tokens",
    "pagedserve_kv_transfer_failures_total": "transfer_failures",
    "pagedserve_kv_transfer_leases": "leases", "pagedserve_kv_transfer_leased_blocks": "leased_blocks",
}
BY_DIRECTION = {"pagedserve_kv_transfer_blocks_total": "blocks", "pagedserve_kv_transfer_bytes_total": "bytes"}


@dataclass(slots=True)
class EngineStats:
    at: float = 0.0
    blocks_used: float = 0.0
    blocks_total: float = 0.0
    running: float = 0.0
    waiting: float = 0.0
    queued_tokens: float = 0.0
    preemptions: float = 0.0
    generation_tokens: float = 0.0
    prompt_tokens: float = 0.0
    prefix_hit_tokens: float = 0.0
    prefix_query_tokens: float = 0.0
    transfer_failures: float = 0.0
    leases: float = 0.0
    leased_blocks: float = 0.0
    transfers: dict[str, float] = field(default_factory=dict)  # blocks_in, blocks_out, bytes_in, bytes_out
    tokens_per_s: float | None = None  # generated, since the sample before

    @property
    def kv_usage(self) -> float | None:
        return self.blocks_used / self.blocks_total if self.blocks_total else None

    @property
    def prefix_hit_rate(self) -> float | None:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else None


def parse(text: str, at: float) -> EngineStats:
    stats = EngineStats(at=at)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = SUMMED.get(sample.name)
            if name is not None:
                setattr(stats, name, getattr(stats, name) + sample.value)
            elif sample.name in BY_DIRECTION:
                key = f"{BY_DIRECTION[sample.name]}_{sample.labels.get('direction', '')}"
                stats.transfers[key] = stats.transfers.get(key, 0.0) + sample.value
    return stats


@dataclass(slots=True)
class ReplicaView:
    replica: Replica
    stats: EngineStats | None  # None: its /metrics did not answer
    error: str | None = None


class Scraper:
    def __init__(self, replicas: list[Replica], client: httpx.AsyncClient, timeout_s: float = 1.5,
                 min_interval_s: float = 1.0):
        self.replicas, self.client, self.timeout_s, self.min_interval_s = replicas, client, timeout_s, min_interval_s
        self.last: dict[str, ReplicaView] = {}
        self.history: dict[str, deque[EngineStats]] = {r.name: deque(maxlen=HISTORY) for r in replicas}
        self.scraped_at = 0.0
        self.lock = asyncio.Lock()

    async def views(self) -> list[ReplicaView]:
        async with self.lock:  # viewers at once share one round of scrapes
            if time.monotonic() - self.scraped_at >= self.min_interval_s:
                await asyncio.gather(*(self._scrape(r) for r in self.replicas))
                self.scraped_at = time.monotonic()
        return [self.last.get(r.name) or ReplicaView(r, None, "not read yet") for r in self.replicas]

    async def _scrape(self, replica: Replica) -> None:
        try:
            response = await self.client.get(replica.url + "/metrics", timeout=self.timeout_s)
            response.raise_for_status()
            stats = parse(response.text, time.time())
        except (httpx.HTTPError, ValueError) as exc:
            self.last[replica.name] = ReplicaView(replica, None, f"/metrics: {type(exc).__name__}")
            return
        history = self.history[replica.name]
        if history:
            before = history[-1]
            elapsed = stats.at - before.at
            if elapsed > 0 and stats.generation_tokens >= before.generation_tokens:  # not a restarted replica
                stats.tokens_per_s = (stats.generation_tokens - before.generation_tokens) / elapsed
        history.append(stats)
        self.last[replica.name] = ReplicaView(replica, stats)

    def series(self, field_name: str) -> dict:
        """A chart of one per-replica quantity over the recent samples (a shared time axis, gaps as null)."""
        times = sorted({round(s.at) for h in self.history.values() for s in h})
        data: list[list] = [times]
        for samples in self.history.values():
            by_time = {round(s.at): getattr(s, field_name) for s in samples}
            data.append([by_time.get(t) for t in times])
        return {"series": [{"label": name} for name in self.history], "data": data}
