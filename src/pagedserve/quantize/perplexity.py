"""Perplexity before and after, on our engine in fp32 through prompt logprobs, in the windows `pagedserve bench
perplexity` uses (consecutive, each window's first token unscored), so the numbers compare with its tables."""
from __future__ import annotations

import math


def windows(tokens: list[int], size: int) -> list[list[int]]:
    return [tokens[i:i + size] for i in range(0, len(tokens) - 1, size) if len(tokens[i:i + size]) > 1]


def perplexity(model: str | None, chunks: list[list[int]]) -> float:
    from pagedserve import LLM, SamplingParams

    llm = LLM(model=model, dtype="float32", kv_cache_memory="512MiB")
    outs = llm.generate([{"prompt_token_ids": c} for c in chunks],
                        SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    logprobs = [out.prompt_logprobs[i][c[i]].logprob for c, out in zip(chunks, outs, strict=True)
                for i in range(1, len(c))]
    return math.exp(-sum(logprobs) / len(logprobs))
