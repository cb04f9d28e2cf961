"""Linear and embedding layers over quantized weights (model/quant.py), on the kernel path this CPU has.

Paths, forced with PAGEDSERVE_QUANT_KERNEL for tests and measurements:
- `avx512`: our C++ integer-dot kernel on AVX-512 VNNI (vpdpwssd), weights widened in registers.
- `avx2`: the same arithmetic on AVX2 (madd_epi16), weights widened once per row into an L1 buffer.
- `scalar`: the same arithmetic in portable C++ (any CPU the extension builds on).
- `torch`: dequantize in PyTorch, then F.linear (no C++ compiler).
Calls of DEQUANT_MIN_ROWS rows or more (AMX_MIN_ROWS with the tiles; batches, prefill) go to a float GEMM. Up to AMX_MAX_ROWS rows, with
bf16 activations on a CPU with AMX, our tile kernel dequantizes 32 weight rows at a time into an L1/L2-resident
bf16 panel and multiplies it on the tiles (`amx`); longer calls (prefill chunks), and every large call without
AMX, dequantize the weights whole into the activation dtype for oneDNN/MKL (`dequant`): there the panel kernel
would re-read all activations per 32 weight rows. PAGEDSERVE_QUANT_GEMM forces one of the two.

`int8` in bf16 on a CPU with AMX int8 tiles runs W8A8 at every M (`w8a8`, csrc/quant_gemm_w8a8.cpp): its weights
are quantized in a Hadamard basis (quant.py) and each token is turned into it and quantized to int8 inside the
kernel; it reads the int8 weights as the tiles' operand, with nothing to dequantize.
PAGEDSERVE_QUANT_W8A8=0 keeps int8 on the paths above (W8A16).

A checkpoint's W8A8 weights (per_token_int8, model/checkpoints/) run on that kernel without the Hadamard basis;
elsewhere per-channel ones run as integer GEMMs (token_quant.int8_linear), and other groupings have their
activations quantized per token in PyTorch before the paths above (`torch`: the float reference of both).
"""
from __future__ import annotations

import os
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.model.kernels import cpu_kernels
from pagedserve.model.quant import QuantizedWeight, turn
from pagedserve.model.token_quant import int8_linear, quantize_tokens

PATHS = {"scalar": 0, "avx2": 1, "avx512": 2}
# Measured on 3072x576 and 576x1536 (one thread, AVX2): the integer kernel is ~2x faster than dequantize +
# GEMM at 1-4 rows and ~1.5x slower from 16; a float GEMM does more multiply-adds per instruction.
DEQUANT_MIN_ROWS = 8
# Measured over the default model's 120 linears (2 threads, AMX Xeon): the tile kernel beats bf16 oneDNN at
# 64-128 rows, ties at 512, and loses to dequantize + oneDNN from 1024 (137 vs 129 ms; 2.2x at 2048).
AMX_MAX_ROWS = 512
# Where the tiles take over from the integer kernel (same 120 linears + LM head, bf16 activations): 4 rows
# 10.0 vs 11.2 ms, 5 rows 12.8 vs 11.9, 7 rows 16.4 vs 11.9.
AMX_MIN_ROWS = 5


@cache
def kernel_path() -> str:
    """The fastest path built here, or PAGEDSERVE_QUANT_KERNEL when set (an unavailable one is an error)."""
    kernels = cpu_kernels()
    built = [] if kernels is None else [name for name, code in PATHS.items() if code in kernels.quant_paths()]
    available = [*built, "torch"]
    wanted = os.environ.get("PAGEDSERVE_QUANT_KERNEL", "auto")
    if wanted == "auto":
        return available[-2] if built else "torch"
    if wanted not in available:
        raise RuntimeError(f"PAGEDSERVE_QUANT_KERNEL={wanted} is not available on this CPU (have: {available})")
    return wanted


@cache
def gemm_path() -> str:
    """The large-M path: `amx` where this CPU and process can run it, else `dequant`; PAGEDSERVE_QUANT_GEMM forces."""
    kernels = cpu_kernels()
    available = ["dequant"] + (["amx"] if kernels is not None and kernels.quant_amx_available() else [])
    wanted = os.environ.get("PAGEDSERVE_QUANT_GEMM", "auto")
    if wanted == "auto":
        return available[-1]
    if wanted not in available:
        raise RuntimeError(f"PAGEDSERVE_QUANT_GEMM={wanted} is not available on this CPU (have: {available})")
    return wanted


@cache
def w8a8_available() -> bool:
    """Whether `int8` runs W8A8 on AMX int8 tiles here (bf16 activations); PAGEDSERVE_QUANT_W8A8=0 turns it off."""
    kernels = cpu_kernels()
    return (os.environ.get("PAGEDSERVE_QUANT_W8A8", "1") != "0" and kernel_path() != "torch"
            and kernels is not None and kernels.quant_w8a8_available())


def int8_mm_ready(w: QuantizedWeight) -> bool:
    """A checkpoint's W8A8 weight the integer GEMM can run: symmetric int8 with one scale per output channel."""
    return w.per_token_int8 and w.bits == 8 and w.mins is None and w.scales.shape[1] == 1


def w8a8_basis(mode: str, dtype: torch.dtype) -> int:
    """The Hadamard width `mode`'s weights are quantized in for a model computed in dtype: 64 where int8 runs
    W8A8, else 0."""
    return 64 if mode == "int8" and dtype == torch.bfloat16 and w8a8_available() else 0


def quant_kernel(mode: str, dtype: torch.dtype) -> str:
    """What runs mode's linears here, for /metrics, /v1/models and the benchmarks."""
    if mode == "none":
        return "none"
    return "w8a8-amx" if w8a8_basis(mode, dtype) else f"{kernel_path()}+{gemm_path()}"


