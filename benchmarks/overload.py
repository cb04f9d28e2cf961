"""Overload benchmark (also `pagedserve bench overload`): 0.5x-3x capacity with mixed priorities,
admission control on vs off. Run `python benchmarks/overload.py --help` for options."""
import sys

from pagedserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main("overload"))
