"""`pagedserve bench BENCHMARK`: one subcommand per module of this package, each with add_arguments(parser),
run_args(args) and QUICK (its flags for a run at a small scale). benchmarks/BENCHMARK.py calls
main(BENCHMARK) to run the same thing as a script; `pagedserve bench all [--quick]` runs every one."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
import tempfile
import time
from pathlib import Path

BENCHMARKS = {
    "throughput": "offline throughput: W1, MIX, PREFIX, single stream vs transformers",
    "serve": "online serving: Poisson arrivals over MIX vs llama-server",
    "overload": "overload control: 0.5x-3x capacity, priorities, control on vs off",
    "routing": "routing policies over 4 replicas (and a labelled simulation mode)",
    "gateway": "gateway overhead, semantic-cache lookup at 100k entries, hit rate",
    "perplexity": "quality: perplexity and top-1 agreement of each numeric mode against fp32",
    "quantization": "quantized weights: single stream vs llama.cpp, W1 per mode, roofline",
    "structured": "structured outputs: decode cost of grammars, llguidance vs xgrammar on our vocabulary",
    "lora": "multi-LoRA: 1-128 adapters batched vs the base model and vs one adapter at a time",
    "disagg": "disaggregated prefill/decode: KV transfer GB/s vs memcpy and loopback; 1P+1D vs 2 co-located",
    "retrieval": "retrieval: recall@3 and MRR of BM25, dense and hybrid; search latency at 1k-100k chunks",
    "tp": "tensor parallelism: all-reduce latency by size (shm vs gloo); W1 and one stream, TP=1 vs TP=2",
    "checkpoints": "quantized checkpoints (compressed-tensors): W1 and one stream vs vLLM CPU on the same folders",
    "spec": "speculative decoding: one stream ms/token with and without ngram on quoting and open workloads",
}


def configure(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    module = importlib.import_module(f"pagedserve.bench.{name}")
    parser.description = module.__doc__
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    module.add_arguments(parser)
    parser.set_defaults(func=module.run_args)
    return parser


def register(sub: argparse._SubParsersAction) -> None:
    bench = sub.add_parser("bench", help="run a benchmark and write its results to docs/benchmarks.md")
    bench_sub = bench.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    for name, help_line in BENCHMARKS.items():
        configure(bench_sub.add_parser(name, help=help_line), name)
    every = bench_sub.add_parser("all", help="every benchmark in turn (--quick: each at a small scale, minutes)",
                                 description="Runs every benchmark with its own defaults, or with --quick at a small "
                                             "scale that checks each one works end to end in a few minutes.")
    every.add_argument("--quick", action="store_true",
                       help="small scale; results go to --docs (default: a temporary folder), not docs/")
    every.add_argument("--only", default=",".join(BENCHMARKS), help="comma-separated subset")
    every.add_argument("--docs", type=Path, default=None, help="where benchmarks.md goes")
    every.set_defaults(func=run_all)


def run_all(args: argparse.Namespace) -> int:
    """Each benchmark parsed by its own parser (so a flag it refuses fails here too); the failures counted."""
    docs = args.docs or (Path(tempfile.mkdtemp(prefix="pagedserve-bench-")) if args.quick else None)
    failed = []
    for name in args.only.split(","):
        module = importlib.import_module(f"pagedserve.bench.{name}")
        argv = (list(module.QUICK) if args.quick else []) + (["--docs", str(docs)] if docs else [])
        parsed = configure(argparse.ArgumentParser(prog=f"pagedserve bench {name}"), name).parse_args(argv)
        print(f"== bench {name} {' '.join(argv)}", flush=True)
        start = time.perf_counter()
        code = int(parsed.func(parsed) or 0)
        print(f"== bench {name}: exit {code} in {time.perf_counter() - start:.0f} s", flush=True)
        if code:
            failed.append(name)
    print(f"bench all: {len(args.only.split(',')) - len(failed)} passed, {len(failed)} failed"
          + (f" ({', '.join(failed)})" if failed else "") + (f"; results in {docs}" if docs else ""))
    return 1 if failed else 0


def main(name: str, argv: list[str] | None = None) -> int:
    """Entry point of benchmarks/NAME.py: the same flags as `pagedserve bench NAME`."""
    parser = configure(argparse.ArgumentParser(prog=f"benchmarks/{name}.py"), name)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)
