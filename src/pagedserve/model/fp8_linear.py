"""FP8 (e4m3) weights on CPUs without FP8 arithmetic.

Every e4m3 value (3 mantissa bits, exponents 2^-9 .. 2^8) is exact in bf16 and fp32, so the weights run as a
float GEMM over the stored values, unchanged, and the per-channel (or per-tensor) scale multiplies each output
once in fp32: y = (x . q^T) * scale. Folding the scale into the weights first would round each product to bf16
(up to 2^-9 relative error per weight); this way the weights add no error at all, and the bf16 GEMM runs on
oneDNN's prepacked path like any float linear (model/linear.py). Activations stay in the model's dtype: the
checkpoint's FP8 activation quantization would only add error, and a CPU gains no speed from it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.model.linear import Linear


@dataclass
class FP8Weight:
    qweight: torch.Tensor  # [N, K] float8_e4m3fn, as stored
    scales: torch.Tensor  # [N] fp32, one per output channel (a per-tensor scale repeated)
    source: str  # the scheme, for logs and extra_repr

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.qweight.shape)

    def dequantize(self) -> torch.Tensor:
        """fp32 [N, K]: compressed-tensors' own decompression (value times scale, in fp32)."""
        return self.qweight.float() * self.scales.unsqueeze(1)

    @staticmethod
    def cat(parts: list[FP8Weight]) -> FP8Weight:
        """Fused projections: rows stacked, each part keeping its own scales."""
        return FP8Weight(torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]),
                         "+".join(sorted({p.source for p in parts})))


class FP8Linear(Linear):
    """A Linear over the exact e4m3 values whose outputs are scaled per channel. The scales and the bias are plain
    attributes, not parameters, so that model.to(bf16) leaves them in fp32 (the bias is added after the scale)."""

    def __init__(self, weight: FP8Weight, bias: nn.Parameter | None = None) -> None:
        n, k = weight.shape
        super().__init__(k, n, bias=False)
        with torch.no_grad():
            self.weight.copy_(weight.qweight.float())
        self.scales = weight.scales.float()
        self.bias_after_scale = bias
        self.source = weight.source

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = super().forward(x).float() * self.scales
        if self.bias_after_scale is not None:
            y = y + self.bias_after_scale.float()
        y = y.to(x.dtype)
        return y if residual is None else residual + y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, {self.source} (fp8 e4m3 values, scaled outputs)"
