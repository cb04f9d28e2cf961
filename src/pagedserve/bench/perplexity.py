"""Quality benchmark: `pagedserve bench perplexity` (or benchmarks/perplexity.py).

Perplexity of the default model (or --model's) over a fixed English text that ships with Python (the standard library's
documentation, pagedserve.bench.workloads.corpus_tokens), scored in non-overlapping windows through the
engine's prompt logprobs, for each numeric mode against the fp32 reference on the same weights: the
change in perplexity and the top-1 agreement (the reference's most likely next token) over every position.
The KV table does the same per --kv-cache-dtype against the model-dtype cache, in short windows and in long
ones (where quantization error accumulates most); prompt scoring attends over the pool, so it reads the
quantized cache at every position. The checkpoints table (--suite checkpoints) scores quantized Hugging Face
folders (`make quantized`'s reference checkpoints, or `pagedserve quantize` outputs) as stored, in fp32, against
the fp32 folder they were made from.
"""
from __future__ import annotations

import argparse
import json
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
         ("gguf (as stored), fp32", {"dtype": "float32", "quantization": "gguf"}),
         ("gguf, integer kernel at every position", {"dtype": "float32", "quantization": "gguf",
                                                     "dequant_min_rows": INTEGER_ONLY}),
         ("int8 (per channel), fp32", {"dtype": "float32", "quantization": "int8"}),
         ("int8, bf16 (W8A8 where the CPU has AMX int8 tiles)", {"dtype": "bfloat16", "quantization": "int8"}),
         ("int4 (groups of 32), fp32", {"dtype": "float32", "quantization": "int4"}),
         ("int4, integer kernel at every position", {"dtype": "float32", "quantization": "int4",
                                                     "dequant_min_rows": INTEGER_ONLY})]
# KV cache formats, same fp32 weights; the first row is the reference (the cache in the model dtype).
KV_MODES = [("fp32 KV (reference)", {"dtype": "float32"}),
            ("bfloat16 KV", {"dtype": "float32", "kv_cache_dtype": "bfloat16"}),
            ("fp8_e4m3 KV (fp8)", {"dtype": "float32", "kv_cache_dtype": "fp8_e4m3"}),
            ("fp8_e5m2 KV", {"dtype": "float32", "kv_cache_dtype": "fp8_e5m2"}),
            ("int8 KV", {"dtype": "float32", "kv_cache_dtype": "int8"}),
            ("int4 KV (KIVI: keys per channel, values per token)", {"dtype": "float32", "kv_cache_dtype": "int4"})]
# Issue 16's budget: fp8 (= e4m3, as in vLLM) and int8 within 1%, int4 within 5%. e5m2 is reported beside it without one: two
# mantissa bits cost this model about 2% even in the Hadamard basis.
KV_BUDGET = {"bfloat16 KV": 0.01, "fp8_e4m3 KV (fp8)": 0.01, "int8 KV": 0.01,
             "int4 KV (KIVI: keys per channel, values per token)": 0.05}
JUDGED_FROM = 10_000  # budgets are judged on at least this many tokens; smaller runs (--quick) only report
# Largest allowed relative increase in perplexity (issue 15's budget for each mode).
BUDGET = {"bf16": 0.01, "gguf (as stored), fp32": 0.005, "gguf, integer kernel at every position": 0.005,
          "int8 (per channel), fp32": 0.01, "int8, bf16 (W8A8 where the CPU has AMX int8 tiles)": 0.01, "int4 (groups of 32), fp32": 0.05,
          "int4, integer kernel at every position": 0.05}


@dataclass
class Scored:
    logprobs: list[float]  # of each scored token
    top1: list[int]  # the most likely token at each scored position
    seconds: float
    scheme: str = "none"  # the weights' quantization as the engine reports it

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
    return Scored(logprobs, top1, seconds, llm.engine.weights_info["quantization"])


QUICK = ["--tokens", "600", "--window", "300", "--kv-windows", "300"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=20480, help="tokens of the text to score (>= 20,000 for the table)")
    p.add_argument("--window", type=int, default=2048, help="window length in tokens (each scored independently)")
    p.add_argument("--docs", type=Path, default=REPO / "docs", help="where benchmarks.md is")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    p.add_argument("--suite", choices=["weights", "kv", "checkpoints", "all"], default="all",
                   help="weights: the weight-quantization table; kv: the KV-cache table; all: both; checkpoints: "
                        "quantized HF folders against the fp32 folder they were made from (not part of all)")
    p.add_argument("--checkpoints", default=str(REPO / "build/quantized"),
                   help="the checkpoints suite: comma-separated quantized folders, or folders holding them")
    p.add_argument("--reference", default=str(REPO / "build/peers/smollm2-hf"),
                   help="the checkpoints suite: the fp32 folder they were made from")
    p.add_argument("--model", default=None,
                   help="score another model than the default (the weights suite only), e.g. gemma-3-270m: the same "
                        "text in its own tokens, every mode on its weights")
    p.add_argument("--kv-windows", default="512,2048",
                   help="window lengths of the KV table, comma-separated (short, then long context)")


