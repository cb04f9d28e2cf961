"""Quality benchmark (also `pagedserve bench perplexity`): perplexity and top-1 agreement of each numeric
mode against the fp32 reference over the standard library's documentation.
Run `python benchmarks/perplexity.py --help` for options."""
import sys

from pagedserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main("perplexity"))
