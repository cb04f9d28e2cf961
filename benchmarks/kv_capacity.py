"""How many 8k-token sequences a KV pool holds, Gemma 3's hybrid layout against a full-attention one.

The same --kv-cache-memory, the same KV format and block size; the only difference is whether sliding-window
layers give back the blocks their window no longer reaches (engine/kv_cache.py). Requests are admitted one by one
through the KV cache manager's own allocation: each prefills in chunks of --chunk tokens to --context, then
decodes --decode tokens; a request that finds no room ends the count. No model runs: the count is exact for the
allocator, and the bytes are ModelRunner's.

    python benchmarks/kv_capacity.py --model gemma-3-270m --kv-cache-memory 2GiB --context 8192
"""
from __future__ import annotations

import argparse
import dataclasses

import torch

from pagedserve.config import parse_size
from pagedserve.engine.kv_cache import KVCacheManager, kv_cache_groups
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.engine.request import Request
from pagedserve.model.kv_cache_dtype import resolve_kv_format
from pagedserve.model.loader import load_model
from pagedserve.model.model_config import ModelConfig
from pagedserve.sampling_params import SamplingParams


def admitted(config: ModelConfig, pool_bytes: int, kv_dtype: str, block_size: int, context: int, chunk: int,
             decode: int) -> tuple[int, int]:
    """(sequences that fit, KV blocks of the pool) for config's layer layout."""
    fmt = resolve_kv_format(kv_dtype, torch.bfloat16)
    num_blocks = pool_bytes // ModelRunner.bytes_per_block(config, fmt, block_size)
    kv = KVCacheManager(num_blocks, block_size, False, [g.window for g in kv_cache_groups(config.layer_windows)])
    count = 0
    while True:
        req = Request(f"r{count}", list(range(context)), SamplingParams(max_tokens=decode), 0.0, 0)
        steps = [min(chunk, context - s) for s in range(0, context, chunk)] + [1] * decode
        for n in steps:
            if not kv.allocate_slots(req, n):
                return count, num_blocks
            req.num_computed_tokens += n
        count += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gemma-3-270m")
    p.add_argument("--kv-cache-memory", default="2GiB")
    p.add_argument("--kv-cache-dtype", default="bfloat16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--context", type=int, default=8192, help="prompt tokens of each sequence")
    p.add_argument("--chunk", type=int, default=2048, help="prefill chunk (--max-num-batched-tokens)")
    p.add_argument("--decode", type=int, default=128, help="tokens each sequence then decodes")
    args = p.parse_args()
    config = load_model(args.model).config
    full = dataclasses.replace(config, layer_types=None, sliding_window=None)
    assert all(w is None for w in full.layer_windows)
    pool = parse_size(args.kv_cache_memory)
    rows = {name: admitted(c, pool, args.kv_cache_dtype, args.block_size, args.context, args.chunk, args.decode)
            for name, c in (("hybrid (sliding layers keep their window)", config), ("full attention", full))}
    per_seq = {name: pool / n if n else float("inf") for name, (n, _) in rows.items()}
    print(f"{args.model}, --kv-cache-memory {args.kv_cache_memory}, {args.kv_cache_dtype} KV, "
          f"{args.context} + {args.decode} tokens a sequence, prefill chunks of {args.chunk}")
    for name, (n, blocks) in rows.items():
        print(f"  {name}: {n} sequences ({blocks} blocks; {per_seq[name] / 2**20:.1f} MiB of pool a sequence)")
    (hybrid, _), (plain, _) = rows.values()
    print(f"  the hybrid layout holds {hybrid / max(plain, 1):.2f}x the sequences: "
          f"{plain / max(hybrid, 1):.2f} of the full layout's KV bytes a sequence")


if __name__ == "__main__":
    main()
