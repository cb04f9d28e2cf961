"""Benchmark workloads (W1, MIX, PREFIX, PREFILL, RAG, single stream) as token-id prompts, reproducible from a
seed."""
from __future__ import annotations

import random
from dataclasses import dataclass

from pagedserve.corpus import CORPUS_MODULES, corpus_text  # noqa: F401 (the benchmarks' text, re-exported)


@dataclass(slots=True)
class Job:
    prompt_token_ids: list[int]
    max_tokens: int


def corpus_tokens(tokenizer) -> list[int]:
    return tokenizer.encode(corpus_text())


def w1(tokens: list[int], num: int = 64, prompt_len: int = 128, output_len: int = 128) -> list[Job]:
    """num requests of prompt_len tokens (different slices of one text), exactly output_len tokens each."""
    stride = (len(tokens) - prompt_len) // num
    return [Job(tokens[i * stride:i * stride + prompt_len], output_len) for i in range(num)]


def mix(tokens: list[int], num: int = 128, seed: int = 0) -> list[Job]:
    """Prompt lengths 64-512 and output lengths 16-256 drawn from a fixed seed."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(num):
        plen, olen = rng.randint(64, 512), rng.randint(16, 256)
        start = rng.randrange(0, len(tokens) - plen)
        jobs.append(Job(tokens[start:start + plen], olen))
    return jobs


def prefix(tokens: list[int], num: int = 64, shared_len: int = 1024, suffix_len: int = 32,
           output_len: int = 32) -> list[Job]:
    """num requests sharing a shared_len-token system prompt plus a unique suffix_len-token tail."""
    shared = tokens[:shared_len]
    rest = tokens[shared_len:]
    stride = (len(rest) - suffix_len) // num
    return [Job(shared + rest[i * stride:i * stride + suffix_len], output_len) for i in range(num)]


def prefill(tokens: list[int], num: int = 32, prompt_len: int = 1024) -> list[Job]:
    """num different prompt_len-token prompts, one output token each: prompt throughput. The prompts are
    slices of the text at different offsets, so none shares a cached block with another."""
    return w1(tokens, num, prompt_len, 1)


def rag(tokens: list[int], num: int = 32, seed: int = 1, output_len: int = 128) -> list[Job]:
    """A retrieval route's shape: prompts of 1,000-1,500 tokens (context and question), output_len-token
    answers, lengths and offsets from a fixed seed."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(num):
        plen = rng.randint(1000, 1500)
        start = rng.randrange(0, len(tokens) - plen)
        jobs.append(Job(tokens[start:start + plen], output_len))
    return jobs
