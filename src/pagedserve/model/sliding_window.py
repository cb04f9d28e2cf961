"""Sliding-window attention over the paged pool, in PyTorch, and the per-group metadata of a hybrid step.

A sliding layer's query at position p sees the keys at p - window + 1 .. p (as transformers masks them). Its KV
cache group (engine/kv_cache.py) frees the blocks no query can see any more, so its block tables hold only the
blocks from the window's first one on: each row gathers those, and a mask on absolute positions does the rest.
On the bf16 fast path the C++ kernels take the same tables instead: positions counted from the table's first key,
each query sees its last `window` keys.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from pagedserve.model.attention import (
    KERNEL_HEAD_DIMS,
    PREFILL_PATHS,
    AttentionMetadata,
    prefill_attention_path,
)
from pagedserve.model.kv_cache_dtype import LayerKVCache


@dataclass(slots=True)
class WindowSpan:
    """One request's prefill rows and the blocks its window reaches."""
    start: int  # first row in the flat batch
    num_tokens: int
    first_pos: int  # position of its first query
    key_start: int  # position of the first key in block_table (block-aligned)
    block_table: torch.Tensor  # int64 [blocks]


@dataclass(slots=True)
class WindowMetadata:
    """A sliding-window group's view of one step. Decode rows come first, then prefill spans."""
    slot_mapping: torch.Tensor  # int64 [num_tokens]
    window: int
    num_decodes: int
    decode_tables: torch.Tensor  # int64 [num_decodes, max_blocks]: the blocks the window reaches, zero-padded
    decode_key_start: torch.Tensor  # int64 [num_decodes]: position of each table's first key
    decode_positions: torch.Tensor  # int64 [num_decodes]: the query's position
    spans: list[WindowSpan]
    decode_context_lens: torch.Tensor | None = None  # int64 [num_decodes]: keys in each table up to the query's
    prefill_spans: torch.Tensor | None = None  # int64 [S, 3]: (start, num_tokens, first_pos - key_start) per span
    prefill_tables: torch.Tensor | None = None  # int64 [S, max_blocks]: their block tables, zero-padded


@dataclass(slots=True)
class HybridMetadata:
    """A step over KV cache groups of several kinds: each group's metadata, and the group of each layer."""
    groups: list[AttentionMetadata | WindowMetadata]
    group_of_layer: list[int]

    def layer(self, i: int) -> AttentionMetadata | WindowMetadata:
        return self.groups[self.group_of_layer[i]]


def window_metadata(rows: list[tuple[int, int, list[int]]], num_decodes: int, slots: list[int], window: int,
                    block_size: int) -> WindowMetadata:
    """rows: (first position, tokens, block table) per request in batch order, decodes first. Table entries
    before the window's first block may be freed (-1): they are never read."""
    bs = block_size
    tables, key_starts, positions, spans, start = [], [], [], [], 0
    for i, (first, n, table) in enumerate(rows):
        lo = max(0, first - window + 1) // bs
        blocks = table[lo:-(-(first + n) // bs)]
        if i < num_decodes:
            tables.append(blocks)
            key_starts.append(lo * bs)
            positions.append(first)
        else:
            spans.append(WindowSpan(start, n, first, lo * bs, torch.tensor(blocks, dtype=torch.long)))
        start += n
    width = max((len(t) for t in tables), default=1)
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long).view(-1, width)
    meta = WindowMetadata(torch.tensor(slots, dtype=torch.long), window, num_decodes, padded,
                          torch.tensor(key_starts, dtype=torch.long), torch.tensor(positions, dtype=torch.long), spans,
                          torch.tensor([p + 1 - k for p, k in zip(positions, key_starts)], dtype=torch.long))
    if spans:
        meta.prefill_spans = torch.tensor([[s.start, s.num_tokens, s.first_pos - s.key_start] for s in spans],
                                          dtype=torch.long)
        meta.prefill_tables = torch.nn.utils.rnn.pad_sequence([s.block_table for s in spans], batch_first=True)
    return meta


def window_attention(q: torch.Tensor, cache: LayerKVCache, meta: WindowMetadata, block_size: int,
                     scale: float, fused: Any | None = None) -> torch.Tensor:
    """q: [T, H, d] (this step's keys already in the cache). Returns [T, H, d].
    fused: the bf16 C++ ops (the model's fast path): their decode and prefill kernels, windowed, replace PyTorch's."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    nd = meta.num_decodes
    kernel = fused is not None and q.shape[-1] in KERNEL_HEAD_DIMS and not cache.fmt.int4
    if nd and kernel:
        out[:nd] = fused.paged_decode_attention(q[:nd], cache.k, cache.v, cache.k_scale, cache.v_scale,
                                                meta.decode_tables, meta.decode_context_lens, block_size, scale,
                                                window=meta.window)
    elif nd:
        k, v = cache.gather(meta.decode_tables, block_size, q.dtype)  # [B, L, KV, d]
        b, length, kv, d = k.shape
        key_pos = meta.decode_key_start.unsqueeze(1) + torch.arange(length)
        q_pos = meta.decode_positions.unsqueeze(1)
        visible = (key_pos <= q_pos) & (key_pos > q_pos - meta.window)
        scores = torch.matmul(q[:nd].reshape(b, kv, -1, d), k.permute(0, 2, 3, 1)).float() * scale  # [B, KV, G, L]
        scores.masked_fill_(~visible.view(b, 1, 1, length), float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
        out[:nd] = torch.matmul(probs, v.transpose(1, 2)).reshape(b, -1, d)
    path = prefill_attention_path() if kernel and meta.spans else "torch"
    if path != "torch":
        fused.prefill_attention(q, cache.k, cache.v, cache.k_scale, cache.v_scale, meta.prefill_spans,
                                meta.prefill_tables, block_size, scale, out, path=PREFILL_PATHS[path], window=meta.window)
        return out
    for s in meta.spans:
        rows = slice(s.start, s.start + s.num_tokens)
        k, v = cache.gather(s.block_table, block_size, q.dtype)
        key_pos = s.key_start + torch.arange(k.shape[0])
        q_pos = (s.first_pos + torch.arange(s.num_tokens)).unsqueeze(1)
        mask = (key_pos <= q_pos) & (key_pos > q_pos - meta.window)
        o = F.scaled_dot_product_attention(q[rows].transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0),
                                           v.transpose(0, 1).unsqueeze(0), attn_mask=mask, scale=scale,
                                           enable_gqa=True)
        out[rows] = o.squeeze(0).transpose(0, 1)
    return out
