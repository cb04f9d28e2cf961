"""Quantized weights: GGUF blocks converted without loss, int8/int4 quantization bounds, and every kernel path
against references (the integer arithmetic re-done in PyTorch, and dequantize-then-matmul in fp32)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from pagedserve.model.kernels import cpu_kernels
from pagedserve.model.quant import QuantizedWeight, from_gguf, quantize, turn
from pagedserve.model.quant_linear import PATHS, few_rows_limit, int8_mm_ready, quant_matmul, w8a8_available
from pagedserve.model.token_quant import int8_linear

gguf = pytest.importorskip("gguf")

KERNEL_PATHS = ["torch"] + ([name for name, code in PATHS.items() if code in cpu_kernels().quant_paths()]
                            if cpu_kernels() is not None else [])
HAS_AMX = cpu_kernels() is not None and cpu_kernels().quant_amx_available()
HAS_W8A8 = w8a8_available()


# K-quants have no quantizer in the gguf package: their blocks are random bytes with finite fp16 scales
# where the format keeps them (byte offsets in the super-block).
K_QUANT_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def gguf_weight(type_name: str, n: int, k: int, seed: int = 0) -> tuple[QuantizedWeight, np.ndarray]:
    """Random weights in a GGUF type: our planar copy and the gguf package's own dequantization."""
    rng = np.random.default_rng(seed)
    qtype = gguf.GGMLQuantizationType[type_name]
    if type_name in K_QUANT_SCALES:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (n, k // block_size, type_size), dtype=np.uint8)
        for offset in K_QUANT_SCALES[type_name]:
            raw[..., offset:offset + 2] = (rng.random((n, k // block_size, 1)) * 0.02).astype(np.float16).view(np.uint8)
        raw = raw.reshape(n, -1)
    else:
        raw = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    return from_gguf(raw, type_name, (n, k)), gguf.quants.dequantize(raw, qtype)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize(("n", "k"), [(1, 256), (7, 512), (33, 768)])
def test_gguf_blocks_convert_without_loss(type_name, n, k):
    ours, theirs = gguf_weight(type_name, n, k)
    assert ours.shape == (n, k)
    assert torch.equal(ours.dequantize(), torch.from_numpy(theirs.astype(np.float32)))


def test_q5_0_every_bit_pattern_converts_without_loss():
    """Random bytes (every high-bit and nibble pattern; the quantizer's outputs cover fewer) with finite scales."""
    rng = np.random.default_rng(5)
    raw = rng.integers(0, 256, (6, 512 // 32, 22), dtype=np.uint8)
    raw[..., 0:2] = (rng.standard_normal((6, 512 // 32, 1)) * 0.05).astype(np.float16).view(np.uint8)
    raw = raw.reshape(6, -1)
    ours = from_gguf(raw, "Q5_0", (6, 512))
    assert ours.bits == 8 and ours.scales.dtype == torch.float16 and ours.levels().abs().max() == 16
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_0)
    assert torch.equal(ours.dequantize(), torch.from_numpy(theirs.astype(np.float32)))


def test_q5_1_every_bit_pattern_converts_without_loss():
    """Random bytes (every high-bit and nibble pattern) with finite scales and mins: 8-bit levels 0..31 with mins."""
    rng = np.random.default_rng(6)
    raw = rng.integers(0, 256, (6, 512 // 32, 24), dtype=np.uint8)
    raw[..., 0:4] = (rng.standard_normal((6, 512 // 32, 2)) * 0.05).astype(np.float16).view(np.uint8)
    raw = raw.reshape(6, -1)
    ours = from_gguf(raw, "Q5_1", (6, 512))
    assert ours.bits == 8 and ours.mins.dtype == torch.float16 and ours.levels().max() == 31
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q5_1)
    assert torch.equal(ours.dequantize(), torch.from_numpy(theirs.astype(np.float32)))


def test_gguf_scales_stay_fp16_and_fuse_with_fp32_ones():
    q4_1, _ = gguf_weight("Q4_1", 8, 256)
    q4_k, _ = gguf_weight("Q4_K", 8, 256)
    assert q4_1.scales.dtype == q4_1.mins.dtype == torch.float16  # as stored: 20 bytes a block, not 24
    assert q4_1.nbytes == 8 * 256 // 32 * 20
    assert q4_k.scales.dtype == torch.float32  # products of two scales: exact only in fp32
    fused = QuantizedWeight.cat([q4_1, q4_k])
    assert fused.scales.dtype == fused.mins.dtype == torch.float32
    assert torch.equal(fused.dequantize(), torch.cat([q4_1.dequantize(), q4_k.dequantize()]))


def test_unsupported_or_truncated_gguf_tensors_are_named():
    with pytest.raises(ValueError, match="Q2_K does not run as stored"):
        from_gguf(np.zeros((4, 84), np.uint8), "Q2_K", (4, 256))
    with pytest.raises(ValueError, match="Q6_K tensor of shape"):
        from_gguf(np.zeros((4, 209), np.uint8), "Q6_K", (4, 256))
    with pytest.raises(ValueError, match="Q4_1 tensor of shape"):
        from_gguf(np.zeros((4, 19), np.uint8), "Q4_1", (4, 32))


@pytest.mark.parametrize(("mode", "group"), [("int8", 32), ("int4", 32), ("int4", 128)])
def test_quantization_error_is_within_half_a_step(mode, group):
    w = torch.randn(40, 256) * torch.linspace(0.1, 3, 40).unsqueeze(1)  # rows of different ranges
    q = quantize(w, mode, group)
    step = q.scales.repeat_interleave(q.group, dim=1)
    assert ((q.dequantize() - w).abs() <= step / 2 + 1e-6).all()
    assert q.nbytes < w.numel() * (1.1 if mode == "int8" else 0.8)


def test_quantize_refuses_shapes_it_cannot_hold():
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize(torch.randn(4, 40), "int8")
    with pytest.raises(ValueError, match="group 128"):
        quantize(torch.randn(4, 96), "int4", 128)
    with pytest.raises(ValueError, match="Hadamard basis of 64"):
        quantize(torch.randn(4, 96), "int8", hadamard=64)


def test_turn_is_its_own_inverse_and_keeps_dot_products():
    x, w = torch.randn(5, 192), torch.randn(7, 192)
    torch.testing.assert_close(turn(turn(x, 64), 64), x, atol=1e-5, rtol=0)
    torch.testing.assert_close(turn(x, 64) @ turn(w, 64).T, x @ w.T, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_turned_int8_weights_meet_turned_activations_on_every_path(path, dtype):
    """int8 weights in the Hadamard basis (W8A8's) give x.W^T on every path: where W8A8 does not run, x is
    turned before the float or integer kernels meet the turned weights."""
    torch.manual_seed(0)
    w, x = torch.randn(40, 256), torch.randn(9, 256)
    q = quantize(w, "int8", hadamard=64)
    assert q.hadamard == 64 and q.rows(torch.tensor([3, 1])).hadamard == 64
    assert QuantizedWeight.cat([q, q]).hadamard == 64
    with pytest.raises(ValueError, match="different formats"):
        QuantizedWeight.cat([q, quantize(w, "int8")])
    y = quant_matmul(x.to(dtype), q, path).float()
    exact = x @ w.T
    assert (y - exact).norm() / exact.norm() < 2e-2  # int8 weights (and activations where W8A8 runs)


def integer_reference(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """The kernels' arithmetic in float64: activations quantized per 32 to int16 (round half to even), integer
    dot products per 16 (the finest weight group), scaled by both scales, plus min times the activation sum."""
    m, k = x.shape
    blocks32 = x.float().view(m, k // 32, 32)
    sx32 = blocks32.abs().amax(dim=-1) / 32767  # in float32, as the kernels compute it: x * (1 / scale)
    xq = torch.round(blocks32 * torch.where(sx32 > 0, 1 / sx32, 0).unsqueeze(-1)).double()
    n = w.shape[0]
    dots = torch.einsum("mbi,nbi->mnb", xq.view(m, k // 16, 16), w.levels().double().view(n, k // 16, 16))
    sx = sx32.double().repeat_interleave(2, 1)
    sw = w.scales.double().repeat_interleave(w.group // 16, 1)
    y = (dots * sx.unsqueeze(1) * sw.unsqueeze(0)).sum(-1)
    if w.mins is not None:
        mw = w.mins.double().repeat_interleave(w.group // 32, 1)
        y = y + (blocks32.double().sum(-1).unsqueeze(1) * mw.unsqueeze(0)).sum(-1)
    return y


WEIGHTS = {
    "Q4_0": lambda n, k: gguf_weight("Q4_0", n, k)[0],
    "Q4_1": lambda n, k: gguf_weight("Q4_1", n, k)[0],
    "Q5_0": lambda n, k: gguf_weight("Q5_0", n, k)[0],
    "Q5_1": lambda n, k: gguf_weight("Q5_1", n, k)[0],
    "Q5_K": lambda n, k: gguf_weight("Q5_K", n, k)[0],
    "Q8_0": lambda n, k: gguf_weight("Q8_0", n, k)[0],
    "Q4_K": lambda n, k: gguf_weight("Q4_K", n, k)[0],
    "Q6_K": lambda n, k: gguf_weight("Q6_K", n, k)[0],
    "int8": lambda n, k: quantize(torch.randn(n, k), "int8"),
    "int4-g32": lambda n, k: quantize(torch.randn(n, k), "int4", 32),
    "int4-g128": lambda n, k: quantize(torch.randn(n, k), "int4", 128),
}


@pytest.mark.parametrize("path", [p for p in KERNEL_PATHS if p != "torch"])
@pytest.mark.parametrize("fmt", list(WEIGHTS))
@pytest.mark.parametrize(("m", "n", "k"), [(1, 7, 256), (7, 33, 512), (64, 300, 768), (300, 5, 256), (3, 9, 288)])
def test_integer_kernels_match_their_arithmetic(path, fmt, m, n, k):
    if (k % 128 and fmt == "int4-g128") or (k % 256 and fmt in K_QUANT_SCALES):
        pytest.skip("K is not a multiple of the format's block")
    torch.manual_seed(m * n + k)
    w = WEIGHTS[fmt](n, k)
    x = torch.randn(m, k)
    x[0, :32] = 0  # an all-zero block has scale 0
    y = quant_matmul(x, w, path, dequant_min_rows=1 << 30)
    ref = integer_reference(x, w)
    assert y.dtype == torch.float32 and y.shape == (m, n)
    # A value on a rounding boundary may land one step apart (the compiler may turn x / 127 into a multiply):
    # allow two such steps of the largest activation scale times the largest weight, a tiny fraction of |y|.
    step = x.abs().max().item() / 32767 * w.dequantize().abs().max().item()
    torch.testing.assert_close(y.double(), ref, rtol=1e-4, atol=2 * step + 1e-4)
    exact = x @ w.dequantize().T  # and within activation-quantization error of the exact product
    assert (y - exact).norm() / exact.norm() < 1e-3


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("fmt", ["Q4_1", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "int4-g128"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantized_path_is_the_float_product(path, fmt, dtype):
    w = WEIGHTS[fmt](45, 256)
    x = torch.randn(70, 256).to(dtype)
    y = quant_matmul(x, w, path, dequant_min_rows=1)
    ref = x.float() @ w.dequantize().T
    assert y.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())
    else:  # weights rounded to bf16 (8 bits of mantissa) before the GEMM
        assert (y.float() - ref).norm() / ref.norm() < 1e-2


@pytest.mark.parametrize("path", [p for p in KERNEL_PATHS if p != "torch"])
def test_bf16_activations_on_the_integer_path(path):
    w = WEIGHTS["Q4_1"](64, 256)
    x = torch.randn(3, 256).to(torch.bfloat16)
    y = quant_matmul(x, w, path, dequant_min_rows=1 << 30)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), integer_reference(x.float(), w), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [2, 70])  # the integer kernel adds it as it stores; the dequantized path after
def test_residual_is_added(path, dtype, m):
    w = WEIGHTS["Q4_1"](40, 288)
    x, residual = torch.randn(m, 288).to(dtype), torch.randn(m, 40).to(dtype)
    y = quant_matmul(x, w, path, residual=residual)
    assert y.dtype == dtype
    expected = quant_matmul(x, w, path).float() + residual.float()
    torch.testing.assert_close(y.float(), expected, rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=0.05 if dtype == torch.bfloat16 else 1e-4)


GEMM_PATHS = ["dequant"] + (["amx"] if cpu_kernels() is not None and cpu_kernels().quant_amx_available() else [])


@pytest.fixture(params=GEMM_PATHS)
def gemm(request, monkeypatch):
    """The large-M path forced for one test."""
    from pagedserve.model import quant_linear

    monkeypatch.setenv("PAGEDSERVE_QUANT_GEMM", request.param)
    quant_linear.gemm_path.cache_clear()
    yield request.param
    quant_linear.gemm_path.cache_clear()


@pytest.mark.parametrize("fmt", list(WEIGHTS))
@pytest.mark.parametrize(("m", "n", "k"), [(8, 7, 256), (33, 45, 512), (300, 70, 768), (64, 33, 288), (130, 300, 512)])
def test_large_m_paths_are_the_bf16_product(gemm, fmt, m, n, k):
    """bf16 activations from DEQUANT_MIN_ROWS rows: N and M off the tiles' multiples, every format."""
    if (k % 128 and fmt == "int4-g128") or (k % 256 and fmt in K_QUANT_SCALES):
        pytest.skip("K is not a multiple of the format's block")
    torch.manual_seed(m + n + k)
    w = WEIGHTS[fmt](n, k)
    x, residual = torch.randn(m, k).bfloat16(), torch.randn(m, n).bfloat16()
    y = quant_matmul(x, w, KERNEL_PATHS[-1], dequant_min_rows=8, residual=residual)  # "torch": no C++ here
    ref = x.float() @ w.dequantize().bfloat16().float().T + residual.float()  # weights rounded to bf16, as both do
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert (y.float() - ref).norm() / ref.norm() < 4e-3  # the bf16 rounding of the output


def w8a8_reference(x: torch.Tensor, w: QuantizedWeight, residual: torch.Tensor | None) -> torch.Tensor:
    """W8A8's arithmetic in float64: each token turned (in fp32), quantized to int8 with amax / 127 (round half
    to even), integer dot products with the int8 weights, scaled by the token's and the channel's scale."""
    xt = turn(x.float(), w.hadamard) if w.hadamard else x.float()
    sx = xt.abs().amax(dim=1, keepdim=True) / 127
    xq = torch.round(xt * torch.where(sx > 0, 1 / sx, 0)).clamp(-127, 127)
    y = (xq.double() @ w.qweight.double().T) * sx.double() * w.scales.double().T
    return y if residual is None else y + residual.double()


@pytest.mark.skipif(not HAS_W8A8, reason="no AMX int8 tiles here")
@pytest.mark.parametrize(("m", "n", "k"), [(1, 7, 64), (7, 33, 128), (64, 300, 576), (300, 45, 1536), (33, 96, 640)])
@pytest.mark.parametrize("hadamard", [64, 0])
@pytest.mark.parametrize("with_residual", [True, False])
def test_w8a8_kernel_matches_its_arithmetic(m, n, k, hadamard, with_residual):
    """M = 1, 7, 64, 300 and N off the 32-row panels; a zero token; with and without the turn and a residual."""
    torch.manual_seed(m + n + k)
    w = quantize(torch.randn(n, k), "int8", hadamard=hadamard)
    x = torch.randn(m, k).bfloat16()
    x[:, 5] *= 30  # an outlier channel, as real activations have
    x[m // 2] = 0
    residual = torch.randn(m, n).bfloat16() if with_residual else None
    y = cpu_kernels().quant_linear_w8a8(x, w.qweight, w.scales, hadamard, residual)
    ref = w8a8_reference(x, w, residual)
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    # the output's bf16 rounding, and a token value on a rounding boundary landing one step apart
    step = (x.float().abs().amax() / 127 * w.dequantize().abs().amax()).item()
    assert ((y.double() - ref).abs() <= ref.abs() / 128 + 2 * step).all()


def checkpoint_w8a8_reference(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """A compressed-tensors W8A8 linear in float64: tokens quantized with amax / 127.5 to [-128, 127] (round half
    to even), integer dot products, scaled by the token's and the channel's scale."""
    sx = x.float().abs().amax(dim=1, keepdim=True) / 127.5
    xq = torch.round(x.float() / torch.where(sx > 0, sx, 1)).clamp(-128, 127)
    return (xq.double() @ w.qweight.double().T) * sx.double() * w.scales.double().T


@pytest.mark.parametrize(("m", "n", "k"), [(1, 7, 64), (7, 33, 128), (64, 300, 576), (300, 45, 1536)])
def test_checkpoint_w8a8_runs_as_an_integer_gemm(m, n, k):
    """A checkpoint's per-channel W8A8 weight off the AMX tiles runs as one int8 GEMM (torch._int_mm) from
    few_rows_limit rows on: exact integer sums, so within the bf16 rounding of the output of the float64
    arithmetic; a zero token stays zero."""
    torch.manual_seed(m + n + k)
    w = replace(quantize(torch.randn(n, k), "int8"), per_token_int8=True)
    assert int8_mm_ready(w)
    x = torch.randn(m, k).bfloat16()
    x[:, 5] *= 30
    x = torch.cat([x, torch.zeros(1, k, dtype=x.dtype)])  # and a zero token
    ref = checkpoint_w8a8_reference(x, w)
    y = int8_linear(x, w.qweight, w.scales)
    assert y.dtype == torch.bfloat16 and y.shape == (m + 1, n)
    assert ((y.double() - ref).abs() <= ref.abs() / 256 + 1e-6).all()
    assert (y[-1] == 0).all()
    residual = torch.randn(m + 1, n).bfloat16()
    if not HAS_W8A8 and m + 1 >= few_rows_limit(x.dtype):  # else the AMX kernel takes it (its own rounding: the
        for path in ("avx2", "avx512"):                       # test above), or few rows the integer kernel
            if PATHS[path] in cpu_kernels().quant_paths():
                assert torch.equal(quant_matmul(x, w, path), y)
                assert torch.equal(quant_matmul(x, w, path, residual=residual), residual + y)
    fake = quant_matmul(x, w, "torch").double()  # the float reference: x fake-quantized into bf16, then a GEMM
    assert (fake - ref).norm() / ref.norm() < 4e-3


@pytest.mark.skipif(not HAS_W8A8, reason="no AMX int8 tiles here")
def test_w8a8_turn_keeps_outlier_channels_from_drowning_a_token():
    """Why W8A8 turns tokens: one channel 50x the rest sets the token's int8 step; spread over 64 channels by the
    Hadamard transform it costs the product far less (the default model: +3% perplexity without, +0.35% with)."""
    torch.manual_seed(1)
    w, x = torch.randn(256, 576), torch.randn(64, 576)
    x[:, 7] *= 50
    exact = x @ w.T
    xb = x.bfloat16()

    def error(hadamard: int) -> float:
        q = quantize(w, "int8", hadamard=hadamard)
        y = cpu_kernels().quant_linear_w8a8(xb, q.qweight, q.scales, hadamard, None).float()
        return ((y - exact).norm() / exact.norm()).item()

    assert error(64) * 3 < error(0)


def test_kernel_path_can_be_forced_and_refuses_what_is_missing(monkeypatch):
    from pagedserve.model import quant_linear

    for name in KERNEL_PATHS:
        quant_linear.kernel_path.cache_clear()
        monkeypatch.setenv("PAGEDSERVE_QUANT_KERNEL", name)
        assert quant_linear.kernel_path() == name
    quant_linear.kernel_path.cache_clear()
    monkeypatch.setenv("PAGEDSERVE_QUANT_KERNEL", "avx1024")
    with pytest.raises(RuntimeError, match="avx1024"):
        quant_linear.kernel_path()
    quant_linear.kernel_path.cache_clear()


# --- the engine and the server in each mode ---------------------------------------------------------------

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three laws of robotics are"]


@pytest.fixture(scope="module")
def fp32_reference() -> list[list[int]]:
    from pagedserve import LLM, SamplingParams

    llm = LLM(dtype="float32", kv_cache_memory="64MiB")
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    return [o.outputs[0].token_ids for o in outs]


def matching_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# gguf runs the reference's own weights (only the arithmetic differs): whole answers agree. int8 / int4 are
# re-quantized from them: greedy paths may part after a few tokens, so the bound is a prefix.
@pytest.mark.parametrize(("mode", "bound"), [("gguf", 24), ("int8", 4), ("int4", 4)])
def test_engine_greedy_agrees_with_fp32_per_mode(fp32_reference, mode, bound):
    from pagedserve import LLM, SamplingParams

    llm = LLM(dtype="float32", quantization=mode, kv_cache_memory="64MiB")
    assert llm.engine.weights_info["quantization"] == mode
    assert llm.engine.weight_bytes < (150e6 if mode == "gguf" else 300e6)  # fp32 is 538 MB
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    prefixes = [matching_prefix(o.outputs[0].token_ids, ref) for o, ref in zip(outs, fp32_reference)]
    assert sorted(prefixes)[1] >= bound, prefixes  # all but one prompt agree at least this far


@pytest.mark.skipif(not HAS_W8A8, reason="no AMX int8 tiles here")
def test_int8_runs_w8a8_in_bf16_and_w8a16_when_told(monkeypatch):
    from pagedserve import LLM, SamplingParams
    from pagedserve.model import quant_linear

    bf16 = LLM(dtype="bfloat16", quantization="none", kv_cache_memory="64MiB")
    reference = [o.outputs[0].token_ids for o in bf16.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))]
    llm = LLM(dtype="bfloat16", quantization="int8", kv_cache_memory="64MiB")
    assert llm.engine.weights_info["quant_kernel"] == "w8a8-amx"
    model = llm.engine.runner.model
    assert model.lm_head.qweight.hadamard == 64 and model.layers[0].mlp.down_proj.qweight.hadamard == 64
    ids = torch.tensor([0, 17, 4000])
    plain = quantize(bf16.engine.runner.model.embed_tokens.weight.float(), "int8").rows(ids).dequantize()
    looked_up = model.embed_tokens(ids).float()  # the tied table is turned back on lookup
    assert (looked_up - plain).abs().max() <= 2 * plain.abs().max() / 127
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12))
    prefixes = [matching_prefix(o.outputs[0].token_ids, ref) for o, ref in zip(outs, reference)]
    assert sorted(prefixes)[1] >= 4, prefixes
    monkeypatch.setenv("PAGEDSERVE_QUANT_W8A8", "0")
    quant_linear.w8a8_available.cache_clear()
    try:
        w8a16 = LLM(dtype="bfloat16", quantization="int8", kv_cache_memory="64MiB")
        assert w8a16.engine.weights_info["quant_kernel"] != "w8a8-amx"
        assert w8a16.engine.runner.model.lm_head.qweight.hadamard == 0
    finally:
        quant_linear.w8a8_available.cache_clear()


def test_auto_quantization_runs_a_gguf_as_stored_only_where_it_pays():
    from pagedserve.model.quant_linear import resolve_quantization

    assert resolve_quantization("int4", True, torch.bfloat16) == "int4"  # an explicit choice stands
    assert resolve_quantization("auto", True, torch.float32) == "none"
    assert resolve_quantization("auto", False, torch.bfloat16) == "none"  # a Hugging Face folder
    assert resolve_quantization("auto", True, torch.bfloat16) == ("gguf" if HAS_AMX else "none")


def test_gguf_mode_needs_a_gguf_and_names_modes():
    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="unknown quantization 'fp4'"):
        LLMEngine(EngineConfig(quantization="fp4"))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["gguf", "int4"])
def test_server_answers_in_each_mode(mode):
    import httpx
    import openai

    from tests.server_support import ServerProcess

    server = ServerProcess(["--quantization", mode, "--kv-cache-memory", "64MiB", "--embedding-model", "none"])
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
        card = client.models.list().data[0]
        assert card.model_extra["quantization"] == mode
        answer = client.chat.completions.create(model=card.id, messages=[{"role": "user", "content": "Say hi"}],
                                                max_tokens=8, temperature=0)
        assert answer.choices[0].message.content and answer.usage.completion_tokens > 0
        metrics = httpx.get(f"{server.url}/metrics").text
        assert f'quantization="{mode}"' in metrics
        assert "pagedserve_model_weight_bytes" in metrics
    finally:
        server.stop()
