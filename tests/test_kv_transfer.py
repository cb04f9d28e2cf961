"""KV blocks moved between two engines in one process (the transfer's engine side): what the decode engine
imports is what it computes with, pinned blocks survive pool pressure, bad payloads change nothing, and
quantized blocks travel with their scales."""
from __future__ import annotations

import pytest
import torch

from pagedserve.config import EngineConfig
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.sampling_params import SamplingParams

PROMPT = "The history of the Roman empire, told briefly for a curious child who likes battles: " * 2


def engine(kv_cache_dtype: str = "auto") -> LLMEngine:
    return LLMEngine(EngineConfig(dtype="float32", kv_cache_memory="16MiB", kv_cache_dtype=kv_cache_dtype))


def greedy(e: LLMEngine, rid: str, ids: list[int], max_tokens: int = 16) -> list[int]:
    e.add_request(rid, ids, SamplingParams(temperature=0, max_tokens=max_tokens))
    done = None
    while e.has_unfinished_requests():
        done = next((o for o in e.step() if o.finished), done)
    return done.outputs[0].token_ids


@pytest.fixture(scope="module")
def engines():
    torch.set_num_threads(1)
    return {"prefill": engine(), "decode": engine(), "reference": engine()}


def test_imported_blocks_are_what_the_decode_engine_computes_with(engines):
    prefill, decode, reference = engines["prefill"], engines["decode"], engines["reference"]
    ids = prefill.tokenizer.encode(PROMPT)
    greedy(prefill, "p", ids, 1)
    lease = prefill.kv_transfer.lease(ids)
    assert len(lease.block_ids) == len(ids) // 16 and prefill.kv_transfer.pinned_blocks == len(lease.block_ids)
    data = prefill.kv_transfer.export(lease.lease_id, 0)

    # Pool pressure on the prefill side does not touch leased blocks.
    for i in range(6):
        greedy(prefill, f"filler-{i}", prefill.tokenizer.encode(f"Filler text number {i}. " * 40), 2)
    assert prefill.kv_transfer.export(lease.lease_id, 0) == data

    # Garbage of the right size is imported as given, and the answer changes: the imported KV is used.
    garbled = greedy_after_import(decode, ids, bytes(len(data)), len(lease.block_ids))
    expected = greedy(reference, "r", ids)
    assert garbled != expected
    decode.kv.reset_prefix_cache()
    assert greedy_after_import(decode, ids, data, len(lease.block_ids)) == expected
    assert decode.kv.hit_tokens >= len(lease.block_ids) * 16

    assert prefill.kv_transfer.release(lease.lease_id) and prefill.kv_transfer.pinned_blocks == 0
    assert not prefill.kv_transfer.release(lease.lease_id)
    with pytest.raises(KeyError, match="no live KV lease"):
        prefill.kv_transfer.export(lease.lease_id, 0)


def import_in_parts(e: LLMEngine, ids: list[int], data: bytes, count: int) -> int:
    """As the decode worker does: a part per call (sizes 1, 2, then the rest: offsets into the payload)."""
    placed = 0
    for part in (1, 2, count):
        placed += e.kv_transfer.import_blocks(ids, 0, data, count, first=placed, num=part)
    return placed


def greedy_after_import(e: LLMEngine, ids: list[int], data: bytes, count: int) -> list[int]:
    assert import_in_parts(e, ids, data, count) == count
    return greedy(e, f"d-{len(data)}-{data[:4].hex()}-{e.kv.hit_tokens}", ids)


def test_a_payload_of_the_wrong_size_is_refused_before_anything_is_registered(engines):
    decode = engines["decode"]
    decode.kv.reset_prefix_cache()
    ids = decode.tokenizer.encode("A different prompt entirely, long enough for two blocks of tokens, surely. " * 2)
    cached_before = decode.kv.stats().blocks_cached
    with pytest.raises(ValueError, match="expects"):
        decode.kv_transfer.import_blocks(ids, 0, b"\x00" * 1000, 2)
    assert decode.kv.stats().blocks_cached == cached_before and decode.kv_transfer.cached_blocks(ids) == 0


def test_leases_expire(engines):
    prefill = engines["prefill"]
    ids = prefill.tokenizer.encode(PROMPT + " And then?")
    greedy(prefill, "p2", ids, 1)
    prefill.kv_transfer.lease_s = 0.0
    try:
        lease = prefill.kv_transfer.lease(ids)
        assert lease.block_ids and prefill.kv_transfer.expire() == 1 and prefill.kv_transfer.pinned_blocks == 0
        assert prefill.kv.num_free_blocks == prefill.kv.num_blocks
    finally:
        prefill.kv_transfer.lease_s = 30.0


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_quantized_blocks_travel_with_their_scales(kv_cache_dtype):
    """int8: per-token scales; int4: per-token value and per-block key parameters (full blocks only travel,
    so no key waits in a tail)."""
    prefill, decode, reference = (engine(kv_cache_dtype) for _ in range(3))
    ids = prefill.tokenizer.encode(PROMPT * 3)
    greedy(prefill, "p", ids, 1)
    lease = prefill.kv_transfer.lease(ids)
    data = prefill.kv_transfer.export(lease.lease_id, 0)
    assert len(data) == prefill.runner.export_size(len(lease.block_ids))
    assert len(lease.block_ids) > 3 and import_in_parts(decode, ids, data, len(lease.block_ids)) == len(lease.block_ids)
    assert greedy(decode, "d", ids) == greedy(reference, "r", ids)


def test_a_shared_memory_segment_is_read_in_place_and_its_name_is_gone():
    from pagedserve.server import kv_shm

    payload = bytes(range(256)) * 1000
    name = kv_shm.write(payload)
    view = kv_shm.take(name, len(payload))
    assert view.readonly and bytes(view) == payload
    with pytest.raises(FileNotFoundError):  # taken once: a second decode worker cannot read it again
        kv_shm.take(name, len(payload))
    short = kv_shm.write(payload[:100])
    with pytest.raises(ValueError, match="fewer than"):
        kv_shm.take(short, len(payload))
