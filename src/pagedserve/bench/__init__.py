"""Benchmarks: the top floor. Each module measures one tier against a peer in the same run and writes its
section of docs/benchmarks.md; nothing in the product tiers imports this package."""
