"""A snapshot of the engine's counters and gauges, taken on the engine thread and read by /metrics."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.engine.spec_decode.stats import SpecDecodeStats


@dataclass(slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    blocks_total: int
    blocks_used: int
    blocks_cached: int
    prefix_cache_hit_tokens: int
    prefix_cache_query_tokens: int
    num_preemptions: int
    prompt_tokens_total: int
    generation_tokens_total: int
    preemptions_by_reason: dict[str, int] = field(default_factory=dict)
    lora_adapters: int = 0  # LoRA adapters in memory, their bytes, loads and evictions since start
    lora_bytes: int = 0
    lora_loads: int = 0
    lora_evictions: int = 0
    kv_leases: int = 0  # KV transfer leases held for decode workers, and the blocks they pin
    kv_leased_blocks: int = 0
    expert_tokens: list[int] = field(default_factory=list)  # MoE: tokens routed to each expert, all layers summed
    expert_load_imbalance: float = 0.0  # MoE: busiest expert's tokens / the mean, averaged over sparse layers
    spec_decode: SpecDecodeStats | None = None  # speculative decoding's counters; None when it is off

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hit_tokens / self.prefix_cache_query_tokens if self.prefix_cache_query_tokens else 0.0
