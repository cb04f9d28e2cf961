"""Dynamic per-token int8 activations, as compressed-tensors defines them for its W8A8 checkpoints: per token,
scale = amax / 127.5 (the int8 range 255 over two), q = clamp(round(x / scale), -128, 127), used as q * scale.
On CPUs without AMX int8 tiles a checkpoint's W8A8 linears run as integer GEMMs (int8_linear: oneDNN's int8
kernel behind torch._int_mm, VNNI where the CPU has it), the products summed exactly in int32 and scaled once by
each token's and each channel's scale. quantize_tokens is the same rounding in float, for the reference path.

This equals compressed-tensors' fake_quantize bit for bit (tests/test_checkpoints.py), yet a whole model's
perplexity here and in transformers differs by tenths of a percent: a float rounding that differs upstream (their
SDPA, our paged attention) flips a rounding here, each row's negative max sits on a tie (-127.5), and a flipped
step perturbs what the next layers round. Measured spread: docs/quantized_checkpoints.md."""
from __future__ import annotations

import torch


def _levels(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as its int8 levels (in fp32) and their fp32 scales [M, 1] (0 for an all-zero row)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127.5
    return torch.round(xf / torch.where(scale > 0, scale, 1.0)).clamp_(-128, 127), scale


def quantize_tokens(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] with each row replaced by its int8 quantization (dequantized, in x's dtype)."""
    q, scale = _levels(x)
    return (q * scale).to(x.dtype)


def int8_linear(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ W^T in x's dtype, for W = scales * qweight (int8 [N, K], one fp32 scale per row [N, 1]) and x
    quantized per token."""
    q, scale = _levels(x)
    acc = torch._int_mm(q.to(torch.int8), qweight.t())
    return (acc.float() * scale * scales.view(1, -1)).to(x.dtype)
