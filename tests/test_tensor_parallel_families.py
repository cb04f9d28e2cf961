"""Tensor parallelism beyond Llama: Qwen3 (QK-norm per head, so each rank norms its own heads) and Gemma 3 (sliding
and full layers, one KV head replicated on both ranks, norms after o_proj and down_proj that need the whole sum),
TP=2 against TP=1 in fp32 with a peft adapter and the base model in one batch: tokens identical, logits within
1e-4, step by step."""
from __future__ import annotations

import copy

import pytest
import torch

from pagedserve import LLM
from pagedserve.lora_request import LoRARequest
from tests.test_hf_folder import byte_tokenizer
from tests.test_model_gemma3 import MODELS as GEMMA_MODELS
from tests.test_model_gemma3 import tiny_gemma
from tests.test_model_qwen3_moe import tiny_model
from tests.test_tensor_parallel import FP32, assert_same_run, greedy_run

# Spawns worker processes per engine: behind make test-all.
pytestmark = pytest.mark.slow

PROMPTS = ["Hello, world!", "The quick brown fox jumps over the lazy dog. " * 4, "1, 2, 3,"]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def family_model(family: str):
    """MLP widths of whole 32-column blocks (the split's unit); heads that split over two ranks."""
    if family == "qwen3":
        return tiny_model("qwen3", 11, {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
                                        "num_key_value_heads": 2, "head_dim": 16})
    seed, shape = GEMMA_MODELS["groups-of-2"]  # 2 KV heads; intermediate 96: 2 + 1 blocks
    return tiny_gemma(seed, {**shape, "num_key_value_heads": 1})  # one KV head, replicated on both ranks


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_tp2_matches_tp1_with_an_adapter(family, tmp_path):
    from peft import LoraConfig, get_peft_model

    model = family_model(family)
    model.save_pretrained(tmp_path / "model")
    byte_tokenizer(tmp_path / "model")
    torch.manual_seed(3)
    peft = get_peft_model(copy.deepcopy(model), LoraConfig(r=8, lora_alpha=16, target_modules=ALL,
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
        assert_same_run(greedy_run(tp2, prompts, loras=loras), expected)
    finally:
        tp2.engine.workers.close()
