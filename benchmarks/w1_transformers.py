"""W1 (64 x 128/128) on another model than bench throughput's SmolLM2: pagedserve against transformers and (when its
HF folder is there) vLLM CPU on the same token ids, in one run, rounds alternating the order. transformers: static
batching with generate(), the GGUF dequantized into dense tensors of --peer-dtype, EOS ignored through
min_new_tokens. vLLM CPU: LLM.generate with every request at once on the GGUF exported as an HF folder
(benchmarks/peers/export_hf_folder.py --model NAME), bf16, its recommended environment (bench/vllm_peer.py).

    python benchmarks/peers/export_hf_folder.py --model gemma-3-270m
    python benchmarks/w1_transformers.py --model gemma-3-270m --peer-batches 64 --rounds 2
"""
from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from pathlib import Path

from pagedserve.bench import hf_peer, vllm_peer
from pagedserve.bench.measure import Run, agreement, length_problems, log
from pagedserve.bench.report import REPO
from pagedserve.bench.throughput import run_engine
from pagedserve.bench.workloads import Job, corpus_tokens, w1
from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.model.loader import resolve_model_path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--quantization", default="gguf")
    p.add_argument("--peer-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--peer-batches", default="64", help="comma-separated static batch sizes transformers tries")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--vllm-folder", type=Path, default=None,
                   help="the model as an HF folder for vLLM CPU (default: build/peers/MODEL-hf; absent: no vLLM)")
    p.add_argument("--vllm-venv", default=str(vllm_peer.DEFAULT_VENV))
    p.add_argument("--threads", type=int, default=2, help="vLLM's compute threads")
    args = p.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, quantization=args.quantization, kv_cache_memory=args.kv_cache_memory))
    jobs = w1(corpus_tokens(engine.tokenizer), args.requests, 128, 128)
    model = hf_peer.load(args.peer_dtype, resolve_model_path(args.model))
    pad = model.config.pad_token_id or 0

    def ours(todo: list[Job]) -> Run:
        engine.kv.reset_prefix_cache()
        return run_engine(engine, todo)

    sides: dict[str, Callable[[list[Job]], Run]] = {"pagedserve": ours}
    sides |= {f"transformers batch {b}": (lambda todo, b=b: hf_peer.static(model, todo, min(b, len(todo)), pad))
              for b in map(int, args.peer_batches.split(","))}
    folder = args.vllm_folder or REPO / "build/peers" / f"{args.model}-hf"
    vllm = None
    if (reason := vllm_peer.missing_reason(args.vllm_venv, folder)) is None:
        vllm = vllm_peer.OfflinePeer(args.vllm_venv, folder, args.threads, "bfloat16", args.requests, 512)
        sides["vLLM CPU"] = vllm.run
    else:
        log(f"no vLLM CPU: {reason}")
    try:
        rates, outputs = run_rounds(sides, jobs, args.rounds)
    finally:
        if vllm is not None:
            vllm.close()
    report(args, rates, outputs, jobs)


def run_rounds(sides: dict[str, Callable[[list[Job]], Run]], jobs: list[Job], rounds: int):
    """({side: output tok/s per round}, {side: first round's outputs}); an untimed warm-up of 4 short requests first."""
    warm = [Job(j.prompt_token_ids[:32], 16) for j in jobs[:4]]
    for fn in sides.values():
        fn(warm)
    rates: dict[str, list[float]] = {s: [] for s in sides}
    outputs: dict[str, list[list[int]]] = {}
    order = list(sides)
    for r in range(rounds):
        for side in order if r % 2 == 0 else order[::-1]:
            run = sides[side](jobs)
            rates[side].append(run.output_tps)
            outputs.setdefault(side, run.outputs)
            problems = length_problems(side, run, jobs)
            if problems:
                raise SystemExit("; ".join(problems))
            log(f"round {r + 1} {side}: {run.output_tps:.1f} output tok/s")
    return rates, outputs


def report(args: argparse.Namespace, rates: dict[str, list[float]], outputs: dict, jobs: list) -> None:
    ours = rates["pagedserve"]
    line = f"W1 {args.model}: pagedserve ({args.quantization}) {statistics.median(ours):.1f} output tok/s " \
           f"({min(ours):.1f}-{max(ours):.1f})"
    transformers = [s for s in rates if s.startswith("transformers")]
    peers = [max(transformers, key=lambda s: statistics.median(rates[s]))] + [s for s in rates if s == "vLLM CPU"]
    for peer in peers:
        same, n, first = agreement(outputs["pagedserve"], outputs[peer])
        paired = [o / t for o, t in zip(ours, rates[peer], strict=True)]
        line += (f"; {peer} ({args.peer_dtype if peer in transformers else 'bfloat16'}) "
                 f"{statistics.median(rates[peer]):.1f} ({min(rates[peer]):.1f}-{max(rates[peer]):.1f}): ratio "
                 f"{statistics.median(paired):.2f}x ({min(paired):.2f}-{max(paired):.2f}), greedy outputs identical "
                 f"{same}/{n}, median first difference at token {first:.0f}")
    print(line)


if __name__ == "__main__":
    main()
