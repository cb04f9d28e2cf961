"""Gateway benchmark (also `pagedserve bench gateway`): latency added over direct engine calls on a cache
miss, semantic-cache lookup at 100k entries, hit rate and staleness on a replayed question stream.
Run `python benchmarks/gateway.py --help` for options."""
import sys

from pagedserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main("gateway"))
