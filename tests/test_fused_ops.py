"""The fused bf16 C++ ops against the PyTorch ops they replace (computed in fp32)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.model.kernels import cpu_kernels, kernels_expected
from pagedserve.model.layers import rotate

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def kernels():
    k = cpu_kernels()
    if k is None:
        if kernels_expected():
            pytest.fail("the C++ kernels failed to build on x86-64 with a compiler present (see the log)")
        pytest.skip("no C++ compiler here, or not x86-64")
    return k


def close(got: torch.Tensor, expected: torch.Tensor) -> None:
    assert got.dtype == BF16
    torch.testing.assert_close(got.float(), expected.float(), rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("rows", [0, 1, 7, 300])
def test_rms_norm(kernels, rows: int) -> None:
    x = torch.randn(rows, 2 * 576, dtype=BF16)[:, :576] * 3  # strided rows, as a slice would give
    w = torch.rand(576, dtype=BF16) + 0.5
    close(kernels.rms_norm(x, w, 1e-5), F.rms_norm(x.float(), (576,), w.float(), 1e-5))


@pytest.mark.parametrize("rows", [0, 1, 5, 300])
def test_silu_and_mul(kernels, rows: int) -> None:
    gate_up = torch.randn(rows, 2 * 1536, dtype=BF16) * 4
    gate, up = gate_up.float().chunk(2, dim=-1)
    close(kernels.silu_and_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("rows", [1, 9])
def test_rope_and_cache(kernels, rows: int) -> None:
    heads, kv_heads, d, slots = 9, 3, 64, 40
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, dtype=BF16)
    angles = torch.rand(rows, d // 2) * 6
    cos, sin = angles.cos(), angles.sin()
    slot_mapping = torch.randperm(slots)[:rows]
    k_cache, v_cache = torch.zeros(slots, kv_heads, d, dtype=BF16), torch.zeros(slots, kv_heads, d, dtype=BF16)
    q, k, v = qkv.float().split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q_ref, k_ref = rotate(q.view(rows, heads, d), cos, sin), rotate(k.view(rows, kv_heads, d), cos, sin)
    kernels.rope_and_cache(qkv, cos, sin, k_cache, v_cache, None, None, slot_mapping, heads, kv_heads)
    close(qkv[:, :heads * d].view(rows, heads, d), q_ref)
    close(qkv[:, heads * d:(heads + kv_heads) * d].view(rows, kv_heads, d), k_ref)
    close(k_cache[slot_mapping], k_ref)
    assert torch.equal(v_cache[slot_mapping], v.view(rows, kv_heads, d).to(BF16))
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[slot_mapping] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_rope_and_cache_turns_q_and_k_into_the_hadamard_basis_for_fp8(kernels, kv_cache_dtype: str) -> None:
    """fp8 caches keep queries and keys in the Hadamard basis: the fused write leaves q and k rotated by RoPE and
    then by the orthonormal Hadamard matrix in qkv, as the Python layers do (hadamard(rotate(...)))."""
    from pagedserve.model.kv_cache_dtype import LayerKVCache, hadamard, resolve_kv_format

    heads, kv_heads, d, rows = 9, 3, 64, 7
    fmt = resolve_kv_format(kv_cache_dtype, BF16)
    assert fmt.rotates_keys(d) and not fmt.rotates_keys(80) and not resolve_kv_format("int8", BF16).rotates_keys(d)
    cache = LayerKVCache(fmt, 16, kv_heads, d)
    cache.set_head_scales(torch.full((kv_heads,), 12.0), torch.full((kv_heads,), 12.0))
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, dtype=BF16)
    angles = torch.rand(rows, d // 2) * 6
    cos, sin = angles.cos(), angles.sin()
    q, k, _ = qkv.float().split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q_ref = hadamard(rotate(q.view(rows, heads, d), cos, sin))
    k_ref = hadamard(rotate(k.view(rows, kv_heads, d), cos, sin))
    kernels.rope_and_cache(qkv, cos, sin, cache.k, cache.v, cache.k_scale, cache.v_scale, torch.arange(rows), heads,
                           kv_heads)
    close(qkv[:, :heads * d].view(rows, heads, d), q_ref)
    close(qkv[:, heads * d:(heads + kv_heads) * d].view(rows, kv_heads, d), k_ref)


PREFILL_PATHS = ["portable", "avx512", "amx", "amx-emulated"]


def prefill_path(kernels, name: str) -> int:
    """The kernel's code for a prefill attention path; skips where this CPU or build lacks it."""
    from pagedserve.model.attention import PREFILL_PATHS as CODES

    if CODES[name] not in kernels.prefill_attention_paths():
        pytest.skip(f"prefill attention path {name} is not built for this CPU")
    return CODES[name]


