"""Routing benchmark (also `pagedserve bench routing`): round_robin vs least_load vs prefix_affinity over
4 local replicas on a multi-tenant chat workload, plus a labelled simulation at cluster scale.
Run `python benchmarks/routing.py --help` for options."""
import sys

from pagedserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main("routing"))
