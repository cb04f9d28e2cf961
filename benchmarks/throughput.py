"""Offline throughput benchmark (also `pagedserve bench throughput`): W1, MIX, PREFIX and single stream,
pagedserve vs transformers. Run `python benchmarks/throughput.py --help` for options."""
import sys

from pagedserve.engine.bench_throughput import main

if __name__ == "__main__":
    sys.exit(main())
