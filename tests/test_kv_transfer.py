"""KV blocks moved between two engines in one process (the transfer's engine side): what the decode engine
imports is what it computes with, pinned blocks survive pool pressure, bad payloads change nothing, and
quantized blocks travel with their scales."""
from __future__ import annotations

import os

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


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8", "int4"])
def test_quantized_blocks_travel_with_their_scales(kv_cache_dtype):
    """int8: per-token scales; fp8: per-head scales, calibrated alike at both ends (the payload is raw bytes:
    CPU index_copy_ has no fp8 kernel); int4: per-token value and per-block key parameters (full blocks only
    travel, so no key waits in a tail)."""
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

    def write(data: bytes) -> str:
        return kv_shm.write_with(len(data), lambda view: view.__setitem__(slice(None), data))

    payload = bytes(range(256)) * 1000
    name = write(payload)
    view = kv_shm.take(name, len(payload))
    assert view.readonly and bytes(view) == payload
    with pytest.raises(FileNotFoundError):  # taken once: a second decode worker cannot read it again
        kv_shm.take(name, len(payload))
    short = write(payload[:100])
    with pytest.raises(ValueError, match="fewer than"):
        kv_shm.take(short, len(payload))

    def fail(view: memoryview) -> None:
        raise RuntimeError("gather failed")
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(RuntimeError, match="gather failed"):
        kv_shm.write_with(64, fail)
    assert set(os.listdir("/dev/shm")) <= before  # a failed export leaves no segment behind


def run_all(e: LLMEngine) -> dict:
    outs = {}
    while e.has_unfinished_requests():
        outs.update({o.request_id: o for o in e.step()})
    return outs


def test_a_request_goes_on_from_a_first_token_sampled_elsewhere(engines):
    """A disaggregated request's decode half: it takes the prefill worker's first token, reports it at once,
    waits (held) while its blocks arrive, then continues: the same tokens as one engine, greedy and seeded."""
    e = engines["reference"]
    ids = e.tokenizer.encode("Name three colours of the rainbow, then three fruits: ")
    for params in (SamplingParams(temperature=0, max_tokens=12), SamplingParams(temperature=0.9, seed=7, max_tokens=12)):
        e.add_request("whole", ids, params)
        whole = run_all(e)["whole"].outputs[0]
        e.kv.reset_prefix_cache()
        first = e.add_request("resumed", ids, params, output_token_ids=whole.token_ids[:1], hold=True)
        assert not first.finished and first.outputs[0].token_ids == whole.token_ids[:1]
        assert whole.text.startswith(first.outputs[0].text)
        generated = e.generation_tokens_total
        assert not e.has_unfinished_requests()  # held: never scheduled before its release
        e.release_held("resumed")
        rest = run_all(e)["resumed"].outputs[0]
        assert rest.token_ids == whole.token_ids and rest.text == whole.text, params
        assert e.generation_tokens_total - generated == 11  # the given token was not generated here


def test_a_first_token_that_ends_the_request_ends_it_at_once(engines):
    e = engines["reference"]
    ids = e.tokenizer.encode("Say yes: ")
    eos = e.eos_token_ids[0]
    done = e.add_request("eos", ids, SamplingParams(max_tokens=8), output_token_ids=[eos], hold=True)
    assert done.finished and done.outputs[0].finish_reason == "stop" and not e.has_unfinished_requests()
    yes = e.tokenizer.encode(" yes")[0]
    done = e.add_request("length", ids, SamplingParams(max_tokens=1), output_token_ids=[yes], hold=True)
    assert done.finished and done.outputs[0].finish_reason == "length" and done.outputs[0].token_ids == [yes]
    done = e.add_request("stop", ids, SamplingParams(max_tokens=8, stop=[e.tokenizer.decode([yes]).strip()]),
                         output_token_ids=[yes], hold=True)
    assert done.finished and done.outputs[0].finish_reason == "stop" and done.outputs[0].text.strip() == ""
    # EOS under min_tokens is just a token; the request goes on
    going = e.add_request("min", ids, SamplingParams(max_tokens=3, min_tokens=2), output_token_ids=[eos], hold=True)
    assert not going.finished
    e.abort_request("min")
    e.release_held("min")  # gone already: nothing to do
    assert not e.has_unfinished_requests() and not e.held


def test_output_from_elsewhere_is_refused_where_it_cannot_be_continued(engines):
    e = engines["reference"]
    ids = e.tokenizer.encode("Hello")
    for params, tokens, match in ((SamplingParams(n=2, max_tokens=4), [1], "n=1"),
                                  (SamplingParams(logprobs=1, max_tokens=4), [1], "logprobs"),
                                  (SamplingParams(max_tokens=4), [10**9], "output token ids"),
                                  (SamplingParams(max_tokens=1), [1, 2], "max_tokens")):
        with pytest.raises(ValueError, match=match):
            e.add_request("bad", ids, params, output_token_ids=tokens)
        assert "bad" not in e.groups
