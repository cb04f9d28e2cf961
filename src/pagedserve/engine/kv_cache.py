"""The KV block pool: allocation, refcounts, copy-on-write forks and automatic prefix caching.

Blocks hold block_size tokens. Only full blocks are cached, under a hash chain
hash(parent hash, block token ids, extra key), and a hit is verified against the stored token ids,
so a hash collision can never reuse the wrong KV. Free blocks wait in an LRU queue and keep their
hash until they are reused, so a freed prefix can still be hit.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.engine.request import Request


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # the full block's tokens, set when it is cached


@dataclass(slots=True)
class KVCacheStats:
    blocks_total: int
    blocks_used: int  # referenced by some request
    blocks_cached: int  # holding a reusable prefix (used or free)
    hit_tokens: int
    query_tokens: int


@dataclass(slots=True)
class ForkResult:
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) blocks the runner must copy


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[int, int] = {}  # block hash -> block id
        self.req_blocks: dict[str, list[int]] = {}
        self.req_hashes: dict[str, list[int]] = {}  # hash chain of the request's cached full blocks
        self.hit_tokens = 0
        self.query_tokens = 0
        self.on_release: Callable[[list[int]], None] | None = None  # told of blocks a free() returned to the pool

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def stats(self) -> KVCacheStats:
        used = self.num_blocks - self.num_free_blocks
        return KVCacheStats(self.num_blocks, used, len(self.cached), self.hit_tokens, self.query_tokens)

    def block_table(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    # -- prefix cache -------------------------------------------------------------------------
    def find_cached_prefix(self, req: Request) -> list[int]:
        """Blocks holding the longest cached prefix of req; at least one token is left to compute."""
        if not self.enable_prefix_caching or req.prompt_logprobs is not None:  # those need every position computed
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        return self.cached_prefix_blocks(req.all_token_ids[:max_blocks * self.block_size], req.cache_salt)

    def cache_full_blocks(self, req: Request) -> None:
        """Register the request's newly completed full blocks (KV computed) in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        hashes = self.req_hashes.setdefault(req.request_id, [])
        table = self.req_blocks[req.request_id]
        num_full = min(req.num_computed_tokens // self.block_size, len(table))
        for i in range(len(hashes), num_full):
            tokens = tuple(req.all_token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = hash((hashes[-1] if hashes else None, tokens, req.cache_salt))
            hashes.append(h)
            block = self.blocks[table[i]]
            if block.block_hash is None and h not in self.cached:
                block.block_hash, block.token_ids = h, tokens
                self.cached[h] = block.block_id

    # -- allocation ---------------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int, cached_blocks: list[int] | None = None) -> bool:
        """Make room for num_new_tokens more tokens after req.num_computed_tokens (plus cached blocks).

        Returns False, changing nothing, when the pool has too few free blocks.
        """
        table = self.req_blocks.get(req.request_id, [])
        cached_blocks = cached_blocks or []
        num_cached = len(cached_blocks) * self.block_size
        needed_total = -(-(req.num_computed_tokens + num_cached + num_new_tokens) // self.block_size)
        num_new_blocks = needed_total - len(table) - len(cached_blocks)
        free_cached = sum(1 for b in cached_blocks if self.blocks[b].ref_count == 0)
        if num_new_blocks > self.num_free_blocks - free_cached:
            return False
        for b in cached_blocks:
            self._touch(b)
        table = table + cached_blocks + [self._pop_free() for _ in range(max(num_new_blocks, 0))]
        self.req_blocks[req.request_id] = table
        if cached_blocks:
            self.req_hashes[req.request_id] = [self.blocks[b].block_hash for b in cached_blocks]
        return True

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.query_tokens += num_query_tokens
        self.hit_tokens += num_hit_tokens

    def fork(self, parent: Request, child_id: str) -> ForkResult | None:
        """The child shares the parent's full blocks; its partial last block is a copy (copy-on-write).

        Returns None, changing nothing, when no block is free for that copy.
        """
        table = self.req_blocks[parent.request_id]
        partial = parent.num_computed_tokens % self.block_size != 0
        if partial and self.num_free_blocks == 0:
            return None
        shared = table[:-1] if partial else list(table)
        for b in shared:
            self.blocks[b].ref_count += 1
        result = ForkResult()
        child_table = list(shared)
        if partial:
            dst = self._pop_free()
            result.copies.append((table[-1], dst))
            child_table.append(dst)
        self.req_blocks[child_id] = child_table
        self.req_hashes[child_id] = list(self.req_hashes.get(parent.request_id, []))
        return result

    def free(self, request_id: str) -> None:
        """Release the request's blocks; the tail goes first into the LRU queue so it is evicted first."""
        released = []
        for b in reversed(self.req_blocks.pop(request_id, [])):
            block = self.blocks[b]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {b} freed twice"
            if block.ref_count == 0:
                self.free_queue[b] = None
                released.append(b)
        self.req_hashes.pop(request_id, None)
        if self.on_release is not None:
            self.on_release(released)

    # -- transfer between workers (disaggregated prefill/decode) ----------------------------------
    def cached_prefix_blocks(self, token_ids: list[int], salt: str | None = None) -> list[int]:
        """The cached blocks holding the longest prefix of these tokens (full blocks only), each verified
        against its stored tokens."""
        hits, parent = [], None
        for i in range(len(token_ids) // self.block_size):
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = hash((parent, tokens, salt))
            block_id = self.cached.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            parent = h
        return hits

    def pin(self, block_ids: list[int]) -> None:
        """Holds blocks (a transfer lease): neither evicted nor reused until unpinned."""
        for b in block_ids:
            self._touch(b)

    def unpin(self, block_ids: list[int]) -> None:
        for b in block_ids:
            block = self.blocks[b]
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {b} unpinned twice"
            if block.ref_count == 0:
                self.free_queue[b] = None

    def insert_cached(self, token_ids: list[int], start: int, count: int, salt: str | None = None) -> list[int]:
        """Free blocks registered in the prefix cache as holding blocks start..start+count of these tokens
        (blocks 0..start must already be cached); the caller writes their KV before anything else runs. They
        stay free (evictable, most recently used). Fewer than count when the pool has fewer free blocks."""
        parent = None
        for i in range(start):
            parent = hash((parent, tuple(token_ids[i * self.block_size:(i + 1) * self.block_size]), salt))
        out = []
        for i in range(start, min(start + count, start + self.num_free_blocks)):
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = hash((parent, tokens, salt))
            if h in self.cached:  # cached meanwhile (computed here): keep what is there
                break
            block_id = self._pop_free()
            block = self.blocks[block_id]
            block.ref_count, block.block_hash, block.token_ids = 0, h, tokens
            self.cached[h] = block_id
            self.free_queue[block_id] = None
            out.append(block_id)
            parent = h
        return out

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            if block.ref_count == 0:
                self._evict(block)

    def _touch(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _pop_free(self) -> int:
        block_id, _ = self.free_queue.popitem(last=False)
        block = self.blocks[block_id]
        self._evict(block)
        block.ref_count = 1
        return block_id

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block.block_id:
                del self.cached[block.block_hash]
            block.block_hash, block.token_ids = None, None
