"""Quantized-weight speed (also `pagedserve bench quantization`): single stream beside llama.cpp, W1 per
--quantization mode, and the roofline of each. Run `python benchmarks/quantization.py --help` for options."""
import sys

from pagedserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main("quantization"))
