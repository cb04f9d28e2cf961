"""Offline throughput benchmark: `pagedserve bench throughput` (or benchmarks/throughput.py).

Runs the workloads of the engine issues through pagedserve's engine and, in the same run, through its
peers, and writes a table with ratios against each peer's best setting to docs/benchmarks.md:
  PREFILL     32 prompts x 1,024 tokens, one output token, no prompt repeated: prompt tok/s
  PREFILL256  128 prompts x 256 tokens, the same
  RAG         32 requests, prompts of 1,000-1,500 tokens (a retrieval route's context), 128-token answers
  W1          64 requests x 128 prompt tokens, exactly 128 greedy output tokens each
  MIX         128 requests, prompts 64-512, outputs 16-256 (fixed seed), greedy, EOS ignored; plus KV waste
  PREFIX      64 requests sharing a 1,024-token system prompt + 32 unique tokens: median TTFT, caching on/off
  SINGLE      one 128-token prompt, 128 output tokens: TTFT and ms per output token
  KV          (opt-in: --workloads ...,kv) each --kv-cache-dtypes format in one run: capacity, LONG, W1, MIX
              (bench/kv_formats.py; a section of its own)

pagedserve runs once per --quantizations entry (e.g. none = bf16 weights, gguf = the GGUF's own blocks).
The peers (--peers), each at its own best setting, on the same weights and the same token-id prompts:
  transformers  its dtype probed (it runs GGUF weights dequantized); static batching at batch 32, 64 and
                all at once (MIX: also sorted by prompt length) and its continuous batching (MIX)
  vllm          vLLM's CPU build (benchmarks/peers/setup_vllm_cpu.sh), LLM.generate with every request at
                once, bf16 from the HF folder the GGUF is exported to, its recommended environment
                (tcmalloc + libiomp5 preloaded, threads bound), prefix caching on but reset before each run
  llama.cpp     llama-server (benchmarks/peers/build_llama_server.sh) on the GGUF, every request at once to
                its parallel slots
A peer that is not installed is skipped with the reason in the notes. Both sides are warmed up; each
figure is repeated with the order of the systems alternating, and reported as median (min-max); ratios are
taken within each round. Token counts come from the outputs; a run whose jobs did not get exactly their
tokens, or whose greedy outputs disagree with a peer's from the first tokens on, fails the benchmark
instead of scoring.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pagedserve.bench import hf_peer, kv_formats, llama_peer, vllm_peer
from pagedserve.bench.measure import Run, agreement, length_problems, log, spread
from pagedserve.bench.report import REPO, machine_line, write_section
from pagedserve.bench.workloads import Job, corpus_tokens, mix, prefill, prefix, rag, w1
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
    """Each setting of transformers worth trying on these jobs, by the label the table shows."""
    sizes = sorted({min(32, len(jobs)), min(64, len(jobs)), len(jobs)})
    settings = {f"static batching, batch {b}" + (" (all at once)" if b == len(jobs) else ""):
                (lambda b=b: hf_peer.static(model, jobs, b, PAD_ID)) for b in sizes}
    if workload == "MIX":
        settings |= {f"static batching, batch {b}, sorted by prompt length":
                     (lambda b=b: hf_peer.static(model, jobs, b, PAD_ID, sort=True)) for b in sizes if b < len(jobs)}
        settings["continuous batching (generate_batch)"] = lambda: hf_peer.continuous(model, jobs)
    return settings


METRICS = {"output": ("output tok/s", lambda r: r.output_tps), "prompt": ("prompt tok/s", lambda r: r.prompt_tps),
           "total": ("total tok/s", lambda r: r.total_tps)}


class Comparison:
    """One workload: every peer swept over its settings once, then pagedserve's variants and each peer's
    best setting repeated, the order reversed every round."""

    def __init__(self, name: str, jobs: list[Job], ours: dict[str, Callable[[], Run]],
                 peers: dict[str, dict[str, Callable[[], Run]]], repeats: int, metric: str = "output"):
        self.name, self.jobs, self.ours_fns, self.repeats = name, jobs, ours, repeats
        self.metric_label, self.value = METRICS[metric]
        self.settings = {peer: dict(s) for peer, s in peers.items() if s}
        self.ours: dict[str, list[Run]] = {label: [] for label in ours}
        self.peer: dict[str, dict[str, list[Run]]] = {peer: {} for peer in self.settings}
        self.problems: list[str] = []

    def run(self) -> None:
        for label in self.ours_fns:
            self._ours(label)
        for peer, settings in self.settings.items():
            for label in list(settings):
                self._peer(peer, label)
        for r in range(1, self.repeats):
            order = [("ours", label) for label in self.ours_fns] + [
                ("peer", peer) for peer in self.settings if self.best_label(peer) is not None]
            for kind, who in (order if r % 2 == 0 else order[::-1]):
                if kind == "ours":
                    self._ours(who)
                else:
                    self._peer(who, self.best_label(who))

    def _ours(self, label: str) -> None:
        run = self.ours_fns[label]()
        log(f"  {self.name} {label}: {self.value(run):.0f} {self.metric_label}")
        self.problems += length_problems(f"{self.name} {label}", run, self.jobs)
        self.ours[label].append(run)

    def _peer(self, peer: str, label: str) -> None:
        who = f"{self.name} {peer}" + (f", {label}" if label else "")
        log(f"  {who} ...")
        run = self.settings[peer][label]()
        log(f"  {who}: {self.value(run):.0f} {self.metric_label}")
        # transformers pads a finished row with EOS: EOS in its output means ignore_eos did not hold
        bad = length_problems(who, run, self.jobs,
                              eos_id=PAD_ID if peer == "transformers" else None)
        if bad:  # a setting that did not do the work cannot be the peer's best
            self.problems += bad
            self.settings[peer].pop(label)
            return
        self.peer[peer].setdefault(label, []).append(run)

    def best_label(self, peer: str) -> str | None:
        valid = {label: runs for label, runs in self.peer[peer].items() if label in self.settings[peer]}
        return max(valid, key=lambda k: self.value(valid[k][0])) if valid else None

    def values(self, runs: list[Run], metric=None) -> list[float]:
        return [(metric or self.value)(r) for r in runs]

    def agreement_notes(self) -> tuple[list[str], bool]:
        notes, agrees = [], True
        first_ours = next(iter(self.ours.values()))[0]
        for peer in self.settings:
            best = self.best_label(peer)
            if best is None or all(len(o) <= 1 for o in first_ours.outputs):
                continue
            same, n, first = agreement(first_ours.outputs, self.peer[peer][best][0].outputs)
            notes.append(f"{self.name} greedy agreement of {next(iter(self.ours))} with {peer}"
                         + (f" ({best})" if best else "") + f": {same}/{n} "
                         f"sequences identical, median first differing token {first:.0f} of "
                         f"{statistics.median(j.max_tokens for j in self.jobs):.0f}.")
            agrees = agrees and first >= MIN_AGREEMENT
        return notes, agrees


def paired_ratios(ours: list[float], peer: list[float], lower_better: bool = False) -> list[float]:
    """ours / peer within each round (higher is better for ours; lower-is-better metrics inverted)."""
    return [(p / o if lower_better else o / p) for o, p in zip(ours, peer, strict=False) if o and p]


# `pagedserve bench all --quick`: every part of this benchmark, at a scale of seconds (vLLM and llama.cpp
# join when installed, else the notes say why not).
QUICK = ["--scale", "0.05", "--length-scale", "0.125", "--repeats", "1", "--peer-dtype", "float32",
         "--workloads", "prefill,rag,w1,mix,prefix,single,kv", "--kv-cache-dtypes", "auto,int8"]
WORKLOADS = "prefill,prefill256,rag,w1,mix,prefix,single"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workloads", default=WORKLOADS,
                   help="comma-separated subset to run: prefill (32 x 1,024 tokens, one output token), prefill256 "
                        "(128 x 256), rag (32 x 1,000-1,500 / 128), w1, mix, prefix, single, and kv (every "
                        "--kv-cache-dtypes format: capacity in a small pool, the LONG workload, W1 and MIX)")
    p.add_argument("--kv-cache-dtypes", default="auto,bfloat16,fp8,int8",
                   help="the formats the kv workload compares, the first being the baseline")
    p.add_argument("--kv-small-pool", default="64MiB", help="the kv workload's small pool (W1 capacity)")
    p.add_argument("--kv-long-pool", default="4GiB", help="the kv workload's pool for LONG (holds all of it)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="pagedserve's dtype (auto: bf16 where the CPU runs it natively, else fp32)")
    p.add_argument("--quantizations", default="auto",
                   help="pagedserve's weight modes, one column each (e.g. none,gguf: bf16 weights and the GGUF's "
                        "own blocks; auto: what the server would choose on this CPU)")
    p.add_argument("--single-quantizations", default="",
                   help="weight modes measured on the single stream only, besides --quantizations (e.g. gguf, "
                        "whose integer path is for one stream on CPUs without AMX)")
    p.add_argument("--peers", default="transformers,vllm,llama.cpp",
                   help="comma-separated peers: transformers, vllm (vLLM CPU), llama.cpp (llama-server); one that is "
                        "not installed is skipped with the reason in the notes")
    p.add_argument("--peer-dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="transformers' dtype; auto: probe both on a small batch and keep the faster")
    p.add_argument("--threads", type=int, default=None,
                   help="compute threads of vLLM and llama.cpp (default: this process's torch threads, as ours)")
    p.add_argument("--vllm-venv", default=str(vllm_peer.DEFAULT_VENV), help="vLLM CPU's virtualenv")
    p.add_argument("--hf-folder", default=str(vllm_peer.DEFAULT_FOLDER),
                   help="the GGUF exported as a HF folder (benchmarks/peers/export_hf_folder.py), for vLLM")
    p.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (ours: --kv-cache-memory)")
    p.add_argument("--llama-server", default=str(llama_peer.DEFAULT_BINARY), help="llama-server binary")
    p.add_argument("--scale", type=float, default=1.0, help="scale request counts (e.g. 0.25 for a quick look)")
    p.add_argument("--length-scale", type=float, default=1.0,
                   help="scale prompt and output lengths (smoke runs only: the tables use 1)")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of pagedserve and of each peer's best setting per workload, order alternating")
    p.add_argument("--no-peer", action="store_true", help="no peers at all (no ratios)")
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


def start_peers(args: argparse.Namespace, tokens: list[int], notes: list[str], want_batch: bool):
    """(transformers model or None, {name: offline peer}) for --peers; what is missing goes to the notes."""
    import torch

    from pagedserve.bench.servers import default_gguf

    wanted = [] if args.no_peer else [p for p in args.peers.split(",") if p]
    threads = args.threads or torch.get_num_threads()
    model, offline = None, {}
    if "transformers" in wanted and want_batch:
        model, note = pick_peer_dtype(tokens, args.peer_dtype)
        notes.append(note)
    if "vllm" in wanted:
        reason = vllm_peer.missing_reason(args.vllm_venv, args.hf_folder)
        if reason:
            notes.append(f"vLLM CPU skipped: {reason}.")
        else:
            offline["vLLM CPU"] = vllm_peer.OfflinePeer(args.vllm_venv, args.hf_folder, threads, "bfloat16",
                                                        args.max_num_seqs, 2048, args.vllm_kv_gib)
            notes.append(f"vLLM CPU {version('vllm-cpu', args.vllm_venv)}: {offline['vLLM CPU'].setting}.")
    if "llama.cpp" in wanted:
        if not Path(args.llama_server).is_file():
            notes.append(f"llama.cpp skipped: no llama-server at {args.llama_server} "
                         "(build it: benchmarks/peers/build_llama_server.sh).")
        else:
            offline["llama.cpp"] = llama_peer.OfflinePeer(default_gguf(), Path(args.llama_server), threads,
                                                          args.max_num_seqs)
            notes.append(f"llama.cpp: {offline['llama.cpp'].setting}.")
    return model, offline


def version(dist: str, venv: str) -> str:
    found = sorted(Path(venv).glob(f"lib/python3*/site-packages/{dist.replace('-', '_')}-*.dist-info"))
    return found[-1].name.removesuffix(".dist-info").split("-")[1] if found else "?"


def run_args(args: argparse.Namespace) -> int:
    from pagedserve.engine.llm_engine import LLMEngine

    todo = set(args.workloads.split(","))

    def engine(**over) -> LLMEngine:
        cfg = {"dtype": args.dtype, "kv_cache_memory": args.kv_cache_memory, "max_num_seqs": args.max_num_seqs,
               "max_num_batched_tokens": args.max_num_batched_tokens} | over
        return LLMEngine(EngineConfig(**cfg))

    modes = args.quantizations.split(",")
    engines = {mode: engine(quantization=mode) for mode in modes}
    eng = engines[modes[0]]
    labels = {mode: "pagedserve" if modes == ["auto"] else f"pagedserve {mode_name(e, mode)}"
              for mode, e in engines.items()}
    tokens = corpus_tokens(eng.tokenizer)
    n = lambda k: max(1, int(k * args.scale))
    ln = lambda k: max(4, int(k * args.length_scale))
    notes: list[str] = []
    batch_workloads = todo & {"prefill", "prefill256", "rag", "w1", "mix", "single"}
    peer, offline = start_peers(args, tokens, notes, bool(batch_workloads))
    for mode, e in engines.items():
        notes.append(f"{labels[mode]}: --quantization {mode}, {str(e.dtype).removeprefix('torch.')} (--dtype {args.dtype}).")
    warm = w1(tokens, 4, output_len=16)  # the same warm-up for every system
    for e in engines.values():
        run_engine(e, warm)
    if peer is not None:
        hf_peer.static(peer, warm, 4, PAD_ID)
    for p in offline.values():
        p.run(warm)
    rows, problems = [], []

    def ours(e: LLMEngine, jobs: list[Job], waste: bool = False) -> Callable[[], Run]:
        def run() -> Run:
            e.kv.reset_prefix_cache()  # every repeat computes its prompts
            return run_engine(e, jobs, waste)
        return run

    def peers_for(name: str, jobs: list[Job]) -> dict[str, dict[str, Callable[[], Run]]]:
        out = {}
        if peer is not None and name in ("W1", "MIX"):  # transformers' settings sweep: the workloads it was run on
            out["transformers"] = peer_settings(peer, jobs, name)
        for pname, p in offline.items():
            out[pname] = {"": (lambda p=p: p.run(jobs))}
        return out

    workloads = (
        ("PREFILL", "prefill", lambda: shorter(prefill(tokens, n(32), 1024), args.length_scale), "prompt"),
        ("PREFILL256", "prefill256", lambda: shorter(prefill(tokens, n(128), 256), args.length_scale), "prompt"),
        ("RAG", "rag", lambda: shorter(rag(tokens, n(32)), args.length_scale), "output"),
        ("W1", "w1", lambda: w1(tokens, n(64), ln(128), ln(128)), "output"),
        ("MIX", "mix", lambda: shorter(mix(tokens, n(128)), args.length_scale), "output"),
    )
    for name, key, make, metric in workloads:
        if key not in todo:
            continue
        jobs = make()
        log(f"{name}: {len(jobs)} requests")
        cmp = Comparison(name, jobs, {labels[m]: ours(e, jobs, waste=name == "MIX") for m, e in engines.items()},
                         peers_for(name, jobs), args.repeats, metric)
        cmp.run()
        problems += cmp.problems
        agree_notes, agrees = cmp.agreement_notes()
        notes += agree_notes
        if not agrees:
            problems.append(f"{name}: pagedserve's greedy outputs disagree with a peer's from the first tokens")
        rows.append(table_row(name, cmp, cmp.value, cmp.metric_label))
        if name == "MIX":
            rows.append(table_row(name, cmp, METRICS["total"][1], "total tok/s (prompt + output)"))
            first = next(iter(cmp.ours.values()))[0]
            notes.append(f"KV waste over the MIX run (allocated but unfilled slots / allocated slots, summed over "
                         f"steps): **{first.kv_waste:.2%}** (target under 4%).")
        if cmp.peer.get("transformers"):
            notes.append(f"{name} transformers settings, output tok/s (first run each): " + "; ".join(
                f"{label} {runs[0].output_tps:.0f}" for label, runs in cmp.peer["transformers"].items()) + ".")
    if "prefix" in todo:
        jobs = prefix(tokens, n(64), ln(1024), ln(32), ln(32))
        medians = {}
        for caching in (True, False):
            e = engine(enable_prefix_caching=caching)
            run_engine(e, [jobs[0]])  # the first request warms the cache when caching is on
            medians[caching] = statistics.median(run_engine(e, jobs[1:]).ttfts) * 1e3
            log(f"PREFIX caching={caching}: median TTFT {medians[caching]:.0f} ms")
        rows.append(("PREFIX", "median TTFT ms, prefix caching on (peer: off; lower is better)",
                     {labels[modes[0]]: [medians[True]]}, {"pagedserve, caching off": [medians[False]]}, {}))
    if "single" in todo:
        job = w1(tokens, 1, ln(128), ln(128))[0]
        single_modes = dict(labels) | {m: f"pagedserve {m}" for m in args.single_quantizations.split(",")
                                       if m and m not in labels}
        singles = {label: engine(quantization=mode, kv_cache_memory="256MiB") for mode, label in single_modes.items()}
        ours_single: dict[str, list[tuple[float, float]]] = {label: [] for label in singles}
        peer_single: dict[str, list[tuple[float, float]]] = {}
        systems = [(label, lambda e=e: single_stream(e, job)) for label, e in singles.items()]
        if peer is not None:
            systems.append(("transformers", lambda: (float("nan"), hf_peer.single_ms_per_token(peer, job))))
        systems += [(pname, lambda p=p: p.single(job)) for pname, p in offline.items()]
        for label, fn in systems:  # a warm-up each
            fn()
        for r in range(max(args.repeats, 3)):
            for label, fn in (systems if r % 2 == 0 else systems[::-1]):
                (ours_single if label in singles else peer_single).setdefault(label, []).append(fn())
        log(f"SINGLE: {ours_single} (peers {peer_single})")
        rows.append(("SINGLE", "ms per output token (lower is better)",
                     {k: [m for _, m in v] for k, v in ours_single.items()},
                     {k: [m for _, m in v] for k, v in peer_single.items()}, {}))
        notes.append("Single stream time to first token (128-token prompt), ms: " + "; ".join(
            f"{k} {spread([t * 1e3 for t, _ in v], '{:.0f}')}" for k, v in (ours_single | peer_single).items()
            if k != "transformers") + ".")
    for p in offline.values():
        p.close()

    sections = {}
    if rows:
        # Without transformers, a section of its own (the transformers table stays): named by the peers that ran.
        title = "Offline throughput (engine)" if peer is not None or not offline else \
            f"Offline throughput against {' and '.join(offline)} (engine)"
        sections[title] = render(rows, notes, problems, args)
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


def mode_name(e: LLMEngine, mode: str) -> str:
    dtype = {"bfloat16": "bf16", "float32": "fp32"}.get(str(e.dtype).removeprefix("torch."), str(e.dtype))
    return dtype if mode in ("none", "auto") else f"{mode}"


def table_row(name: str, cmp: Comparison, metric, label: str):
    """(workload, metric, ours {label: values}, peers {name (setting): values}, ratios {peer: per round})."""
    ours = {k: cmp.values(v, metric) for k, v in cmp.ours.items()}
    peers, ratios = {}, {}
    for peer in cmp.peer:
        best = cmp.best_label(peer)
        if best is None:
            continue
        title = peer + (f" ({best})" if best else "")
        peers[title] = cmp.values(cmp.peer[peer][best], metric)
        ratios[peer] = {k: paired_ratios(v, peers[title]) for k, v in ours.items()}
    return name, label, ours, peers, ratios


def render(rows, notes, problems, args) -> str:
    flags = (f"--workloads {args.workloads} --dtype {args.dtype} --quantizations {args.quantizations} "
             f"--peers {args.peers} --repeats {args.repeats}")
    flags += f" --single-quantizations {args.single_quantizations}" if args.single_quantizations else ""
    flags += "" if args.scale == 1 else f" --scale {args.scale}"
    flags += "" if args.length_scale == 1 else f" --length-scale {args.length_scale}"
    lines = [f"Command: `pagedserve bench throughput {flags}`", "", machine_line(), "",
             "| workload | metric | system | figure | vs each peer (ratio within each round) |", "|---|---|---|---|---|"]
    for name, metric, ours, peers, ratios in rows:
        lower_better = "lower" in metric
        for label, values in ours.items():
            vs = []
            for peer, title in zip(ratios or peers, peers, strict=False):
                if ratios:
                    r = ratios[peer][label]
                else:
                    mp = statistics.median(peers[title])
                    r = [mp / statistics.median(values) if lower_better else statistics.median(values) / mp]
                vs.append(f"{peer} {spread(r, '{:.2f}')}x")
            lines.append(f"| {name} | {metric} | {label} | {spread(values)} | {'; '.join(vs) or '-'} |")
        for title, values in peers.items():
            lines.append(f"| {name} | {metric} | {title} | {spread(values)} | |")
    lines += [""] + [f"- {n}" for n in notes + problems]
    lines.append("- Figures: median (min-max over the repeats). Ratios: how many times better pagedserve is "
                 "(both directions: above 1 is ours ahead), within each round against the peer's fastest setting "
                 "in this run, median (min-max) over the rounds.")
    return "\n".join(lines)
