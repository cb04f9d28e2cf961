"""KV transfer with tensor parallelism at either end: a payload holds every KV head, as a TP=1 worker's does, so a
TP=2 prefill worker hands its blocks to a TP=1 decode worker and back. Each rank gathers or writes its own heads'
share (SmolLM2's uneven 2 + 1 split; Gemma's one KV head replicated on both ranks). The decode end answers as a
worker that prefilled itself."""
from __future__ import annotations

import pytest

from pagedserve import LLM
from pagedserve.sampling_params import SamplingParams
from tests.test_hf_folder import byte_tokenizer
from tests.test_tensor_parallel import FP32, GREEDY
from tests.test_tensor_parallel_families import family_model

PROMPT = "The history of the Roman empire, told briefly for a curious child who likes battles: " * 6


def handoff(prefill: LLM, decode: LLM, ids: list[int]) -> tuple[list[int], int]:
    """prefill computes ids, its lease's blocks are imported into decode in parts; decode's greedy tokens and
    the prompt tokens it found cached."""
    prefill.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1))
    transfer = prefill.engine.kv_transfer
    lease = transfer.lease(ids)
    count = len(lease.block_ids)
    data = bytes(transfer.export(lease.lease_id, 0))
    assert len(data) == decode.engine.runner.export_size(count)  # the same payload whatever the split
    decode.engine.kv.reset_prefix_cache()
    placed = 0
    for part in (1, 2, count):
        placed += decode.engine.kv_transfer.import_blocks(ids, 0, data, count, first=placed, num=part)
    assert placed == count > 3
    transfer.release(lease.lease_id)
    before = decode.engine.stats().prefix_cache_hit_tokens
    out = decode.generate({"prompt_token_ids": ids}, GREEDY)[0].outputs[0].token_ids
    return out, decode.engine.stats().prefix_cache_hit_tokens - before


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_tp2_and_tp1_hand_blocks_both_ways(kv_cache_dtype):
    args = {**FP32, "kv_cache_dtype": kv_cache_dtype}
    tp1, tp2 = LLM(**args), LLM(tensor_parallel_size=2, **args)
    try:
        ids = tp1.tokenizer.encode(PROMPT)
        expected = LLM(**args).generate({"prompt_token_ids": ids}, GREEDY)[0].outputs[0].token_ids
        for prefill, decode in ((tp2, tp1), (tp1, tp2)):
            tokens, hits = handoff(prefill, decode, ids)
            assert hits >= (len(ids) - 1) // 16 * 16 and tokens == expected
    finally:
        tp2.engine.workers.close()


@pytest.mark.slow
def test_replicated_kv_heads_travel_once(tmp_path):
    """Gemma 3 with one KV head on two ranks: both store it, the payload holds it once; sliding groups too."""
    family_model("gemma3").save_pretrained(tmp_path)
    byte_tokenizer(tmp_path)
    args = {"model": str(tmp_path), **FP32}
    tp1, tp2 = LLM(**args), LLM(tensor_parallel_size=2, **args)
    try:
        ids = list(PROMPT.encode())
        expected = LLM(**args).generate({"prompt_token_ids": ids}, GREEDY)[0].outputs[0].token_ids
        for prefill, decode in ((tp2, tp1), (tp1, tp2)):
            tokens, hits = handoff(prefill, decode, ids)
            assert hits == (len(ids) - 1) // 16 * 16 and tokens == expected
    finally:
        tp2.engine.workers.close()
