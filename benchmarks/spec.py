"""Speculative decoding benchmark (also `pagedserve bench spec`): one stream ms per token with and without
n-gram proposals, on prompts that quote their context and on one that does not.
Run `python benchmarks/spec.py --help` for options."""
import sys

from pagedserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main("spec"))
