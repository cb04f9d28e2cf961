"""The C++ decode stack (model/decode_stack.py) against the Python layers it stands in for: the same tokens and
the same log-probabilities, bit for bit, at batch sizes on either kernel path and with quantized KV caches."""
from __future__ import annotations

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.model.kernels import cpu_kernels
from tests.stack_support import Counted

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the stack is part of the C++ kernels")

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three laws of robotics are",
           "Write a haiku about the sea", "List three prime numbers:", "Dear Sir,"]


def generate(llm: LLM, prompts: list[str], stack: bool) -> tuple[list, int]:
    """Tokens and top log-probabilities of greedy answers, and the steps the stack ran."""
    model = llm.engine.runner.model
    saved = model.decode_stack
    model.decode_stack = Counted(saved) if stack else None
    try:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3))
        steps = model.decode_stack.steps if stack else 0
    finally:
        model.decode_stack = saved
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs], steps


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "int8", "int4"])
def test_stack_equals_the_python_layers(kv_cache_dtype):
    llm = LLM(dtype="bfloat16", quantization="gguf", kv_cache_dtype=kv_cache_dtype, kv_cache_memory="64MiB",
              enable_prefix_caching=False)
    assert llm.engine.runner.model.decode_stack is not None
    for batch in (1, 3, 7):  # the integer kernel, then (with AMX) the tiles from 5 rows
        prompts = PROMPTS[:batch]
        stacked, steps = generate(llm, prompts, stack=True)
        assert steps >= 11  # every step after the prefill
        assert stacked == generate(llm, prompts, stack=False)[0]


def test_stack_serves_only_what_it_covers():
    int4 = LLM(dtype="bfloat16", quantization="int4", kv_cache_memory="64MiB")  # our int4 weights, bf16 KV
    assert int4.engine.runner.model.decode_stack is not None
    stacked, steps = generate(int4, PROMPTS[:2], stack=True)
    assert steps >= 11 and stacked == generate(int4, PROMPTS[:2], stack=False)[0]
    int8 = LLM(dtype="bfloat16", quantization="int8", kv_cache_memory="64MiB")  # W8A8 where AMX int8 tiles exist
    stacked, steps = generate(int8, PROMPTS[:6], stack=True)
    assert steps >= 11 and stacked == generate(int8, PROMPTS[:6], stack=False)[0]
    plain = LLM(dtype="bfloat16", quantization="none", kv_cache_memory="64MiB")
    assert plain.engine.runner.model.decode_stack is None  # float linears: oneDNN's, from the layers
    reference = LLM(dtype="float32", quantization="gguf", kv_cache_memory="64MiB")
    assert reference.engine.runner.model.decode_stack is None  # the fp32 reference path has no fused kernels
