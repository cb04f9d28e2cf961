"""Quality benchmark: `pagedserve bench perplexity` (or benchmarks/perplexity.py).

Perplexity of the default model over a fixed English text that ships with Python (the standard library's
documentation, pagedserve.bench.workloads.corpus_tokens), scored in non-overlapping windows through the
engine's prompt logprobs, for each numeric mode against the fp32 reference on the same weights: the
change in perplexity and the top-1 agreement (the reference's most likely next token) over every position.
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path

from pagedserve.bench.measure import log
from pagedserve.bench.report import REPO, machine_line, write_section
from pagedserve.bench.workloads import corpus_tokens

INTEGER_ONLY = 1 << 30  # dequant_min_rows that keeps every call on the integer kernel (the decode arithmetic)
# (label, engine settings); the first row is the reference the others are measured against. Windows are
# prefills, which run quantized weights through dequantize + GEMM; the "integer kernel" rows force the
# decode path's arithmetic (activations quantized per 32 to int16) onto every position instead.
MODES = [("fp32 (reference)", {"dtype": "float32"}),
         ("bf16", {"dtype": "bfloat16"}),
         ("gguf (Q4_1 / Q8_0 as stored), fp32", {"dtype": "float32", "quantization": "gguf"}),
         ("gguf, integer kernel at every position", {"dtype": "float32", "quantization": "gguf",
                                                     "dequant_min_rows": INTEGER_ONLY}),
         ("int8 (per channel), fp32", {"dtype": "float32", "quantization": "int8"}),
         ("int4 (groups of 32), fp32", {"dtype": "float32", "quantization": "int4"}),
         ("int4, integer kernel at every position", {"dtype": "float32", "quantization": "int4",
                                                     "dequant_min_rows": INTEGER_ONLY})]
# Largest allowed relative increase in perplexity (issue 15's budget for each mode).
BUDGET = {"bf16": 0.01, "gguf (Q4_1 / Q8_0 as stored), fp32": 0.005, "gguf, integer kernel at every position": 0.005,
          "int8 (per channel), fp32": 0.01, "int4 (groups of 32), fp32": 0.05,
          "int4, integer kernel at every position": 0.05}


@dataclass
class Scored:
    logprobs: list[float]  # of each scored token
    top1: list[int]  # the most likely token at each scored position
    seconds: float

    @property
    def perplexity(self) -> float:
        return math.exp(-sum(self.logprobs) / len(self.logprobs))


def windows(tokens: list[int], size: int) -> list[list[int]]:
    return [tokens[i:i + size] for i in range(0, len(tokens) - 1, size) if len(tokens[i:i + size]) > 1]


def score(settings: dict, chunks: list[list[int]]) -> Scored:
    """Every position of every window but the first of each (nothing to predict it from)."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.model import quant_linear

    settings = dict(settings)
    crossover = settings.pop("dequant_min_rows", quant_linear.DEQUANT_MIN_ROWS)
    llm = LLM(**{"kv_cache_memory": "512MiB", **settings})
    default, quant_linear.DEQUANT_MIN_ROWS = quant_linear.DEQUANT_MIN_ROWS, crossover
    try:
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": c} for c in chunks],
                            SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
        seconds = time.perf_counter() - start
    finally:
        quant_linear.DEQUANT_MIN_ROWS = default
    logprobs, top1 = [], []
    for chunk, out in zip(chunks, outs, strict=True):
        for i in range(1, len(chunk)):
            entry = out.prompt_logprobs[i]
            logprobs.append(entry[chunk[i]].logprob)
            top1.append(next(t for t, lp in entry.items() if lp.rank == 1))
    return Scored(logprobs, top1, seconds)


QUICK = ["--tokens", "600", "--window", "300"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=20480, help="tokens of the text to score (>= 20,000 for the table)")
    p.add_argument("--window", type=int, default=2048, help="window length in tokens (each scored independently)")
    p.add_argument("--docs", type=Path, default=REPO / "docs", help="where benchmarks.md is")
    p.add_argument("--no-write", action="store_true", help="print the table only")


def run_args(args: argparse.Namespace) -> int:
    from pagedserve.model.loader import load_model

    tokens = corpus_tokens(load_model(None).tokenizer)[:args.tokens]
    chunks = windows(tokens, args.window)
    results: dict[str, Scored] = {}
    for label, settings in MODES:
        log(f"{label}: scoring {len(tokens)} tokens in {len(chunks)} windows of {args.window}")
        results[label] = score(settings, chunks)
        log(f"  perplexity {results[label].perplexity:.4f} in {results[label].seconds:.0f} s")
    body, failures = render(results, args, len(tokens), len(chunks))
    print(body)
    if failures:
        log("over budget: " + "; ".join(failures))
    if not args.no_write:
        write_section("Perplexity (quality of each numeric mode)", body, args.docs / "benchmarks.md")
    return 1 if failures else 0


def render(results: dict[str, Scored], args: argparse.Namespace, num_tokens: int, num_windows: int) -> tuple[str, list[str]]:
    ref = next(iter(results.values()))
    lines = [f"Command: `pagedserve bench perplexity --tokens {args.tokens} --window {args.window}`", "",
             machine_line(), "",
             (f"Text: the first {num_tokens:,} tokens of the standard library's documentation (ships with Python), "
              f"{num_windows} windows of {args.window}; {len(ref.logprobs):,} scored positions. Same GGUF weights "
              f"in every row (int8 / int4 re-quantize them)."), "",
             "| mode | perplexity | vs fp32 | budget | top-1 agreement with fp32 | scoring time (s) |",
             "|---|---|---|---|---|---|"]
    failures = []
    for label, r in results.items():
        change = r.perplexity / ref.perplexity - 1
        agree = sum(a == b for a, b in zip(r.top1, ref.top1, strict=True)) / len(ref.top1)
        budget = BUDGET.get(label)
        if budget is not None and abs(change) > budget:
            failures.append(f"{label}: {change:+.2%} against a budget of {budget:.1%}")
        lines.append(f"| {label} | {r.perplexity:.4f} | {change:+.3%} | "
                     f"{'-' if budget is None else f'{budget:.1%}'} | {agree:.2%} | {r.seconds:.0f} |")
    return "\n".join(lines), failures