@pytest.fixture
def forced_prefill_path(monkeypatch):
    """Sets PAGEDSERVE_PREFILL_ATTENTION for one test (the choice is cached per process: cleared before and after)."""
    from pagedserve.model.attention import prefill_attention_path

    def force(name: str) -> None:
        monkeypatch.setenv("PAGEDSERVE_PREFILL_ATTENTION", name)
        prefill_attention_path.cache_clear()

    yield force
    monkeypatch.delenv("PAGEDSERVE_PREFILL_ATTENTION", raising=False)
    prefill_attention_path.cache_clear()


def test_bf16_fast_path_matches_plain_pytorch(kernels) -> None:
    """The whole bf16 model on the fused ops against the same model on PyTorch's elementwise ops and SDPA."""
    from pagedserve import LLM
    from pagedserve.sampling_params import SamplingParams

    prompts = ["The three most important inventions in history are", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=3)
    fast, plain = LLM(dtype="bfloat16", kv_cache_memory="16MiB"), LLM(dtype="bfloat16", kv_cache_memory="16MiB")
    plain.engine.runner.model.kernels = None
    for a, b in zip(fast.generate(prompts, params), plain.generate(prompts, params)):
        got, expected = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        token = a.outputs[0].token_ids[0]
        assert abs(got[token].logprob - expected[token].logprob) < 0.1


@pytest.mark.parametrize("path", PREFILL_PATHS[:3])
def test_prefill_paths_in_the_model(kernels, forced_prefill_path, path: str) -> None:
    """The bf16 model with each prefill attention path against the same model with SDPA (the torch path): prompts
    of a few to 700 tokens, prefilled whole and in 64-token chunks over their cached prefix. Logits are bf16 (an ulp
    is 1/16 to 1/8 at this model's top logits), so logprobs agree within two ulps; a wrong block or mask moves them
    by far more."""
    from pagedserve import LLM
    from pagedserve.model.attention import prefill_attention_path
    from pagedserve.sampling_params import SamplingParams

    prefill_path(kernels, path)
    prompts = ["The three most important inventions in history are", "def fibonacci(n):",
               "A short history of the printing press: " + "movable type, presses and paper mills. " * 60]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    results = {}
    for name in ("torch", path):
        forced_prefill_path(name)
        assert prefill_attention_path() == name
        for budget in (2048, 64):
            llm = LLM(dtype="bfloat16", kv_cache_memory="32MiB", enable_prefix_caching=False,
                      max_num_batched_tokens=budget)
            results[name, budget] = [o.outputs[0] for o in llm.generate(prompts, params)]
    for budget in (2048, 64):
        for got, expected in zip(results[path, budget], results["torch", budget]):
            assert got.token_ids == expected.token_ids
            token = got.token_ids[0]
            assert abs(got.logprobs[0][token].logprob - expected.logprobs[0][token].logprob) < 0.15


def test_prefill_path_can_be_forced_and_refuses_what_is_missing(kernels, forced_prefill_path) -> None:
    from pagedserve.model.attention import prefill_attention_path

    forced_prefill_path("avx1024")
    with pytest.raises(RuntimeError, match="not available"):
        prefill_attention_path()
    forced_prefill_path("auto")
    assert prefill_attention_path() in ("portable", "avx512", "amx")


