"""Quantized checkpoints against vLLM CPU (also `pagedserve bench checkpoints`): W1 and one stream on each folder of
build/quantized/, both engines loading the same files. Run `python benchmarks/checkpoints.py --help` for options."""
import sys

from pagedserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main("checkpoints"))
