"""Property tests of the KV block manager: no leaks, no double frees, consistent refcounts, prefixes found again."""
from __future__ import annotations

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedserve.engine.kv_cache import KVCacheManager
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
        for i, b in enumerate(cached):  # a hit always holds exactly the request's tokens
            assert self.kv.blocks[b].token_ids == tuple(tokens[i * BLOCK:(i + 1) * BLOCK])
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