def filled_cache(kv_cache_dtype: str, model_dtype: torch.dtype, num_slots: int, kv_heads: int, d: int):
    """A cache in the given format holding random K/V (with a few outliers), written by the reference path."""
    from pagedserve.model.kv_cache_dtype import LayerKVCache, resolve_kv_format

    cache = LayerKVCache(resolve_kv_format(kv_cache_dtype, model_dtype), num_slots, kv_heads, d)
    k, v = torch.randn(num_slots, kv_heads, d) * 2, torch.randn(num_slots, kv_heads, d)
    k[::37, :, 3] *= 8  # outlier channels, as real keys have
    if cache.fmt.quantized and not cache.fmt.per_token_scale:
        cache.set_head_scales(k.abs().amax(dim=(0, 2)), v.abs().amax(dim=(0, 2)))
    cache.write(k.to(model_dtype), v.to(model_dtype), torch.arange(num_slots))
    return cache


KV_FORMATS = ["auto", "bfloat16", "fp8_e4m3", "fp8_e5m2", "int8"]


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("kv_cache_dtype", KV_FORMATS)
@pytest.mark.parametrize(("heads", "kv_heads", "d", "block_size"), [(9, 3, 64, 16), (8, 1, 128, 16), (4, 4, 64, 8),
                                                                   (6, 3, 64, 32), (10, 2, 64, 16)])
@pytest.mark.parametrize("lens", [[1, 15, 16, 17, 33, 1000], [300]])
def test_paged_decode_attention(kernels, dtype, kv_cache_dtype: str, heads: int, kv_heads: int, d: int,
                                block_size: int, lens: list[int]) -> None:
    """The decode kernel (online-softmax AVX-512 BF16 path for bf16) against gather-then-matmul in fp32 over the
    same stored cache, in every KV format; lengths around block and 16-token chunk edges, shuffled blocks, q a
    strided slice of a fused qkv."""
    from pagedserve.model.attention import AttentionMetadata, decode_attention_torch

    if kv_cache_dtype != "auto" and (heads, d, block_size) not in ((9, 64, 16), (8, 128, 16)):
        pytest.skip("the quantized formats on two shapes")
    torch.manual_seed(0)
    max_blocks = -(-max(lens) // block_size)
    num_blocks = len(lens) * max_blocks + 3
    cache = filled_cache(kv_cache_dtype, dtype, num_blocks * block_size, kv_heads, d)
    tables = torch.randperm(num_blocks)[:len(lens) * max_blocks].view(len(lens), max_blocks)
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * d).to(dtype) * 3  # sharp softmaxes too
    q = qkv[:, :heads * d].view(len(lens), heads, d)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), len(lens), tables, torch.tensor(lens), [])
    got = kernels.paged_decode_attention(q, cache.k, cache.v, cache.k_scale, cache.v_scale, tables,
                                         torch.tensor(lens), block_size, d ** -0.5)
    expected = decode_attention_torch(q.float(), cache, meta, block_size, d ** -0.5)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), expected, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "fp8_e5m2", "int8"])
