"""AWQ (Lin et al. 2023): per-input-channel scales s = mean|x|^alpha, alpha grid-searched to minimise the output
error of the linears that share the input, folded into what produces that input (so the float model is
unchanged and only the rounding moves), then a per-group clipping search of the weights' range.

Errors are measured as ||dW M||^2 with M = X^T, or once there are more tokens than input channels the Cholesky
factor L of G = X^T X (tr(dW G dW^T) = ||dW L||^2): exact either way, at the cost of the smaller."""
from __future__ import annotations

import torch

from pagedserve.quantize.layer import GROUPS
from pagedserve.quantize.rtn import Grid, Quantized, grouped, rtn

N_GRID = 20
MAX_SHRINK = 0.5  # clipping keeps at least half of each group's range
NO_CLIP = ("self_attn.q_proj", "self_attn.k_proj")  # as AutoAWQ: their errors meet in the softmax, not per group


def metric(x: torch.Tensor) -> torch.Tensor:
    """M [K, m] with ||dW M||^2 the squared output error of dW on the tokens x [..., K]."""
    x = x.reshape(-1, x.shape[-1])
    if x.shape[0] <= x.shape[1]:
        return x.T.contiguous()
    g = x.T.double() @ x.double()
    g += 1e-6 * g.diagonal().mean() * torch.eye(g.shape[0], dtype=g.dtype)  # dead channels leave G singular
    return torch.linalg.cholesky(g).float()


def output_error(dw: torch.Tensor, m: torch.Tensor) -> float:
    return float((dw @ m).square().sum())


def search_scales(weights: list[torch.Tensor], x_mean: torch.Tensor, m: torch.Tensor, grid: Grid) -> torch.Tensor:
    """The per-channel scales [K] (alpha in 0, 1/20 .. 19/20; alpha 0 is plain round-to-nearest)."""
    best, best_s = float("inf"), torch.ones_like(x_mean)
    for i in range(N_GRID):
        s = x_mean.pow(i / N_GRID).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        err = sum(output_error(w - rtn(w * s, grid).dequantize() / s, m) for w in weights)
        if err < best:
            best, best_s = err, s
    return best_s


def search_clip(w: torch.Tensor, m: torch.Tensor, grid: Grid) -> torch.Tensor:
    """Per (row, group) range ratio in 1, 0.95 .. 0.55 with the least output error of that group's columns."""
    n, k = w.shape
    size = k if grid.group is None else grid.group
    blocks = torch.stack([m[i:i + size] @ m[i:i + size].T for i in range(0, k, size)])  # G's [groups, s, s]
    best = torch.full((n, k // size), float("inf"))
    ratio = torch.ones_like(best)
    for i in range(int(MAX_SHRINK * N_GRID)):
        r = 1 - i / N_GRID
        dw = grouped(w - rtn(w, grid, r).dequantize(), grid)
        err = torch.einsum("ngs,gst,ngt->ng", dw, blocks, dw)
        better = err < best
        best, ratio = torch.where(better, err, best), torch.where(better, r, ratio)
    return ratio


def awq_layer(w: dict[str, torch.Tensor], taps: dict[str, torch.Tensor], grid: Grid, fold_o: bool
              ) -> tuple[dict[str, torch.Tensor], dict[str, Quantized]]:
    """Layer weights with the scales folded in (norms and producing rows changed), and each linear quantized.
    fold_o: v_proj's rows feed o_proj's columns one to one (no grouped-query sharing)."""
    w = dict(w)
    producer = {"qkv": "input_layernorm.weight", "gate_up": "post_attention_layernorm.weight",
                "down": "mlp.up_proj.weight", "o": "self_attn.v_proj.weight" if fold_o else None}
    metrics = {}
    for tap, names in GROUPS.items():
        x = taps[tap]
        metrics[tap] = metric(x)
        if producer[tap] is None:
            continue
        x_mean = x.reshape(-1, x.shape[-1]).abs().mean(0)
        s = search_scales([w[f"{n}.weight"] for n in names], x_mean, metrics[tap], grid)
        for n in names:
            w[f"{n}.weight"] = w[f"{n}.weight"] * s
        prev = producer[tap]
        w[prev] = w[prev] / (s if w[prev].dim() == 1 else s.unsqueeze(1))
        bias = prev.replace(".weight", ".bias")
        if bias in w:  # Qwen2's v_proj
            w[bias] = w[bias] / s
        metrics[tap] = metrics[tap] / s.unsqueeze(1)  # the folded layer's inputs are x / s
    quantized = {}
    for tap, names in GROUPS.items():
        for n in names:
            weight = w[f"{n}.weight"]
            ratio = 1.0 if n in NO_CLIP else search_clip(weight, metrics[tap], grid)
            quantized[n] = rtn(weight, grid, ratio)
    return w, quantized
