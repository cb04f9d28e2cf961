"""LoRA adapters under tensor parallelism, sharded like their base layers (S-LoRA): a column-parallel projection's
adapter (qkv, gate_up) keeps this rank's output rows of B and all of A; a row-parallel one's (o, down) keeps this
rank's input columns of A and all of B, so its partial delta joins the partial product the all-reduce sums.

Rank 0 picks the slots (LoRASlots._activate); each worker mirrors them from the step's LoRAPlan, so the rows,
segments and slot numbers of rank 0's LoRABatch hold on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.distributed.split import RankShard, gate_up_rows, qkv_rows
from pagedserve.model.lora import LoRAAdapter, LoRABatch, LoRASlots, LoRAWeights
from pagedserve.model.model_config import ModelConfig


def shard_adapter(adapter: LoRAAdapter, shard: RankShard, config: ModelConfig) -> LoRAAdapter:
    """shard's part of adapter (config: the whole model's)."""
    d = config.head_dim
    rows = {"qkv_proj": qkv_rows(shard, config), "gate_up_proj": gate_up_rows(shard, config)}
    cols = {"o_proj": range(shard.q_heads.start * d, shard.q_heads.stop * d), "down_proj": shard.intermediate}
    layers = []
    for layer in adapter.layers:
        part = {}
        for module, w in layer.items():
            if module in rows:
                part[module] = LoRAWeights(w.a, w.b[rows[module]].contiguous())
            else:
                c = cols[module]
                part[module] = LoRAWeights(w.a[:, c.start:c.stop].contiguous(), w.b)
        layers.append(part)
    sharded = LoRAAdapter(adapter.name, adapter.int_id, adapter.path, adapter.rank, layers)
    sharded.cache_key = adapter.cache_key  # the adapter's identity on every rank (its slot key), not this part's
    return sharded


@dataclass(slots=True)
class LoRAPlan:
    """A step's LoRABatch as the workers get it: its rows and segments, and which adapter each slot must hold."""
    index: torch.Tensor
    seg_starts: torch.Tensor
    seg_slots: torch.Tensor
    keys: list[str]  # the adapter (cache_key) of each segment's slot

    @classmethod
    def of(cls, batch: LoRABatch) -> LoRAPlan:
        key_of = {slot: key for key, slot in batch.slots.slot_of.items()}
        return cls(batch.index, batch.seg_starts, batch.seg_slots, [key_of[s] for s in batch.seg_slots.tolist()])

    def batch(self, slots: LoRASlots, adapters: dict[str, LoRAAdapter]) -> LoRABatch:
        """The worker's LoRABatch over its own slots, filled as rank 0's are."""
        for slot, key in zip(self.seg_slots.tolist(), self.keys):
            slots.hold(adapters[key], slot)
        return LoRABatch(slots, self.index, self.seg_starts, self.seg_slots)
