"""KV blocks moved between workers (disaggregated prefill and decode), on the engine's side. Every method
runs on the engine thread (AsyncLLM.call).

The prefill worker, once a prompt is computed, leases its full blocks: they are pinned (neither evicted nor
reused) until the decode worker has pulled them and acknowledged, or until the lease expires. The decode
worker pulls only the blocks its own prefix cache lacks and registers them in that cache; its request then
runs as any other whose prompt prefix is cached, so a transfer that failed or was evicted meanwhile only
costs recomputation, never a wrong answer. Blocks are identified by the prompt's tokens and the request's cache
salt (a LoRA adapter's weights digest), not by a hash one process computed: Python's hashes need not agree
between processes.
"""
from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass

import torch

from pagedserve.engine.kv_cache import KVCacheManager, held
from pagedserve.engine.model_runner import ModelRunner


@dataclass(slots=True)
class Lease:
    lease_id: str
    block_ids: list[tuple[int, ...]]  # per block position, each KV cache group's block (engine/kv_cache.py)
    tokens_sha: str  # of the token ids the blocks hold (and the salt): the decode side checks it has the same
    expires_at: float  # time.monotonic()

    def public(self, block_size: int, kv_format: str, lease_s: float) -> dict:
        return {"lease_id": self.lease_id, "num_blocks": len(self.block_ids), "block_size": block_size,
                "kv_format": kv_format, "tokens_sha": self.tokens_sha, "expires_in_s": lease_s}


def tokens_sha(token_ids: list[int], salt: str | None = None) -> str:
    text = ",".join(map(str, token_ids)) + ("" if salt is None else f"|{salt}")
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class KVTransfer:
    def __init__(self, kv: KVCacheManager, runner: ModelRunner, lease_s: float = 30.0,
                 max_pinned_fraction: float = 0.5, max_leases: int = 1024):
        self.kv = kv
        self.runner = runner
        self.lease_s = lease_s
        # Leases never pin more than this share of the pool, nor more than max_leases at once: decode workers
        # that never come (or a peer gone wrong) cannot starve this worker's own requests of blocks.
        self.max_pinned_fraction = max_pinned_fraction
        self.max_leases = max_leases
        self.leases: dict[str, Lease] = {}

    @property
    def block_size(self) -> int:
        return self.kv.block_size

    @property
    def pinned_blocks(self) -> int:
        return sum(len(held(lease.block_ids)) for lease in self.leases.values())

    def lease(self, token_ids: list[int], salt: str | None = None) -> Lease:
        """Pins the cached full blocks of this prompt that a request for it can hit (its last token is always
        computed), those that survived until now and as many leading ones as the bounds on leases allow: the
        decode worker computes the rest; salt: the cache salt the prompt was computed under."""
        self.expire()
        room = int(self.max_pinned_fraction * self.kv.num_blocks) - self.pinned_blocks
        if len(self.leases) >= self.max_leases:
            room = 0
        hit = (len(token_ids) - 1) // self.block_size * self.block_size
        blocks = self.kv.cached_prefix_blocks(token_ids[:hit], salt)
        while blocks and len(held(blocks)) > room:  # whole positions: a sliding group's block with its full ones
            blocks.pop()
        self.kv.pin(blocks)
        lease = Lease(uuid.uuid4().hex, blocks, tokens_sha(token_ids[:len(blocks) * self.block_size], salt),
                      time.monotonic() + self.lease_s)
        self.leases[lease.lease_id] = lease
        return lease

    def export(self, lease_id: str, start: int, end: int | None = None,
               out: torch.Tensor | None = None) -> memoryview:
        """Blocks start..end of the lease, gathered into out when given (see ModelRunner.export_blocks)."""
        lease = self.live(lease_id)
        return self.runner.export_blocks(lease.block_ids[start:end], out)

    def export_size(self, lease_id: str, start: int) -> int:
        return self.runner.export_size(len(self.live(lease_id).block_ids[start:]))

    def release(self, lease_id: str) -> bool:
        """The pull is done (or abandoned): the blocks go back to the prefix cache, still reusable."""
        lease = self.leases.pop(lease_id, None)
        if lease is not None:
            self.kv.unpin(lease.block_ids)
        return lease is not None

    def expire(self) -> int:
        now = time.monotonic()
        gone = [lease_id for lease_id, lease in self.leases.items() if lease.expires_at <= now]
        for lease_id in gone:
            self.release(lease_id)
        return len(gone)

    def cached_blocks(self, token_ids: list[int], salt: str | None = None) -> int:
        """How many leading full blocks of this prompt the local prefix cache already holds."""
        return self.kv.cached_prefix_length(token_ids, salt)

    def import_blocks(self, token_ids: list[int], start: int, data: bytes, count: int, salt: str | None = None,
                      first: int = 0, num: int | None = None) -> int:
        """data holds blocks start..start+count of the prompt: registers blocks start+first..start+first+num of
        them (all by default) as cached and writes their KV; returns how many were placed (fewer when the pool
        is short: the rest is recomputed). A part at a time keeps each pause of the step thread short."""
        if len(data) != self.runner.export_size(count):
            raise ValueError(f"KV data of {len(data)} bytes for {count} blocks; this worker expects "
                             f"{self.runner.export_size(count)} (another model, block size or KV format?)")
        num = count - first if num is None else min(num, count - first)
        if self.cached_blocks(token_ids, salt) != start + first:  # the local cache changed since the pull began
            return 0
        positions = self.kv.insert_cached(token_ids, start + first, num, salt, total=start + count)
        self.runner.import_blocks(positions, data, count, first)
        return len(positions)

    def live(self, lease_id: str) -> Lease:
        self.expire()
        lease = self.leases.get(lease_id)
        if lease is None:
            raise KeyError(f"no live KV lease {lease_id!r} (unknown, released or expired after "
                           f"{self.lease_s:.0f} s)")
        return lease

