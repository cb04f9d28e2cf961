"""Gemma 3's C++ kernels against their PyTorch references: head_dim 256 and sliding windows in the decode and prefill
attention kernels (every prefill path this CPU can force, every KV format), the (1 + w) norms, QK-norm and GeGLU; then
the real 270M GGUF in bf16: the kernel path against plain PyTorch ops, and the decode stack against the Python layers,
bit for bit."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.model.sliding_window import window_attention, window_metadata
from tests.stack_support import Counted
from tests.test_fused_ops import (
    BF16,
    KV_FORMATS,
    PREFILL_PATHS,
    close,
    filled_cache,
    kernels,  # noqa: F401  (the fixture)
    prefill_path,
)


@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 7])
def test_gemma_rms_norm(kernels, rows: int, residual: bool) -> None:  # noqa: F811
    from pagedserve.model.models.gemma3 import GemmaRMSNorm

    norm = GemmaRMSNorm(640, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(640) * 0.5)
    x = (torch.randn(rows, 2 * 640) * 3).to(BF16)[:, :640]  # strided rows
    res = torch.randn(rows, 640).to(BF16) if residual else None
    norm.scale = 1.0 + norm.weight.detach().float()
    expected = norm(x.float(), None, None if res is None else res.float())
    got = norm(x, kernels, res)
    close(got, expected)
    if res is not None:  # the norm is rounded to bf16 before the add, as the PyTorch layer in bf16 rounds it
        assert torch.equal(got, (res.float() + norm(x, kernels).float()).to(BF16))


@pytest.mark.parametrize("rows", [1, 9])
def test_gemma_qk_norm(kernels, rows: int) -> None:  # noqa: F811
    heads, kv_heads, d = 4, 1, 256
    qkv = (torch.randn(rows, (heads + 2 * kv_heads) * d) * 4).to(BF16)
    q_scale, k_scale = 1 + torch.randn(d) * 0.3, 1 + torch.randn(d) * 0.3
    q, k, v = qkv.float().split([heads * d, kv_heads * d, kv_heads * d], dim=-1)

    def ref(x: torch.Tensor, n: int, scale: torch.Tensor) -> torch.Tensor:
        x = x.view(rows, n, d)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * scale

    kernels.gemma_qk_norm(qkv, q_scale, k_scale, heads, kv_heads, 1e-6)
    close(qkv[:, :heads * d].view(rows, heads, d), ref(q, heads, q_scale))
    close(qkv[:, heads * d:(heads + kv_heads) * d].view(rows, kv_heads, d), ref(k, kv_heads, k_scale))
    assert torch.equal(qkv[:, (heads + kv_heads) * d:].float(), v)  # values untouched


@pytest.mark.parametrize("rows", [0, 1, 5])
def test_gelu_tanh_and_mul(kernels, rows: int) -> None:  # noqa: F811
    gate_up = (torch.randn(rows, 2 * 2048) * 3).to(BF16)
    gate, up = gate_up.float().chunk(2, dim=-1)
    close(kernels.gelu_tanh_and_mul(gate_up), F.gelu(gate, approximate="tanh") * up)


def window_rows(lens: list[int], window: int, block_size: int, num_blocks: int) -> tuple[list, list[int]]:
    """window_metadata's rows for decodes at positions len - 1, their tables shuffled over the pool, with the blocks
    before each window freed (-1) as the KV cache gives them back; and their slots."""
    perm = torch.randperm(num_blocks).tolist()
    rows, used = [], 0
    for n in lens:
        table = perm[used:used + -(-n // block_size)]
        used += len(table)
        first_live = max(0, n - window) // block_size
        rows.append((n - 1, 1, [-1] * first_live + table[first_live:]))
    slots = [t[(p // block_size)] * block_size + p % block_size for p, _, t in rows]
    return rows, slots


@pytest.mark.parametrize("kv_cache_dtype", KV_FORMATS)
@pytest.mark.parametrize(("heads", "kv_heads", "d", "block_size"), [(4, 1, 256, 16), (9, 3, 64, 16), (4, 2, 64, 8)])
@pytest.mark.parametrize("window", [24, 512])
def test_windowed_decode_attention(kernels, kv_cache_dtype: str, heads: int, kv_heads: int, d: int,  # noqa: F811
                                   block_size: int, window: int) -> None:
    """The decode kernel with a window against window_attention's PyTorch path on the same metadata and stored
    cache: lengths below, at and past the window, windows that start mid-block and mid 16-token chunk."""
    if kv_cache_dtype not in ("auto", "int8") and d != 256:
        pytest.skip("every format at head_dim 256; two at 64")
    torch.manual_seed(0)
    lens = [1, 20, window, window + 1, window + 7, window + 37, 3 * window + 5]
    num_blocks = sum(-(-n // block_size) for n in lens) + 2
    cache = filled_cache(kv_cache_dtype, BF16, num_blocks * block_size, kv_heads, d)
    rows, slots = window_rows(lens, window, block_size, num_blocks)
    meta = window_metadata(rows, len(rows), slots, window, block_size)
    q = (torch.randn(len(lens), (heads + 2 * kv_heads) * d) * 3).to(BF16)[:, :heads * d].view(len(lens), heads, d)
    got = window_attention(q, cache, meta, block_size, d ** -0.5, kernels)
    expected = window_attention(q.float(), cache, meta, block_size, d ** -0.5)
    torch.testing.assert_close(got.float(), expected, rtol=1.6e-2, atol=1e-2)


def test_windowed_decode_attention_float32(kernels) -> None:  # noqa: F811
    """The fp32 row-by-row path: the window through the kernel call itself (tables from the first block)."""
    torch.manual_seed(0)
    heads, kv_heads, d, bs, window = 4, 1, 256, 16, 40
    lens = [3, 40, 41, 100]
    cache = filled_cache("auto", torch.float32, 64 * bs, kv_heads, d)
    rows, slots = window_rows(lens, window, bs, 64)
    meta = window_metadata(rows, len(rows), slots, window, bs)
    q = torch.randn(len(lens), heads, d)
    got = kernels.paged_decode_attention(q, cache.k, cache.v, None, None, meta.decode_tables, meta.decode_context_lens,
                                         bs, d ** -0.5, window=window)
    torch.testing.assert_close(got, window_attention(q, cache, meta, bs, d ** -0.5), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("path", PREFILL_PATHS)
@pytest.mark.parametrize("kv_cache_dtype", KV_FORMATS[:1] + KV_FORMATS[2:])
@pytest.mark.parametrize(("heads", "kv_heads", "d", "block_size", "window"),
                         [(4, 1, 256, 16, 40), (9, 3, 64, 16, 24), (4, 2, 64, 8, 77), (4, 1, 256, 16, 0)])
def test_windowed_prefill_attention(kernels, path: str, kv_cache_dtype: str, heads: int, kv_heads: int,  # noqa: F811
                                    d: int, block_size: int, window: int) -> None:
    """Each path of the prefill kernel with a causal window (0: none, head_dim 256) against SDPA with the windowed
    mask, through window_metadata's spans (tables from the window's first block, earlier blocks freed): fresh prompts
    shorter and longer than the window, and chunks over cached context; two decode rows first."""
    code = prefill_path(kernels, path)
    if path == "amx-emulated" and (kv_cache_dtype != "auto" or d != 256):
        pytest.skip("the emulated tiles are slow: its layouts on the plain cache")
    if kv_cache_dtype not in ("auto", "int8") and d != 256:
        pytest.skip("every format at head_dim 256")
    torch.manual_seed(0)
    w = window or 10_000
    shapes = [(17, 0), (33, 0), (130, 0), (5, 40), (33, 17), (64, 200), (40, 31)]  # (new tokens, cached)
    num_blocks = sum(-(-(n + c) // block_size) for n, c in shapes) + 8
    cache = filled_cache(kv_cache_dtype, BF16, num_blocks * block_size, kv_heads, d)
    perm, used, rows = torch.randperm(num_blocks).tolist(), 0, [(9, 1, [0, 1]), (20, 1, [2, 3])]
    for n, c in shapes:
        table = perm[used:used + -(-(n + c) // block_size)]
        used += len(table)
        first_live = max(0, c - w + 1) // block_size
        rows.append((c, n, [-1] * first_live + table[first_live:]))
    slots = [0] * sum(n for _, n, _ in rows)
    meta = window_metadata(rows, 2, slots, w, block_size)
    q = (torch.randn(len(slots), heads, d) * 3).to(BF16)
    out = torch.zeros(len(slots), heads, d, dtype=BF16)
    kernels.prefill_attention(q, cache.k, cache.v, cache.k_scale, cache.v_scale, meta.prefill_spans,
                              meta.prefill_tables, block_size, d ** -0.5, out, path=code, window=window)
    assert not out[:2].any()  # decode rows are the decode kernel's
    for s in meta.spans:
        k, v = (x.float().transpose(0, 1).unsqueeze(0) for x in cache.gather(s.block_table, block_size, BF16))
        key_pos = s.key_start + torch.arange(k.shape[2])
        q_pos = (s.first_pos + torch.arange(s.num_tokens)).unsqueeze(1)
        mask = (key_pos <= q_pos) & (key_pos > q_pos - w)
        qs = q[s.start:s.start + s.num_tokens].float().transpose(0, 1).unsqueeze(0)
        expected = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=d ** -0.5, enable_gqa=True)
        torch.testing.assert_close(out[s.start:s.start + s.num_tokens].float(), expected.squeeze(0).transpose(0, 1),
                                   rtol=2e-2, atol=2e-2)


# -- the real model: Gemma 3 270M, bf16 over the GGUF's quantized linears -------------------------------------------
PROMPTS = ["The capital of France is", "Once upon a time", "def fibonacci(n):"]
LONG = "A short history of the printing press: " + "movable type, presses and paper mills. " * 70  # > 512 tokens


@pytest.fixture(scope="module")
def gemma_bf16():
    from pagedserve import LLM

    llm = LLM("gemma-3-270m", dtype="bfloat16", quantization="gguf", kv_cache_memory="64MiB",
              enable_prefix_caching=False, max_num_batched_tokens=256)
    assert llm.engine.runner.model.kernels is not None
    assert llm.engine.runner.model.decode_stack is not None
    return llm


def answers(llm, prompts: list[str], max_tokens: int) -> list[tuple[list[int], list[dict[int, float]]]]:
    from pagedserve.sampling_params import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3))
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


@pytest.mark.slow
def test_gemma_decode_stack_equals_the_python_layers(kernels, gemma_bf16) -> None:  # noqa: F811
    """Bit for bit, at one and three sequences, one of them decoding past its 512-token window (sliding layers
    reading tables that start at the window's first block)."""
    model = gemma_bf16.engine.runner.model
    stack = model.decode_stack
    for prompts in (PROMPTS[:1], [PROMPTS[1], LONG, PROMPTS[2]]):
        model.decode_stack = Counted(stack)
        try:
            stacked = answers(gemma_bf16, prompts, 8)
            steps = model.decode_stack.steps
            model.decode_stack = None
            layers = answers(gemma_bf16, prompts, 8)
        finally:
            model.decode_stack = stack
        assert steps >= 7 and stacked == layers


@pytest.mark.slow
def test_gemma_kernel_path_matches_plain_pytorch(kernels, gemma_bf16) -> None:  # noqa: F811
    """The bf16 model on its C++ ops (windowed attention kernels in 256-token prefill chunks, the decode stack)
    against the same weights on PyTorch's ops and attention: the same greedy tokens (or a parting only at a near tie),
    and first-token log-probabilities within two bf16 ulps of the logits."""
    runner = gemma_bf16.engine.runner
    model = runner.model
    prompts = [PROMPTS[0], LONG]
    fast = answers(gemma_bf16, prompts, 6)
    saved = model.kernels, model.decode_stack
    model.kernels, model.decode_stack, runner.use_kernel = None, None, False
    try:
        plain = answers(gemma_bf16, prompts, 6)
    finally:
        (model.kernels, model.decode_stack), runner.use_kernel = saved, True
    for (tokens, logprobs), (plain_tokens, plain_logprobs) in zip(fast, plain):
        # bf16 on two op orders: greedy paths may part only where the top choices are within rounding of a tie
        # (the long prompt's first token: 108 / 255999 / 107 within 0.07 nats; thread counts move such ties).
        parted = next((i for i, (a, b) in enumerate(zip(tokens, plain_tokens)) if a != b), None)
        if parted is not None:
            ranked = plain_logprobs[parted]
            assert tokens[parted] in ranked and ranked[plain_tokens[parted]] - ranked[tokens[parted]] < 0.15, \
                (parted, tokens, plain_tokens, ranked)
        first = tokens[0] if tokens[0] in plain_logprobs[0] else plain_tokens[0]
        assert abs(logprobs[0][first] - plain_logprobs[0][first]) < 0.15
