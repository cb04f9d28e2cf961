"""INT4 KV blocks, KIVI-style (Liu et al. 2024), laid out for a paged pool.

Keys have outlier channels, so they are quantized per channel across the 16 tokens of a full block; values per
token. Both asymmetric, 4 bits (two codes a byte, the even element in the low nibble): x ~ (code - zero) * scale,
with an 8-bit scale code (model/scale_codes.py, rounded to the nearest step) and a 4-bit zero point. A block's keys can only be quantized once the
block is full, so until then they wait in bf16 in a tail slot (one per partly written block; KIVI's
full-precision residual); the write that fills the block quantizes them.

A 4-bit zero point only fits ranges that hold 0 or come near it, and some key channels sit far from 0 for a
whole block. So the keys a layer writes are first shifted by a per-channel offset (their mean on the start-up
calibration text, per layer and KV head): q.(k - mu) = q.k - q.mu, and q.mu is the same for every key a query
reads, so softmax and the attention output are unchanged and readers never add mu back. Tails hold shifted keys
too, so every key of a sequence carries the same shift.

Per layer and KV head a 16-token block of head_dim 64 takes 512 + 512 bytes of codes, 64 + 32 of key scale codes
and zero points and 32 of values' (one pair per token): 1,152 bytes against bf16's 4,096 (3.56x). With fp16
scales and minimums (KIVI's own format) it would take 1,344 (3.05x); the 8-bit parameters cost about 1.4% of
perplexity (+3.3% against +1.9% over the benchmark text, within int4's 5% budget; docs/benchmarks.md).

The PyTorch functions here are the reference the C++ write (rope_and_cache_int4) and readers are tested against.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.model.scale_codes import scale_code, scales_of

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class KeyWritePlan:
    """Where one step's keys go; the same for every layer."""
    rows: torch.Tensor  # int64 [T]: the tail row each token's key is copied to; -1 for a block filled in this step alone
    completions: torch.Tensor  # int64 [C, 3]: (block, tail or -1, first row of the step) of each block that fills


class KeyTails:
    """Which partly written block holds its keys in which bf16 tail slot. Shared by the layers, whose tail tensors
    grow with it (the slots needed are about the running sequences; forks may need more)."""

    def __init__(self, num_blocks: int, block_size: int, num_tails: int) -> None:
        self.block_size = block_size
        self.num_tails = num_tails
        self.tail_of_block = torch.full((num_blocks,), -1, dtype=torch.int32)  # what the kernels read
        self._of_block = [-1] * num_blocks  # its mirror, for Python's per-step planning
        self._free = list(range(num_tails))
        self.on_grow: list[Callable[[int], None]] = []  # each layer resizes its tail tensor
        # tensor parallelism: rank 0 plans, and records each block's new tail for the workers to follow
        self.journal: dict[int, int] | None = None

    @property
    def in_use(self) -> int:
        return self.num_tails - len(self._free)

    def plan(self, slots: list[int]) -> KeyWritePlan:
        """Tail rows and block completions for a step writing tokens into these slots (each request's tokens
        consecutive, in position order). Blocks that fill give their tail back; readers of this step already read
        them quantized, since the write quantizes before attention reads."""
        bs = self.block_size
        rows = [-1] * len(slots)
        completions: list[tuple[int, int, int]] = []
        released: list[int] = []
        i = 0
        while i < len(slots):
            block, j = slots[i] // bs, i + 1
            while j < len(slots) and slots[j] == slots[j - 1] + 1 and slots[j] // bs == block:
                j += 1
            fills = slots[j - 1] % bs == bs - 1
            tail = self._of_block[block]
            if fills and tail < 0 and slots[i] % bs == 0:
                completions.append((block, -1, i))
            else:
                if tail < 0:
                    tail = self._take(block)
                rows[i:j] = [tail * bs + s % bs for s in slots[i:j]]
                if fills:
                    completions.append((block, tail, -1))
                    self._set(block, -1)
                    released.append(tail)
            i = j
        self._free += released  # after this step's allocations: its completions still read these tails
        return KeyWritePlan(torch.tensor(rows, dtype=torch.long),
                            torch.tensor(completions, dtype=torch.long).view(-1, 3))

    def fork(self, src: int, dst: int) -> tuple[int, int] | None:
        """A copy-on-write copy of a partly written block: dst gets its own tail; (src tail, dst tail) to copy."""
        tail = self._of_block[src]
        if tail < 0:
            return None
        return tail, self._take(dst)

    def release(self, blocks: list[int]) -> None:
        """Blocks back in the free pool: any tail they held is free again."""
        for b in blocks:
            tail = self._of_block[b]
            if tail >= 0:
                self._set(b, -1)
                self._free.append(tail)

    def drain(self) -> tuple[int, dict[int, int]]:
        """Rank 0: the tails' count and each block's tail set since the last drain."""
        changes, self.journal = self.journal or {}, {}
        return self.num_tails, changes

    def follow(self, num_tails: int, changes: dict[int, int]) -> None:
        """A worker rank: its tails as rank 0's drain gave them (the workers never plan: the step's plan comes
        with its batch, and copy_blocks with the tails rank 0 forked)."""
        if num_tails > self.num_tails:
            self._grow(num_tails)
        for block, tail in changes.items():
            self._set(block, tail)

    def _take(self, block: int) -> int:
        if not self._free:
            grown = max(2 * self.num_tails, 1)
            logger.info("int4 KV: %d key tails in use; growing to %d", self.num_tails, grown)
            self._free = list(range(self.num_tails, grown))
            self._grow(grown)
        tail = self._free.pop()
        self._set(block, tail)
        return tail

    def _grow(self, num_tails: int) -> None:
        self.num_tails = num_tails
        for resize in self.on_grow:
            resize(num_tails)

    def _set(self, block: int, tail: int) -> None:
        self._of_block[block] = tail
        self.tail_of_block[block] = tail
        if self.journal is not None:
            self.journal[block] = tail


