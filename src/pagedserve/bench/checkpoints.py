"""Quantized checkpoints against vLLM CPU: `pagedserve bench checkpoints` (or benchmarks/checkpoints.py).

Each compressed-tensors folder of build/quantized/ (`make quantized`: llm-compressor's W4A16 GPTQ and RTN, W8A16,
W8A8 int with dynamic per-token activations, FP8 per channel and per tensor, all of the default model) is loaded
by pagedserve as stored and by vLLM's CPU build from the same folder, each in bf16 at its own recommended setting
(vllm_peer.environment), and measured in one run:
  W1      64 requests x 128 prompt tokens, exactly 128 greedy output tokens each, all at once: output tok/s
  SINGLE  one 128-token prompt, 128 output tokens: ms per output token after the first
Repeated with the order alternating; ratios are taken within each round and reported as median (min-max).
A scheme vLLM cannot load is reported with its reason (the last lines of build/peers/vllm-offline.log) and
pagedserve's figures alone. Outputs are checked: every job got exactly its tokens, and both systems' greedy
outputs agree over their first tokens (both quantize the same weights, but round activations differently).
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from pagedserve.bench import vllm_peer
from pagedserve.bench.measure import agreement, length_problems, log, spread
from pagedserve.bench.report import REPO, command_line, machine_line, publish
from pagedserve.bench.throughput import MIN_AGREEMENT, paired_ratios, run_engine, single_stream
from pagedserve.bench.workloads import corpus_tokens, w1
from pagedserve.config import EngineConfig

SCHEMES = "w8a8-int,w4a16-gptq,w4a16-rtn,w8a16,fp8-channel,fp8-tensor"
QUICK = ["--schemes", "w8a8-int", "--requests", "4", "--length", "16", "--repeats", "1"]
TITLE = "Quantized checkpoints: pagedserve vs vLLM CPU on the same folders"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--schemes", default=SCHEMES, help="comma-separated folders under --quantized-dir")
    p.add_argument("--quantized-dir", type=Path, default=REPO / "build/quantized",
                   help="where `make quantized` wrote the reference checkpoints")
    p.add_argument("--requests", type=int, default=64, help="W1's requests")
    p.add_argument("--length", type=int, default=128, help="prompt and output tokens of W1 and the single stream")
    p.add_argument("--repeats", type=int, default=2, help="rounds per scheme, the order alternating")
    p.add_argument("--threads", type=int, default=None, help="vLLM's compute threads (default: torch's, as ours)")
    p.add_argument("--vllm-venv", default=str(vllm_peer.DEFAULT_VENV), help="vLLM CPU's virtualenv")
    p.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE (ours: --kv-cache-memory)")
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--docs", type=Path, default=REPO / "docs", help="where benchmarks.md is")
    p.add_argument("--no-write", action="store_true", help="print the table but leave docs/benchmarks.md alone")


def run_args(args: argparse.Namespace) -> int:
    import torch

    threads = args.threads or torch.get_num_threads()
    rows, notes, problems = [], [], []
    for scheme in args.schemes.split(","):
        folder = args.quantized_dir / scheme
        if not (folder / "config.json").is_file():
            problems.append(f"{scheme}: no checkpoint at {folder} (make quantized)")
            continue
        row, note, bad = _compare(args, scheme, folder, threads)
        rows.append(row)
        notes.append(note)
        problems += bad
    return publish(TITLE, _table(rows, notes, args, threads), problems, args.docs, not args.no_write)


def _compare(args: argparse.Namespace, scheme: str, folder: Path, threads: int) -> tuple[list[str], str, list[str]]:
    """(the table row, a note, problems) for one checkpoint."""
    from pagedserve.engine.llm_engine import LLMEngine

    log(f"{scheme}: loading pagedserve")
    engine = LLMEngine(EngineConfig(model=str(folder), dtype="bfloat16", kv_cache_memory=args.kv_cache_memory,
                                    max_num_seqs=args.requests))
    tokens = corpus_tokens(engine.tokenizer)
    jobs, single = w1(tokens, args.requests, args.length, args.length), w1(tokens, 1, args.length, args.length)[0]
    ours = Side(lambda: run_engine(engine, jobs), lambda: single_stream(engine, single))
    peer, reason = _start_peer(args, folder, threads)
    theirs = Side(lambda: peer.run(jobs), lambda: peer.single(single)) if peer else None
    try:
        for r in range(args.repeats + 1):  # round 0 warms both up and is not kept
            for side in ([ours, theirs] if r % 2 == 0 else [theirs, ours]):
                if side is not None:
                    side.round(keep=r > 0)
    finally:
        if peer is not None:
            peer.close()
    problems = length_problems(f"{scheme} pagedserve", ours.runs[0], jobs)
    row = [scheme, engine.weights_info["quant_kernel"], spread(ours.w1), spread(ours.ms, "{:.2f}")]
    if theirs is None:
        return row + ["-"] * 4, f"{scheme}: vLLM CPU did not load it: {reason}", problems
    problems += length_problems(f"{scheme} vLLM CPU", theirs.runs[0], jobs)
    same, n, first = agreement(ours.runs[0].outputs, theirs.runs[0].outputs)
    if first < MIN_AGREEMENT:
        problems.append(f"{scheme}: outputs disagree with vLLM's from the first tokens (median {first:.0f})")
    row += [spread(theirs.w1), spread(theirs.ms, "{:.2f}"), spread(paired_ratios(ours.w1, theirs.w1), "{:.2f}x"),
            spread(paired_ratios(ours.ms, theirs.ms, lower_better=True), "{:.2f}x")]
    return row, f"{scheme}: greedy W1 outputs {same}/{n} identical, median first differing token {first:.0f}.", \
        problems


class Side:
    """One system's W1 output tok/s and single-stream ms/token, round by round."""

    def __init__(self, batch, one) -> None:
        self.batch, self.one = batch, one
        self.w1: list[float] = []
        self.ms: list[float] = []
        self.runs: list = []

    def round(self, keep: bool) -> None:
        run = self.batch()
        _, ms = self.one()
        if keep:
            self.runs.append(run)
            self.w1.append(run.output_tps)
            self.ms.append(ms)
        log(f"  W1 {run.output_tps:.0f} tok/s, single {ms:.2f} ms/token" + ("" if keep else " (warm-up)"))


