"""Property tests of the KV block manager: no leaks, no double frees, consistent refcounts, prefixes found again."""
from __future__ import annotations

from collections import Counter
from typing import ClassVar

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedserve.engine.kv_cache import NULL_BLOCK, KVCacheGroup, KVCacheManager, kv_cache_groups
from pagedserve.engine.request import Request
from pagedserve.sampling_params import SamplingParams

BLOCK = 4
NUM_BLOCKS = 16


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), 0.0, seed=0)


class KVMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS, BLOCK)
        self.reqs: dict[str, Request] = {}
        self.next_id = 0

    def _new_id(self) -> str:
        self.next_id += 1
        return f"r{self.next_id}"

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=24))
    def allocate(self, tokens):
        req = make_request(self._new_id(), tokens)
        cached = self.kv.find_cached_prefix(req)
        for i, entry in enumerate(cached):  # a hit always holds exactly the request's tokens (in every group)
            for b in entry if isinstance(entry, tuple) else (entry,):
                assert b == NULL_BLOCK or self.kv.blocks[b].token_ids == tuple(tokens[i * BLOCK:(i + 1) * BLOCK])
        num_new = len(tokens) - len(cached) * BLOCK
        if self.kv.allocate_slots(req, num_new, cached):
            req.num_computed_tokens = len(tokens)
            self.kv.cache_full_blocks(req)
            self.reqs[req.request_id] = req

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), new=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def append(self, data, new):
        req = self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))]
        if self.kv.allocate_slots(req, len(new)):
            for t in new:
                req.append_token(t)
            req.num_computed_tokens = req.num_tokens
            self.kv.cache_full_blocks(req)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))]
        child = make_request(self._new_id(), list(parent.all_token_ids))
        result = self.kv.fork(parent, child.request_id)
        if result is not None:
            child.num_computed_tokens = parent.num_computed_tokens
            self.reqs[child.request_id] = child
            for src, dst in result.copies:
                assert src != dst and self.kv.blocks[dst].ref_count == 1

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        self.kv.free(rid)
        del self.reqs[rid]

    @rule()
    def evict_all_free(self):
        self.kv.reset_prefix_cache()

    @invariant()
    def refcounts_match_block_tables(self):
        refs = Counter(b for rid in self.reqs for b in self.kv.block_table(rid))
        for block in self.kv.blocks:
            assert block.ref_count == refs.get(block.block_id, 0)
            assert (block.ref_count == 0) == (block.block_id in self.kv.free_queue)

    @invariant()
    def cached_map_is_consistent(self):
        for h, b in self.kv.cached.items():
            assert self.kv.blocks[b].block_hash == h and self.kv.blocks[b].token_ids is not None

    @invariant()
    def tables_cover_tokens(self):
        for rid, req in self.reqs.items():
            assert len(self.kv.block_table(rid)) == -(-req.num_computed_tokens // BLOCK)


TestKVMachine = KVMachine.TestCase
TestKVMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@given(st.lists(st.integers(0, 50), min_size=BLOCK * 2, max_size=40))
@settings(max_examples=100, deadline=None)
def test_freed_prefix_is_found_again(tokens):
    kv = KVCacheManager(NUM_BLOCKS, BLOCK)
    first = make_request("a", tokens)
    assert kv.allocate_slots(first, len(tokens))
    first.num_computed_tokens = len(tokens)
    kv.cache_full_blocks(first)
    table = kv.block_table("a")
    kv.free("a")
    again = make_request("b", tokens + [7])
    hit = kv.find_cached_prefix(again)
    assert hit == table[:len(tokens) // BLOCK]


def test_hash_collision_never_reuses_wrong_kv():
    kv = KVCacheManager(NUM_BLOCKS, BLOCK)
    req = make_request("a", [1, 2, 3, 4, 5])
    assert kv.allocate_slots(req, 5)
    req.num_computed_tokens = 5
    kv.cache_full_blocks(req)
    block = kv.blocks[kv.block_table("a")[0]]
    block.token_ids = (9, 9, 9, 9)  # as if another prefix had landed under the same hash
    assert kv.find_cached_prefix(make_request("b", [1, 2, 3, 4, 5])) == []


def test_lru_evicts_least_recently_freed_first():
    kv = KVCacheManager(4, BLOCK)
    for rid, base in (("a", 0), ("b", 10)):
        req = make_request(rid, [base + i for i in range(2 * BLOCK)])
        assert kv.allocate_slots(req, 2 * BLOCK)
        req.num_computed_tokens = 2 * BLOCK
        kv.cache_full_blocks(req)
    kv.free("a")
    kv.free("b")
    # Two new blocks evict a's blocks (freed first) and keep b's prefix.
    assert kv.allocate_slots(make_request("c", [99] * 2 * BLOCK), 2 * BLOCK)
    assert kv.find_cached_prefix(make_request("a2", [i for i in range(2 * BLOCK)] + [0])) == []
    assert len(kv.find_cached_prefix(make_request("b2", [10 + i for i in range(2 * BLOCK)] + [0]))) == 2


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(2, BLOCK)
    req = make_request("a", list(range(3 * BLOCK)))
    assert not kv.allocate_slots(req, 3 * BLOCK)
    assert kv.num_free_blocks == 2 and kv.block_table("a") == []


class HybridKVMachine(KVMachine):
    """The same operations over a hybrid pool (vLLM v1's hybrid allocator): one full-attention group and two
    sliding-window groups (windows of 6 and 9 tokens, off block boundaries) sharing one pool of block ids."""

    WINDOWS: ClassVar[list[int | None]] = [6, None, 9]

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(NUM_BLOCKS * 2, BLOCK, windows=self.WINDOWS)

    @invariant()
    def refcounts_match_block_tables(self):
        refs = Counter(b for rid in self.reqs for g in range(len(self.WINDOWS)) for b in self.kv.block_table(rid, g)
                       if b != NULL_BLOCK)
        for block in self.kv.blocks:
            assert block.ref_count == refs.get(block.block_id, 0)
            assert (block.ref_count == 0) == (block.block_id in self.kv.free_queue)

    @invariant()
    def cached_map_is_consistent(self):
        for g, cached in enumerate(self.kv.cached_by_group):
            for h, b in cached.items():
                block = self.kv.blocks[b]
                assert block.block_hash == h and block.token_ids is not None and block.group == g

    @invariant()
    def tables_cover_tokens(self):
        """Every group's table spans the computed tokens; a sliding group holds the blocks the next token's window
        reaches and NULL_BLOCK before them, a full group every block."""
        for rid, req in self.reqs.items():
            for g, window in enumerate(self.WINDOWS):
                table = self.kv.block_table(rid, g)
                assert len(table) == -(-req.num_computed_tokens // BLOCK)
                if window is None:
                    assert NULL_BLOCK not in table
                    continue
                first_seen = max(0, req.num_computed_tokens - window + 1) // BLOCK
                assert NULL_BLOCK not in table[first_seen:]
                assert set(table[:first_seen]) <= {NULL_BLOCK} or rid not in self.kv.req_window_start


TestHybridKVMachine = HybridKVMachine.TestCase
TestHybridKVMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_hybrid_groups_share_one_pool():
    """Gemma 3 270M's layout: 15 sliding and 3 full layers make six groups of three layers (five sliding)."""
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
    groups = kv_cache_groups(windows)
    assert [g.window for g in groups] == [None] + [512] * 5 and all(len(g.layers) == 3 for g in groups)
    assert groups[0].layers == (5, 11, 17)
    assert kv_cache_groups([None] * 30) == [KVCacheGroup(tuple(range(30)))]


def test_hybrid_prefix_hit_needs_only_the_window():
    """A freed sequence's sliding blocks before the window are gone, yet its prefix is still a hit."""
    kv = KVCacheManager(64, BLOCK, windows=[None, 6])
    tokens = list(range(10 * BLOCK))
    first = make_request("a", tokens)
    for step in range(0, len(tokens), BLOCK):  # chunked: the window drops the oldest sliding blocks as it goes
        assert kv.allocate_slots(first, BLOCK)
        first.num_computed_tokens += BLOCK
        kv.cache_full_blocks(first)
    sliding = kv.block_table("a", 1)
    assert sliding.count(NULL_BLOCK) >= 7 and NULL_BLOCK not in kv.block_table("a", 0)
    kv.free("a")
    for b in sliding[:7]:
        assert b == NULL_BLOCK
    again = make_request("b", tokens + [1])
    hit = kv.find_cached_prefix(again)
    assert len(hit) == 10
    assert all(entry[1] == NULL_BLOCK for entry in hit[:8]) and all(entry[1] != NULL_BLOCK for entry in hit[8:])
    assert kv.allocate_slots(again, 1, hit)
    assert kv.block_table("b", 0) == [entry[0] for entry in hit] + kv.block_table("b", 0)[10:]


def test_hybrid_capacity_at_8k_contexts():
    """At 8k-token contexts Gemma 3's hybrid layout holds about 4.5 times the sequences of a full layout in the same
    pool: per sequence 512 blocks of the full group and 5 x 33 of the sliding ones, against 6 x 512."""
    pool = 4096
    windows = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]
    groups = [g.window for g in kv_cache_groups(windows)]

    def concurrency(manager: KVCacheManager) -> int:
        n = 0
        while True:
            req = make_request(f"r{n}", list(range(n * 8192, (n + 1) * 8192)))
            for _ in range(0, 8192, 256):  # chunked prefill: blocks before the window go back as it advances
                if not manager.allocate_slots(req, 256):
                    return n
                req.num_computed_tokens += 256
                manager.cache_full_blocks(req)
            n += 1

    hybrid = concurrency(KVCacheManager(pool, 16, windows=groups))
    full = concurrency(KVCacheManager(pool // 6, 16))  # the same bytes: a full layout's block holds all 18 layers
    assert (hybrid, full) == (5, 1)  # 6 x 677 blocks fit once prefilled, but the sixth's last chunk needs 5 x 49
