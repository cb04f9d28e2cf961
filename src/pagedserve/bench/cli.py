"""`pagedserve bench BENCHMARK`: one subcommand per module of this package, each with add_arguments(parser)
and run_args(args). benchmarks/BENCHMARK.py calls main(BENCHMARK) to run the same thing as a script."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

BENCHMARKS = {
    "throughput": "offline throughput: W1, MIX, PREFIX, single stream vs transformers",
    "serve": "online serving: Poisson arrivals over MIX vs llama-server",
    "overload": "overload control: 0.5x-3x capacity, priorities, control on vs off",
    "routing": "routing policies over 4 replicas (and a labelled simulation mode)",
    "gateway": "gateway overhead, semantic-cache lookup at 100k entries, hit rate",
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


def main(name: str, argv: list[str] | None = None) -> int:
    """Entry point of benchmarks/NAME.py: the same flags as `pagedserve bench NAME`."""
    parser = configure(argparse.ArgumentParser(prog=f"benchmarks/{name}.py"), name)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args) or 0)
