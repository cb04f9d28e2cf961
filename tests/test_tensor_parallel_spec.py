"""Speculative decoding over a tensor-parallel target: every method's proposals are verified by the split model
(the draft model runs whole, beside rank 0), with and without a LoRA adapter. Greedy output in fp32 equals TP=1's
without speculation, and proposals were made and accepted."""
from __future__ import annotations

import json

import pytest

from pagedserve import LLM
from pagedserve.model.loader import default_model_path
from pagedserve.sampling_params import SamplingParams
from tests.lora_support import lora, make_adapters
from tests.test_tensor_parallel import FP32

# Spawns worker processes per engine: behind make test-all.
pytestmark = pytest.mark.slow

PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = ["Repeat exactly: the quick brown fox jumps over the lazy dog. the quick brown fox jumps over the lazy dog.",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"]
METHODS = {"ngram": {"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5},
           "suffix": {"num_speculative_tokens": 4},
           "draft_model": {"num_speculative_tokens": 3, "model": str(default_model_path())}}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, hf_model) -> dict:
    return make_adapters(hf_model, tmp_path_factory.mktemp("adapters"))


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("with_lora", [False, True])
def test_tp2_speculates_like_tp1(method, with_lora, adapters):
    extra = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 16} if with_lora else {}
    loras = [lora(adapters, "all16"), None] if with_lora else None
    expected = [o.outputs[0].token_ids for o in LLM(**FP32, **extra).generate(PROMPTS, PARAMS, lora_request=loras)]
    spec = json.dumps({"method": method, **METHODS[method]})
    llm = LLM(tensor_parallel_size=2, speculative_config=spec, **FP32, **extra)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS, lora_request=loras)]
        assert got == expected
        stats = llm.engine.spec_stats
        assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    finally:
        llm.engine.workers.close()
