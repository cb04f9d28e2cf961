"""Quantized weights in one planar layout, whatever their source.

qweight [N, K] int8 (8 bits) or [N, K/2] uint8 (4 bits: in each 32-wide group byte j holds k = j in its low
nibble and k = j + 16 in its high one, GGML's order), scales [N, K/group] fp32 and, for asymmetric 4 bits,
mins [N, K/group]: w = scale * q + min. GGUF Q4_0, Q4_1 and Q8_0 convert to it without loss (their fp16
scales are exact in fp32); `int8` (per output channel, symmetric) and `int4` (per group, asymmetric,
round-to-nearest) are quantized from float weights of any model.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

QUANTIZATIONS = ("none", "gguf", "int8", "int4")
GGUF_BLOCK = 32
# GGUF type name -> (bytes per 32-block, bits, has a min): the types that run as stored.
GGUF_TYPES = {"Q4_0": (18, 4, False), "Q4_1": (20, 4, True), "Q8_0": (34, 8, False)}


@dataclass
class QuantizedWeight:
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    group: int
    source: str  # what it was converted from: a GGUF type, or int8 / int4

    @property
    def shape(self) -> tuple[int, int]:
        n, width = self.qweight.shape
        return n, width * 2 if self.bits == 4 else width

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins) if t is not None)

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K], in plain PyTorch: the reference the kernels are tested against."""
        n, k = self.shape
        if self.bits == 4:
            blocks = self.qweight.view(n, k // GGUF_BLOCK, GGUF_BLOCK // 2)
            q = torch.cat([blocks & 0xF, blocks >> 4], dim=-1).reshape(n, k).float()
        else:
            q = self.qweight.float()
        w = q.view(n, k // self.group, self.group) * self.scales.unsqueeze(-1)
        if self.mins is not None:
            w = w + self.mins.unsqueeze(-1)
        return w.reshape(n, k)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows at index (a permutation or a selection), same layout."""
        mins = None if self.mins is None else self.mins[index].contiguous()
        return QuantizedWeight(self.qweight[index].contiguous(), self.scales[index].contiguous(), mins, self.bits,
                               self.group, self.source)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Rows of several weights of one format stacked (fused qkv and gate_up projections)."""
        first = parts[0]
        if any((p.bits, p.group, p.mins is None) != (first.bits, first.group, first.mins is None) for p in parts):
            raise ValueError(f"cannot fuse weights of different formats: {sorted({p.source for p in parts})}")
        mins = None if first.mins is None else torch.cat([p.mins for p in parts])
        return QuantizedWeight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), mins,
                               first.bits, first.group, "+".join(sorted({p.source for p in parts})))


def from_gguf(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """A GGUF tensor's raw blocks ([rows, bytes] uint8, as gguf.GGUFReader gives them) in planar layout."""
    if type_name not in GGUF_TYPES:
        raise ValueError(f"GGUF type {type_name} does not run as stored (supported: {', '.join(GGUF_TYPES)})")
    block_bytes, bits, has_min = GGUF_TYPES[type_name]
    n, k = shape
    if k % GGUF_BLOCK or data.size != n * (k // GGUF_BLOCK) * block_bytes:
        raise ValueError(f"{type_name} tensor of shape {shape} has {data.size} bytes of data")
    blocks = np.ascontiguousarray(data).reshape(n, k // GGUF_BLOCK, block_bytes)
    scales = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    start = 4 if has_min else 2
    mins = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32) if has_min else None
    payload = blocks[..., start:].reshape(n, -1)
    if bits == 8:
        qweight = torch.from_numpy(payload.copy().view(np.int8))
    else:
        qweight = torch.from_numpy(payload.copy())
        if not has_min:  # Q4_0 stores q - 8: an unsigned q with min = -8 * scale
            mins = -8.0 * scales
    return QuantizedWeight(qweight, torch.from_numpy(scales), None if mins is None else torch.from_numpy(mins),
                           bits, GGUF_BLOCK, type_name)


def quantize(w: torch.Tensor, mode: str, group: int = 32) -> QuantizedWeight:
    """int8: per output channel, symmetric. int4: per group, asymmetric, round to nearest."""
    w = w.detach().float()
    n, k = w.shape
    if k % GGUF_BLOCK:
        raise ValueError(f"{mode} needs K divisible by {GGUF_BLOCK}; this weight is {n}x{k}")
    if mode == "int8":
        scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
        q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight(q.contiguous(), scale.contiguous(), None, 8, k, "int8")
    if mode != "int4":
        raise ValueError(f"unknown quantization {mode!r}")
    if group % GGUF_BLOCK or k % group:
        raise ValueError(f"int4 group {group} must divide K={k} and be a multiple of {GGUF_BLOCK}")
    g = w.view(n, k // group, group)
    low, high = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((high - low) / 15).clamp_min(1e-12)
    q = torch.round((g - low.unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
    q = q.view(n, k // GGUF_BLOCK, 2, GGUF_BLOCK // 2)
    packed = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2)
    return QuantizedWeight(packed.contiguous(), scale.contiguous(), low.contiguous(), 4, group, "int4")
