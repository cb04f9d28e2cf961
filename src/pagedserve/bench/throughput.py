"""Offline throughput benchmark: `pagedserve bench throughput` (or benchmarks/throughput.py).

Runs the workloads of the engine issue through pagedserve's engine and, in the same run, through
transformers' `generate` with static batching (the peer), and writes a table with ratios to
docs/benchmarks.md:
  W1      64 requests x 128 prompt tokens, exactly 128 greedy output tokens each
  MIX     128 requests, prompts 64-512, outputs 16-256 (fixed seed), greedy, EOS ignored; plus KV waste
  PREFIX  64 requests sharing a 1,024-token system prompt + 32 unique tokens: median TTFT, caching on/off
  SINGLE  one 128-token prompt, 128 output tokens: TTFT and ms per output token
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.bench.report import machine_line, write_section
from pagedserve.bench.workloads import Job, corpus_tokens, mix, prefix, w1
from pagedserve.config import EngineConfig
from pagedserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # torch and the engine load only when a benchmark runs, keeping `--help` fast
    from pagedserve.engine.llm_engine import LLMEngine


@dataclass
class Result:
    elapsed: float
    output_tokens: int
    prompt_tokens: int
    ttfts: list[float] = field(default_factory=list)
    kv_waste: float | None = None

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.elapsed

    @property
    def total_tps(self) -> float:
        return (self.output_tokens + self.prompt_tokens) / self.elapsed


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_engine(engine: LLMEngine, jobs: list[Job], track_waste: bool = False) -> Result:
    """All jobs arrive at once; greedy, EOS ignored, exactly max_tokens each."""
    start = time.perf_counter()
    for i, job in enumerate(jobs):
        engine.add_request(f"j{i}", job.prompt_token_ids,
                           SamplingParams(temperature=0, max_tokens=job.max_tokens, ignore_eos=True))
    first: dict[str, float] = {}
    allocated = unfilled = 0
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter() - start)
        steps += 1
        if track_waste:
            for req in engine.scheduler.running:
                slots = len(engine.kv.block_table(req.request_id)) * engine.kv.block_size
                allocated += slots
                unfilled += slots - req.num_computed_tokens
        if steps % 50 == 0:
            log(f"  step {steps}: {len(first)}/{len(jobs)} started, {engine.scheduler.num_waiting} waiting")
    elapsed = time.perf_counter() - start
    return Result(elapsed, sum(j.max_tokens for j in jobs), sum(len(j.prompt_token_ids) for j in jobs),
                  list(first.values()), unfilled / allocated if allocated else None)


def run_hf_static(model, jobs: list[Job], batch_size: int, pad_id: int) -> Result:
    """transformers generate, static batches with left padding; each batch runs to its longest output."""
    import torch

    start = time.perf_counter()
    ttfts = []
    for b in range(0, len(jobs), batch_size):
        batch = jobs[b:b + batch_size]
        width = max(len(j.prompt_token_ids) for j in batch)
        ids = torch.tensor([[pad_id] * (width - len(j.prompt_token_ids)) + j.prompt_token_ids for j in batch])
        mask = torch.tensor([[0] * (width - len(j.prompt_token_ids)) + [1] * len(j.prompt_token_ids) for j in batch])
        n = max(j.max_tokens for j in batch)
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=pad_id)
        ttfts += [t0 - start] * len(batch)  # a static batch's first token comes after its whole prefill
        log(f"  transformers batch {b // batch_size + 1}: {len(batch)} x {n} tokens in {time.perf_counter() - t0:.1f}s")
    elapsed = time.perf_counter() - start
    return Result(elapsed, sum(j.max_tokens for j in jobs), sum(len(j.prompt_token_ids) for j in jobs), ttfts)


def load_hf(dtype):
    from transformers import AutoModelForCausalLM

    from pagedserve.model.loader import default_model_path

    path = default_model_path()
    return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype).eval()


def single_stream(engine: LLMEngine, job: Job) -> tuple[float, float]:
    """(TTFT seconds, ms per output token after the first)."""
    start = time.perf_counter()
    engine.add_request("single", job.prompt_token_ids,
                       SamplingParams(temperature=0, max_tokens=job.max_tokens, ignore_eos=True))
    ttft = None
    while engine.has_unfinished_requests():
        engine.step()
        if ttft is None:
            ttft = time.perf_counter() - start
    total = time.perf_counter() - start
    return ttft, (total - ttft) / (job.max_tokens - 1) * 1e3


def hf_single(model, job: Job) -> float:
    """ms per output token of transformers' generate at batch 1 (prefill excluded by difference)."""
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", default="w1,mix,prefix,single", help="comma-separated subset to run")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="both engines' dtype")
    p.add_argument("--scale", type=float, default=1.0, help="scale request counts (e.g. 0.25 for a quick look)")
    p.add_argument("--no-peer", action="store_true", help="skip transformers (no ratios)")
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--no-write", action="store_true", help="print the table but leave docs/benchmarks.md alone")


