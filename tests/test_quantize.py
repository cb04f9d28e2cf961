"""`pagedserve quantize` (src/pagedserve/quantize/): the methods on synthetic layers, the packing through our
compressed-tensors loader, and end to end on the default model against transformers + compressed-tensors."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch

from pagedserve.model.checkpoints.compressed_tensors import load_compressed_tensors
from pagedserve.model.kernels import cpu_kernels
from pagedserve.quantize.awq import metric, search_clip, search_scales
from pagedserve.quantize.cli import grid_for
from pagedserve.quantize.gptq import gptq, hessian
from pagedserve.quantize.rtn import Grid, rtn
from pagedserve.quantize.writer import module_tensors, quantization_config

ROOT = Path(__file__).resolve().parents[1]
LLMC_PYTHON = Path(os.environ.get("PAGEDSERVE_LLMC_PYTHON", ROOT / "build" / "llmc-venv" / "bin" / "python"))


def output_error(w: torch.Tensor, wq: torch.Tensor, x: torch.Tensor) -> float:
    return float(((x @ (w - wq).T) ** 2).mean())


def correlated_inputs(n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Inputs with correlated channels of unequal size, like a layer's (GPTQ's error feedback needs correlation)."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(k, k, generator=g) / k ** 0.5
    return (torch.randn(n, k, generator=g) @ mix) * torch.rand(k, generator=g).mul(3).add(0.2)


@pytest.mark.parametrize("group,symmetric", [(32, True), (64, False), (None, True)])
def test_gptq_beats_round_to_nearest_on_its_calibration_inputs(group, symmetric):
    torch.manual_seed(0)
    x, w = correlated_inputs(2048, 128), torch.randn(64, 128)
    grid = Grid(4, group, symmetric)
    baseline = output_error(w, rtn(w, grid).dequantize(), x)
    for act_order in (False, True):
        err = output_error(w, gptq(w, hessian(x), grid, act_order, damp=0.01).dequantize(), x)
        assert err < 0.8 * baseline, (act_order, err, baseline)


def test_gptq_dampening_factors_a_singular_hessian():
    x = correlated_inputs(512, 64)
    x[:, 5] = 0  # a dead input and rank < K: only the dampening makes H invertible
    x[:, 7] = x[:, 6]
    w = torch.randn(16, 64)
    q = gptq(w, hessian(x), Grid(4, 32), damp=0.01)
    assert torch.isfinite(q.scale).all() and output_error(w, q.dequantize(), x) < output_error(w, rtn(w, Grid(4, 32)).dequantize(), x)


def test_awq_scales_and_clipping_beat_round_to_nearest_with_outlier_channels():
    torch.manual_seed(0)
    x = torch.randn(2048, 128)
    x[:, :4] *= 30  # a few activation channels far larger than the rest, as in real layers
    w = torch.randn(96, 128)
    grid = Grid(4, 32)
    m = metric(x)
    s = search_scales([w], x.abs().mean(0), m, grid)
    scaled = rtn(w * s, grid, search_clip(w * s, m / s.unsqueeze(1), grid)).dequantize() / s
    baseline = output_error(w, rtn(w, grid).dequantize(), x)
    assert not torch.allclose(s, torch.ones_like(s))
    assert output_error(w, scaled, x) < 0.7 * baseline


@pytest.mark.parametrize("bits,group,symmetric", [(4, 64, True), (4, 32, False), (8, None, True)])
def test_packing_round_trips_through_our_loader(bits, group, symmetric):
    """The written tensors, read back by model/checkpoints/compressed_tensors.py, are the intended integers."""
    torch.manual_seed(1)
    grid = Grid(bits, group, symmetric)
    w = torch.randn(48, 192)
    q = rtn(w, grid)
    tensors = module_tensors("model.layers.0.mlp.down_proj", q, w8a8=False)
    loaded, scheme = load_compressed_tensors(tensors, quantization_config(grid, w8a8=False))
    weight = loaded["model.layers.0.mlp.down_proj.weight"]
    assert weight.bits == bits and scheme.startswith("compressed-tensors pack-quantized")
    kernels = cpu_kernels()
    got = weight.dequantize() if kernels is None else kernels.quant_dequantize(
        weight.qweight, weight.scales, weight.mins, weight.bits, weight.group, torch.float32)
    torch.testing.assert_close(got, q.dequantize(), rtol=0, atol=1e-6 if symmetric else 1e-5)


def test_w8a8_layout_loads_as_int8_with_per_token_activations():
    grid = Grid(8, None)
    q = rtn(torch.randn(32, 64), grid)
    tensors = module_tensors("model.layers.0.self_attn.o_proj", q, w8a8=True)
    loaded, _ = load_compressed_tensors(tensors, quantization_config(grid, w8a8=True))
    weight = loaded["model.layers.0.self_attn.o_proj.weight"]
    assert weight.per_token_int8 and torch.equal(weight.qweight, q.q)


def args(**kw) -> argparse.Namespace:
    return argparse.Namespace(**({"method": "gptq", "bits": 4, "group_size": None, "asym": False,
                                  "act_order": False} | kw))


def test_unsupported_combinations_are_named():
    assert grid_for(args()) == Grid(4, 64, True)
    assert grid_for(args(bits=8)) == Grid(8, None, True)
    assert grid_for(args(method="smoothquant", bits=8)) == Grid(8, None, True)
    for bad, words in [(args(method="smoothquant"), "W8A8"), (args(group_size=48), "multiple of 32"),
                       (args(method="awq", act_order=True), "GPTQ"), (args(bits=8, asym=True), "asymmetric")]:
        with pytest.raises(ValueError, match=words):
            grid_for(bad)


SMALL = ["--num-samples", "4", "--seq-len", "128", "--ppl-tokens", "1024", "--ppl-window", "512"]


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, dict]:
    """`pagedserve quantize` with each weight-only method at int4 sym group 64 on a small calibration: the reports,
    scored by transformers + compressed-tensors too where llm-compressor's venv is (`make quantized` makes it)."""
    from pagedserve.cli import main

    if not LLMC_PYTHON.exists():
        pytest.skip(f"no transformers + compressed-tensors venv at {LLMC_PYTHON} (make quantized provisions it)")
    reports = {}
    for method in ("rtn", "gptq", "awq"):
        out = tmp_path_factory.mktemp(method)
        assert main(["quantize", "--method", method, *SMALL, "--out", str(out),
                     "--transformers-python", str(LLMC_PYTHON)]) == 0
        reports[method] = json.loads((out / "quantize_report.json").read_text()) | {"folder": str(out)}
    return reports


