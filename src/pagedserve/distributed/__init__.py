"""Tensor parallelism: one model split across processes on one host (shared memory) or several (gloo).

The driver process keeps the scheduler, the KV block manager and the sampler and is rank 0; workers (ranks 1..N-1)
run the same forward pass on their shards, steered by the step inputs the driver sends them.
"""
