"""Hugging Face folders quantized by the tools people publish with, loaded as stored (one module per format)."""
from __future__ import annotations

import torch

from pagedserve.model.checkpoints.compressed_tensors import load_compressed_tensors
from pagedserve.model.fp8_linear import FP8Weight
from pagedserve.model.quant import QuantizedWeight

SUPPORTED = ("compressed-tensors",)


def checkpoint_weights(tensors: dict[str, torch.Tensor], quantization_config: dict | None
                       ) -> tuple[dict[str, torch.Tensor | QuantizedWeight | FP8Weight], str]:
    """The folder's tensors in HF naming (float32, or quantized as stored) and the scheme's name ('none' when the
    config.json has no quantization_config)."""
    if not quantization_config:
        return {k: v.float() for k, v in tensors.items()}, "none"
    method = quantization_config.get("quant_method")
    if method == "compressed-tensors":
        return load_compressed_tensors(tensors, quantization_config)
    raise ValueError(f"quantization_config quant_method {method!r} is not supported (supported: "
                     f"{', '.join(SUPPORTED)})")
