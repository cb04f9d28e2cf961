"""GPTQ (Frantar et al. 2022): each column rounded in turn, its error fed back into the columns not yet rounded
through the inverse Hessian's Cholesky factor, H = 2 X^T X / n from the calibration inputs.

Activation order (--act-order) takes the columns by decreasing diag(H) but keeps each column's scale from its
original group, computed before the pass (llm-compressor's `actorder: static`): the written weights are in
their original order with plain groups, so no g_idx is needed (our loader refuses one)."""
from __future__ import annotations

import torch

from pagedserve.quantize.rtn import Grid, Quantized, qparams, rtn, to_grid

BLOCK = 128  # columns per lazy batch update


def hessian(x: torch.Tensor) -> torch.Tensor:
    """2 X^T X / n over every token of x [..., K] (fp32, as llm-compressor; the factorisation is in fp64)."""
    x = x.reshape(-1, x.shape[-1]).float()
    return (2.0 / x.shape[0]) * (x.T @ x)


def inverse_cholesky(h: torch.Tensor, damp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1; the dampening grows tenfold until it factors."""
    eye = torch.eye(h.shape[0], dtype=h.dtype)
    mean = h.diagonal().mean()
    for _ in range(6):
        factor, info = torch.linalg.cholesky_ex(h + damp * mean * eye)
        if not info:
            inv = torch.cholesky_inverse(factor)
            upper, info = torch.linalg.cholesky_ex(inv, upper=True)
            if not info:
                return upper
        damp *= 10
    raise ValueError("GPTQ: the Hessian stays singular however much it is dampened (calibration inputs all zero?)")


def gptq(w: torch.Tensor, h: torch.Tensor, grid: Grid, act_order: bool = False, damp: float = 0.01) -> Quantized:
    """w [N, K] fp32 quantized on grid with H [K, K] (hessian())."""
    n, k = w.shape
    size = k if grid.group is None else grid.group
    w = w.float().clone()
    h = h.double().clone()
    dead = h.diagonal() == 0  # inputs that are always zero: their weights do not matter
    h[dead, dead] = 1
    w[:, dead] = 0
    groups = k // size
    scale = torch.zeros(n, groups)
    zero = None if grid.symmetric else torch.zeros(n, groups)
    if act_order:  # static groups: every scale from the weights before any error feedback
        static = rtn(w, grid)
        scale.copy_(static.scale)
        if zero is not None:
            zero.copy_(static.zero)
        perm = torch.argsort(h.diagonal(), descending=True)
    else:
        perm = torch.arange(k)
    w, h = w[:, perm], h[perm][:, perm]
    hinv = inverse_cholesky(h, damp).float()
    q = torch.zeros(n, k)
    block = max(size, BLOCK // size * size) if size < k else BLOCK
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        w1, hinv1 = w[:, i1:i2].clone(), hinv[i1:i2, i1:i2]
        err1 = torch.zeros_like(w1)
        for i in range(i2 - i1):
            col = int(perm[i1 + i])
            g = col // size
            if not act_order and col % size == 0:  # a group's scale from its columns as updated so far
                end = col + size
                cols = torch.cat([w1[:, i:min(end, i2) - i1], w[:, i2:end]], dim=1) if end > i2 else w1[:, i:i + size]
                s, z = qparams(cols, grid)
                scale[:, g] = s
                if zero is not None:
                    zero[:, g] = z
            z = None if zero is None else zero[:, g]
            qc = to_grid(w1[:, i:i + 1], scale[:, g], z, grid)[:, 0]
            deq = (qc - (0 if z is None else z)) * scale[:, g]
            q[:, i1 + i] = qc
            err = (w1[:, i] - deq) / hinv1[i, i]
            w1[:, i:] -= err.unsqueeze(1) * hinv1[i, i:].unsqueeze(0)
            err1[:, i] = err
        w[:, i2:] -= err1 @ hinv[i1:i2, i2:]
    q = q[:, torch.argsort(perm)]
    return Quantized(q.to(torch.int8), scale.float(), None if zero is None else zero.to(torch.int8), grid)
