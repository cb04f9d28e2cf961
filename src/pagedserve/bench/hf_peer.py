"""The transformers peer of the offline benchmark, at each of its own settings: static batching with
`generate` (batch 32, 64 or everything at once, optionally sorted by prompt length), its continuous
batching (`generate_batch` manager), and batch-1 decoding. Every run returns the tokens it generated, so
the benchmark can check what it timed (ignore_eos held, counts, agreement with pagedserve)."""
from __future__ import annotations

import inspect
import time
from pathlib import Path

from pagedserve.bench.measure import Job, Run, log


def load(dtype_name: str, path: Path | None = None):
    """transformers' model of a GGUF (default: the packaged SmolLM2) with its weights dequantized into dense
    tensors of dtype_name. Since transformers 5.2x a GGUF's weights otherwise stay packed and, without a
    downloaded matmul kernel, are unpacked again in every forward (~40x slower): never the peer's best setting,
    nor the same arithmetic as the fp32 reference."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from pagedserve.model.loader import default_model_path

    path = path or default_model_path()
    extra = {}
    if "dequantize" in inspect.signature(getattr(transformers, "GgufConfig", lambda: None)).parameters:
        extra["quantization_config"] = transformers.GgufConfig(dequantize=True)
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                dtype=getattr(torch, dtype_name), **extra).eval()


def static(model, jobs: list[Job], batch_size: int, pad_id: int, sort: bool = False) -> Run:
    """generate() over static batches with left padding; each batch runs to its longest output, but only
    each job's own max_tokens count as output."""
    import torch

    order = sorted(range(len(jobs)), key=lambda i: len(jobs[i].prompt_token_ids)) if sort else range(len(jobs))
    order = list(order)
    outputs: list[list[int]] = [[] for _ in jobs]
    ttfts = []
    start = time.perf_counter()
    for b in range(0, len(order), batch_size):
        idx = order[b:b + batch_size]
        batch = [jobs[i] for i in idx]
        width = max(len(j.prompt_token_ids) for j in batch)
        ids = torch.tensor([[pad_id] * (width - len(j.prompt_token_ids)) + j.prompt_token_ids for j in batch])
        mask = torch.tensor([[0] * (width - len(j.prompt_token_ids)) + [1] * len(j.prompt_token_ids) for j in batch])
        n = max(j.max_tokens for j in batch)
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=pad_id)
        for row, i in enumerate(idx):
            outputs[i] = out[row, width:width + jobs[i].max_tokens].tolist()
        ttfts += [t0 - start] * len(batch)  # a static batch's first token comes after its whole prefill
        log(f"  transformers batch {b // batch_size + 1}: {len(batch)} x {n} tokens in {time.perf_counter() - t0:.1f}s")
    return Run(time.perf_counter() - start, outputs, sum(len(j.prompt_token_ids) for j in jobs), ttfts)


def continuous(model, jobs: list[Job]) -> Run:
    """transformers' own continuous batching: every job added at once, each with its own max_new_tokens
    and EOS disabled."""
    from transformers import GenerationConfig

    config = GenerationConfig(do_sample=False, max_new_tokens=max(j.max_tokens for j in jobs), eos_token_id=None)
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    start = time.perf_counter()
    try:
        ids = [manager.add_request(j.prompt_token_ids, max_new_tokens=j.max_tokens) for j in jobs]
        done = {}
        while len(done) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                if result.error:
                    raise RuntimeError(f"transformers continuous batching failed: {result.error}")
                done[result.request_id] = (result.generated_tokens, result.lifespan[0] - start)
    finally:
        manager.stop(block=True)
    elapsed = time.perf_counter() - start
    return Run(elapsed, [list(done[i][0]) for i in ids], sum(len(j.prompt_token_ids) for j in jobs),
               [done[i][1] for i in ids])


def single_ms_per_token(model, job: Job) -> float:
    """ms per output token at batch 1 (the prefill and first token subtracted by difference)."""
    import torch

    ids = torch.tensor([job.prompt_token_ids])
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, do_sample=False, pad_token_id=2)
        t1 = time.perf_counter()
        model.generate(ids, max_new_tokens=job.max_tokens, min_new_tokens=job.max_tokens, do_sample=False,
                       pad_token_id=2)
        t2 = time.perf_counter()
    return ((t2 - t1) - (t1 - t0)) / (job.max_tokens - 1) * 1e3