@pytest.mark.parametrize("rows", [1, 9, 300])
def test_rope_and_cache_quantizes_on_the_way_in(kernels, kv_cache_dtype: str, rows: int) -> None:
    """The fused write quantizes rotated k and v as the reference quantize_rows does (a value within an ulp of a
    rounding boundary may take the neighbouring code), into their slots only, with int8 scale codes per token and head."""
    from pagedserve.model.kv_cache_dtype import LayerKVCache, quantize_rows, resolve_kv_format
    from pagedserve.model.scale_codes import scales_of

    heads, kv_heads, d, slots = 9, 3, 64, 400
    fmt = resolve_kv_format(kv_cache_dtype, BF16)
    cache = LayerKVCache(fmt, slots, kv_heads, d)
    if not fmt.per_token_scale:
        cache.set_head_scales(torch.tensor([12.0, 20.0, 9.0]), torch.tensor([10.0, 14.0, 12.0]))  # no saturation
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, dtype=BF16) * 2
    angles = torch.rand(rows, d // 2) * 6
    slot_mapping = torch.randperm(slots)[:rows]
    kernels.rope_and_cache(qkv, angles.cos(), angles.sin(), cache.k, cache.v, cache.k_scale, cache.v_scale,
                           slot_mapping, heads, kv_heads)
    _, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)  # k as rotated in place
    for x, stored, scales in ((k, cache.k, cache.k_scale), (v, cache.v, cache.v_scale)):
        x = x.reshape(rows, kv_heads, d).float()
        codes, scale = quantize_rows(x, fmt, scales)
        got = stored[slot_mapping].float()
        if fmt.per_token_scale:  # scale codes: amax / 127 rounded up onto the log grid, as the reference
            assert (scales[slot_mapping].int() - scale.int()).abs().le(1).all()
            scale = scales_of(scales[slot_mapping])
            ideal = x.abs().amax(-1) / 127
            assert scale.ge(ideal * 0.9999).all() and scale.le(ideal * 2 ** (1 / 12) * 1.0001).all()
            assert (got - codes.float()).abs().le(1).all()
            assert (got * scale.unsqueeze(-1) - x).abs().le(scale.unsqueeze(-1) * 0.5001).all()
        else:
            assert (got.view(1, -1) == codes.float().view(1, -1)).float().mean() > 0.98
            mantissa_bits = 3 if kv_cache_dtype == "fp8_e4m3" else 2
            deq = got * scale.view(1, -1, 1)
            assert (deq - x).abs().le(x.abs() * 2.0 ** -mantissa_bits + 0.02 * scale.view(1, -1, 1)).all()
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[slot_mapping] = False
    assert not cache.k[untouched].view(torch.uint8).any() and not cache.v[untouched].view(torch.uint8).any()


@pytest.mark.parametrize("path", PREFILL_PATHS)
@pytest.mark.parametrize("kv_cache_dtype", KV_FORMATS[:1] + KV_FORMATS[2:])
@pytest.mark.parametrize(("heads", "kv_heads", "d", "block_size"), [(9, 3, 64, 16), (8, 1, 128, 16), (4, 4, 64, 8),
                                                                   (10, 2, 64, 32)])
def test_prefill_attention(kernels, path: str, kv_cache_dtype: str, heads: int, kv_heads: int, d: int,
                           block_size: int) -> None:
    """Each path of the bf16 prefill kernel against SDPA (fp32) on the same spans and stored cache: fresh prompts
    of lengths around the 16-query tiles and 32-key blocks, and chunked continuations over cached context, in one step
    after two decode rows; quantized caches are read as the kernel reads them (dequantized, rounded to bf16)."""
    from pagedserve.model.attention import AttentionMetadata, PrefillSpan

    code = prefill_path(kernels, path)
    if path == "amx-emulated" and (kv_cache_dtype != "auto" or block_size != 16):
        pytest.skip("the emulated tiles are slow: its layouts on the plain cache")
    torch.manual_seed(0)
    shapes = [(1, 0), (15, 0), (16, 0), (17, 0), (33, 0), (130, 0), (5, 40), (33, 17), (64, 200), (40, 31)]
    max_blocks = -(-max(n + c for n, c in shapes) // block_size)
    num_blocks = len(shapes) * max_blocks
    cache = filled_cache(kv_cache_dtype, BF16, num_blocks * block_size, kv_heads, d)
    tables = torch.randperm(num_blocks).view(len(shapes), max_blocks)
    nd = 2
    rows = nd + sum(n for n, _ in shapes)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d).to(BF16) * 3
    q = qkv[:, :heads * d].view(rows, heads, d)
    spans, start = [], nd
    for (n, c), table in zip(shapes, tables):
        spans.append(PrefillSpan(start, n, c, table))
        start += n
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), nd, tables[:nd], torch.tensor([7, 9]), spans,
                             prefill_spans=torch.tensor([[p.start, p.num_tokens, p.context_len] for p in spans]),
                             prefill_tables=tables)
    out = torch.zeros(rows, heads, d, dtype=BF16)
    kernels.prefill_attention(q, cache.k, cache.v, cache.k_scale, cache.v_scale, meta.prefill_spans,
                              meta.prefill_tables, block_size, d ** -0.5, out, path=code)
    assert not out[:nd].any()  # decode rows are the decode kernel's
    assert_prefill_matches_sdpa(out, q, cache, spans, block_size)


