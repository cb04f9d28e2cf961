"""One stream against llama.cpp's llama-bench on the same GGUF, in CPU time per decoded token as well as wall time.

On a shared machine wall time measures the neighbours as much as the engine; the CPU time a process spends per
token (at one thread, where no thread waits on another) is what the engine itself costs. pagedserve: a 128-token
prompt, then --tokens greedy tokens, timed after the first (time.process_time); llama-bench: the difference between
runs of 32 and 32 + --tokens generated tokens (its load and warm-up cancel), from the children's rusage. Rounds
alternate the two.

    python benchmarks/single_stream_cpu.py --model gemma-3-270m --threads 1 --rounds 3
"""
from __future__ import annotations

import argparse
import resource
import statistics
import subprocess
import time

from pagedserve.bench.quantization import LLAMA_BENCH
from pagedserve.bench.workloads import corpus_tokens, w1
from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.model.loader import resolve_model_path
from pagedserve.sampling_params import SamplingParams


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def llama_bench(binary: str, gguf: str, threads: int, tokens: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per generated token."""
    def run(n: int) -> tuple[float, float]:
        cpu, wall = children_cpu(), time.perf_counter()
        subprocess.run([binary, "-m", gguf, "-t", str(threads), "-p", "0", "-n", str(n), "-r", "1"],
                       capture_output=True, check=True)
        return children_cpu() - cpu, time.perf_counter() - wall
    (c1, w1_), (c2, w2) = run(32), run(32 + tokens)
    return (c2 - c1) / tokens * 1e3, (w2 - w1_) / tokens * 1e3


def pagedserve(engine: LLMEngine, prompt: list[int], tokens: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per decoded token after the first."""
    engine.add_request("single", prompt, SamplingParams(temperature=0, max_tokens=tokens + 1, ignore_eos=True))
    engine.step()  # the prefill and the first token
    cpu, wall = time.process_time(), time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return (time.process_time() - cpu) / tokens * 1e3, (time.perf_counter() - wall) / tokens * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--quantization", default="gguf")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--llama-bench", default=str(LLAMA_BENCH), help="llama-bench binary")
    args = p.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, quantization=args.quantization, dtype="bfloat16",
                                    num_threads=args.threads, kv_cache_memory="256MiB"))
    prompt = w1(corpus_tokens(engine.tokenizer), 1, 128, 128)[0].prompt_token_ids
    gguf = str(resolve_model_path(args.model))
    pagedserve(engine, prompt, 16)  # warm-up
    ours, theirs = [], []
    for r in range(args.rounds):
        runs = [lambda: ours.append(pagedserve(engine, prompt, args.tokens)),
                lambda: theirs.append(llama_bench(args.llama_bench, gguf, args.threads, args.tokens))]
        for run in runs if r % 2 == 0 else runs[::-1]:
            run()
        print(f"round {r + 1}: pagedserve {ours[-1][0]:.2f} CPU ms/token ({ours[-1][1]:.2f} wall), llama.cpp "
              f"{theirs[-1][0]:.2f} ({theirs[-1][1]:.2f} wall)", flush=True)
    cpu = [a[0] / b[0] for a, b in zip(theirs, ours, strict=True)]
    print(f"median: pagedserve {statistics.median(o[0] for o in ours):.2f} CPU ms/token, llama.cpp "
          f"{statistics.median(t[0] for t in theirs):.2f}; llama.cpp / pagedserve CPU time {statistics.median(cpu):.2f}x "
          f"({min(cpu):.2f}-{max(cpu):.2f}); wall {statistics.median(o[1] for o in ours):.2f} vs "
          f"{statistics.median(t[1] for t in theirs):.2f} ms/token")


if __name__ == "__main__":
    main()
