"""Offline throughput benchmark (also `pagedserve bench throughput`): W1, MIX, PREFIX and single stream,
pagedserve vs transformers. Run `python benchmarks/throughput.py --help` for options."""
import sys

from pagedserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main("throughput"))