@pytest.mark.parametrize("path", PREFILL_PATHS[:3])
def test_prefill_attention_long_span(kernels, path: str) -> None:
    """A 1,000-token prompt whose first 300 tokens are cached: many key blocks per query tile, the tiles spread over
    the threads."""
    from pagedserve.model.attention import PrefillSpan

    code = prefill_path(kernels, path)
    torch.manual_seed(1)
    heads, kv_heads, d, bs, new, cached = 9, 3, 64, 16, 700, 300
    blocks = -(-(new + cached) // bs)
    cache = filled_cache("auto", BF16, blocks * bs, kv_heads, d)
    table = torch.randperm(blocks)
    q = (torch.randn(new, heads, d) * 3).to(BF16)
    out = torch.zeros(new, heads, d, dtype=BF16)
    kernels.prefill_attention(q, cache.k, cache.v, None, None, torch.tensor([[0, new, cached]]), table.unsqueeze(0), bs,
                              d ** -0.5, out, path=code)
    assert_prefill_matches_sdpa(out, q, cache, [PrefillSpan(0, new, cached, table)], bs)


def test_prefill_attention_refuses_what_it_cannot_read(kernels) -> None:
    """A path this CPU lacks, a span outside q, a block table naming blocks outside the pool: errors, not reads."""
    torch.manual_seed(0)
    cache = filled_cache("auto", BF16, 64, 1, 64)
    q = torch.randn(8, 2, 64).to(BF16)
    out = torch.zeros_like(q)
    args = (q, cache.k, cache.v, None, None)
    with pytest.raises(RuntimeError, match="not built"):
        kernels.prefill_attention(*args, torch.tensor([[0, 8, 0]]), torch.tensor([[0]]), 16, 0.125, out, path=99)
    with pytest.raises(RuntimeError, match="out of range"):
        kernels.prefill_attention(*args, torch.tensor([[4, 8, 0]]), torch.tensor([[0]]), 16, 0.125, out)
    with pytest.raises(RuntimeError, match="outside the pool"):
        kernels.prefill_attention(*args, torch.tensor([[0, 8, 0]]), torch.tensor([[4]]), 16, 0.125, out)
    with pytest.raises(RuntimeError, match="too short"):
        kernels.prefill_attention(*args, torch.tensor([[0, 8, 20]]), torch.tensor([[0]]), 16, 0.125, out)


def assert_prefill_matches_sdpa(out: torch.Tensor, q: torch.Tensor, cache, spans, block_size: int) -> None:
    """Each span's rows of out against SDPA (fp32) over the cache read back through its block table, dequantized
    to bf16 as the kernel stages a quantized chunk before its bf16 dot products."""
    d = q.shape[-1]
    for p in spans:
        total = p.context_len + p.num_tokens
        kp, vp = (x[:total].float().transpose(0, 1).unsqueeze(0) for x in cache.gather(p.block_table, block_size, BF16))
        qp = q[p.start:p.start + p.num_tokens].float().transpose(0, 1).unsqueeze(0)
        mask = torch.arange(total).unsqueeze(0) <= torch.arange(p.num_tokens).unsqueeze(1) + p.context_len
        expected = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=d ** -0.5, enable_gqa=True)
        got = out[p.start:p.start + p.num_tokens]
        torch.testing.assert_close(got.float(), expected.squeeze(0).transpose(0, 1), rtol=2e-2, atol=2e-2)
