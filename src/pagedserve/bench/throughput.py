"""Offline throughput benchmark: `pagedserve bench throughput` (or benchmarks/throughput.py).

Runs the workloads of the engine issue through pagedserve's engine and, in the same run, through
transformers (the peer) at each of its own settings, and writes a table with ratios against the peer's
best setting to docs/benchmarks.md:
  W1      64 requests x 128 prompt tokens, exactly 128 greedy output tokens each
  MIX     128 requests, prompts 64-512, outputs 16-256 (fixed seed), greedy, EOS ignored; plus KV waste
  PREFIX  64 requests sharing a 1,024-token system prompt + 32 unique tokens: median TTFT, caching on/off
  SINGLE  one 128-token prompt, 128 output tokens: TTFT and ms per output token
  KV      (opt-in: --workloads ...,kv) each --kv-cache-dtypes format in one run: capacity, LONG, W1, MIX
          (bench/kv_formats.py; a section of its own)

The peer: its dtype is probed (transformers runs GGUF weights packed and computes in fp32, so bf16 is not
always its best); static batching at batch 32, 64 and all at once (MIX: also sorted by prompt length) and
its continuous batching (MIX). Both sides are warmed up the same way; each figure is repeated with the
order of the systems alternating, and reported as median (min-max). Token counts come from the outputs;
a run whose jobs did not get exactly their tokens, or whose greedy outputs disagree with the peer's from
the first tokens on, fails the benchmark instead of scoring.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pagedserve.bench import hf_peer, kv_formats
from pagedserve.bench.measure import Run, agreement, length_problems, log, spread
from pagedserve.bench.report import REPO, machine_line, write_section
from pagedserve.bench.workloads import Job, corpus_tokens, mix, prefix, w1
from pagedserve.config import EngineConfig
from pagedserve.sampling_params import SamplingParams

if TYPE_CHECKING:  # torch and the engine load only when a benchmark runs, keeping `--help` fast
    from pagedserve.engine.llm_engine import LLMEngine

MIN_AGREEMENT = 4  # median first differing token below this: the engine computes something else
PAD_ID = 2  # SmolLM2's <|im_end|>, also its EOS: an output padded after EOS shows it


def run_engine(engine: LLMEngine, jobs: list[Job], track_waste: bool = False) -> Run:
    """All jobs arrive at once; greedy, EOS ignored, max_tokens each."""
    start = time.perf_counter()
    preempted = engine.scheduler.num_preemptions
    for i, job in enumerate(jobs):
        engine.add_request(f"j{i}", job.prompt_token_ids,
                           SamplingParams(temperature=0, max_tokens=job.max_tokens, ignore_eos=True))
    first: dict[str, float] = {}
    outputs: dict[str, list[int]] = {}
    allocated = unfilled = steps = peak = 0
    decode_steps = []
    while engine.has_unfinished_requests():
        peak = max(peak, len(engine.scheduler.running))
        step_start, decoding = time.perf_counter(), len(first) == len(jobs)
        for out in engine.step():
            first.setdefault(out.request_id, time.perf_counter() - start)
            if out.finished:
                outputs[out.request_id] = list(out.outputs[0].token_ids)
        if decoding:
            decode_steps.append(time.perf_counter() - step_start)
        steps += 1
        if track_waste:
            for req in engine.scheduler.running:
                slots = len(engine.kv.block_table(req.request_id)) * engine.kv.block_size
                allocated += slots
                unfilled += slots - req.num_computed_tokens
        if steps % 50 == 0:
            log(f"  step {steps}: {len(first)}/{len(jobs)} started, {engine.scheduler.num_waiting} waiting")
    elapsed = time.perf_counter() - start
    return Run(elapsed, [outputs.get(f"j{i}", []) for i in range(len(jobs))],
               sum(len(j.prompt_token_ids) for j in jobs), list(first.values()),
               unfilled / allocated if allocated else None, peak, engine.scheduler.num_preemptions - preempted,
               decode_steps)


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


def peer_settings(model, jobs: list[Job], workload: str) -> dict[str, Callable[[], Run]]:
    """Each setting of the peer worth trying on these jobs, by the label the table shows."""
    sizes = sorted({min(32, len(jobs)), min(64, len(jobs)), len(jobs)})
    settings = {f"static batching, batch {b}" + (" (all at once)" if b == len(jobs) else ""):
                (lambda b=b: hf_peer.static(model, jobs, b, PAD_ID)) for b in sizes}
    if workload == "MIX":
        settings |= {f"static batching, batch {b}, sorted by prompt length":
                     (lambda b=b: hf_peer.static(model, jobs, b, PAD_ID, sort=True)) for b in sizes if b < len(jobs)}
        settings["continuous batching (generate_batch)"] = lambda: hf_peer.continuous(model, jobs)
    return settings


class Comparison:
    """One workload: the peer swept over its settings, then ours and the peer's best repeated with the
    order alternating."""

    def __init__(self, name: str, jobs: list[Job], ours: Callable[[], Run], peer_model, repeats: int):
        self.name, self.jobs, self.ours_fn, self.repeats = name, jobs, ours, repeats
        self.settings = peer_settings(peer_model, jobs, name) if peer_model is not None else {}
        self.ours: list[Run] = []
        self.peer: dict[str, list[Run]] = {}
        self.problems: list[str] = []

    def run(self) -> None:
        self._ours()
        for label, fn in self.settings.items():
            self._peer(label, fn)
        best = self.best_label()
        for r in range(1, self.repeats):
            if best and r % 2:
                self._peer(best, self.settings[best])
            self._ours()
            if best and not r % 2:
                self._peer(best, self.settings[best])

    def _ours(self) -> None:
        run = self.ours_fn()
        log(f"  {self.name} pagedserve: {run.output_tps:.0f} output tok/s")
        self.problems += length_problems(f"{self.name} pagedserve", run, self.jobs)
        self.ours.append(run)

    def _peer(self, label: str, fn: Callable[[], Run]) -> None:
        log(f"  {self.name} transformers, {label} ...")
        run = fn()
        log(f"  {self.name} transformers, {label}: {run.output_tps:.0f} output tok/s")
        bad = length_problems(f"{self.name} transformers, {label}", run, self.jobs, eos_id=PAD_ID)
        if bad:  # a setting that did not do the work cannot be the peer's best
            self.problems += bad
            self.settings.pop(label)
            return
        self.peer.setdefault(label, []).append(run)

    def best_label(self) -> str | None:
        valid = {label: runs for label, runs in self.peer.items() if label in self.settings}
        return max(valid, key=lambda k: valid[k][0].output_tps) if valid else None

    def agreement_note(self) -> tuple[str, bool]:
        best = self.best_label()
        if best is None:
            return "", True
        same, n, first = agreement(self.ours[0].outputs, self.peer[best][0].outputs)
        note = (f"{self.name} greedy agreement with the peer ({best}): {same}/{n} sequences identical, median "
                f"first differing token {first:.0f} of {statistics.median(j.max_tokens for j in self.jobs):.0f}.")
        return note, first >= MIN_AGREEMENT


# `pagedserve bench all --quick`: every part of this benchmark, at a scale of seconds.
QUICK = ["--scale", "0.05", "--length-scale", "0.125", "--repeats", "1", "--peer-dtype", "float32",
         "--workloads", "w1,mix,prefix,single,kv", "--kv-cache-dtypes", "auto,int8"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", default="w1,mix,prefix,single",
                   help="comma-separated subset to run: w1, mix, prefix, single, and kv (every --kv-cache-dtypes "
                        "format: capacity in a small pool, the LONG workload, W1 and MIX)")
    p.add_argument("--kv-cache-dtypes", default="auto,bfloat16,fp8,int8",
                   help="the formats the kv workload compares, the first being the baseline")
    p.add_argument("--kv-small-pool", default="64MiB", help="the kv workload's small pool (W1 capacity)")
    p.add_argument("--kv-long-pool", default="4GiB", help="the kv workload's pool for LONG (holds all of it)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="pagedserve's dtype (auto: bf16 where the CPU runs it natively, else fp32)")
    p.add_argument("--peer-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="transformers' dtype; auto: probe both on a small batch and keep the faster")
    p.add_argument("--scale", type=float, default=1.0, help="scale request counts (e.g. 0.25 for a quick look)")
    p.add_argument("--length-scale", type=float, default=1.0,
                   help="scale prompt and output lengths (smoke runs only: the tables use 1)")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of pagedserve and of the peer's best setting per workload, order alternating")
    p.add_argument("--no-peer", action="store_true", help="skip transformers (no ratios)")
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--docs", type=Path, default=REPO / "docs", help="where benchmarks.md is")
    p.add_argument("--no-write", action="store_true", help="print the table but leave docs/benchmarks.md alone")


def pick_peer_dtype(tokens: list[int], choice: str) -> tuple[object, str]:
    """The peer model in the dtype it runs fastest (a 8 x 32-token W1 probe each), and a note saying so."""
    if choice != "auto":
        return hf_peer.load(choice), f"transformers in {choice} (set by --peer-dtype)."
    probe, rates = w1(tokens, 8, output_len=32), {}
    for name in ("float32", "bfloat16"):
        model = hf_peer.load(name)
        hf_peer.static(model, probe[:2], 2, PAD_ID)  # warm-up
        rates[name] = (hf_peer.static(model, probe, 8, PAD_ID).output_tps, model)
    best = max(rates, key=lambda k: rates[k][0])
    return rates[best][1], ("transformers' dtype probed on 8 x 32 tokens: " +
                            ", ".join(f"{k} {v[0]:.0f} tok/s" for k, v in rates.items()) + f"; it runs in {best}.")


def shorter(jobs: list[Job], scale: float) -> list[Job]:
    """The same jobs with prompts and outputs cut to `scale` of their length (for smoke runs)."""
    if scale == 1:
        return jobs
    return [Job(j.prompt_token_ids[:max(4, int(len(j.prompt_token_ids) * scale))], max(4, int(j.max_tokens * scale)))
            for j in jobs]


def run_args(args: argparse.Namespace) -> int:
    from pagedserve.engine.llm_engine import LLMEngine

    todo = set(args.workloads.split(","))

    def engine(**over) -> LLMEngine:
        cfg = {"dtype": args.dtype, "kv_cache_memory": args.kv_cache_memory, "max_num_seqs": args.max_num_seqs,
               "max_num_batched_tokens": args.max_num_batched_tokens} | over
        return LLMEngine(EngineConfig(**cfg))

    eng = engine()
    tokens = corpus_tokens(eng.tokenizer)
    n = lambda k: max(1, int(k * args.scale))
    ln = lambda k: max(4, int(k * args.length_scale))
    peer, notes = None, []
    if not args.no_peer and todo - {"kv"}:
        peer, note = pick_peer_dtype(tokens, args.peer_dtype)
        notes.append(note)
    notes.append(f"pagedserve runs in {str(eng.dtype).removeprefix('torch.')} (--dtype {args.dtype}).")
    warm = w1(tokens, 4, output_len=16)  # the same warm-up for both systems
    run_engine(eng, warm)
    if peer is not None:
        hf_peer.static(peer, warm, 4, PAD_ID)
    rows, problems = [], []

    def ours(jobs: list[Job], waste: bool = False) -> Callable[[], Run]:
        def run() -> Run:
            eng.kv.reset_prefix_cache()  # every repeat computes its prompts
            return run_engine(eng, jobs, waste)
        return run

    for name, jobs in (("W1", w1(tokens, n(64), ln(128), ln(128)) if "w1" in todo else None),
                       ("MIX", shorter(mix(tokens, n(128)), args.length_scale) if "mix" in todo else None)):
        if jobs is None:
            continue
        log(f"{name}: {len(jobs)} requests")
        cmp = Comparison(name, jobs, ours(jobs, waste=name == "MIX"), peer, args.repeats)
        cmp.run()
        problems += cmp.problems
        note, agrees = cmp.agreement_note()
        if note:
            notes.append(note)
        if not agrees:
            problems.append(f"{name}: pagedserve's greedy outputs disagree with the peer's from the first tokens")
        best = cmp.best_label()
        peer_tps = [r.output_tps for r in cmp.peer[best]] if best else None
        rows.append((name, "output tok/s", [r.output_tps for r in cmp.ours], peer_tps,
                     f"transformers, {best}" if best else "-"))
        if name == "MIX":
            rows.append((name, "total tok/s", [r.total_tps for r in cmp.ours],
                         [r.total_tps for r in cmp.peer[best]] if best else None, "prompt + output"))
            notes.append(f"KV waste over the MIX run (allocated but unfilled slots / allocated slots, summed over "
                         f"steps): **{cmp.ours[0].kv_waste:.2%}** (target under 4%).")
        if cmp.peer:
            notes.append(f"{name} peer settings, output tok/s (first run each): " + "; ".join(
                f"{label} {runs[0].output_tps:.0f}" for label, runs in cmp.peer.items()) + ".")
    if "prefix" in todo:
        jobs = prefix(tokens, n(64), ln(1024), ln(32), ln(32))
        medians = {}
        for caching in (True, False):
            e = engine(enable_prefix_caching=caching)
            run_engine(e, [jobs[0]])  # the first request warms the cache when caching is on
            medians[caching] = statistics.median(run_engine(e, jobs[1:]).ttfts) * 1e3
            log(f"PREFIX caching={caching}: median TTFT {medians[caching]:.0f} ms")
        rows.append(("PREFIX", "median TTFT ms (lower is better)", [medians[True]], [medians[False]],
                     "peer = pagedserve with prefix caching off"))
    if "single" in todo:
        job, single = w1(tokens, 1, ln(128), ln(128))[0], engine()
        ours_single, peer_single = [], []
        for r in range(max(args.repeats, 3)):
            first_ours = r % 2 == 0 or peer is None
            if not first_ours:
                peer_single.append(hf_peer.single_ms_per_token(peer, job))
            ours_single.append(single_stream(single, job))
            if first_ours and peer is not None:
                peer_single.append(hf_peer.single_ms_per_token(peer, job))
        log(f"SINGLE: {[round(m, 1) for _, m in ours_single]} ms/token (transformers {peer_single})")
        rows.append(("SINGLE", "ms per output token (lower is better)", [m for _, m in ours_single],
                     peer_single or None, "transformers generate, batch 1"))
        notes.append(f"Single stream time to first token (128-token prompt): "
                     f"{spread([t * 1e3 for t, _ in ours_single], '{:.0f}')} ms.")

    sections = {}
    if rows:
        sections["Offline throughput (engine)"] = render(rows, notes, problems, args)
    if "kv" in todo:
        log("KV cache formats: " + args.kv_cache_dtypes)
        body, kv_problems = kv_formats.measure(args.kv_cache_dtypes.split(","), tokens, engine, run_engine, args)
        sections["KV cache formats (capacity and speed)"] = body
        problems += kv_problems
    for body in sections.values():
        print(body)
    if problems:
        log("the run did not check out; docs/benchmarks.md left alone:\n  " + "\n  ".join(problems))
        return 1
    if not args.no_write:
        for title, body in sections.items():
            write_section(title, body, args.docs / "benchmarks.md")
    return 0


def render(rows, notes, problems, args) -> str:
    flags = f"--workloads {args.workloads} --dtype {args.dtype} --repeats {args.repeats}"
    flags += "" if args.scale == 1 else f" --scale {args.scale}"
    flags += "" if args.length_scale == 1 else f" --length-scale {args.length_scale}"
    lines = [f"Command: `pagedserve bench throughput {flags}`", "", machine_line(), "",
             "| workload | metric | pagedserve | peer (best setting) | ratio of medians | peer is |",
             "|---|---|---|---|---|---|"]
    for name, metric, ours, peer, what in rows:
        lower_better = "lower" in metric
        mo, mp = statistics.median(ours), statistics.median(peer) if peer else None
        ratio = (mp / mo if lower_better else mo / mp) if mp else None
        lines.append(f"| {name} | {metric} | {spread(ours)} | {'-' if peer is None else spread(peer)} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}x'} | {what} |")
    lines += [""] + [f"- {n}" for n in notes + problems]
    lines.append("- Figures: median (min-max over the repeats). Ratio: how many times better pagedserve is "
                 "(both directions), against the peer's fastest setting in this run.")
    return "\n".join(lines)
