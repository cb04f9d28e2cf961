"""Linear layers whose bf16 weights are prepacked once for oneDNN.

A plain bf16 F.linear reorders the whole weight into oneDNN's blocked layout on every call; at decode
batch sizes that reorder costs as much as the matmul itself (2x slower at batch 1). Packing once at load
removes it and lets a residual add run as the matmul's post-op.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def can_pack(dtype: torch.dtype, device: torch.device) -> bool:
    """fp32 stays on the plain path: it is the reference that greedy output must match token for token."""
    return (dtype == torch.bfloat16 and device.type == "cpu" and torch.backends.mkldnn.is_available()
            and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class Linear(nn.Linear):
    packed: torch.Tensor | None = None

    def pack(self) -> None:
        """Replace the weight by its oneDNN-packed copy (a tied weight stays with its other owner)."""
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), None)
        self.weight = nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x @ W.T + b, plus residual when given."""
        if self.packed is None:
            y = F.linear(x, self.weight, self.bias)
            return y if residual is None else residual + y
        if residual is None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")


def pack_linears(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, Linear):
            module.pack()
