"""Quantized-weight speed: `pagedserve bench quantization` (or benchmarks/quantization.py).

For each --quantization mode, in one run, with the modes' order alternating between repeats:
  SINGLE  one 128-token prompt, 128 greedy output tokens: TTFT and ms per output token, beside llama.cpp's
          llama-bench on the same GGUF with the same threads (tg128 and pp128)
  W1      64 x (128 in, 128 out), output tok/s, against the first mode (the float path)
  MIX     bench throughput's MIX (128 requests, prompts 64-512, outputs 16-256), output tok/s, the same way
with the roofline of each: weight bytes read per output token (resident weight bytes: a single stream
reads them all every token) and the GB/s that implies, against this machine's copy bandwidth measured in
the same run. Greedy outputs of every mode are compared with the first mode's (first differing token).
Quality per mode is `pagedserve bench perplexity`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

from pagedserve.bench.measure import Run, agreement, length_problems, log, spread
from pagedserve.bench.report import REPO, machine_line, publish
from pagedserve.bench.servers import default_gguf
from pagedserve.bench.throughput import run_engine, single_stream
from pagedserve.bench.workloads import Job, corpus_tokens, mix, w1
from pagedserve.config import EngineConfig

if TYPE_CHECKING:
    from pagedserve.engine.llm_engine import LLMEngine

LLAMA_BENCH = REPO / "build" / "peers" / "llama.cpp" / "build" / "bin" / "llama-bench"
QUICK = ["--modes", "none,gguf", "--requests", "4", "--length", "16", "--repeats", "1", "--mix-requests", "4"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or packaged model (gemma-3-270m); default: SmolLM2-135M. "
                   "Another model writes its own section, llama-bench on its GGUF")
    p.add_argument("--modes", default="none,gguf,int8,int4", help="comma-separated --quantization modes; the "
                   "first is the baseline of the ratios")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="activations' dtype")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of every system")
    p.add_argument("--requests", type=int, default=64, help="W1 requests")
    p.add_argument("--length", type=int, default=128, help="prompt and output tokens of W1 and SINGLE")
    p.add_argument("--mix-requests", type=int, default=128, help="MIX requests (0: skip MIX)")
    p.add_argument("--repeats", type=int, default=3, help="rounds over the modes; the order reverses every round")
    p.add_argument("--kv-cache-memory", default="2GiB",
                   help="KV pool of each engine: W1 fits without preemption (as in `bench throughput`)")
    p.add_argument("--llama-bench", default=str(LLAMA_BENCH),
                   help="llama-bench binary (benchmarks/peers/build_llama_server.sh builds it)")
    p.add_argument("--docs", type=Path, default=REPO / "docs", help="where benchmarks.md is")
    p.add_argument("--no-write", action="store_true", help="print the table only")


def copy_bandwidth_gbs(size_mb: int = 512) -> float:
    """Best of 5 copies of a buffer far larger than the caches: bytes read + written per second."""
    import torch

    src = torch.ones(size_mb * 2**20 // 4)
    dst = torch.empty_like(src)
    best = min(_timed(lambda: dst.copy_(src)) for _ in range(5))
    return 2 * src.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def llama_bench(binary: str, threads: int, length: int, gguf: Path | None = None) -> dict[str, float] | None:
    """llama.cpp on gguf (default: the packaged SmolLM2): {"tg_ms": ms per generated token, "pp_tps": prompt
    tokens/s}."""
    if not Path(binary).is_file():
        log(f"no llama-bench at {binary} (benchmarks/peers/build_llama_server.sh builds it): peer skipped")
        return None
    out = subprocess.run([binary, "-m", str(gguf or default_gguf()), "-p", str(length), "-n", str(length), "-t", str(threads),
                          "-r", "3", "-o", "json"], capture_output=True, text=True, check=True, timeout=900)
    rows = json.loads(out.stdout)
    tg = next(r for r in rows if r["n_gen"] > 0)
    pp = next(r for r in rows if r["n_prompt"] > 0)
    return {"tg_ms": 1e3 / tg["avg_ts"], "pp_tps": pp["avg_ts"]}


def run_args(args: argparse.Namespace) -> int:
    from pagedserve.engine.llm_engine import LLMEngine

    modes = args.modes.split(",")
    from pagedserve.model.loader import resolve_model_path

    engines = {m: LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, quantization=m, num_threads=args.threads,
                                         kv_cache_memory=args.kv_cache_memory)) for m in modes}
    base = engines[modes[0]]
    tokens = corpus_tokens(base.tokenizer)
    single = w1(tokens, 1, args.length, args.length)[0]
    workloads = {"W1": w1(tokens, args.requests, args.length, args.length)}
    if args.mix_requests:
        workloads["MIX"] = mix(tokens, args.mix_requests)
    for eng in engines.values():  # the same warm-up for each
        run_engine(eng, w1(tokens, 4, 16, 16))
    bandwidth = copy_bandwidth_gbs()
    log(f"copy bandwidth {bandwidth:.1f} GB/s")
    singles = {m: [] for m in modes}
    ttfts = {m: [] for m in modes}
    tps = {name: {m: [] for m in modes} for name in workloads}
    outputs, problems = {}, []
    for r in range(args.repeats):
        for m in (modes if r % 2 == 0 else modes[::-1]):
            eng = engines[m]
            ttft, ms = single_stream(eng, single)
            singles[m].append(ms)
            ttfts[m].append(ttft * 1e3)
            for name, jobs in workloads.items():
                run = throughput(eng, f"{name} {m}", jobs, problems)
                tps[name][m].append(run.output_tps)
                if name == "W1":
                    outputs.setdefault(m, run.outputs)
            log(f"round {r + 1} {m}: single {ms:.1f} ms/token, " +
                ", ".join(f"{name} {tps[name][m][-1]:.0f} tok/s" for name in workloads))
    path = resolve_model_path(args.model) if args.model else None  # None: the packaged SmolLM2 GGUF
    peer = llama_bench(args.llama_bench, args.threads, args.length, path) if path is None or path.suffix == ".gguf" else None
    body = render(args, engines, singles, ttfts, tps, outputs, peer, bandwidth)
    title = "Quantized weights (speed)" + (f": {args.model}" if args.model else "")
    return publish(title, body, problems, args.docs, not args.no_write)


def throughput(eng: LLMEngine, label: str, jobs: list[Job], problems: list[str]) -> Run:
    """One run of jobs on a cold prefix cache; a preemption or a wrong length is a problem of the run."""
    eng.kv.reset_prefix_cache()
    preempted = eng.scheduler.num_preemptions
    run = run_engine(eng, jobs)
    if eng.scheduler.num_preemptions != preempted:
        problems.append(f"{label}: preempted {eng.scheduler.num_preemptions - preempted} times (pool too small)")
    problems += length_problems(label, run, jobs)
    return run


def render(args, engines, singles, ttfts, tps, outputs, peer, bandwidth) -> str:
    import torch

    from pagedserve.model.quant_linear import few_rows_limit

    modes, names = list(engines), list(tps)
    kernels = ", ".join(sorted({e.weights_info["quant_kernel"] for e in engines.values()} - {"none"})) or "none"
    model = f"--model {args.model} " if args.model else ""
    lines = [(f"Command: `pagedserve bench quantization {model}--modes {args.modes} --threads {args.threads} "
             f"--requests {args.requests} --length {args.length} --mix-requests {args.mix_requests} "
             f"--repeats {args.repeats} --kv-cache-memory {args.kv_cache_memory}`"), "", machine_line(), "",
             ("| mode | dtype | weights MB | SINGLE ms/token | SINGLE TTFT ms | weight GB/s at one stream | " +
              "".join(f"{name} output tok/s | {name} vs {modes[0]} | " for name in names) +
              f"greedy W1 vs {modes[0]}: identical, median first difference |"),
             "|---|---|---|---|---|---|" + "---|---|" * len(names) + "---|"]
    for m, eng in engines.items():
        ms = statistics.median(singles[m])
        same, n, first = agreement(outputs[m], outputs[modes[0]])
        ratios = "".join(f"{spread(tps[name][m], '{:.0f}')} | "
                         f"{spread([a / b for a, b in zip(tps[name][m], tps[name][modes[0]], strict=True)], '{:.2f}x')} | "
                         for name in names)
        lines.append(f"| {m} | {str(eng.dtype).removeprefix('torch.')} | {eng.weight_bytes / 1e6:.0f} | "
                     f"{spread(singles[m])} | {spread(ttfts[m], '{:.0f}')} | {eng.weight_bytes / ms / 1e6:.1f} | "
                     f"{ratios}{same}/{n}, {first:.0f} of {args.length} |")
    if peer:
        lines.append(f"| llama.cpp (llama-bench, same GGUF) | - | - | {peer['tg_ms']:.1f} | "
                     f"{args.length / peer['pp_tps'] * 1e3:.0f} (pp{args.length}) | - | " + "- | - | " * len(names) +
                     "- |")
    lines += ["", (f"- Copy bandwidth of this machine in the same run: {bandwidth:.1f} GB/s (read + write). Weight "
              "GB/s: resident weight bytes / ms per token (a single stream reads every weight each token; the "
              "KV cache and activations are not counted)."),
              (f"- Threads: {args.threads} for every system. Figures: median (min-max over the rounds); the modes' "
              f"order reverses every round. vs {modes[0]}: the ratio within each round (a shared machine's speed "
              "drifts between rounds), median (min-max) over the rounds."),
              (f"- Kernels (integer path for calls under {few_rows_limit(torch.bfloat16)} rows + large-M path): "
              f"{kernels}. The integer path quantizes activations per 32 to int16; `amx` multiplies bf16 tiles over "
              "weights dequantized 32 rows at a time (calls up to 512 rows; prefill chunks beyond that take "
              "`dequant`); `dequant` dequantizes whole matrices into a float GEMM; `w8a8-amx` (int8 where the CPU "
              "has AMX int8 tiles) runs every call on int8 tiles, weights per channel and tokens per token in a "
              "Hadamard basis over each 64 channels (csrc/quant_gemm_w8a8.cpp). Quantized modes run pure decode "
              "steps on the decode stack (all layers in one C++ call, model/decode_stack.py); `none` on the Python "
              "layers over oneDNN's packed bf16 linears.")]
    return "\n".join(lines)
