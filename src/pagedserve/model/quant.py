"""Quantized weights in one planar layout, whatever their source.

qweight [N, K] int8 (8 bits) or [N, K/2] uint8 (4 bits: in each 32-wide group byte j holds k = j in its low
nibble and k = j + 16 in its high one, GGML's order), scales [N, K/group] fp32 and, for asymmetric 4 bits,
mins [N, K/group] (4 bits, or 8 bits in groups of 32 or more): w = scale * q + min. GGUF Q4_0, Q4_1 and Q8_0 convert
to it without loss (their fp16
scales are exact in fp32); `int8` (per output channel, symmetric) and `int4` (per group, asymmetric,
round-to-nearest) are quantized from float weights of any model. An `int8` weight that runs W8A8 (activations
quantized per token, quant_linear.py) is quantized in a Hadamard basis over each 64 input channels (hadamard=64):
its dequantize() is W.H, and x.H must meet it (turn()); H is orthonormal and symmetric, so x.H.(W.H)^T = x.W^T.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.model.kv_cache_dtype import hadamard as hadamard_transform

QUANTIZATIONS = ("auto", "none", "gguf", "int8", "int4")  # auto: quant_linear.resolve_quantization
GGUF_BLOCK = 32
K_BLOCK = 256  # the K-quants' super-block
# GGUF type name -> (bytes per block, weights per block): the types that run as stored (any other loads dequantized).
GGUF_TYPES = {"Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32), "Q5_1": (24, 32), "Q8_0": (34, 32),
              "Q4_K": (144, 256), "Q5_K": (176, 256), "Q6_K": (210, 256)}


@dataclass
class QuantizedWeight:
    qweight: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    bits: int
    group: int
    source: str  # what it was converted from: a GGUF type, or int8 / int4
    hadamard: int = 0  # K in blocks of this width turned by Hadamard's matrix (0: not turned)
    per_token_int8: bool = False  # a checkpoint's W8A8: activations quantized per token to int8 (quant_linear.py)
    # GPTQ's activation order: the stored columns are the input channels in this order (their groups made
    # contiguous once at load), so the kernels read x[:, input_perm]; None: the input's own order
    input_perm: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        n, width = self.qweight.shape
        return n, width * 2 if self.bits == 4 else width

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.mins) if t is not None)

    def levels(self) -> torch.Tensor:
        """The stored integers q as fp32 [N, K], in k order."""
        n, k = self.shape
        if self.bits == 4:
            blocks = self.qweight.view(n, k // GGUF_BLOCK, GGUF_BLOCK // 2)
            return torch.cat([blocks & 0xF, blocks >> 4], dim=-1).reshape(n, k).float()
        return self.qweight.float()

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K] in the input's column order, in plain PyTorch: the reference the kernels are tested against."""
        n, k = self.shape
        w = self.levels().view(n, k // self.group, self.group) * self.scales.float().unsqueeze(-1)
        if self.mins is not None:
            w = w + self.mins.float().unsqueeze(-1)
        w = w.reshape(n, k)
        if self.input_perm is None:
            return w
        return torch.empty_like(w).index_copy_(1, self.input_perm, w)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The rows at index (a permutation or a selection), same layout."""
        mins = None if self.mins is None else self.mins[index].contiguous()
        return QuantizedWeight(self.qweight[index].contiguous(), self.scales[index].contiguous(), mins, self.bits,
                               self.group, self.source, self.hadamard, self.per_token_int8, self.input_perm)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """Rows of several weights of one format stacked (fused qkv and gate_up projections)."""
        first = parts[0]
        if not all(p.fuses_with(first) for p in parts):
            raise ValueError(f"cannot fuse weights of different formats: {sorted({p.source for p in parts})}")
        dtype = first.scales.dtype if len({p.scales.dtype for p in parts}) == 1 else torch.float32
        mins = None if first.mins is None else torch.cat([p.mins.to(dtype) for p in parts])
        return QuantizedWeight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales.to(dtype) for p in parts]),
                               mins, first.bits, first.group, "+".join(sorted({p.source for p in parts})), first.hadamard,
                               first.per_token_int8, first.input_perm)

    def fuses_with(self, other: QuantizedWeight) -> bool:
        """Whether one kernel call can run both stacked: the same format and the same input order."""
        same_order = (self.input_perm is None) == (other.input_perm is None) and (
            self.input_perm is None or torch.equal(self.input_perm, other.input_perm))
        return same_order and (self.bits, self.group, self.mins is None, self.hadamard, self.per_token_int8) == (
            other.bits, other.group, other.mins is None, other.hadamard, other.per_token_int8)


def from_gguf(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedWeight:
    """A GGUF tensor's raw blocks ([rows, bytes] uint8, as gguf.GGUFReader gives them) in planar layout, without
    loss: Q4_0 / Q4_1 / Q4_K as 4 bits in groups of 32 (a K-quant's 6-bit sub-block scales times its fp16
    super-block scale are exact in fp32), Q8_0 and Q5_0 (q - 16) as 8 bits in groups of 32, Q5_1 and Q5_K (q of
    0..31) as 8 bits in groups of 32 with mins, Q6_K as 8 bits in groups of 16."""
    if type_name not in GGUF_TYPES:
        raise ValueError(f"GGUF type {type_name} does not run as stored (supported: {', '.join(GGUF_TYPES)})")
    block_bytes, block = GGUF_TYPES[type_name]
    n, k = shape
    if k % block or data.size != n * (k // block) * block_bytes:
        raise ValueError(f"{type_name} tensor of shape {shape} has {data.size} bytes of data")
    blocks = np.ascontiguousarray(data).reshape(n * (k // block), block_bytes)
    if type_name == "Q4_K":
        q, scales, mins = _q4_k(blocks)
        return _planar_4bit(q.reshape(n, k), scales.reshape(n, -1), mins.reshape(n, -1), type_name)
    if type_name == "Q5_K":
        q, scales, mins = _q5_k(blocks)
        return QuantizedWeight(torch.from_numpy(q.reshape(n, k)), torch.from_numpy(scales.reshape(n, -1)),
                               torch.from_numpy(mins.reshape(n, -1)), 8, GGUF_BLOCK, type_name)
    if type_name == "Q6_K":
        q, scales = _q6_k(blocks)
        return QuantizedWeight(torch.from_numpy(q.reshape(n, k)), torch.from_numpy(scales.reshape(n, -1)), None, 8,
                               16, type_name)
    # Their scales stay fp16, as stored: 2 bytes a block fewer to stream than fp32, and no value changes.
    scales = blocks[:, 0:2].copy().view(np.float16)[:, 0].reshape(n, -1)
    if type_name in ("Q8_0", "Q5_0"):
        q = blocks[:, 2:].copy().view(np.int8) if type_name == "Q8_0" else _q5_0(blocks)
        return QuantizedWeight(torch.from_numpy(q.reshape(n, k)), torch.from_numpy(scales), None, 8, GGUF_BLOCK,
                               type_name)
    if type_name == "Q5_1":
        mins = blocks[:, 2:4].copy().view(np.float16)[:, 0].reshape(n, -1)
        q = _five_bits(blocks[:, 4:]).astype(np.int8)
        return QuantizedWeight(torch.from_numpy(q.reshape(n, k)), torch.from_numpy(scales), torch.from_numpy(mins), 8,
                               GGUF_BLOCK, type_name)
    if type_name == "Q4_1":
        mins = blocks[:, 2:4].copy().view(np.float16)[:, 0].reshape(n, -1)
        payload = blocks[:, 4:]
    else:  # Q4_0 stores q - 8: an unsigned q with min = -8 * scale (exact in fp16 unless it overflows)
        mins, payload = -8.0 * scales.astype(np.float32), blocks[:, 2:]
        if np.isfinite(mins.astype(np.float16)).all():
            mins = mins.astype(np.float16)
        else:
            scales = scales.astype(np.float32)
    return QuantizedWeight(torch.from_numpy(payload.reshape(n, k // 2).copy()), torch.from_numpy(scales),
                           torch.from_numpy(np.ascontiguousarray(mins)), 4, GGUF_BLOCK, type_name)


def _q5_0(blocks: np.ndarray) -> np.ndarray:
    """Q5_0 blocks (fp16 d, then the 5-bit values) -> q - 16 as int8 [blocks, 32], in k order."""
    return _five_bits(blocks[:, 2:]).astype(np.int8) - 16


def _five_bits(payload: np.ndarray) -> np.ndarray:
    """Q5_0 / Q5_1 values (32 high bits, 16 bytes of low nibbles) -> q (0..31) as uint8 [blocks, 32], in k order:
    element j's low nibble is byte j % 16's low (j < 16) or high half, its fifth bit is bit j of the high bits."""
    high = payload[:, 0:4].copy().view("<u4")  # [blocks, 1]
    bit4 = ((high >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8) << 4
    low = payload[:, 4:20]
    return np.concatenate([low & 0x0F, low >> 4], axis=1) | bit4


def _q4_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks -> (q [blocks, 256] in k order, scales and mins [blocks, 8] fp32)."""
    from gguf.quants import Q4_K

    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (qs & 0x0F).reshape(-1, K_BLOCK), d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def _q5_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q5_K super-blocks -> (q (0..31) as int8 [blocks, 256] in k order, scales and mins [blocks, 8] fp32): Q4_K's
    scales and nibbles, plus a fifth bit per value, bit i of the 32 qh bytes for the values of sub-block i."""
    _, scales, mins = _q4_k(np.concatenate([blocks[:, :16], blocks[:, 48:]], axis=1))
    nibbles = blocks[:, 48:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    high = blocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = (nibbles & 0x0F).reshape(-1, 8, 32) | ((high & 1) << 4)
    return q.reshape(-1, K_BLOCK).astype(np.int8), scales, mins


def _q6_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K super-blocks -> (q - 32 as int8 [blocks, 256] in k order, scales [blocks, 16] fp32)."""
    ql = blocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    qh = blocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    q = ((ql & 0x0F).reshape(-1, 2, 4, 32) | ((qh & 0x03).reshape(-1, 2, 4, 32) << 4)).astype(np.int8) - 32
    scales = blocks[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = blocks[:, 208:210].copy().view(np.float16).astype(np.float32)
    return q.reshape(-1, K_BLOCK), d * scales


def _planar_4bit(q: np.ndarray, scales: np.ndarray, mins: np.ndarray, source: str) -> QuantizedWeight:
    """4-bit values [N, K] (0..15, k order) packed GGML-style per 32: byte j = q[j] | q[j + 16] << 4."""
    n, k = q.shape
    g = q.reshape(n, k // GGUF_BLOCK, 2, GGUF_BLOCK // 2).astype(np.uint8)
    packed = (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2)
    return QuantizedWeight(torch.from_numpy(np.ascontiguousarray(packed)), torch.from_numpy(scales.copy()),
                           torch.from_numpy(mins.copy()), 4, GGUF_BLOCK, source)


def turn(x: torch.Tensor, width: int) -> torch.Tensor:
    """x times the block-diagonal Hadamard matrix of `width` over its last dim (a multiple of width), in fp32."""
    k = x.shape[-1]
    return hadamard_transform(x.float().reshape(-1, k // width, width)).reshape(x.shape)


def quantize(w: torch.Tensor, mode: str, group: int = 32, hadamard: int = 0) -> QuantizedWeight:
    """int8: per output channel, symmetric, in the Hadamard basis of width `hadamard` when given (see turn()).
    int4: per group, asymmetric, round to nearest."""
    w = w.detach().float()
    n, k = w.shape
    if k % GGUF_BLOCK:
        raise ValueError(f"{mode} needs K divisible by {GGUF_BLOCK}; this weight is {n}x{k}")
    if mode == "int8":
        if hadamard:
            if k % hadamard:
                raise ValueError(f"a Hadamard basis of {hadamard} needs K divisible by it; this weight is {n}x{k}")
            w = turn(w, hadamard)
        scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
        q = torch.round(w / scale).clamp(-127, 127).to(torch.int8)
        return QuantizedWeight(q.contiguous(), scale.contiguous(), None, 8, k, "int8", hadamard)
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