def run_args(args: argparse.Namespace) -> int:
    from pagedserve.model.loader import load_model

    if args.model and args.suite != "weights":
        log("--model scores the weights suite only (the KV table's capacities are the default model's): "
            "add --suite weights")
        return 2
    if args.suite == "checkpoints":
        return run_checkpoints(args)
    tokens = corpus_tokens(load_model(args.model).tokenizer)[:args.tokens]
    failures = []
    if args.suite in ("weights", "all"):
        chunks = windows(tokens, args.window)
        modes = [(label, {**settings, "model": args.model}) for label, settings in MODES]
        results = score_all(modes, chunks, len(tokens), args.window)
        body, failed = render(results, args, len(tokens), len(chunks))
        failures += failed
        print(body)
        if not args.no_write:
            title = "Perplexity (quality of each numeric mode)" + (f": {args.model}" if args.model else "")
            write_section(title, body, args.docs / "benchmarks.md")
    if args.suite in ("kv", "all"):
        by_window = {}
        for size in (int(w) for w in args.kv_windows.split(",")):
            by_window[size] = score_all(KV_MODES, windows(tokens, size), len(tokens), size)
        body, failed = render_kv(by_window, args, len(tokens))
        failures += failed
        print(body)
        if not args.no_write:
            write_section("Perplexity with a quantized KV cache", body, args.docs / "benchmarks.md")
    if failures and len(tokens) < JUDGED_FROM:
        log(f"over budget on only {len(tokens)} tokens (noise at this size; judged from {JUDGED_FROM:,}): "
            + "; ".join(failures))
        return 0
    if failures:
        log("over budget: " + "; ".join(failures))
    return 1 if failures else 0


def score_all(modes: list[tuple[str, dict]], chunks: list[list[int]], num_tokens: int, size: int) -> dict[str, Scored]:
    results: dict[str, Scored] = {}
    for label, settings in modes:
        log(f"{label}: scoring {num_tokens} tokens in {len(chunks)} windows of {size}")
        results[label] = score(settings, chunks)
        log(f"  perplexity {results[label].perplexity:.4f} in {results[label].seconds:.0f} s")
    return results


def compare(r: Scored, ref: Scored) -> tuple[float, float]:
    """Relative change in perplexity and top-1 agreement against the reference."""
    agree = sum(a == b for a, b in zip(r.top1, ref.top1, strict=True)) / len(ref.top1)
    return r.perplexity / ref.perplexity - 1, agree


def render_kv(by_window: dict[int, dict[str, Scored]], args: argparse.Namespace,
              num_tokens: int) -> tuple[str, list[str]]:
    sizes = list(by_window)
    lines = [f"Command: `pagedserve bench perplexity --suite kv --tokens {args.tokens} --kv-windows {args.kv_windows}`",
             "", machine_line(), "",
             (f"Text: the first {num_tokens:,} tokens of the standard library's documentation, in windows of "
              f"{' and '.join(map(str, sizes))} tokens; fp32 weights (the same GGUF) in every row, so only the "
              "cache differs. Prompt scoring attends over the pool: every position reads the stored format. "
              "fp8 scales come from the start-up calibration pass (per layer and KV head) and fp8 keys and "
              "queries are in the Hadamard basis; int8 scales per token and head (8-bit codes); int4 keys are "
              "shifted by their calibrated mean per channel and carry 8-bit scale codes and 4-bit zero points "
              "(kv_int4.py)."), "",
             "| KV cache | " + " | ".join(f"perplexity ({w}) | vs reference ({w}) | top-1 ({w})" for w in sizes)
             + " | budget | tokens per MiB |",
             "|---|" + "---|---|---|" * len(sizes) + "---|---|"]
    failures = []
    refs = {w: next(iter(r.values())) for w, r in by_window.items()}
    for label, settings in KV_MODES:
        cells, budget = [], KV_BUDGET.get(label)
        for w in sizes:
            r = by_window[w][label]
            change, agree = compare(r, refs[w])
            cells.append(f"{r.perplexity:.4f} | {change:+.3%} | {agree:.2%}")
            if budget is not None and abs(change) > budget:
                failures.append(f"{label} (windows of {w}): {change:+.2%} against a budget of {budget:.1%}")
        lines.append(f"| {label} | " + " | ".join(cells) +
                     f" | {'-' if budget is None else f'{budget:.0%}'} | {tokens_per_mib(settings)} |")
    return "\n".join(lines), failures


def tokens_per_mib(settings: dict) -> int:
    """Of the default model: 30 layers, 3 KV heads of 64, 16-token blocks (int4's key tails not counted)."""
    import torch

    from pagedserve.model.kv_cache_dtype import resolve_kv_format

    fmt = resolve_kv_format(settings.get("kv_cache_dtype", "auto"), torch.float32)
    return (1 << 20) * 16 // (30 * fmt.block_bytes(16, 3, 64))


