"""Building blocks every model family shares: the step's context, RMSNorm, rotary embeddings, weight fusion."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.model.attention import AttentionMetadata
from pagedserve.model.fp8_linear import FP8Weight
from pagedserve.model.lora import LoRABatch
from pagedserve.model.model_config import ModelConfig
from pagedserve.model.quant import QuantizedWeight


@dataclass(slots=True)
class StepContext:
    """What every layer of one forward pass shares, computed once per step rather than once per layer."""
    meta: AttentionMetadata
    block_size: int
    cos: torch.Tensor  # [T, d/2] at each token's position: fp32 for the kernels, else the model dtype
    sin: torch.Tensor
    kernels: Any | None  # the fused bf16 C++ ops; None: plain PyTorch ops (the fp32 reference path)
    lora: LoRABatch | None = None  # the step's adapters and their rows; None: the base model only


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor, kernels: Any | None = None) -> torch.Tensor:
        if kernels is not None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (HF layout), with linear or llama3 frequency scaling or GGUF rope_freqs factors.
    theta: another base than the config's (Gemma 3's sliding layers)."""

    def __init__(self, config: ModelConfig, freq_factors: torch.Tensor | None = None,
                 theta: float | None = None) -> None:
        super().__init__()
        d = config.head_dim
        base = config.rope_theta if theta is None else theta
        inv_freq = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        scaling = config.rope_scaling if theta is None else None
        inv_freq = scale_frequencies(inv_freq, scaling)
        if freq_factors is not None:
            inv_freq = inv_freq / freq_factors.double()
        t = torch.arange(config.max_position_embeddings, dtype=torch.float64)
        if scaling and scaling.get("rope_type", scaling.get("type")) == "linear":
            t = t / scaling["factor"]
        freqs = torch.outer(t, inv_freq)
        self.register_buffer("cos", freqs.cos().float(), persistent=False)
        self.register_buffer("sin", freqs.sin().float(), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [T, d/2] at positions."""
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, d]; cos, sin: [T, d/2]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def scale_frequencies(inv_freq: torch.Tensor, scaling: dict | None) -> torch.Tensor:
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "llama3":
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_ctx = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)


def fuse(weights: dict[str, torch.Tensor | QuantizedWeight | FP8Weight], fused: str, parts: list[str]) -> None:
    missing = [p for p in parts if p not in weights]
    if missing:
        raise ValueError(f"model file lacks {missing[0]!r}")
    tensors = [weights.pop(p) for p in parts]
    if all(isinstance(t, FP8Weight) for t in tensors):
        weights[fused] = FP8Weight.cat(tensors)
        return
    quantized = [isinstance(t, QuantizedWeight | FP8Weight) for t in tensors]
    if all(isinstance(t, QuantizedWeight) and t.fuses_with(tensors[0]) for t in tensors):
        weights[fused] = QuantizedWeight.cat(tensors)
    else:  # mixed formats (say Q4_K beside Q6_K) cannot share one kernel call: that projection runs in float
        weights[fused] = torch.cat([t.dequantize() if q else t for t, q in zip(tensors, quantized)], dim=0)
