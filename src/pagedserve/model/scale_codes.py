"""8-bit scale codes for quantized KV rows and groups: code u stands for 2^(9 - u / 12), a log grid of 12 steps
an octave from 512 down to about 2e-4. One byte instead of an fp16 or fp32 scale is what lets int8 rows and int4
groups come close to their formats' nominal sizes (int8: 65 bytes a 64-wide row, not 68); the grid's step costs at
most 5.9% of a quantization step when a scale is rounded up, 2.9% when rounded to the nearest code. The C++
kernels build the same table (kv_quant.h scale_code_table)."""
from __future__ import annotations

import torch

STEPS_PER_OCTAVE = 12
TOP_LOG2 = 9
SCALE_TABLE = (2.0 ** (TOP_LOG2 - torch.arange(256, dtype=torch.float64) / STEPS_PER_OCTAVE)).float()


def scale_code(scale: torch.Tensor, round_up: bool) -> torch.Tensor:
    """uint8 codes of positive scales: the nearest code, or the smallest scale at least as large (so that nothing
    clips) when round_up; scales beyond the grid take its ends."""
    steps = STEPS_PER_OCTAVE * (TOP_LOG2 - torch.log2(scale))
    return (steps.floor() if round_up else steps.round()).clamp(0, 255).to(torch.uint8)


def scales_of(codes: torch.Tensor) -> torch.Tensor:
    return SCALE_TABLE[codes.long()]
