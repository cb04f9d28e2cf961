"""SmoothQuant (Xiao et al. 2022) for W8A8: per input channel s = max|x|^alpha / max|w|^(1 - alpha) moves the
activations' outlier channels into the weights (x / s, w * s), folded into the RMSNorm before q/k/v and
gate/up, so that dynamic per-token int8 activations lose less; weights then int8 per output channel."""
from __future__ import annotations

import torch

from pagedserve.quantize.layer import GROUPS, LINEARS
from pagedserve.quantize.rtn import Grid, Quantized, rtn

ALPHA = 0.5
SMOOTHED = {"qkv": "input_layernorm.weight", "gate_up": "post_attention_layernorm.weight"}


def smoothing(x: torch.Tensor, weights: list[torch.Tensor], alpha: float = ALPHA) -> torch.Tensor:
    act = x.reshape(-1, x.shape[-1]).abs().amax(0)
    wmax = torch.cat(weights).abs().amax(0)
    s = act.pow(alpha) / wmax.pow(1 - alpha)
    return torch.where((act > 0) & (wmax > 0), s, torch.ones_like(s)).clamp(min=1e-5)


def smoothquant_layer(w: dict[str, torch.Tensor], taps: dict[str, torch.Tensor], grid: Grid
                      ) -> tuple[dict[str, torch.Tensor], dict[str, Quantized]]:
    w = dict(w)
    for tap, norm in SMOOTHED.items():
        names = GROUPS[tap]
        s = smoothing(taps[tap], [w[f"{n}.weight"] for n in names])
        for n in names:
            w[f"{n}.weight"] = w[f"{n}.weight"] * s
        w[norm] = w[norm] / s
    return w, {n: rtn(w[f"{n}.weight"], grid) for n in LINEARS}
