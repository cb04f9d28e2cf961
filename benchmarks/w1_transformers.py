"""W1 (64 x 128/128) on another model than bench throughput's SmolLM2: pagedserve against transformers on the same
token ids, in one run, rounds alternating the two (bench throughput's transformers peer: static batching with
generate(), the GGUF dequantized into dense tensors of --peer-dtype, EOS ignored through min_new_tokens).

    python benchmarks/w1_transformers.py --model gemma-3-270m --peer-batches 64 --rounds 2
"""
from __future__ import annotations

import argparse
import statistics

from pagedserve.bench import hf_peer
from pagedserve.bench.measure import agreement, log
from pagedserve.bench.throughput import run_engine
from pagedserve.bench.workloads import corpus_tokens, w1
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
    args = p.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, quantization=args.quantization, kv_cache_memory=args.kv_cache_memory))
    jobs = w1(corpus_tokens(engine.tokenizer), args.requests, 128, 128)
    model = hf_peer.load(args.peer_dtype, resolve_model_path(args.model))
    pad = model.config.pad_token_id or 0
    batches = [int(b) for b in args.peer_batches.split(",")]
    run_engine(engine, jobs[:4])  # warm-up, both sides
    hf_peer.static(model, jobs[:4], 4, pad)
    ours, theirs, outputs = [], {b: [] for b in batches}, {}
    for r in range(args.rounds):
        sides = ["ours", *batches]
        for side in sides if r % 2 == 0 else sides[::-1]:
            if side == "ours":
                engine.kv.reset_prefix_cache()
                run = run_engine(engine, jobs)
                ours.append(run.output_tps)
            else:
                run = hf_peer.static(model, jobs, side, pad)
                theirs[side].append(run.output_tps)
            outputs.setdefault(side, run.outputs)
            log(f"round {r + 1} {side}: {run.output_tps:.1f} output tok/s")
    best = max(batches, key=lambda b: statistics.median(theirs[b]))
    same, n, first = agreement(outputs["ours"], outputs[best])
    print(f"W1 {args.model}: pagedserve ({args.quantization}) {statistics.median(ours):.1f} output tok/s "
          f"({min(ours):.1f}-{max(ours):.1f}); transformers ({args.peer_dtype}) best static batch {best}: "
          f"{statistics.median(theirs[best]):.1f} ({min(theirs[best]):.1f}-{max(theirs[best]):.1f}); ratio "
          f"{statistics.median(ours) / statistics.median(theirs[best]):.2f}x; greedy outputs identical {same}/{n}, "
          f"median first difference at token {first:.0f}")


if __name__ == "__main__":
    main()
