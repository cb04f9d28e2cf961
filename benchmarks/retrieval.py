"""Retrieval benchmark (also `pagedserve bench retrieval`): recall@3 and MRR@10 of BM25, dense and hybrid on
labelled questions over Python's documentation topics, search latency at 1k-100k chunks, indexing throughput.
Run `python benchmarks/retrieval.py --help` for options."""
import sys

from pagedserve.bench.cli import main

if __name__ == "__main__":
    sys.exit(main("retrieval"))