def run_args(args: argparse.Namespace) -> int:
    import torch

    from pagedserve.engine.llm_engine import LLMEngine

    todo = set(args.workloads.split(","))
    dtype = getattr(torch, args.dtype)

    def engine(**over) -> LLMEngine:
        cfg = {"dtype": args.dtype, "kv_cache_memory": args.kv_cache_memory, "max_num_seqs": args.max_num_seqs,
                   "max_num_batched_tokens": args.max_num_batched_tokens} | over
        return LLMEngine(EngineConfig(**cfg))

    eng = engine()
    tokens = corpus_tokens(eng.tokenizer)
    n = lambda k: max(1, int(k * args.scale))
    hf = None if args.no_peer else load_hf(dtype)
    rows, notes = [], []

    if "w1" in todo:
        jobs = w1(tokens, n(64))
        log(f"W1: {len(jobs)} requests")
        ours = run_engine(eng, jobs)
        log(f"  pagedserve {ours.output_tps:.0f} output tok/s")
        peer = run_hf_static(hf, jobs, 32, 2) if hf else None
        rows.append(("W1", "output tok/s", ours.output_tps, peer.output_tps if peer else None,
                     "transformers static batching, batch 32"))
    if "mix" in todo:
        eng.kv.reset_prefix_cache()
        jobs = mix(tokens, n(128))
        log(f"MIX: {len(jobs)} requests")
        ours = run_engine(eng, jobs, track_waste=True)
        log(f"  pagedserve {ours.output_tps:.0f} output tok/s, KV waste {ours.kv_waste:.2%}")
        peer = run_hf_static(hf, jobs, 32, 2) if hf else None
        rows.append(("MIX", "output tok/s", ours.output_tps, peer.output_tps if peer else None,
                     "transformers static batching, batches of 32, left padding"))
        rows.append(("MIX", "total tok/s", ours.total_tps, peer.total_tps if peer else None, "prompt + output"))
        notes.append(f"KV waste over the MIX run (allocated but unfilled slots / allocated slots, summed over "
                     f"steps): **{ours.kv_waste:.2%}** (target under 4%).")
    if "prefix" in todo:
        jobs = prefix(tokens, n(64))
        medians = {}
        for caching in (True, False):
            e = engine(enable_prefix_caching=caching)
            run_engine(e, [jobs[0]])  # the first request warms the cache when caching is on
            res = run_engine(e, jobs[1:])
            medians[caching] = statistics.median(res.ttfts)
            log(f"PREFIX caching={caching}: median TTFT {medians[caching] * 1e3:.0f} ms")
        rows.append(("PREFIX", "median TTFT ms (lower is better)", medians[True] * 1e3, medians[False] * 1e3,
                     "peer = pagedserve with prefix caching off"))
    if "single" in todo:
        job = w1(tokens, 1)[0]
        ttft, ms = single_stream(engine(), job)
        peer_ms = hf_single(hf, job) if hf else None
        log(f"SINGLE: TTFT {ttft * 1e3:.0f} ms, {ms:.1f} ms/token (transformers {peer_ms})")
        rows.append(("SINGLE", "ms per output token (lower is better)", ms, peer_ms, "transformers generate, batch 1"))
        notes.append(f"Single stream time to first token (128-token prompt): {ttft * 1e3:.0f} ms.")

    body = render(rows, notes, args)
    print(body)
    if not args.no_write:
        write_section("Offline throughput (engine)", body)
    return 0


def render(rows, notes, args) -> str:
    lines = [(f"Command: `pagedserve bench throughput --workloads {args.workloads} --dtype {args.dtype}"
             f"{'' if args.scale == 1 else f' --scale {args.scale}'}`"), "", machine_line(), "",
             "| workload | metric | pagedserve | peer | ratio | peer is |", "|---|---|---|---|---|---|"]
    for name, metric, ours, peer, what in rows:
        lower_better = "lower" in metric
        ratio = (peer / ours if lower_better else ours / peer) if peer else None
        lines.append(f"| {name} | {metric} | {ours:.1f} | {'-' if peer is None else f'{peer:.1f}'} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}x'} | {what} |")
    lines += [""] + [f"- {n}" for n in notes] + ["- Ratio: how many times better pagedserve is (both directions)."]
    return "\n".join(lines)
