"""Greedy batches: the argmax of the model-dtype logits in C++ (engine/sampler.greedy_tokens, csrc/argmax.cpp)
against the path it replaced (the [rows, vocab] logits copied to fp32, then torch.max), paired in one process:
the same engine runs W1 (64 x 128/128, all greedy) with each path in turn, rounds alternating, and checks that
both give the same tokens. The old path is restored by swapping two functions, nothing else changes.

python benchmarks/greedy_sampling.py --model gemma-3-270m --rounds 2
"""
from __future__ import annotations

import argparse
import statistics

from pagedserve.bench.measure import log
from pagedserve.bench.throughput import run_engine
from pagedserve.bench.workloads import corpus_tokens, w1
from pagedserve.config import EngineConfig
from pagedserve.engine import llm_engine, sampler
from pagedserve.engine.llm_engine import LLMEngine


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the packaged SmolLM2")
    p.add_argument("--quantization", default="none")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, quantization=args.quantization, kv_cache_memory="1GiB"))
    jobs = w1(corpus_tokens(engine.tokenizer), args.requests, 128, 128)
    run_engine(engine, jobs[:4])  # warm-up
    paths = {"argmax in the model dtype (C++)": (sampler.SamplingBatch.plain_greedy, sampler.greedy_tokens),
             "fp32 copy + torch.max": (property(lambda self: False), lambda logits: logits.max(dim=-1).indices)}
    rates: dict[str, list[float]] = {name: [] for name in paths}
    outputs: dict[str, list[list[int]]] = {}
    for r in range(args.rounds):
        for name, (plain_greedy, greedy_tokens) in (paths.items() if r % 2 == 0 else reversed(paths.items())):
            sampler.SamplingBatch.plain_greedy = plain_greedy
            sampler.greedy_tokens = llm_engine.greedy_tokens = greedy_tokens
            engine.kv.reset_prefix_cache()
            run = run_engine(engine, jobs)
            outputs.setdefault(name, run.outputs)
            rates[name].append(sum(map(len, run.outputs)) / run.elapsed)
            log(f"round {r + 1} {name}: {rates[name][-1]:.1f} output tok/s, decode step median "
                f"{statistics.median(run.decode_step_s) * 1000:.1f} ms")
    new, old = rates.values()
    print(f"W1 {args.model or 'SmolLM2-135M'}: new / old {', '.join(f'{a / b:.3f}' for a, b in zip(new, old))} per "
          f"round; same tokens: {len(set(map(str, outputs.values()))) == 1}")


if __name__ == "__main__":
    main()
