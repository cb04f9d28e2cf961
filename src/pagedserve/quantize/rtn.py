"""The integer grid every method writes (compressed-tensors' own rules, so that its decompression gives back exactly
our dequantized weights) and plain round-to-nearest on it."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Grid:
    bits: int
    group: int | None  # columns per scale; None: one scale per output channel
    symmetric: bool = True

    @property
    def qmin(self) -> int:
        return -(1 << (self.bits - 1))

    @property
    def qmax(self) -> int:
        return (1 << (self.bits - 1)) - 1

    def groups(self, k: int) -> int:
        return 1 if self.group is None else k // self.group


@dataclass(slots=True)
class Quantized:
    """One weight on its grid: q [N, K] int8 and per (row, group) scale (fp32) and zero point (int, asym only)."""
    q: torch.Tensor
    scale: torch.Tensor  # [N, groups]
    zero: torch.Tensor | None  # [N, groups] int8, or None when symmetric
    grid: Grid

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.q, self.scale, self.zero, self.grid)


def qparams(w: torch.Tensor, grid: Grid, ratio: torch.Tensor | float = 1.0
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Scale and zero point of each row of w [N, cols] (one group), the range shrunk by ratio (AWQ's clipping).
    As compressed-tensors' calculate_qparams: 0 always on the grid; symmetric scale = amax / ((qmax - qmin) / 2)."""
    lo = w.amin(dim=1).clamp(max=0) * ratio
    hi = w.amax(dim=1).clamp(min=0) * ratio
    span = grid.qmax - grid.qmin
    if grid.symmetric:
        scale = torch.maximum(-lo, hi) / (span / 2)
        return scale.clamp(min=torch.finfo(torch.float32).tiny), None
    scale = ((hi - lo) / span).clamp(min=torch.finfo(torch.float32).tiny)
    zero = torch.round(grid.qmin - lo / scale).clamp(grid.qmin, grid.qmax)
    return scale, zero


def to_grid(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, grid: Grid) -> torch.Tensor:
    """Integers of w [N, cols] for one column group's scale / zero [N]."""
    z = 0 if zero is None else zero.unsqueeze(1)
    return torch.clamp(torch.round(w / scale.unsqueeze(1)) + z, grid.qmin, grid.qmax)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, grid: Grid) -> torch.Tensor:
    n, k = q.shape
    size = k if grid.group is None else grid.group
    shifted = q.float().view(n, k // size, size)
    if zero is not None:
        shifted = shifted - zero.float().unsqueeze(-1)
    return (shifted * scale.unsqueeze(-1)).reshape(n, k)


def grouped(w: torch.Tensor, grid: Grid) -> torch.Tensor:
    """w [N, K] as [N, groups, group size]."""
    n, k = w.shape
    return w.reshape(n, grid.groups(k), k // grid.groups(k))


def rtn(w: torch.Tensor, grid: Grid, ratio: torch.Tensor | float = 1.0) -> Quantized:
    """Round to nearest per group; ratio (scalar or [N, groups]) shrinks each group's range (clipping)."""
    n, k = w.shape
    g = grouped(w.float(), grid)
    ratio = torch.as_tensor(ratio, dtype=torch.float32).expand(n, g.shape[1]).reshape(-1)
    flat = g.reshape(n * g.shape[1], -1)
    scale, zero = qparams(flat, grid, ratio)
    q = to_grid(flat, scale, zero, grid).to(torch.int8).reshape(n, k)
    shape = (n, g.shape[1])
    return Quantized(q, scale.reshape(shape), None if zero is None else zero.to(torch.int8).reshape(shape), grid)


def check_groups(k: int, grid: Grid, name: str) -> None:
    if grid.group is not None and k % grid.group:
        raise ValueError(f"--group-size {grid.group} does not divide {name}'s {k} input features; pick a group size "
                         f"that divides every linear's K (e.g. 64 or 32 for SmolLM2's 576 and 1536)")