def quantize(x: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 codes of x over dim (uint8, one per element, unpacked), with each group's scale code and
    zero point (uint8, dim removed). The zero point is the code of 0 when the range holds it, else 0 or 15 and the
    scale grows to span from 0 to the range's far end."""
    xf = x.float()
    lo, hi = xf.amin(dim, keepdim=True), xf.amax(dim, keepdim=True)
    scale = ((hi - lo) / 15).clamp_min(1e-30)
    zero = (-lo / scale).round().clamp(0, 15)
    reach_hi = torch.where(zero < 15, hi / (15 - zero).clamp_min(1), 0.0)
    reach_lo = torch.where(zero > 0, -lo / zero.clamp_min(1), 0.0)
    scale = torch.maximum(scale, torch.maximum(reach_hi, reach_lo))
    code = scale_code(scale, round_up=False)
    codes = (xf / scales_of(code) + zero).round().clamp(0, 15)
    return codes.to(torch.uint8), code.squeeze(dim), zero.to(torch.uint8).squeeze(dim)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """Two codes a byte along the last dim, the even element in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack([packed & 15, packed >> 4], dim=-1).flatten(-2)


def quantize_values(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """v: [T, KV, D] -> packed codes [T, KV, D / 2] and parameters [T, KV, 2] (scale code, zero point), uint8."""
    codes, scale, zero = quantize(v, -1)
    return pack(codes), torch.stack([scale, zero], dim=-1)


def quantize_key_blocks(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k: [C, block_size, KV, D], whole blocks -> packed codes [C, block_size, KV, D / 2] and parameters
    [C, KV, D + D / 2], uint8: each channel's scale code, then the channels' zero points packed two a byte."""
    codes, scale, zero = quantize(k, 1)
    return pack(codes), torch.cat([scale, pack(zero)], dim=-1)


def value_scales(params: torch.Tensor) -> torch.Tensor:
    """[..., 2] value parameters -> [...] float scales."""
    return scales_of(params[..., 0])


def key_scales(params: torch.Tensor) -> torch.Tensor:
    """[..., D + D / 2] key parameters -> [..., D] float scales."""
    return scales_of(params[..., :params.shape[-1] * 2 // 3])


def dequantize_values(packed: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """[..., KV, D / 2] codes with [..., KV, 2] parameters -> [..., KV, D] fp32."""
    zero = params[..., 1:].float()
    return (unpack(packed).float() - zero) * value_scales(params).unsqueeze(-1)


def dequantize_key_blocks(packed: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """[..., block_size, KV, D / 2] codes with [..., KV, D + D / 2] parameters -> [..., block_size, KV, D] fp32."""
    d = params.shape[-1] * 2 // 3
    zero = unpack(params[..., d:]).float().unsqueeze(-3)  # broadcast over the block's tokens
    return (unpack(packed).float() - zero) * key_scales(params).unsqueeze(-3)