@pytest.mark.slow
@pytest.mark.timeout(3600)  # the fixture quantizes three ways: 15 minutes did not suffice on 2 loaded cores
def test_written_folder_serves_here_and_in_transformers_with_the_same_perplexity(written):
    from pagedserve import LLM, SamplingParams

    for method, report in written.items():
        ppl = report["perplexity"]
        assert abs(ppl["after"] / ppl["transformers"] - 1) < 1e-3, (method, ppl)
    llm = LLM(written["gptq"]["folder"], dtype="float32", kv_cache_memory="64MiB")
    assert llm.engine.weights_info["quantization"].startswith("compressed-tensors pack-quantized: W4A16")
    out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 8


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_gptq_and_awq_beat_round_to_nearest_at_the_same_grid(written):
    rtn_ppl = written["rtn"]["perplexity"]["after"]
    for method in ("gptq", "awq"):
        assert written[method]["grid"] == written["rtn"]["grid"]
        assert written[method]["perplexity"]["after"] < rtn_ppl, (method, written[method]["perplexity"], rtn_ppl)


@pytest.mark.slow
def test_qwen3_calibrates_through_its_qk_norm_and_writes_a_folder_transformers_reads(tmp_path):
    """The calibration forward is the model: a tiny Qwen3 through quantize/layer.py's forward gives transformers'
    logits (fp32). `pagedserve quantize` (AWQ, which folds scales through the layer) writes a Qwen3 folder that
    serves here with transformers' + compressed-tensors' perplexity on it (where llm-compressor's venv is)."""
    import torch.nn.functional as F

    from pagedserve import LLM
    from pagedserve.cli import main
    from pagedserve.model.layers import RotaryEmbedding
    from pagedserve.model.loader import load_model
    from pagedserve.quantize import layer
    from tests.test_hf_folder import byte_tokenizer
    from tests.test_model_qwen3_moe import tiny_model

    model = tiny_model("qwen3", 21, {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
                                     "num_key_value_heads": 2, "head_dim": 16})
    folder = tmp_path / "qwen3"
    model.save_pretrained(folder)
    byte_tokenizer(folder)
    loaded = load_model(str(folder))
    c, w = loaded.config, loaded.weights
    ids = torch.tensor([list(b"The quick brown fox jumps over the lazy dog.")])
    cos, sin = RotaryEmbedding(c).tables(torch.arange(ids.shape[1]), torch.float32)
    with torch.no_grad():
        x = F.embedding(ids, w["model.embed_tokens.weight"])
        for i in range(c.num_hidden_layers):
            x = layer.forward(layer.layer_weights(w, i), x, cos, sin, c)
        logits = F.linear(F.rms_norm(x, (c.hidden_size,), w["model.norm.weight"], c.rms_norm_eps), w["lm_head.weight"])
        torch.testing.assert_close(logits, model(ids).logits, rtol=1e-4, atol=1e-4)

    out = tmp_path / "awq"
    extra = ["--transformers-python", str(LLMC_PYTHON)] if LLMC_PYTHON.exists() else []
    assert main(["quantize", str(folder), "--method", "awq", *SMALL, "--ppl-window", "256", "--out", str(out),
                 *extra]) == 0
    report = json.loads((out / "quantize_report.json").read_text())
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    if extra:
        ppl = report["perplexity"]
        assert abs(ppl["after"] / ppl["transformers"] - 1) < 1e-3, ppl
    llm = LLM(str(out), dtype="float32", kv_cache_memory="4MiB")
    assert llm.engine.family.name == "qwen3"
    assert llm.engine.weights_info["quantization"].startswith("compressed-tensors pack-quantized: W4A16")
