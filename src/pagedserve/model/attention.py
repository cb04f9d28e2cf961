"""Paged attention in PyTorch: K/V live in one block pool and are read through block tables."""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch
import torch.nn.functional as F

from pagedserve.model.kernels import cpu_kernels
from pagedserve.model.kv_cache_dtype import LayerKVCache
from pagedserve.model.kv_int4 import KeyWritePlan

KERNEL_HEAD_DIMS = (64, 128, 256)  # what the C++ attention kernels are built for; other sizes take the PyTorch path
# The C++ prefill kernel's paths (csrc/prefill_attention.cpp), fastest last; `amx-emulated` runs the amx path's code
# over tiles emulated in C++ (tests only), `torch` is the PyTorch path (SDPA per span).
PREFILL_PATHS = {"portable": 1, "avx512": 2, "amx": 3, "amx-emulated": 4}
PREFILL_PREFERENCE = ("torch", "portable", "avx512", "amx")


@cache
def prefill_attention_path() -> str:
    """The prefill attention path this CPU runs best, or PAGEDSERVE_PREFILL_ATTENTION when set (an unavailable one
    is an error): amx on AMX CPUs, avx512 with AVX-512 BF16, portable (fp32 multiply-adds) elsewhere."""
    kernels = cpu_kernels()
    built = [] if kernels is None else [n for n, c in PREFILL_PATHS.items() if c in kernels.prefill_attention_paths()]
    available = ["torch", *built]
    wanted = os.environ.get("PAGEDSERVE_PREFILL_ATTENTION", "auto")
    if wanted == "auto":
        return max((n for n in available if n in PREFILL_PREFERENCE), key=PREFILL_PREFERENCE.index)
    if wanted not in available:
        raise RuntimeError(f"PAGEDSERVE_PREFILL_ATTENTION={wanted} is not available on this CPU (have: {available})")
    return wanted


@dataclass(slots=True)
class PrefillSpan:
    start: int  # first row of this request's queries in the flat token batch
    num_tokens: int  # queries this step
    context_len: int  # tokens already in the cache before this step
    block_table: torch.Tensor  # int64 [num_blocks needed for context_len + num_tokens]


@dataclass(slots=True)
class AttentionMetadata:
    """How the flat token batch maps onto the KV pool. Decode rows come first, then prefill spans."""
    slot_mapping: torch.Tensor  # int64 [num_tokens]: where each token's K/V is written
    num_decodes: int
    decode_block_tables: torch.Tensor  # int64 [num_decodes, max_blocks]
    decode_context_lens: torch.Tensor  # int64 [num_decodes]: tokens each decode attends to, itself included
    prefills: list[PrefillSpan]
    use_kernel: bool = True  # the C++ kernels; False: the pure-PyTorch path
    prefill_spans: torch.Tensor | None = None  # int64 [S, 3]: (start, num_tokens, context_len) of each prefill
    prefill_tables: torch.Tensor | None = None  # int64 [S, max_blocks]: their block tables, zero-padded
    key_plan: KeyWritePlan | None = None  # int4 KV: where this step's keys wait and which blocks fill


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata,
                    block_size: int, scale: float, fused: Any | None = None) -> torch.Tensor:
    """q: [T, H, d]; k, v: [T, KV, d] of this step (already in the cache). Returns [T, H, d].
    fused: the bf16 C++ ops (the model's fast path), whose prefill kernel then replaces SDPA.
    A cache stored narrower than q (quantized, or bf16 under fp32) is read for fresh prompts too, so a prompt's
    logits never depend on whether its prefix came from the prefix cache or how it was chunked."""
    nd = meta.num_decodes
    if nd == q.shape[0]:  # a pure decode step: the decode output is the whole output
        return decode_attention(q, cache, meta, block_size, scale)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if nd:
        out[:nd] = decode_attention(q[:nd], cache, meta, block_size, scale)
    path = prefill_attention_path() if fused is not None else "torch"
    if path != "torch" and meta.prefill_spans is not None and q.shape[-1] in KERNEL_HEAD_DIMS:
        # Every span in one call, reading the pool this step's keys were just written to.
        fused.prefill_attention(q, cache.k, cache.v, cache.k_scale, cache.v_scale, meta.prefill_spans,
                                meta.prefill_tables, block_size, scale, out, cache.k_tail, cache.tail_of_block,
                                PREFILL_PATHS[path])
        return out
    for p in meta.prefills:
        rows = slice(p.start, p.start + p.num_tokens)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, d]
        if p.context_len == 0 and cache.k.dtype == q.dtype:
            kp, vp = k[rows], v[rows]
            op = F.scaled_dot_product_attention(qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
                                                is_causal=True, scale=scale, enable_gqa=True)
        else:
            total = p.context_len + p.num_tokens
            kp, vp = cache.gather(p.block_table, block_size, q.dtype)
            kp, vp = kp[:total], vp[:total]
            mask = causal_mask_with_context(p.num_tokens, p.context_len, q.device)
            op = F.scaled_dot_product_attention(qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
                                                attn_mask=mask, scale=scale, enable_gqa=True)
        out[rows] = op.squeeze(0).transpose(0, 1)
    return out


def decode_attention(q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, block_size: int,
                     scale: float) -> torch.Tensor:
    """q: [B, H, d], one query per decode row. Returns [B, H, d]."""
    kernels = (cpu_kernels() if meta.use_kernel and q.device.type == "cpu" and q.shape[-1] in KERNEL_HEAD_DIMS
               else None)
    if kernels is None:
        return decode_attention_torch(q, cache, meta, block_size, scale)
    return kernels.paged_decode_attention(q, cache.k, cache.v, cache.k_scale, cache.v_scale,
                                          meta.decode_block_tables, meta.decode_context_lens, block_size, scale,
                                          cache.k_tail, cache.tail_of_block)


def decode_attention_torch(q: torch.Tensor, cache: LayerKVCache, meta: AttentionMetadata, block_size: int,
                           scale: float) -> torch.Tensor:
    """Gather-then-matmul decode attention; GQA by grouping query heads per KV head. q: [B, H, d]."""
    k, v = cache.gather(meta.decode_block_tables, block_size, q.dtype)  # [B, L, KV, d]
    b, length, kv, d = k.shape
    qg = q.reshape(b, kv, -1, d)
    scores = torch.matmul(qg, k.permute(0, 2, 3, 1)).float() * scale  # [B, KV, G, L]
    valid = torch.arange(length).unsqueeze(0) < meta.decode_context_lens.unsqueeze(1)
    scores.masked_fill_(~valid.view(b, 1, 1, length), float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, v.transpose(1, 2)).reshape(q.shape)


def causal_mask_with_context(num_tokens: int, context_len: int, device: torch.device) -> torch.Tensor:
    """Query i (at position context_len + i) sees keys 0 .. context_len + i."""
    q_pos = torch.arange(num_tokens, device=device).unsqueeze(1) + context_len
    k_pos = torch.arange(context_len + num_tokens, device=device).unsqueeze(0)
    return k_pos <= q_pos
