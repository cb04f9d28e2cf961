"""Online serving benchmark (also `pagedserve bench serve`): Poisson arrivals over MIX, pagedserve vs
llama-server. Run `python benchmarks/serve.py --help` for options."""
import sys

from pagedserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main("serve"))
