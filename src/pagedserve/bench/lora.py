"""Multi-LoRA throughput: `pagedserve bench lora` (or benchmarks/lora.py).

--requests requests of --length prompt and exactly --length output tokens (greedy, EOS ignored), spread
over 1, 8, 32 and 128 distinct adapters (uniformly, and Zipf with s = 1.1), at each --ranks, all in one run:
  base     the same requests on the base model alone (no adapters): the overhead's reference
  batched  every adapter in one running batch (--max-loras = the adapters), one forward pass per step
  naive    one adapter at a time, as a server that merges an adapter into the weights must: each adapter's
           requests alone at the base model's speed (a merged adapter adds no compute), plus the time to
           merge it (W += scale B A over every targeted projection, measured here) at each switch
Adapters are written here (PEFT files, random weights on all seven projections, fixed seeds), loaded
through the engine's loader; their memory and load time are reported, and throughput against the number
of adapters is plotted.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from pagedserve.bench.measure import log
from pagedserve.bench.report import REPO, machine_line, publish
from pagedserve.bench.workloads import corpus_tokens, w1
from pagedserve.config import EngineConfig
from pagedserve.lora_request import LoRARequest
from pagedserve.model.lora import part_shapes
from pagedserve.sampling_params import SamplingParams

QUICK = ["--requests", "8", "--length", "8", "--adapters", "1,4", "--ranks", "8", "--no-plot"]
MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=128, help="requests per run")
    p.add_argument("--length", type=int, default=64, help="prompt and output tokens of each request")
    p.add_argument("--adapters", default="1,8,32,128", help="comma-separated numbers of distinct adapters")
    p.add_argument("--ranks", default="8,64", help="comma-separated adapter ranks")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"], help="the engine's dtype")
    p.add_argument("--no-plot", action="store_true", help="skip docs/lora_throughput.png")
    p.add_argument("--docs", type=Path, default=REPO / "docs", help="where benchmarks.md is")
    p.add_argument("--no-write", action="store_true", help="print the table only")


def write_adapters(root: Path, config, count: int, rank: int) -> list[LoRARequest]:
    shapes = part_shapes(config)
    out = []
    for i in range(count):
        gen = torch.Generator().manual_seed(rank * 1000 + i)
        tensors = {}
        for layer in range(config.num_hidden_layers):
            for m in MODULES:
                where = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
                key = f"base_model.model.model.layers.{layer}.{where}.{m}.lora_{{}}.weight"
                n_out, n_in = shapes[m]
                tensors[key.format("A")] = torch.randn(rank, n_in, generator=gen) / n_in ** 0.5
                tensors[key.format("B")] = torch.randn(n_out, rank, generator=gen) * 0.01
        folder = root / f"r{rank}-{i}"
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank,
                                                                "target_modules": MODULES}))
        save_file(tensors, str(folder / "adapter_model.safetensors"))
        out.append(LoRARequest(f"r{rank}-{i}", rank * 1000 + i + 1, str(folder)))
    return out


def assignment(requests: int, adapters: int, zipf: bool, seed: int = 0) -> list[int]:
    """Which adapter each request uses: uniform round robin, or Zipf(1.1) draws."""
    if not zipf:
        return [i % adapters for i in range(requests)]
    weights = [1 / (k + 1) ** 1.1 for k in range(adapters)]
    return random.Random(seed).choices(range(adapters), weights, k=requests)


def timed_run(engine, jobs, loras: list[LoRARequest | None]) -> tuple[float, int]:
    """Every run computes its prompts: the prefix cache is emptied first (the runs repeat the same prompts)."""
    engine.kv.reset_prefix_cache()
    params = [SamplingParams(temperature=0, max_tokens=j.max_tokens, ignore_eos=True) for j in jobs]
    for i, (job, p, lora) in enumerate(zip(jobs, params, loras, strict=True)):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", job.prompt_token_ids, p, lora_request=lora)
    start, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                if out.error:
                    raise RuntimeError(out.error)
                tokens += len(out.outputs[0].token_ids)
    return time.perf_counter() - start, tokens


def merge_seconds(adapter) -> float:
    """Time to fold one adapter into the weights: B A for every projection it targets."""
    start = time.perf_counter()
    for layer in adapter.layers:
        for w in layer.values():
            torch.matmul(w.b, w.a)
    return time.perf_counter() - start


def run_args(args: argparse.Namespace) -> int:
    from pagedserve.engine.llm_engine import LLMEngine

    counts, ranks = [int(x) for x in args.adapters.split(",")], [int(x) for x in args.ranks.split(",")]
    engine = LLMEngine(EngineConfig(dtype=args.dtype, kv_cache_memory="2GiB", enable_lora=True,
                                    max_loras=max(counts), max_lora_rank=max(ranks), max_cpu_loras=max(counts),
                                    max_num_seqs=args.requests))
    jobs = w1(corpus_tokens(engine.tokenizer), args.requests, args.length, args.length)
    expected = args.requests * args.length
    timed_run(engine, jobs, [None] * len(jobs))  # warm-up at the runs' own shapes
    base_s, tokens = timed_run(engine, jobs, [None] * len(jobs))
    base_runs = [tokens / base_s]
    log(f"base: {base_runs[0]:.0f} tok/s")
    rows, problems, alone = [], [], {}  # alone: (adapters, zipf) -> seconds of the naive runs, merges left out
    with tempfile.TemporaryDirectory(prefix="pagedserve-lora-") as tmp:
        for rank in ranks:
            requests = write_adapters(Path(tmp), engine.model_config, max(counts), rank)
            start = time.perf_counter()
            loaded = [engine.loras.load(r) for r in requests]
            load_ms = (time.perf_counter() - start) / len(requests) * 1e3
            merge_s = statistics.median(merge_seconds(a) for a in loaded[:8])
            timed_run(engine, jobs, [requests[k] for k in assignment(args.requests, max(counts), False)])  # warm-up
            for count in counts:
                for zipf in (False, True):
                    which = assignment(args.requests, count, zipf)
                    elapsed, tokens = timed_run(engine, jobs, [requests[k] for k in which])
                    if tokens != expected:
                        problems.append(f"rank {rank}, {count} adapters: {tokens} tokens, expected {expected}")
                    if (count, zipf) not in alone:  # the same for every rank: weights as merged run at base cost
                        alone[count, zipf] = one_at_a_time(engine, jobs, which)
                    naive = alone[count, zipf] + len(set(which)) * merge_s
                    rows.append({"rank": rank, "adapters": count, "zipf": zipf, "distinct": len(set(which)),
                                 "tps": tokens / elapsed, "naive_tps": expected / naive,
                                 "mb": loaded[0].nbytes / 1e6, "load_ms": load_ms, "merge_ms": merge_s * 1e3})
                    log(f"rank {rank}, {count} adapters{' zipf' if zipf else ''}: {tokens / elapsed:.0f} tok/s "
                        f"({tokens / elapsed / base_runs[0]:.0%} of the first base run), naive {expected / naive:.0f}")
    engine.kv.reset_prefix_cache()
    base_s, tokens = timed_run(engine, jobs, [None] * len(jobs))  # again at the end: the machine drifts
    base_runs.append(tokens / base_s)
    base_tps = statistics.median(base_runs)
    for r in rows:
        r["vs_base"] = r["tps"] / base_tps
    body = render(args, base_runs, rows)
    if not args.no_plot and not args.no_write:
        plot(rows, base_tps, args.docs / "lora_throughput.png")
    return publish("Multi-LoRA", body, problems, args.docs, not args.no_write)


def one_at_a_time(engine, jobs, which: list[int]) -> float:
    """Seconds to serve each adapter's requests alone, one adapter after another, on the base weights."""
    total = 0.0
    for k in sorted(set(which)):
        group = [j for j, w in zip(jobs, which, strict=True) if w == k]
        engine.kv.reset_prefix_cache()
        total += timed_run(engine, group, [None] * len(group))[0]
    return total


