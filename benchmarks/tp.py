"""Tensor-parallel benchmark (also `pagedserve bench tp`): all-reduce latency and bandwidth by size, shared memory
vs gloo; W1 and one stream at TP=1 on one core vs TP=2 on two. Run `python benchmarks/tp.py --help` for options."""
import sys

from pagedserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main("tp"))
