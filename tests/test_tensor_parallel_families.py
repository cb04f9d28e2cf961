"""Tensor parallelism beyond Llama: Qwen3 (QK-norm per head, so each rank norms its own heads), Gemma 3 (sliding
and full layers, one KV head replicated on both ranks, norms after o_proj and down_proj that need the whole sum),
and the mixtures of experts (every expert split by its columns, the router whole on each rank), TP=2 against TP=1 in fp32 with a peft adapter and the base model in one batch: tokens identical, logits within
ATOL, step by step."""
from __future__ import annotations

import copy

import pytest
import torch

from pagedserve import LLM
from pagedserve.lora_request import LoRARequest
from tests.test_hf_folder import byte_tokenizer
from tests.test_model_gemma3 import MODELS as GEMMA_MODELS
from tests.test_model_gemma3 import tiny_gemma
from tests.test_model_qwen3_moe import ALIGNED, tiny_model
from tests.test_tensor_parallel import FP32, assert_same_run, greedy_run

# Spawns worker processes per engine: behind make test-all.
pytestmark = pytest.mark.slow

# The ranks' partial sums meet in another order than one process's: these random models' logits reach ~10, and
# differ by up to ~1.5e-4 (SmolLM2's, in tests/test_tensor_parallel.py, stay within 1e-4).
ATOL = 5e-4
PROMPTS = ["Hello, world!", "The quick brown fox jumps over the lazy dog. " * 4, "1, 2, 3,"]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def family_model(family: str):
    """MLP and expert widths of whole 32-column blocks (the split's unit); heads that split over two ranks."""
    if family == "qwen3":
        return tiny_model("qwen3", 11, {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
                                        "num_key_value_heads": 2, "head_dim": 16})
    if family == "qwen3_moe":  # a dense layer among the sparse ones; experts of 3 blocks: 2 + 1
        return tiny_model("qwen3_moe", 12, {**ALIGNED["qwen3_moe"][2], "moe_intermediate_size": 96,
                                            "mlp_only_layers": [1], "num_hidden_layers": 3})
    if family == "mixtral":  # heads of 16: a rank's o_proj columns, 2 heads, are whole int8 blocks
        return tiny_model("mixtral", 13, {**ALIGNED["mixtral"][2], "intermediate_size": 96, "head_dim": 16})
    seed, shape = GEMMA_MODELS["groups-of-2"]  # 2 KV heads; intermediate 96: 2 + 1 blocks
    return tiny_gemma(seed, {**shape, "num_key_value_heads": 1})  # one KV head, replicated on both ranks


@pytest.mark.parametrize("family", ["qwen3", "gemma3", "qwen3_moe", "mixtral"])
def test_tp2_matches_tp1_with_an_adapter(family, tmp_path):
    from peft import LoraConfig, get_peft_model

    model = family_model(family)
    model.save_pretrained(tmp_path / "model")
    byte_tokenizer(tmp_path / "model")
    torch.manual_seed(3)
    targets = ALL if family in ("qwen3", "gemma3") else ALL[:4]  # experts take no adapter (tests/test_model_qwen3_moe)
    peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=8, lora_alpha=16, target_modules=targets,
                                                           init_lora_weights=False))
    peft.save_pretrained(tmp_path / "adapter")
    adapter = LoRARequest("a", 1, str(tmp_path / "adapter"))
    args = {"model": str(tmp_path / "model"), "max_num_batched_tokens": 24, "enable_lora": True, **FP32}
    tp1 = LLM(**args)
    assert tp1.engine.model_config.family == family
    prompts = [tp1.tokenizer.encode(p) for p in PROMPTS]
    loras = [adapter, None, adapter]
    expected = greedy_run(tp1, prompts, loras=loras)
    assert expected[0][0] != greedy_run(tp1, prompts[:1])[0][0]  # the adapter changes the output
    tp2 = LLM(tensor_parallel_size=2, **args)
    try:
        assert_same_run(greedy_run(tp2, prompts, loras=loras), expected, ATOL)
    finally:
        tp2.engine.workers.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_tp2_splits_quantized_experts(family, tmp_path, quant_kernel):
    """int8 experts split along their groups: each rank's part of every expert's rows and columns, the sum of
    the parts the whole product (the dequantizing path; the integer kernel quantizes each rank's activations)."""
    from pagedserve.model.models.moe import SparseMoE

    quant_kernel("torch")  # the workers read it as they start
    family_model(family).save_pretrained(tmp_path)
    byte_tokenizer(tmp_path)
    args = {"model": str(tmp_path), "quantization": "int8", **FP32}
    tp1 = LLM(**args)
    assert any(isinstance(m, SparseMoE) and m.quantized for m in tp1.engine.runner.model.modules())
    prompts = [tp1.tokenizer.encode(p) for p in PROMPTS]
    expected = greedy_run(tp1, prompts)
    tp2 = LLM(tensor_parallel_size=2, **args)
    try:
        assert_same_run(greedy_run(tp2, prompts), expected, ATOL)
    finally:
        tp2.engine.workers.close()
