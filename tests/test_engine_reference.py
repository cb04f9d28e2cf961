"""Greedy output must be token-identical to transformers (fp32, same GGUF) in every scheduling regime."""
from __future__ import annotations

import pytest

from pagedserve import LLM
from pagedserve.sampling_params import SamplingParams
from tests.conftest import hf_greedy

NUM_TOKENS = 24
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)


@pytest.fixture(scope="module")
def expected(hf_model, reference_prompts) -> list[list[int]]:
    return [hf_greedy(hf_model, p, NUM_TOKENS) for p in reference_prompts]


def run(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("engine_args", [
    pytest.param({}, id="prefix-caching-on"),
    pytest.param({"enable_prefix_caching": False}, id="prefix-caching-off"),
    pytest.param({"max_num_batched_tokens": 40}, id="chunked-prefill"),
    pytest.param({"attention_backend": "torch"}, id="torch-attention"),
])
def test_batch_matches_transformers(engine_args, expected, reference_prompts):
    llm = LLM(dtype="float32", kv_cache_memory="32MiB", **engine_args)
    assert run(llm, reference_prompts) == expected
    if llm.engine.config.enable_prefix_caching:
        # The same batch again is served largely from the prefix cache, with the same tokens.
        before = llm.engine.stats().prefix_cache_hit_tokens
        assert run(llm, reference_prompts) == expected
        assert llm.engine.stats().prefix_cache_hit_tokens - before >= sum(len(p) for p in reference_prompts) // 2


def test_preemption_keeps_output_identical(expected, reference_prompts):
    # Room for the longest request alone and little more, so the batch must preempt and recompute.
    longest = max(len(p) for p in reference_prompts) + NUM_TOKENS
    blocks = -(-longest // 16) + 4
    llm = LLM(dtype="float32", kv_cache_memory=str(blocks * 16 * 30 * 2 * 192 * 4))
    assert llm.engine.kv.num_blocks == blocks
    assert run(llm, reference_prompts) == expected
    assert llm.engine.stats().num_preemptions > 0


def test_tokenizer_matches_transformers(hf_model):
    from transformers import AutoTokenizer

    from pagedserve.model.loader import default_model_path, load_model

    path = default_model_path()
    hf_tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = load_model(None).tokenizer
    for text in ["Hello world!", "  leading spaces and 12345 digits", "naïve café — ünïcödé 日本語 🙂",
                 "<|im_start|>user\nhi<|im_end|>", "tabs\tand\nnewlines\r\n"]:
        assert ours.encode(text) == hf_tok.encode(text, add_special_tokens=False), text
