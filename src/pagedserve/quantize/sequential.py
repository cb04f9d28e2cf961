"""Layer-by-layer calibration, as GPTQ does it: each decoder layer's inputs are captured on the calibration
tokens, its linears quantized, and the quantized layer run forward to give the next layer its inputs (so every
layer calibrates against the error of the ones before it)."""
from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.model.layers import RotaryEmbedding
from pagedserve.model.model_config import ModelConfig
from pagedserve.quantize import layer
from pagedserve.quantize.awq import awq_layer
from pagedserve.quantize.gptq import gptq, hessian
from pagedserve.quantize.rtn import Grid, Quantized, check_groups, rtn
from pagedserve.quantize.smoothquant import smoothquant_layer

logger = logging.getLogger(__name__)
METHODS = ("rtn", "gptq", "awq", "smoothquant")


@dataclass(frozen=True, slots=True)
class Settings:
    method: str
    grid: Grid
    act_order: bool = False  # GPTQ only
    damp: float = 0.01  # GPTQ's dampening, a fraction of the Hessian's mean diagonal

    @property
    def w8a8(self) -> bool:
        return self.method == "smoothquant"


def progress(items: Iterable[int], total: int, desc: str) -> Iterator[int]:
    """tqdm's bar where it is installed, else a log line per layer."""
    try:
        from tqdm import tqdm
    except ImportError:
        start = time.perf_counter()
        for i in items:
            yield i
            logger.info("%s: layer %d/%d done (%.0f s)", desc, i + 1, total, time.perf_counter() - start)
        return
    yield from tqdm(items, total=total, desc=desc, unit="layer")


def quantize_layer(w: dict[str, torch.Tensor], taps: dict[str, torch.Tensor], config: ModelConfig,
                   settings: Settings) -> tuple[dict[str, torch.Tensor], dict[str, Quantized]]:
    """The layer's (possibly rescaled) float weights and its linears quantized."""
    for tap, names in layer.GROUPS.items():
        for n in names:
            check_groups(w[f"{n}.weight"].shape[1], settings.grid, n)
    if settings.method == "awq":
        return awq_layer(w, taps, settings.grid, fold_o=config.num_attention_heads == config.num_key_value_heads)
    if settings.method == "smoothquant":
        return smoothquant_layer(w, taps, settings.grid)
    if settings.method == "rtn":
        return w, {n: rtn(w[f"{n}.weight"], settings.grid) for n in layer.LINEARS}
    out = {}
    for tap, names in layer.GROUPS.items():
        h = hessian(taps[tap])
        for n in names:
            out[n] = gptq(w[f"{n}.weight"], h, settings.grid, settings.act_order, settings.damp)
    return w, out


def quantize_weights(weights: dict[str, torch.Tensor], config: ModelConfig, samples: torch.Tensor,
                     settings: Settings) -> tuple[dict[str, torch.Tensor], dict[str, Quantized]]:
    """All of the model's float weights (norms rescaled where a method folds scales into them) and every decoder
    linear quantized, by full module name. samples [S, T] token ids."""
    layer.check_family(config)
    weights = dict(weights)
    rope = RotaryEmbedding(config, weights.get("rope_freqs"))
    positions = torch.arange(samples.shape[1])
    cos, sin = rope.tables(positions, torch.float32)
    quantized = {}
    with torch.no_grad():
        x = F.embedding(samples, weights["model.embed_tokens.weight"])
        for i in progress(range(config.num_hidden_layers), config.num_hidden_layers, f"{settings.method} layers"):
            w = layer.layer_weights(weights, i)
            taps: dict[str, torch.Tensor] = {}
            layer.forward(w, x, cos, sin, config, taps)
            w, layer_quantized = quantize_layer(w, taps, config, settings)
            del taps
            w |= {f"{n}.weight": q.dequantize() for n, q in layer_quantized.items()}
            x = layer.forward(w, x, cos, sin, config, act_quant=settings.w8a8)
            prefix = f"model.layers.{i}."
            weights |= {prefix + k: v for k, v in w.items() if k.removesuffix(".weight") not in layer_quantized}
            quantized |= {prefix + n: q for n, q in layer_quantized.items()}
    return weights, quantized