def render(results: dict[str, Scored], args: argparse.Namespace, num_tokens: int, num_windows: int) -> tuple[str, list[str]]:
    ref = next(iter(results.values()))
    model = f" --model {args.model} --suite weights" if args.model else ""
    lines = [f"Command: `pagedserve bench perplexity{model} --tokens {args.tokens} --window {args.window}`", "",
             machine_line(), "",
             (f"Text: the first {num_tokens:,} tokens of the standard library's documentation (ships with Python), "
              f"{num_windows} windows of {args.window}; {len(ref.logprobs):,} scored positions. Same GGUF weights "
              f"in every row (int8 / int4 re-quantize them)."), "",
             "| mode | perplexity | vs fp32 | budget | top-1 agreement with fp32 | scoring time (s) |",
             "|---|---|---|---|---|---|"]
    failures = []
    for label, r in results.items():
        change, agree = compare(r, ref)
        budget = BUDGET.get(label)
        if budget is not None and abs(change) > budget:
            failures.append(f"{label}: {change:+.2%} against a budget of {budget:.1%}")
        lines.append(f"| {label} | {r.perplexity:.4f} | {change:+.3%} | "
                     f"{'-' if budget is None else f'{budget:.1%}'} | {agree:.2%} | {r.seconds:.0f} |")
    return "\n".join(lines), failures


# The budgets for checkpoints, by what config.json's quantization says: W8A8 and FP8 within 1%.
CHECKPOINT_BUDGET = {"W8A8": 0.01, "float8": 0.01, "fp8": 0.01}


def checkpoint_folders(spec: str) -> list[Path]:
    """Each folder with a config.json that names a quantization_config, given directly or one level down."""
    found = []
    for entry in (Path(p) for p in spec.split(",") if p):
        candidates = [entry] if (entry / "config.json").is_file() else sorted(entry.glob("*/config.json"))
        found += [c if c.is_dir() else c.parent for c in candidates]
    return [f for f in found if "quantization_config" in json.loads((f / "config.json").read_text())]


def run_checkpoints(args: argparse.Namespace) -> int:
    from pagedserve.model.loader import load_model

    folders = checkpoint_folders(args.checkpoints)
    if not folders:
        log(f"no quantized folders in {args.checkpoints} (make quantized, or pagedserve quantize)")
        return 2
    tokens = corpus_tokens(load_model(args.reference).tokenizer)[:args.tokens]
    chunks = windows(tokens, args.window)
    modes = [(f"{Path(args.reference).name} fp32 (reference)", {"model": args.reference, "dtype": "float32"})]
    modes += [(f.name, {"model": str(f), "dtype": "float32"}) for f in folders]
    results = score_all(modes, chunks, len(tokens), args.window)
    ref = next(iter(results.values()))
    lines = [(f"Command: `pagedserve bench perplexity --suite checkpoints --tokens {args.tokens} --window "
              f"{args.window}`"), "", machine_line(), "",
             (f"Each folder as stored (our loader and kernels, fp32), {len(ref.logprobs):,} scored positions of the "
              f"standard library's documentation, against the fp32 folder they were made from."), "",
             "| checkpoint | scheme | perplexity | vs fp32 | budget | top-1 agreement with fp32 |", "|---|---|---|---|---|---|"]
    failures = []
    for label, r in results.items():
        scheme, (change, agree) = r.scheme, compare(r, ref)
        budget = next((b for key, b in CHECKPOINT_BUDGET.items() if key in scheme), None)
        if budget is not None and change > budget:
            failures.append(f"{label}: {change:+.2%} against a budget of {budget:.0%}")
        lines.append(f"| {label} | {scheme} | {r.perplexity:.4f} | {change:+.2%} | "
                     f"{'-' if budget is None else f'{budget:.0%}'} | {agree:.2%} |")
    body = "\n".join(lines) + "".join(f"\n- {n}" for n in against_rtn(results)) + \
        "".join(f"\n- over budget: {f}" for f in failures)
    print(body)
    if not args.no_write:
        write_section("Perplexity of quantized checkpoints", body, args.docs / "benchmarks.md")
    return 1 if failures and len(tokens) >= JUDGED_FROM else 0


def against_rtn(results: dict[str, Scored]) -> list[str]:
    """Each checkpoint beside a round-to-nearest one ('rtn' in its name) of the same scheme: which is better."""
    notes = []
    for rtn_label, rtn in ((k, v) for k, v in results.items() if "rtn" in k.lower()):
        for label, r in results.items():
            if label != rtn_label and r.scheme == rtn.scheme:
                verdict = "better" if r.perplexity < rtn.perplexity else "NOT better"
                notes.append(f"{label} is {verdict} than {rtn_label} at the same scheme ({r.scheme}): "
                             f"{r.perplexity:.4f} vs {rtn.perplexity:.4f}.")
    return notes
