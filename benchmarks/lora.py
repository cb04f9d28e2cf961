"""Multi-LoRA benchmark (also `pagedserve bench lora`): adapters batched against the base model
and against serving one adapter at a time.
Run `python benchmarks/lora.py --help` for options."""
import sys

from pagedserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main("lora"))
