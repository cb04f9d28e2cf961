"""The layers of a rank's part of the model, and shard_llama, which cuts a loaded model (any family's layers: Llama's
projections, and a mixture of experts' experts) down to one rank's part.

Column-parallel projections (qkv, gate_up) need no new layer: a rank's rows are a smaller Linear of the same kind.
Row-parallel ones sum their partial products across ranks before the residual joins, so it is added once.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pagedserve.distributed.split import RankShard, columns_of, gate_up_rows, qkv_rows, rows_of
from pagedserve.model.fp8_linear import FP8Linear, FP8Weight
from pagedserve.model.linear import Linear
from pagedserve.model.models.moe import SparseMoE, padded
from pagedserve.model.quant import QuantizedWeight
from pagedserve.model.quant_linear import QuantEmbedding, QuantLinear


class RowParallelLinear(nn.Module):
    """o_proj and down_proj: this rank's input columns, then the all-reduce, then the residual. add_partial
    (the step's LoRA, whose A holds the same input columns) adds to the partial product before the sum."""

    sums_partials = True  # what models/llama.py's project_out asks

    def __init__(self, inner: nn.Module, comm: Any) -> None:
        super().__init__()
        self.inner = inner
        self.comm = comm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None,
                add_partial: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        y = self.inner(x)
        if add_partial is not None:
            add_partial(y)
        y = self.comm.all_reduce(y)
        return y if residual is None else residual + y


class VocabParallelEmbedding(nn.Module):
    """This rank's vocabulary rows; a token another rank holds looks up zeros here, and the all-reduce (one
    nonzero term per row, so exact) gives every rank the whole embedding."""

    def __init__(self, inner: nn.Module, vocab: range, comm: Any) -> None:
        super().__init__()
        self.inner = inner
        self.vocab = vocab
        self.comm = comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab.start
        outside = (local < 0) | (local >= len(self.vocab))
        x = self.inner(local.masked_fill(outside, 0))
        return self.comm.all_reduce(x.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(nn.Module):
    """This rank's vocabulary share of the logits, gathered into the whole row on every rank."""

    def __init__(self, inner: nn.Module, sizes: tuple[int, ...], comm: Any) -> None:
        super().__init__()
        self.inner = inner
        self.sizes = list(sizes)
        self.comm = comm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.comm.all_gather(self.inner(hidden).contiguous(), self.sizes)


def linear_of(module: nn.Module, weight: torch.Tensor | QuantizedWeight | FP8Weight,
              bias: torch.Tensor | None) -> nn.Module:
    """A layer of module's kind over weight (float, quantized or FP8)."""
    bias_param = None if bias is None else nn.Parameter(bias.contiguous(), requires_grad=False)
    if isinstance(weight, QuantizedWeight):
        return QuantLinear(weight, bias_param)
    if isinstance(weight, FP8Weight):
        layer = FP8Linear(weight, bias_param)
        layer.weight.data = layer.weight.data.to(module.weight.dtype)  # the values, in the model's dtype (exact)
        return layer
    n, k = weight.shape
    layer = Linear(k, n, bias=bias is not None, device="meta")
    layer.weight = nn.Parameter(weight, requires_grad=False)
    layer.bias = bias_param
    return layer


def weight_of(module: nn.Module) -> torch.Tensor | QuantizedWeight | FP8Weight:
    if isinstance(module, FP8Linear):  # its e4m3 values, exact in any float dtype, and its output scales
        return FP8Weight(module.weight.detach().to(torch.float8_e4m3fn), module.scales, module.source)
    return module.qweight if isinstance(module, QuantLinear | QuantEmbedding) else module.weight.detach()


def bias_of(module: nn.Module) -> torch.Tensor | None:
    bias = module.bias_after_scale if isinstance(module, FP8Linear) else module.bias
    return None if bias is None else bias.detach()


def column_parallel(module: nn.Module, rows: torch.Tensor) -> nn.Module:
    bias = bias_of(module)
    return linear_of(module, rows_of(weight_of(module), rows), None if bias is None else bias[rows])


def row_parallel(module: nn.Module, cols: range, comm: Any) -> RowParallelLinear:
    if bias_of(module) is not None:
        raise ValueError("a row-parallel projection with a bias is not supported")
    return RowParallelLinear(linear_of(module, columns_of(weight_of(module), cols), None), comm)


def shard_experts(moe: SparseMoE, cols: range, comm: Any) -> None:
    """Only columns cols of every expert's MLP (its gate and up outputs, its down's inputs) stay; comm sums the
    ranks' partial outputs."""
    a, b = cols.start, cols.stop
    if moe.quantized:
        gate_up = torch.cat([torch.arange(a, b), moe.inter + torch.arange(a, b)])
        moe.quantized = [(rows_of(gu, gate_up), columns_of(down, cols)) for gu, down in moe.quantized]
    else:  # the padded layout of SparseMoE.load_experts, at the new width
        h, pi, n = moe.hidden, padded(moe.inter), b - a
        w13 = torch.zeros(moe.num_experts, padded(h), 2 * padded(n), dtype=moe.w13.dtype)
        w13[:, :, :n] = moe.w13[:, :, a:b]
        w13[:, :, padded(n):padded(n) + n] = moe.w13[:, :, pi + a:pi + b]
        w2 = torch.zeros(moe.num_experts, padded(n), padded(h), dtype=moe.w2.dtype)
        w2[:, :n] = moe.w2[:, a:b]
        moe.w13, moe.w2 = nn.Parameter(w13, requires_grad=False), nn.Parameter(w2, requires_grad=False)
    moe.inter, moe.comm = b - a, comm


@torch.no_grad()
def shard_llama(model: nn.Module, shard: RankShard, comm: Any) -> None:
    """Replaces model's layers (a loaded Llama-family model, before use_fast_path packs them) by rank shard's part."""
    config = model.config
    local = shard.local_config(config)
    d = config.head_dim
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = column_parallel(attn.qkv_proj, qkv_rows(shard, config))
        attn.o_proj = row_parallel(attn.o_proj, range(shard.q_heads.start * d, shard.q_heads.stop * d), comm)
        attn.num_heads, attn.num_kv_heads = local.num_attention_heads, local.num_key_value_heads
        attn.q_size, attn.kv_size = local.q_size, local.kv_size
        if isinstance(mlp, SparseMoE):
            shard_experts(mlp, shard.expert_intermediate, comm)
            continue
        mlp.gate_up_proj = column_parallel(mlp.gate_up_proj, gate_up_rows(shard, config))
        mlp.down_proj = row_parallel(mlp.down_proj, shard.intermediate, comm)
    vocab = torch.arange(shard.vocab.start, shard.vocab.stop)
    embed = model.embed_tokens
    rows = rows_of(weight_of(embed), vocab)
    if isinstance(embed, QuantEmbedding):
        inner_embed: nn.Module = QuantEmbedding(rows, embed.dtype)
    else:
        inner_embed = nn.Embedding.from_pretrained(rows, freeze=True)
    tied = config.tie_word_embeddings
    head = (linear_of(model.lm_head, inner_embed.qweight if isinstance(inner_embed, QuantEmbedding)
                      else inner_embed.weight, None) if tied else column_parallel(model.lm_head, vocab))
    if tied and isinstance(head, Linear):
        head.weight = inner_embed.weight  # one tensor for both, as in the whole model
    model.embed_tokens = VocabParallelEmbedding(inner_embed, shard.vocab, comm)
    model.lm_head = ParallelLMHead(head, shard.vocab_sizes, comm)
