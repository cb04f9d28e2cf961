"""GPTQ (AutoGPTQ / GPTQModel) and AWQ (AutoAWQ, GEMM packing) folders, repacked once at load into the planar
layout of model/quant.py.

GPTQ: qweight int32 [K * bits / 32, N] packs consecutive input channels of one column, LSB first; qzeros int32
[G, N * bits / 32] packs consecutive columns the same way, stored minus one in the v1 checkpoint format
(checkpoint_format "gptq"; "gptq_v2" stores them as they are); scales [G, N]; g_idx [K] the group of each input
channel. AWQ GEMM: qweight int32 [K, N / 8] packs 8 columns of one input channel, nibble i holding column
AWQ_ORDER[i]; qzeros [G, N / 8] alike; scales [G, N]. Both dequantize as w[n, k] = scale * (q - zero).

4 bits run as GGML nibbles with mins = -zero * scale (the kernels' fma scale * q + min: one rounding more than
the reference's scale * (q - zero) when zero * scale is not exact); symmetric 8 bits as int8 q - zero (zero is
128); asymmetric 8 bits have no kernel (no 8-bit mins) and are dequantized at load, with a warning. An
activation order (desc_act: a g_idx that is not k // group) is reordered once at load: the columns sorted by
group so that each group is contiguous again, and the kernels read the input's columns in that order.
"""
from __future__ import annotations

import logging

import torch

from pagedserve.model.checkpoints.compressed_tensors import (
    activation_order,
    dequantize_reference,
    in_order,
    pack_nibbles,
)
from pagedserve.model.quant import GGUF_BLOCK, QuantizedWeight

logger = logging.getLogger(__name__)

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: nibble i of a word holds column AWQ_ORDER[i]


def unpack_lsb_first(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32 / bits unsigned values, LSB first, spread along dim (0 or 1)."""
    shifts = torch.arange(32 // bits, dtype=torch.int32) * bits
    values = (packed.to(torch.int32).unsqueeze(dim + 1) >> shifts.view(*([1] * (dim + 1)), -1, *([1] * (1 - dim))))
    values = values & ((1 << bits) - 1)
    shape = list(packed.shape)
    shape[dim] *= 32 // bits
    return values.reshape(shape).to(torch.int16)


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """[rows, N / 8] AWQ words -> [rows, N] values in column order."""
    nibbles = unpack_lsb_first(packed, 4, 1).view(packed.shape[0], -1, 8)
    columns = torch.empty_like(nibbles)
    columns[:, :, list(AWQ_ORDER)] = nibbles
    return columns.reshape(packed.shape[0], -1)


def load_gptq_awq(tensors: dict[str, torch.Tensor], config: dict) -> tuple[dict, str]:
    method, bits = config.get("quant_method"), int(config.get("bits", config.get("w_bit", 4)))
    group = int(config.get("group_size", config.get("q_group_size", 128)))
    if method == "awq" and (bits != 4 or str(config.get("version", "gemm")).lower() != "gemm"):
        raise ValueError(f"AWQ {config.get('version')} with {bits} bits is not supported (supported: GEMM, 4 bits)")
    if method == "gptq" and bits not in (4, 8):
        raise ValueError(f"GPTQ with {bits} bits is not supported (supported: 4, 8)")
    modules = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith(".qweight")})
    parts = {f"{m}.{p}" for m in modules for p in ("qweight", "qzeros", "scales", "g_idx")}
    out = {k: v.float() for k, v in tensors.items() if k not in parts}
    for m in modules:
        if method == "awq":
            q, zeros = unpack_awq(tensors[f"{m}.qweight"]), unpack_awq(tensors[f"{m}.qzeros"])
        else:
            q = unpack_lsb_first(tensors[f"{m}.qweight"], bits, 0)
            zeros = unpack_lsb_first(tensors[f"{m}.qzeros"], bits, 1)
            if config.get("checkpoint_format", "gptq") == "gptq":  # v1 stores zero - 1
                zeros = (zeros + 1) & ((1 << bits) - 1)
        k = q.shape[0]
        size = k if group <= 0 else group
        perm = activation_order(tensors.get(f"{m}.g_idx"), k, size, m)
        q = q.t() if perm is None else q.t()[:, perm]
        out[f"{m}.weight"] = in_order(planar(q.contiguous(), zeros.t().contiguous(),
                                             tensors[f"{m}.scales"].float().t(), bits, size, f"{method} int{bits}", m),
                                      perm)
    name = f"{method} int{bits} group {group if group > 0 else 'per channel'}"
    return out, name


def planar(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, bits: int, group: int, source: str,
           module: str) -> QuantizedWeight | torch.Tensor:
    """q [N, K] unsigned, zeros and scales [N, G] -> our layout."""
    k = q.shape[1]
    if k % GGUF_BLOCK or group % GGUF_BLOCK or k % group:
        raise ValueError(f"{module}: groups of {group} over K={k} cannot run on our kernels (multiples of 32)")
    scales = scales.contiguous()
    if bits == 4:
        mins = -zeros.float() * scales
        return QuantizedWeight(pack_nibbles(q.to(torch.uint8)), scales, mins.contiguous(), 4, group, source)
    if bool((zeros == 128).all()):
        return QuantizedWeight((q - 128).to(torch.int8).contiguous(), scales, None, 8, group, source)
    logger.warning("%s: asymmetric int8 weights have no kernel (it reads no 8-bit mins): dequantized at load", module)
    return dequantize_reference(q, scales, zeros, group)
