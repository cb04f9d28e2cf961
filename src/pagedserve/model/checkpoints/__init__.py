"""Hugging Face folders quantized by the tools people publish with, loaded as stored (one module per format)."""
from __future__ import annotations

import torch

from pagedserve.model.checkpoints.compressed_tensors import load_compressed_tensors
from pagedserve.model.checkpoints.gptq_awq import load_gptq_awq
from pagedserve.model.fp8_linear import FP8Weight
from pagedserve.model.quant import QuantizedWeight
from pagedserve.model.quant_linear import gemm_path, int8_mm_ready, kernel_path, w8a8_available

SUPPORTED = ("compressed-tensors", "gptq", "awq")


def checkpoint_weights(tensors: dict[str, torch.Tensor], quantization_config: dict | None
                       ) -> tuple[dict[str, torch.Tensor | QuantizedWeight | FP8Weight], str]:
    """The folder's tensors in HF naming (float32, or quantized as stored) and the scheme's name ('none' when the
    config.json has no quantization_config)."""
    if not quantization_config:
        return {k: v.float() for k, v in tensors.items()}, "none"
    method = quantization_config.get("quant_method")
    if method == "compressed-tensors":
        return load_compressed_tensors(tensors, quantization_config)
    if method in ("gptq", "awq"):
        return load_gptq_awq(tensors, quantization_config)
    raise ValueError(f"quantization_config quant_method {method!r} is not supported (supported: "
                     f"{', '.join(SUPPORTED)})")


def checkpoint_kernel(weights: dict[str, torch.Tensor | QuantizedWeight | FP8Weight], dtype: torch.dtype) -> str:
    """What runs a checkpoint's quantized weights in a model computed in dtype, for /metrics and /v1/models."""
    paths = set()
    for w in weights.values():
        if isinstance(w, FP8Weight):
            paths.add(f"fp8-values-{'bf16' if dtype == torch.bfloat16 else 'fp32'}-gemm")
        elif isinstance(w, QuantizedWeight) and w.per_token_int8 and dtype == torch.bfloat16 and w8a8_available():
            paths.add("w8a8-amx")
        elif isinstance(w, QuantizedWeight) and int8_mm_ready(w) and kernel_path() != "torch":
            paths.add("int8-tokens+int8-mm")
        elif isinstance(w, QuantizedWeight):
            paths.add(("int8-tokens+" if w.per_token_int8 else "") + f"{kernel_path()}+{gemm_path()}")
    return ",".join(sorted(paths)) or "none"
