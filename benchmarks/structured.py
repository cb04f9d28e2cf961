"""Structured-output benchmark (also `pagedserve bench structured`): what grammar-constrained decoding costs
a batch, and llguidance against xgrammar on our vocabulary.
Run `python benchmarks/structured.py --help` for options."""
import sys

from pagedserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main("structured"))
