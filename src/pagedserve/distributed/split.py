"""Which part of a Llama-family model each rank holds (Megatron-style), decided once from the model's shape.

- Attention splits by whole GQA groups: a rank holds some KV heads and exactly the query heads that read them, so
  every rank keeps the model's query-heads-per-KV-head ratio (the attention kernels' GQA layout). With at least as
  many KV heads as ranks they are dealt out as evenly as possible, uneven where they do not divide (SmolLM2-135M's
  3 KV heads on 2 ranks: 2 + 1, so 6 + 3 query heads; the attention work is uneven, the MLP and vocabulary are not).
  With fewer KV heads than ranks each KV head is replicated on ranks / KV heads ranks, which share its query heads;
  that needs both divisions to be exact, else the shape is refused.
- qkv and gate_up split by output rows (each rank's q, k, v, gate and up rows), o and down by input columns, whose
  partial products are summed by an all-reduce; the embedding and LM head split the vocabulary (an all-reduce of
  rows only one rank holds, and an all-gather of logits).
- A mixture of experts splits every expert like the MLP (its gate and up columns, its down's input columns, one
  all-reduce per sparse layer); the router is whole on every rank, so all ranks route alike.
- Quantized weights split along their groups: a K range that would cut a group (or a Hadamard block) is refused.
  A weight with one group per row (int8 per channel) keeps its scale per row on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pagedserve.model.fp8_linear import FP8Weight
from pagedserve.model.model_config import ModelConfig
from pagedserve.model.quant import GGUF_BLOCK, QuantizedWeight


@dataclass(frozen=True, slots=True)
class RankShard:
    rank: int
    world_size: int
    q_heads: range  # global query heads this rank computes
    kv_heads: range  # global KV heads it stores and computes (replicated across ranks when fewer than them)
    intermediate: range  # MLP columns (of gate, of up, and rows of down's input)
    vocab: range  # embedding rows and logits
    vocab_sizes: tuple[int, ...]  # every rank's vocabulary share, for the all-gather
    expert_intermediate: range = range(0)  # each expert's columns, as the MLP's (a mixture of experts)

    def local_config(self, config: ModelConfig) -> ModelConfig:
        """The config of this rank's part: its heads (the KV cache it owns) and MLP width; the vocabulary stays
        whole, as the logits that come back are."""
        return replace(config, num_attention_heads=len(self.q_heads), num_key_value_heads=len(self.kv_heads),
                       intermediate_size=len(self.intermediate), moe_intermediate_size=len(self.expert_intermediate))


def even_parts(total: int, world: int) -> list[range]:
    """total split into world contiguous ranges, the first total % world one longer."""
    base, extra = divmod(total, world)
    starts = [r * base + min(r, extra) for r in range(world + 1)]
    return [range(starts[r], starts[r + 1]) for r in range(world)]


def plan_shard(config: ModelConfig, rank: int, world: int) -> RankShard:
    """Raises ValueError, naming the shape, where the model cannot split over world ranks."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    group = heads // kv
    if kv >= world:
        kv_heads = even_parts(kv, world)[rank]
    elif world % kv == 0 and group % (world // kv) == 0:
        share = world // kv  # ranks per KV head, each with group // share of its query heads
        head = rank // share
        per = group // share
        first = head * group + (rank % share) * per
        return _shard(config, rank, world, range(first, first + per), range(head, head + 1))
    else:
        raise ValueError(f"cannot split {heads} query heads / {kv} KV heads over {world} ranks: with fewer KV heads "
                         f"than ranks, the ranks must be a multiple of the KV heads ({kv}) and each KV head's "
                         f"{group} query heads must divide among its {world // kv if world % kv == 0 else '?'} ranks")
    return _shard(config, rank, world, range(kv_heads.start * group, kv_heads.stop * group), kv_heads)


def _shard(config: ModelConfig, rank: int, world: int, q_heads: range, kv_heads: range) -> RankShard:
    vocab = even_parts(config.vocab_size, world)
    experts = _columns(config.moe_intermediate_size, rank, world, "expert") if config.num_experts else range(0)
    return RankShard(rank, world, q_heads, kv_heads, _columns(config.intermediate_size, rank, world, "MLP"),
                     vocab[rank], tuple(len(v) for v in vocab), experts)


def _columns(width: int, rank: int, world: int, what: str) -> range:
    """This rank's columns of an MLP (or of each expert) of width columns, in whole blocks of GGUF_BLOCK."""
    if width % GGUF_BLOCK or width // GGUF_BLOCK < world:
        raise ValueError(f"cannot split an {what} of {width} columns over {world} ranks in blocks of {GGUF_BLOCK}")
    blocks = even_parts(width // GGUF_BLOCK, world)[rank]
    return range(blocks.start * GGUF_BLOCK, blocks.stop * GGUF_BLOCK)


def qkv_rows(shard: RankShard, config: ModelConfig) -> torch.Tensor:
    """This rank's rows of the fused [q; k; v] projection."""
    d, q_size, kv_size = config.head_dim, config.q_size, config.kv_size
    q = torch.arange(shard.q_heads.start * d, shard.q_heads.stop * d)
    k = torch.arange(shard.kv_heads.start * d, shard.kv_heads.stop * d)
    return torch.cat([q, q_size + k, q_size + kv_size + k])


def gate_up_rows(shard: RankShard, config: ModelConfig) -> torch.Tensor:
    """This rank's rows of the fused [gate; up] projection."""
    cols = torch.arange(shard.intermediate.start, shard.intermediate.stop)
    return torch.cat([cols, config.intermediate_size + cols])


def rows_of(w: torch.Tensor | QuantizedWeight | FP8Weight, index: torch.Tensor) -> torch.Tensor | QuantizedWeight | FP8Weight:
    if isinstance(w, FP8Weight):
        return FP8Weight(w.qweight[index].contiguous(), w.scales[index].contiguous(), w.source)
    return w.rows(index) if isinstance(w, QuantizedWeight) else w[index].contiguous()


def columns_of(w: torch.Tensor | QuantizedWeight | FP8Weight, cols: range) -> torch.Tensor | QuantizedWeight | FP8Weight:
    """The input columns cols of w [N, K]; a quantized weight only along whole groups; an FP8 one keeps its
    output scales whole (one per output row)."""
    if isinstance(w, FP8Weight):
        return FP8Weight(w.qweight[:, cols.start:cols.stop].contiguous(), w.scales, w.source)
    if not isinstance(w, QuantizedWeight):
        return w[:, cols.start:cols.stop].contiguous()
    n, k = w.shape
    k0, k1 = cols.start, cols.stop
    if w.input_perm is not None:
        raise ValueError(f"cannot split a {n}x{k} {w.source} weight in GPTQ's activation order by input columns: its "
                         "stored columns mix every rank's inputs (serve it without --tensor-parallel-size)")
    one_group = w.group == k  # per channel: each part keeps the row's scale, as one group of its own width
    unit = GGUF_BLOCK if one_group else w.group
    if k0 % unit or k1 % unit or (w.hadamard and (k0 % w.hadamard or k1 % w.hadamard)):
        raise ValueError(f"cannot split a {n}x{k} {w.source} weight (groups of {w.group}, Hadamard blocks of "
                         f"{w.hadamard}) at columns {k0}..{k1}: the split would cut a group")
    per_byte = 2 if w.bits == 4 else 1
    qweight = w.qweight[:, k0 // per_byte:k1 // per_byte].contiguous()
    if one_group:  # replace(): whatever else the weight carries (its source, basis, flags) goes with it
        return replace(w, qweight=qweight, scales=w.scales.clone(), mins=None if w.mins is None else w.mins.clone(),
                       group=k1 - k0)
    g0, g1 = k0 // w.group, k1 // w.group
    mins = None if w.mins is None else w.mins[:, g0:g1].contiguous()
    return replace(w, qweight=qweight, scales=w.scales[:, g0:g1].contiguous(), mins=mins)