def few_rows_limit(dtype: torch.dtype) -> int:
    """Calls of fewer rows take the integer kernel; more go to the GEMM path."""
    return AMX_MIN_ROWS if dtype == torch.bfloat16 and gemm_path() == "amx" else DEQUANT_MIN_ROWS


def resolve_quantization(requested: str, model_is_gguf: bool, dtype: torch.dtype) -> str:
    """`auto`: `gguf` for a GGUF model computed in bf16 on a CPU with AMX tiles, where running the stored
    weights was measured faster than the dequantized model at every batch size (one stream 2x, batches of 64
    1.1x) at the same perplexity; `none` elsewhere: without AMX a batch dequantizes whole matrices per call.
    The kernels a process is forced to use do not change the answer."""
    if requested != "auto":
        return requested
    kernels = cpu_kernels()
    amx = kernels is not None and kernels.quant_amx_available()
    return "gguf" if model_is_gguf and dtype == torch.bfloat16 and amx else "none"


def _forced(path: str) -> bool:
    """Whether PAGEDSERVE_QUANT_GEMM names this large-M path (then it runs at every M)."""
    return os.environ.get("PAGEDSERVE_QUANT_GEMM") == path


def quant_matmul(x: torch.Tensor, w: QuantizedWeight, path: str, dequant_min_rows: int | None = None,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ W^T (+ residual) in x's dtype."""
    if w.input_perm is not None and path != "torch":  # GPTQ's activation order: the kernels read the columns as
        x = x.index_select(-1, w.input_perm)           # stored (dequantize() gives them in the input's order)
    few_rows = few_rows_limit(x.dtype) if dequant_min_rows is None else dequant_min_rows
    if w.hadamard:
        if x.dtype == torch.bfloat16 and w8a8_available():
            return cpu_kernels().quant_linear_w8a8(x.contiguous(), w.qweight, w.scales, w.hadamard,
                                                   None if residual is None else residual.contiguous())
        x = turn(x, w.hadamard).to(x.dtype)  # any other path meets the turned weights in their basis
    elif w.per_token_int8:
        if x.dtype == torch.bfloat16 and w8a8_available() and w.group == x.shape[1] and w.group % 64 == 0:
            return cpu_kernels().quant_linear_w8a8(x.contiguous(), w.qweight, w.scales, 0,
                                                   None if residual is None else residual.contiguous())
        if path != "torch" and int8_mm_ready(w) and x.shape[0] >= few_rows:  # fewer: the integer kernel reads
            y = int8_linear(x, w.qweight, w.scales)                            # the weights faster (measured)
            return y if residual is None else residual + y
        x = quantize_tokens(x)
    if path == "torch":
        y = F.linear(x, w.dequantize().to(x.dtype))
    elif x.shape[0] >= few_rows:
        if x.dtype == torch.bfloat16 and gemm_path() == "amx" and (x.shape[0] <= AMX_MAX_ROWS or _forced("amx")):
            return cpu_kernels().quant_linear_amx(x, w.qweight, w.scales, w.mins, w.bits, w.group,
                                                  None if residual is None else residual.contiguous())
        y = F.linear(x, cpu_kernels().quant_dequantize(w.qweight, w.scales, w.mins, w.bits, w.group, x.dtype))
    else:  # the integer kernel adds the residual as it stores
        return cpu_kernels().quant_linear(x.contiguous(), w.qweight, w.scales, w.mins, w.bits, w.group, PATHS[path],
                                          None if residual is None else residual.contiguous())
    return y if residual is None else residual + y


class QuantLinear(nn.Module):
    """A Linear whose weight is a QuantizedWeight. The weight is a plain attribute, not a buffer, so that
    model.to(dtype) leaves its fp32 scales alone."""

    def __init__(self, weight: QuantizedWeight, bias: nn.Parameter | None = None) -> None:
        super().__init__()
        self.qweight = weight
        self.bias = bias  # the replaced Linear's own parameter: loading it later still lands here
        self.out_features, self.in_features = weight.shape

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if self.bias is not None:  # the bias goes before the residual
            y = quant_matmul(x, self.qweight, kernel_path()) + self.bias
            return y if residual is None else residual + y
        return quant_matmul(x, self.qweight, kernel_path(), residual=residual)

    def extra_repr(self) -> str:
        w = self.qweight
        order = ", activation order" if w.input_perm is not None else ""
        return f"in={self.in_features}, out={self.out_features}, {w.source} ({w.bits}-bit, group {w.group}{order})"


class QuantEmbedding(nn.Module):
    """Token embedding rows dequantized on lookup (GGUF stores the tied embedding as Q8_0)."""

    def __init__(self, weight: QuantizedWeight, dtype: torch.dtype) -> None:
        super().__init__()
        self.qweight = weight
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.qweight.rows(ids).dequantize()
        if self.qweight.hadamard:  # a head tied to it runs W8A8: turned back (H.H = I)
            rows = turn(rows, self.qweight.hadamard)
        return rows.to(self.dtype)

    def _apply(self, fn, recurse: bool = True):
        self.dtype = fn(torch.empty(0, dtype=self.dtype)).dtype  # follows model.to(dtype)
        return super()._apply(fn, recurse)


def quantized_bytes(model: nn.Module) -> int:
    """Resident bytes of the model's weights: quantized ones as stored, the rest as they are."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if isinstance(module, QuantLinear | QuantEmbedding) and id(module.qweight) not in seen:
            seen.add(id(module.qweight))
            total += module.qweight.nbytes
        total += sum(w.nbytes for pair in getattr(module, "quantized", ()) for w in pair)  # experts (models/moe.py)
    params = {id(p): p for p in model.parameters()}
    return total + sum(p.numel() * p.element_size() for p in params.values())