def _start_peer(args: argparse.Namespace, folder: Path, threads: int):
    """(the vLLM peer or None, why not)."""
    missing = vllm_peer.missing_reason(args.vllm_venv, folder)
    if missing:
        return None, missing
    try:
        return vllm_peer.OfflinePeer(args.vllm_venv, folder, threads, "bfloat16", args.requests,
                                     2 * args.length + 16, args.vllm_kv_gib), None
    except RuntimeError as exc:
        log_file = REPO / "build/peers/vllm-offline.log"
        tail = [line.strip() for line in log_file.read_text(errors="replace").splitlines() if line.strip()][-2:] \
            if log_file.is_file() else []
        return None, f"{exc}: {' / '.join(tail)[-300:]}"


def _table(rows: list[list[str]], notes: list[str], args: argparse.Namespace, threads: int) -> str:
    head = ("| scheme | our kernel | W1 tok/s ours | ms/token ours | W1 tok/s vLLM | ms/token vLLM | W1 ours/vLLM "
            "| single ours/vLLM |\n|---|---|---|---|---|---|---|---|\n")
    lines = "".join("| " + " | ".join(r) + " |\n" for r in rows)
    ratios = [float(r[6].split("x")[0]) for r in rows if r[6] != "-"]
    summary = f"Median W1 ratio over the schemes both load: {statistics.median(ratios):.2f}x.\n" if ratios else ""
    return (f"Command: `{command_line()}`. {machine_line()} {threads} threads each; bf16 both; W1 {args.requests} x {args.length}/"
            f"{args.length}, single {args.length}/{args.length}; {args.repeats} rounds after a warm-up, "
            f"median (min-max).\n\n{head}{lines}\n{summary}" + "".join(f"- {n}\n" for n in notes))
