"""Dynamic per-token int8 activations, as compressed-tensors defines them for its W8A8 checkpoints: per token,
scale = amax / 127.5 (the int8 range 255 over two), q = clamp(round(x / scale), -128, 127), used as q * scale.
The reference path of such weights on CPUs without AMX int8 tiles (quant_linear.py), where the fake-quantized
activations then meet the int8 weights on the W8A16 kernels.

This equals compressed-tensors' fake_quantize bit for bit (tests/test_checkpoints.py), yet a whole model's
perplexity here and in transformers differs by tenths of a percent: a float rounding that differs upstream (their
SDPA, our paged attention) flips a rounding here, each row's negative max sits on a tie (-127.5), and a flipped
step perturbs what the next layers round. Measured spread: docs/quantized_checkpoints.md."""
from __future__ import annotations

import torch


def quantize_tokens(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] with each row replaced by its int8 quantization (dequantized, in x's dtype)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True) / 127.5
    q = torch.round(xf / torch.where(scale > 0, scale, 1.0)).clamp(-128, 127)
    return (q * scale).to(x.dtype)
