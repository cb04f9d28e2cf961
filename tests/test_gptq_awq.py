"""GPTQ and AWQ folders' packed layouts (model/checkpoints/gptq_awq.py) against tensors packed here from known
integers, following each format's documented layout (AutoGPTQ's pack: input channels LSB first down qweight's rows,
zeros minus one in the v1 format; AutoAWQ's GEMM pack: 8 columns a word in the order 0, 2, 4, 6, 1, 3, 5, 7)."""
from __future__ import annotations

import pytest
import torch

from pagedserve.model.checkpoints import checkpoint_weights
from pagedserve.model.kernels import cpu_kernels
from pagedserve.model.quant import QuantizedWeight

N, K = 64, 256


def words(values: torch.Tensor, bits: int) -> torch.Tensor:
    """[..., 32 / bits] unsigned values -> int32 words, the first value in the lowest bits."""
    shifted = values.to(torch.int64) << (torch.arange(values.shape[-1]) * bits)
    total = shifted.sum(-1)
    return torch.where(total >= 1 << 31, total - (1 << 32), total).to(torch.int32)


def gptq_pack(q: torch.Tensor, zeros: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [K, N] and zeros [G, N] unsigned -> (qweight [K * bits / 32, N], qzeros [G, N * bits / 32]), v1 format."""
    per = 32 // bits
    qweight = words(q.view(K // per, per, N).permute(0, 2, 1), bits)
    stored = (zeros - 1) & ((1 << bits) - 1)
    qzeros = words(stored.view(zeros.shape[0], N // per, per), bits)
    return qweight, qzeros


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """[rows, N] 4-bit values -> [rows, N / 8] words, nibble i holding column 0, 2, 4, 6, 1, 3, 5, 7 [i]."""
    grouped = values.view(values.shape[0], -1, 8)[:, :, [0, 2, 4, 6, 1, 3, 5, 7]]
    return words(grouped, 4)


def as_run(w: QuantizedWeight) -> torch.Tensor:
    kernels = cpu_kernels()
    if kernels is None:
        return w.dequantize()
    return kernels.quant_dequantize(w.qweight, w.scales, w.mins, w.bits, w.group, torch.float32)


def expected(q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """w [N, K] = scale * (q - zero) of each input channel's group, in fp32."""
    g = torch.arange(K) // group
    return ((q.float() - zeros.float()[g]) * scales.float()[g]).t()


def check(weights: dict, q, zeros, scales, group, bits):
    w = weights["layer.weight"]
    assert isinstance(w, QuantizedWeight) and (w.bits, w.group) == (bits, group)
    want = expected(q, zeros, scales, group)
    got = as_run(w)
    if bits == 8 or bool((zeros == 8).all()):  # symmetric: the same single rounding
        assert torch.equal(got, want)
    else:  # the fma of scale * q and the rounded min: within an ulp of each weight's largest term
        assert torch.allclose(got, want, rtol=0, atol=4e-7 * float(scales.abs().max()) * 16)
    assert weights["norm.weight"].dtype == torch.float32


@pytest.mark.parametrize(("bits", "group", "sym"), [(4, 128, True), (4, 32, False), (4, 64, True), (8, 128, True),
                                                    (4, -1, False), (8, -1, True)])
def test_gptq_unpacks_exactly(bits, group, sym):
    torch.manual_seed(bits + group)
    size = K if group == -1 else group
    q = torch.randint(0, 1 << bits, (K, N))
    zeros = (torch.full((K // size, N), 1 << (bits - 1)) if sym else torch.randint(0, 1 << bits, (K // size, N)))
    scales = (torch.rand(K // size, N) * 0.02 + 0.001).half()
    qweight, qzeros = gptq_pack(q, zeros, bits)
    tensors = {"layer.qweight": qweight, "layer.qzeros": qzeros, "layer.scales": scales,
               "layer.g_idx": (torch.arange(K) // size).int(), "norm.weight": torch.ones(K, dtype=torch.float16)}
    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": False}
    weights, scheme = checkpoint_weights(tensors, config)
    assert scheme.startswith(f"gptq int{bits}")
    check(weights, q, zeros, scales, size, bits)


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_activation_order_runs_the_checkpoints_matrix(bits):
    """desc_act: g_idx scatters each group's channels over K (GPTQ quantized them by decreasing Hessian diagonal).
    Loaded once into contiguous groups, the weight reads the input in that order: every kernel path (the integer
    kernel for a few rows, the dequantizing GEMM for many) gives x @ W^T of the checkpoint's W; q, k and v, which
    share their input and so their order, still fuse into one call."""
    from pagedserve.model.layers import fuse
    from pagedserve.model.quant_linear import QuantLinear

    torch.manual_seed(bits)
    group = 64
    g_idx = (torch.argsort(torch.rand(K)) // group).int()
    q = torch.randint(0, 1 << bits, (K, N))
    zeros = torch.full((K // group, N), 1 << (bits - 1))
    scales = (torch.rand(K // group, N) * 0.02 + 0.001).half()
    qweight, qzeros = gptq_pack(q, zeros, bits)
    tensors = {f"{p}.{part}": t for p in ("q", "k") for part, t in
               (("qweight", qweight), ("qzeros", qzeros), ("scales", scales), ("g_idx", g_idx))}
    weights, _ = checkpoint_weights(tensors, {"quant_method": "gptq", "bits": bits, "group_size": group,
                                              "sym": True, "desc_act": True})
    g = g_idx.long()
    want = ((q.float() - zeros.float()[g]) * scales.float()[g]).t()
    assert weights["q.weight"].input_perm is not None and torch.equal(weights["q.weight"].dequantize(), want)
    fuse(weights, "qk.weight", ["q.weight", "k.weight"])
    fused = weights["qk.weight"]
    assert isinstance(fused, QuantizedWeight) and fused.input_perm is not None
    for rows in (2, 64):  # int8 weights' integer kernel rounds the activations to int16: 1e-3 of the largest output
        x = torch.randn(rows, K)
        got, ref = QuantLinear(fused)(x), x @ torch.cat([want, want]).t()
        assert (got - ref).abs().max() <= 1e-3 * ref.abs().max(), (rows, (got - ref).abs().max())


def test_gptq_activation_order_with_uneven_groups_is_refused_by_name():
    q, zeros = torch.randint(0, 16, (K, N)), torch.full((2, N), 8)
    qweight, qzeros = gptq_pack(q, zeros, 4)
    tensors = {"layer.qweight": qweight, "layer.qzeros": qzeros, "layer.scales": torch.ones(2, N).half(),
               "layer.g_idx": (torch.arange(K) % 3 == 0).int()}
    with pytest.raises(ValueError, match="activation order whose groups are not all 128"):
        checkpoint_weights(tensors, {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True})


@pytest.mark.parametrize("group", [32, 128])
def test_awq_gemm_unpacks_exactly(group):
    torch.manual_seed(group)
    q = torch.randint(0, 16, (K, N))
    zeros = torch.randint(0, 16, (K // group, N))
    scales = (torch.rand(K // group, N) * 0.02 + 0.001).half()
    tensors = {"layer.qweight": awq_pack(q), "layer.qzeros": awq_pack(zeros), "layer.scales": scales,
               "norm.weight": torch.ones(K)}
    weights, _ = checkpoint_weights(tensors, {"quant_method": "awq", "bits": 4, "group_size": group,
                                              "zero_point": True, "version": "gemm"})
    check(weights, q, zeros, scales, group, 4)
    with pytest.raises(ValueError, match="AWQ gemv"):
        checkpoint_weights(tensors, {"quant_method": "awq", "bits": 4, "group_size": group, "version": "gemv"})