def render(args, base_runs: list[float], rows: list[dict]) -> str:
    lines = [(f"Command: `pagedserve bench lora --requests {args.requests} --length {args.length} --adapters "
             f"{args.adapters} --ranks {args.ranks} --dtype {args.dtype}`"), "", machine_line(), "",
             (f"{args.requests} requests x ({args.length} prompt, {args.length} output) tokens. Base model alone: "
              f"{base_runs[0]:.0f} output tok/s before the adapter runs, {base_runs[1]:.0f} after; `vs base` is "
              "against their median."), "",
             ("| rank | adapters | spread | distinct in the batch | batched tok/s | vs base | naive tok/s | "
             "batched vs naive | MB per adapter | load ms | merge ms |"), "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['rank']} | {r['adapters']} | {'Zipf 1.1' if r['zipf'] else 'uniform'} | {r['distinct']} | "
                     f"{r['tps']:.0f} | {r['vs_base']:.0%} | {r['naive_tps']:.0f} | "
                     f"{r['tps'] / r['naive_tps']:.1f}x | {r['mb']:.1f} | {r['load_ms']:.0f} | {r['merge_ms']:.1f} |")
    lines += ["", ("- Adapters target all seven projections of every layer; one run per row (a shared machine: "
              "read ratios, not absolutes)."),
              ("- Naive: each adapter's requests alone at the base model's speed (merged weights add no compute) "
              "plus one merge per adapter; the unmerge before the next one is not counted (it favours naive).")]
    return "\n".join(lines)


def plot(rows: list[dict], base_tps: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for rank in sorted({r["rank"] for r in rows}):
        for zipf, style in ((False, "-o"), (True, "--s")):
            pts = [r for r in rows if r["rank"] == rank and r["zipf"] == zipf]
            ax.plot([r["adapters"] for r in pts], [r["tps"] for r in pts], style,
                    label=f"batched, rank {rank}{', Zipf' if zipf else ''}")
            if not zipf:
                ax.plot([r["adapters"] for r in pts], [r["naive_tps"] for r in pts], ":x",
                        label=f"naive, rank {rank}")
    ax.axhline(base_tps, color="gray", lw=1, label="base model alone")
    ax.set(xscale="log", xlabel="distinct adapters", ylabel="output tok/s", title="Multi-LoRA throughput")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
