"""Disaggregated prefill/decode benchmark (also `pagedserve bench disagg`): KV transfer cost beside memcpy and a
loopback socket, and 1 prefill + 1 decode worker against 2 co-located replicas under a mixed Poisson load.
Run `python benchmarks/disagg.py --help` for options."""
import sys

from pagedserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main("disagg"))
