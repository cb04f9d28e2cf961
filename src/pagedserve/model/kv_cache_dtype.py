"""KV cache storage formats and one layer's cache in the pool.

- the model dtype (or bfloat16 under a float32 model): stored as computed;
- fp8_e4m3 / fp8_e5m2: one scale per layer and KV head, set by a calibration pass at start-up (the largest
  |K| and |V| each head produces over a fixed text, with 2x headroom; values beyond are saturated). Queries and
  keys are turned into a Hadamard basis first (KVFormat.rotates_keys);
- int8: symmetric, one scale per token and KV head, computed as the token is written and kept as an 8-bit code
  (model/scale_codes.py, rounded up);
- int4: KIVI-style, keys per channel across a full block and values per token (model/kv_int4.py).

Scales live beside the blocks (per slot, or per head for fp8), so a block stays self-contained for prefix
caching, preemption and copy-on-write forks. Writes quantize on the way in; the C++ kernels read the stored
format and dequantize in registers. The PyTorch functions here are the reference those kernels are tested on.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from pagedserve.model import kv_int4
from pagedserve.model.kv_int4 import KeyTails, KeyWritePlan
from pagedserve.model.scale_codes import scale_code, scales_of

KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
FP8_HEADROOM = 2.0  # calibrated amax times this maps to the format's largest value


@dataclass(frozen=True, slots=True)
class KVFormat:
    name: str  # canonical: bfloat16, float32, fp8_e4m3, fp8_e5m2, int8 or int4
    storage: torch.dtype  # element dtype of the pool (int4: uint8, two codes a byte)

    @property
    def quantized(self) -> bool:
        return self.name in ("fp8_e4m3", "fp8_e5m2", "int8", "int4")

    @property
    def per_token_scale(self) -> bool:
        return self.name == "int8"

    @property
    def per_head_scale(self) -> bool:
        """fp8: scales per layer and KV head, from a calibration pass."""
        return self.name.startswith("fp8")

    def rotates_keys(self, head_dim: int) -> bool:
        """fp8: queries and keys go into an orthonormal Hadamard basis after RoPE (q.k is unchanged; QuaRot's
        rotation), which spreads the outlier channels over all channels before keys are stored. fp8 rounds each
        value relative to its size, so unrotated the few channels both q and k weigh heavily carry most of the
        error of q.k: perplexity +1.42% against +0.61% rotated at 2,048-token windows. Needs a power-of-two
        head_dim (the C++ write, rope_and_cache, applies the same rule)."""
        return self.per_head_scale and head_dim & (head_dim - 1) == 0

    @property
    def int4(self) -> bool:
        return self.name == "int4"

    @property
    def max_value(self) -> float:
        return torch.finfo(self.storage).max if self.storage.is_floating_point else 127.0

    def block_bytes(self, block_size: int, num_kv_heads: int, head_dim: int) -> int:
        """Bytes one block of one layer (K and V) takes in the pool, its scales included."""
        if self.int4:  # codes; a scale code and 4-bit zero point per key channel; a scale code and zero per value
            return num_kv_heads * (block_size * head_dim + head_dim * 3 // 2 + block_size * 2)
        data = head_dim * torch.empty(0, dtype=self.storage).element_size()
        return 2 * block_size * num_kv_heads * (data + (1 if self.per_token_scale else 0))


def resolve_kv_format(name: str, model_dtype: torch.dtype) -> KVFormat:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; choose one of {', '.join(KV_CACHE_DTYPES)}")
    name = {"fp8": "fp8_e4m3", "auto": str(model_dtype).removeprefix("torch.")}.get(name, name)
    storage = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16,
               "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8,
               "int4": torch.uint8}[name]
    if name == "float32" and model_dtype != torch.float32:
        raise ValueError("kv_cache_dtype float32 needs --dtype float32 (the cache is never wider than the model)")
    return KVFormat(name, storage)


class LayerKVCache:
    """One layer's K and V in the pool: [slots, kv_heads, head_dim] each, in the format's storage dtype, and
    their scales: [kv_heads] (fp8) or [slots, kv_heads] scale codes (int8); None when stored unquantized.
    int4: codes [slots, kv_heads, head_dim / 2], k_scale the keys' uint8 parameters [blocks, kv_heads, head_dim * 3/2]
    and v_scale the values' [slots, kv_heads, 2] (model/kv_int4.py), k_tail the partly written blocks' keys in bf16
    and k_offset the per-channel shift of every key this layer writes (calibrated; float32 [kv_heads, head_dim])."""

    def __init__(self, fmt: KVFormat, num_slots: int, num_kv_heads: int, head_dim: int, block_size: int = 16,
                 tails: KeyTails | None = None) -> None:
        self.fmt = fmt
        self.block_size = block_size
        shape = (num_slots, num_kv_heads, head_dim // 2 if fmt.int4 else head_dim)
        self.k = torch.zeros(shape, dtype=fmt.storage)
        self.v = torch.zeros(shape, dtype=fmt.storage)
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.k_tail: torch.Tensor | None = None
        self.k_offset: torch.Tensor | None = None
        self.tails: KeyTails | None = None
        if fmt.int4:
            self.tails = tails or KeyTails(num_slots // block_size, block_size, 4)
            self.k_scale = torch.zeros(num_slots // block_size, num_kv_heads, head_dim * 3 // 2, dtype=torch.uint8)
            self.v_scale = torch.zeros(num_slots, num_kv_heads, 2, dtype=torch.uint8)
            self.k_offset = torch.zeros(num_kv_heads, head_dim)
            self.k_tail = torch.zeros(self.tails.num_tails * block_size, num_kv_heads, head_dim, dtype=torch.bfloat16)
            self.tails.on_grow.append(self._grow_tails)
        elif fmt.per_token_scale:
            self.k_scale = torch.zeros(num_slots, num_kv_heads, dtype=torch.uint8)  # scale codes
            self.v_scale = torch.zeros(num_slots, num_kv_heads, dtype=torch.uint8)
        elif fmt.quantized:
            self.k_scale = torch.ones(num_kv_heads)
            self.v_scale = torch.ones(num_kv_heads)

    @property
    def tail_of_block(self) -> torch.Tensor | None:
        return self.tails.tail_of_block if self.tails is not None else None

    def _grow_tails(self, num_tails: int) -> None:
        grown = self.k_tail.new_zeros(num_tails * self.block_size, *self.k_tail.shape[1:])
        grown[:self.k_tail.shape[0]] = self.k_tail
        self.k_tail = grown

    def set_head_scales(self, k_amax: torch.Tensor, v_amax: torch.Tensor) -> None:
        """fp8: scales from the calibrated largest magnitudes per KV head."""
        limit = self.fmt.max_value / FP8_HEADROOM
        self.k_scale = (k_amax.float() / limit).clamp_min(1e-6)
        self.v_scale = (v_amax.float() / limit).clamp_min(1e-6)

    def set_key_offset(self, mean: torch.Tensor) -> None:
        """int4: keys are stored shifted by their calibrated mean per channel (rounded to bf16, so workers that
        calibrate the same model agree); attention is unchanged by a shift common to every key."""
        self.k_offset = mean.float().to(torch.bfloat16).float()

    def write(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
              key_plan: KeyWritePlan | None = None) -> None:
        """k, v: [T, kv_heads, head_dim] in the model dtype, quantized into their slots. int4: key_plan says
        where keys wait and which blocks fill (planned once per step for all layers; made here when None)."""
        if self.fmt.int4:
            self._write_int4(k, v, slot_mapping, key_plan or self.tails.plan(slot_mapping.tolist()))
            return
        for x, cache, scale_name in ((k, self.k, "k_scale"), (v, self.v, "v_scale")):
            if not self.fmt.quantized:
                cache.index_copy_(0, slot_mapping, x.to(cache.dtype))
                continue
            data, scale = quantize_rows(x, self.fmt, getattr(self, scale_name))
            if self.fmt.per_token_scale:
                getattr(self, scale_name).index_copy_(0, slot_mapping, scale)
            cache.view(torch.uint8).index_copy_(0, slot_mapping, data.view(torch.uint8))

    def _write_int4(self, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, plan: KeyWritePlan) -> None:
        codes, params = kv_int4.quantize_values(v)
        self.v.index_copy_(0, slot_mapping, codes)
        self.v_scale.index_copy_(0, slot_mapping, params)
        k = (k.float() - self.k_offset).to(torch.bfloat16)  # shifted keys quantize from bf16, tail or not
        staged = plan.rows >= 0
        self.k_tail.index_copy_(0, plan.rows[staged], k[staged])
        if not plan.completions.numel():
            return
        bs = self.block_size
        blocks, tails, firsts = plan.completions.unbind(1)
        from_tail = tails >= 0
        keys = torch.empty(len(blocks), bs, *k.shape[1:], dtype=k.dtype)
        keys[from_tail] = self.k_tail.view(-1, bs, *k.shape[1:])[tails[from_tail]]
        keys[~from_tail] = k[firsts[~from_tail].unsqueeze(1) + torch.arange(bs)]
        codes, params = kv_int4.quantize_key_blocks(keys)
        self.k.index_copy_(0, (blocks.unsqueeze(1) * bs + torch.arange(bs)).flatten(), codes.flatten(0, 1))
        self.k_scale.index_copy_(0, blocks, params)

    def gather(self, block_table: torch.Tensor, block_size: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the blocks in block_table ([..., nb]) as [..., nb * block_size, kv_heads, head_dim] in dtype:
        the PyTorch path's (reference) read."""
        return (self._gather_one(self.k, self.k_scale, block_table, block_size, dtype),
                self._gather_one(self.v, self.v_scale, block_table, block_size, dtype))

    def _gather_one(self, cache: torch.Tensor, scale: torch.Tensor | None, block_table: torch.Tensor,
                    block_size: int, dtype: torch.dtype) -> torch.Tensor:
        if self.fmt.int4:
            return self._gather_int4(cache, block_table, block_size).to(dtype)
        blocks = cache.view(-1, block_size, *cache.shape[1:])[block_table].flatten(-4, -3)
        if not self.fmt.quantized:
            return blocks.to(dtype)
        if self.fmt.per_token_scale:
            s = scales_of(scale.view(-1, block_size, scale.shape[1])[block_table].flatten(-3, -2)).unsqueeze(-1)
        else:
            s = scale.view(-1, 1)
        return (blocks.float() * s).to(dtype)

    def _gather_int4(self, cache: torch.Tensor, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
        codes = cache.view(-1, block_size, *cache.shape[1:])[block_table]
        if cache is self.v:
            params = self.v_scale.view(-1, block_size, *self.v_scale.shape[1:])[block_table]
            return kv_int4.dequantize_values(codes, params).flatten(-4, -3)
        keys = kv_int4.dequantize_key_blocks(codes, self.k_scale[block_table])
        tail = self.tails.tail_of_block[block_table].long()
        staged = self.k_tail.view(-1, block_size, *self.k_tail.shape[1:])[tail.clamp_min(0)].float()
        return torch.where((tail >= 0).view(*tail.shape, 1, 1, 1), staged, keys).flatten(-4, -3)

    def copy_tail(self, src_tail: int, dst_tail: int) -> None:
        bs = self.block_size
        self.k_tail[dst_tail * bs:(dst_tail + 1) * bs] = self.k_tail[src_tail * bs:(src_tail + 1) * bs]

    def copy_block(self, src: int, dst: int, block_size: int) -> None:
        rows_src, rows_dst = slice(src * block_size, (src + 1) * block_size), slice(dst * block_size, (dst + 1) * block_size)
        self.k[rows_dst] = self.k[rows_src]
        self.v[rows_dst] = self.v[rows_src]
        if self.fmt.per_token_scale:
            self.k_scale[rows_dst] = self.k_scale[rows_src]
            self.v_scale[rows_dst] = self.v_scale[rows_src]
        elif self.fmt.int4:  # a partly written block: its keys' tail is copied by the runner (KeyTails.fork)
            self.k_scale[dst] = self.k_scale[src]
            self.v_scale[rows_dst] = self.v_scale[rows_src]


@functools.cache
def _hadamard_matrix(d: int) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / math.sqrt(d)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """x times Sylvester's Hadamard matrix over the last dim (a power of two), orthonormal: x.H.(y.H) = x.y."""
    return (x.float() @ _hadamard_matrix(x.shape[-1])).to(x.dtype)


def quantize_rows(x: torch.Tensor, fmt: KVFormat, head_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [T, kv_heads, head_dim] -> (stored values, scales: [T, kv_heads] codes for int8, else the head scales)."""
    xf = x.float()
    if fmt.per_token_scale:
        code = scale_code((xf.abs().amax(-1) / 127.0).clamp_min(1e-30), round_up=True)
        return (xf / scales_of(code).unsqueeze(-1)).round_().clamp_(-127, 127).to(torch.int8), code
    limit = fmt.max_value
    return (xf / head_scale.view(1, -1, 1)).clamp_(-limit, limit).to(fmt.storage), head_scale
