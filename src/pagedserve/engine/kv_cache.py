"""The KV block pool: allocation, refcounts, copy-on-write forks and automatic prefix caching.

Blocks hold block_size tokens. Only full blocks are cached, under a hash chain
hash(parent hash, block token ids, extra key), and a hit is verified against the stored token ids,
so a hash collision can never reuse the wrong KV. Free blocks wait in an LRU queue and keep their
hash until they are reused, so a freed prefix can still be hit.

Hybrid models (vLLM v1's hybrid allocator): the layers are split into KV cache groups of one size, each all
full attention or all one sliding window (kv_cache_groups). One pool of block ids serves every group: a block
id holds one block's K and V for as many layers as a group has (the runner's storage is that many layers deep,
each layer reading the storage of its place in its group), so blocks are interchangeable between groups. A
request has one block table per group, all indexed by block position. A full-attention group keeps every block;
a sliding group gives back the blocks wholly before its window (their entries become NULL_BLOCK), so a long
sequence holds about window / block_size blocks per sliding group. Prefix caching keys a block by (group,
hash): a hit needs every block of the prefix in the full groups, and only the blocks the next token's window
reaches in the sliding ones.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.engine.request import Request

NULL_BLOCK = -1  # a sliding group's table entry for a block its window no longer sees (given back to the pool)


@dataclass(frozen=True, slots=True)
class KVCacheGroup:
    """Layers that share one block table per request: all full attention (window None) or all one window."""
    layers: tuple[int, ...]
    window: int | None = None


def kv_cache_groups(layer_windows: list[int | None]) -> list[KVCacheGroup]:
    """Groups of one size, the greatest common divisor of each kind's layer count (Gemma 3 270M: 15 sliding and
    3 full layers make 5 sliding groups and 1 full group of 3); a model with one kind is one group."""
    kinds: dict[int | None, list[int]] = {}
    for i, w in enumerate(layer_windows):
        kinds.setdefault(w, []).append(i)
    size = math.gcd(*(len(layers) for layers in kinds.values()))
    return [KVCacheGroup(tuple(layers[j:j + size]), window)
            for window, layers in sorted(kinds.items(), key=lambda kv: kv[0] or 0) for j in range(0, len(layers), size)]


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None  # the full block's tokens, set when it is cached
    group: int = 0  # the KV cache group whose prefix cache holds it


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
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: list[int | None] | None = None) -> None:
        """windows: each KV cache group's sliding window, None for full attention (default: one full group)."""
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = list(windows or [None])
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached_by_group: list[dict[int, int]] = [{} for _ in self.windows]  # block hash -> block id
        self.req_blocks: dict[str, list[list[int]]] = {}  # per request, one table per group
        self.req_hashes: dict[str, list[int]] = {}  # hash chain of the request's cached full blocks
        self.req_window_start: dict[str, list[int]] = {}  # per sliding group: entries before it are NULL_BLOCK
        self.hit_tokens = 0
        self.query_tokens = 0
        self.on_release: Callable[[list[int]], None] | None = None  # told of blocks a free() returned to the pool

    @property
    def hybrid(self) -> bool:
        return self.windows != [None]

    @property
    def cached(self) -> dict[int, int]:
        """The first group's prefix cache (the only one of a model without sliding layers)."""
        return self.cached_by_group[0]

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def stats(self) -> KVCacheStats:
        used = self.num_blocks - self.num_free_blocks
        cached = sum(len(c) for c in self.cached_by_group)
        return KVCacheStats(self.num_blocks, used, cached, self.hit_tokens, self.query_tokens)

    def block_table(self, request_id: str, group: int = 0) -> list[int]:
        tables = self.req_blocks.get(request_id)
        return tables[group] if tables else []

    def _first_needed(self, position: int, group: int) -> int:
        """The first block a query at position still sees in this group."""
        window = self.windows[group]
        return 0 if window is None else max(0, position - window + 1) // self.block_size

    # -- prefix cache -------------------------------------------------------------------------
    def find_cached_prefix(self, req: Request) -> list:
        """Blocks holding the longest cached prefix of req; at least one token is left to compute. One entry per
        block: its id, or with sliding groups a tuple of each group's id (NULL_BLOCK where no longer needed)."""
        if not self.enable_prefix_caching or req.prompt_logprobs is not None:  # those need every position computed
            return []
        max_blocks = (req.num_tokens - 1) // self.block_size
        hits = self._prefix_hits(req.all_token_ids[:max_blocks * self.block_size], req.cache_salt)
        return hits if self.hybrid else [h[0] for h in hits]

    def _prefix_hits(self, token_ids: list[int], salt: str | None) -> list[tuple[int, ...]]:
        """The longest prefix (in full blocks) every group can serve: full groups hold all its blocks, sliding
        groups the ones the next token's window reaches. Hits are verified against the stored tokens."""
        groups = range(len(self.windows))
        full = [g for g in groups if self.windows[g] is None]
        found: list[list[int | None]] = [[] for _ in groups]
        for i, (h, tokens) in enumerate(self._chain(token_ids, len(token_ids) // self.block_size, salt)):
            for g in groups:
                block_id = self.cached_by_group[g].get(h)
                found[g].append(block_id if block_id is not None and self.blocks[block_id].token_ids == tokens else None)
            if any(found[g][i] is None for g in full):
                break
        length = next((i for i in range(len(found[0])) if any(found[g][i] is None for g in full)), len(found[0]))
        while length and any(None in found[g][self._first_needed(length * self.block_size, g):length] for g in groups):
            length -= 1
        return [tuple(found[g][i] if i >= self._first_needed(length * self.block_size, g) else NULL_BLOCK
                      for g in groups) for i in range(length)]

    def _chain(self, token_ids: list[int], num_blocks: int, salt: str | None) -> list[tuple[int, tuple[int, ...]]]:
        """(hash, tokens) of the first num_blocks full blocks of token_ids, each hash chained to its parent's."""
        out, parent = [], None
        for i in range(num_blocks):
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            parent = hash((parent, tokens, salt))
            out.append((parent, tokens))
        return out

    def cache_full_blocks(self, req: Request) -> None:
        """After a step: register the request's newly completed full blocks (KV computed) in the prefix cache, then
        give back the sliding groups' blocks that the next token's window no longer reaches."""
        tables = self.req_blocks[req.request_id]
        if self.enable_prefix_caching:
            self._register(req, tables)
        self._drop_out_of_window(req.request_id, tables, req.num_computed_tokens)

    def _register(self, req: Request, tables: list[list[int]]) -> None:
        hashes = self.req_hashes.setdefault(req.request_id, [])
        num_full = min(req.num_computed_tokens // self.block_size, len(tables[0]))
        for i in range(len(hashes), num_full):
            tokens = tuple(req.all_token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = hash((hashes[-1] if hashes else None, tokens, req.cache_salt))
            hashes.append(h)
            for g, table in enumerate(tables):
                if table[i] == NULL_BLOCK:
                    continue
                block = self.blocks[table[i]]
                if block.block_hash is None and h not in self.cached_by_group[g]:
                    block.block_hash, block.token_ids, block.group = h, tokens, g
                    self.cached_by_group[g][h] = block.block_id

    # -- allocation ---------------------------------------------------------------------------
    def allocate_slots(self, req: Request, num_new_tokens: int, cached_blocks: list | None = None) -> bool:
        """Make room for num_new_tokens more tokens after req.num_computed_tokens (plus cached blocks, as
        find_cached_prefix returned them). Sliding groups first give back the blocks before the new tokens' window.

        Returns False, changing nothing, when the pool has too few free blocks.
        """
        rid, bs, groups = req.request_id, self.block_size, range(len(self.windows))
        tables = self.req_blocks.get(rid) or [[] for _ in groups]
        cached = [entry if isinstance(entry, tuple) else (entry,) for entry in cached_blocks or []]
        start = req.num_computed_tokens + len(cached) * bs
        num_new_blocks = -(-(start + num_new_tokens) // bs) - len(tables[0]) - len(cached)
        revived = {b for entry in cached for b in entry if b != NULL_BLOCK and self.blocks[b].ref_count == 0}
        dropped = self._out_of_window(rid, tables, start)
        returned = sum(1 for b in dropped if self.blocks[b].ref_count == 1)
        if max(num_new_blocks, 0) * len(self.windows) > self.num_free_blocks - len(revived) + returned:
            return False
        for entry in cached:
            for b in entry:
                if b != NULL_BLOCK:
                    self._touch(b)
        tables = [table + [entry[g] for entry in cached] for g, table in enumerate(tables)]
        self.req_blocks[rid] = tables
        if cached:
            self.req_hashes[rid] = [h for h, _ in self._chain(req.all_token_ids, len(cached), req.cache_salt)]
        self._drop_out_of_window(rid, tables, start)
        for table in tables:
            table += [self._pop_free() for _ in range(max(num_new_blocks, 0))]
        return True

    def _out_of_window(self, rid: str, tables: list[list[int]], position: int) -> list[int]:
        """Blocks of the sliding groups wholly before the window of a query at position."""
        starts = self.req_window_start.get(rid) or [0] * len(tables)
        return [b for g, table in enumerate(tables) if self.windows[g] is not None
                for b in table[starts[g]:self._first_needed(position, g)] if b != NULL_BLOCK]

    def _drop_out_of_window(self, rid: str, tables: list[list[int]], position: int) -> None:
        if not self.hybrid:
            return
        starts = self.req_window_start.setdefault(rid, [0] * len(tables))
        released = []
        for g, table in enumerate(tables):
            if self.windows[g] is None:
                continue
            end = self._first_needed(position, g)
            for i in range(starts[g], min(end, len(table))):
                if table[i] != NULL_BLOCK:
                    released += self._release(table[i])
                    table[i] = NULL_BLOCK
            starts[g] = max(starts[g], end)
        if released and self.on_release is not None:
            self.on_release(released)

    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.query_tokens += num_query_tokens
        self.hit_tokens += num_hit_tokens

    def fork(self, parent: Request, child_id: str) -> ForkResult | None:
        """The child shares the parent's full blocks; its partial last block is a copy (copy-on-write), in each group.

        Returns None, changing nothing, when no block is free for those copies.
        """
        tables = self.req_blocks[parent.request_id]
        partial = parent.num_computed_tokens % self.block_size != 0
        if partial and self.num_free_blocks < len(tables):
            return None
        result = ForkResult()
        child_tables = []
        for table in tables:
            shared = table[:-1] if partial else list(table)
            for b in shared:
                if b != NULL_BLOCK:
                    self.blocks[b].ref_count += 1
            if partial:
                dst = self._pop_free()
                result.copies.append((table[-1], dst))
                shared.append(dst)
            child_tables.append(shared)
        self.req_blocks[child_id] = child_tables
        self.req_hashes[child_id] = list(self.req_hashes.get(parent.request_id, []))
        if parent.request_id in self.req_window_start:
            self.req_window_start[child_id] = list(self.req_window_start[parent.request_id])
        return result

    def trim(self, req: Request) -> None:
        """Gives back the blocks past req's computed tokens: those that held only rejected proposals' KV (never
        hashed: only blocks of computed tokens are cached)."""
        keep = -(-req.num_computed_tokens // self.block_size)
        released = []
        for table in self.req_blocks.get(req.request_id, []):
            for b in reversed(table[keep:]):
                if b != NULL_BLOCK:
                    released += self._release(b)
            del table[keep:]
        if released and self.on_release is not None:
            self.on_release(released)

    def free(self, request_id: str) -> None:
        """Release the request's blocks; the tail goes first into the LRU queue so it is evicted first."""
        released = []
        for table in self.req_blocks.pop(request_id, []):
            for b in reversed(table):
                if b != NULL_BLOCK:
                    released += self._release(b)
        self.req_hashes.pop(request_id, None)
        self.req_window_start.pop(request_id, None)
        if self.on_release is not None:
            self.on_release(released)

    def _release(self, block_id: int) -> list[int]:
        """Drops one reference; the block, when that was the last one, joins the free queue (returned)."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block_id} freed twice"
        if block.ref_count:
            return []
        self.free_queue[block_id] = None
        return [block_id]

    # -- transfer between workers (disaggregated prefill/decode) ----------------------------------
    # A transferred block is a block position: a tuple of each group's block id there (NULL_BLOCK where a sliding
    # group's window no longer reaches it: nothing of it travels), one entry without sliding layers.
    def cached_prefix_blocks(self, token_ids: list[int], salt: str | None = None) -> list[tuple[int, ...]]:
        """The cached blocks holding the longest prefix of these tokens (full blocks only) that a request for
        them could hit, each verified against its stored tokens."""
        return self._prefix_hits(token_ids, salt)

    def cached_prefix_length(self, token_ids: list[int], salt: str | None = None) -> int:
        """How many leading full blocks of these tokens every full-attention group holds (the sliding groups'
        are what a transfer of that many blocks brings along)."""
        full = [g for g, w in enumerate(self.windows) if w is None]
        for i, (h, tokens) in enumerate(self._chain(token_ids, len(token_ids) // self.block_size, salt)):
            ids = [self.cached_by_group[g].get(h) for g in full]
            if any(b is None or self.blocks[b].token_ids != tokens for b in ids):
                return i
        return len(token_ids) // self.block_size

    def pin(self, positions: list[tuple[int, ...]]) -> None:
        """Holds blocks (a transfer lease): neither evicted nor reused until unpinned."""
        for b in held(positions):
            self._touch(b)

    def unpin(self, positions: list[tuple[int, ...]]) -> None:
        for b in held(positions):
            self._release(b)

    def insert_cached(self, token_ids: list[int], start: int, count: int, salt: str | None = None,
                      total: int | None = None) -> list[tuple[int, ...]]:
        """Free blocks registered in the prefix cache as holding block positions start..start+count of these
        tokens (positions 0..start must already be cached); the caller writes their KV before anything else runs.
        They stay free (evictable, most recently used). A sliding group gets blocks only where the window of a
        prefix of total positions (start + count by default) reaches. Fewer positions than count when the pool is
        short."""
        total = start + count if total is None else total
        need = [self._first_needed(total * self.block_size, g) for g in range(len(self.windows))]
        chain = self._chain(token_ids, start, salt)
        parent = chain[-1][0] if chain else None
        out = []
        for i in range(start, start + count):
            tokens = tuple(token_ids[i * self.block_size:(i + 1) * self.block_size])
            h = hash((parent, tokens, salt))
            groups = [g for g in range(len(self.windows)) if i >= need[g]]
            if any(h in self.cached_by_group[g] for g in groups) or len(groups) > self.num_free_blocks:
                break  # cached meanwhile (computed here): keep what is there; or the pool is short
            position = [NULL_BLOCK] * len(self.windows)
            for g in groups:
                block_id = position[g] = self._pop_free()
                block = self.blocks[block_id]
                block.ref_count, block.block_hash, block.token_ids, block.group = 0, h, tokens, g
                self.cached_by_group[g][h] = block_id
                self.free_queue[block_id] = None
            out.append(tuple(position))
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
            if self.cached_by_group[block.group].get(block.block_hash) == block.block_id:
                del self.cached_by_group[block.group][block.block_hash]
            block.block_hash, block.token_ids = None, None


def held(positions: list[tuple[int, ...]]) -> list[int]:
    """The block ids of transferred block positions, NULL_BLOCK left out."""
    return [b for position in positions for b in position if b != NULL_BLOCK]
