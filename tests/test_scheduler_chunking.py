"""The prefill share of a step that carries decodes (issue #38): long prompts are chunked so running
streams keep their inter-token latency, while steps without decodes give prefill the whole budget."""
from __future__ import annotations

from pagedserve.engine.kv_cache import KVCacheManager
from pagedserve.engine.request import Request
from pagedserve.engine.scheduler import Scheduler
from pagedserve.sampling_params import SamplingParams

BLOCK = 16


def request(rid: str, num_prompt: int, arrival: float) -> Request:
    return Request(rid, list(range(1, num_prompt + 1)), SamplingParams(max_tokens=64), arrival, 0, 0)


def step(sched: Scheduler) -> dict[str, int]:
    """One schedule() as the engine does it; returns tokens per request."""
    out = sched.schedule()
    for req, n in out.scheduled:
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.append_token(7)
    return {req.request_id: n for req, n in out.scheduled}


def scheduler(cap: int | None) -> Scheduler:
    return Scheduler(KVCacheManager(1024, BLOCK, enable_prefix_caching=False), max_num_seqs=32,
                     max_num_batched_tokens=2048, max_prefill_tokens_beside_decodes=cap)


def test_a_long_prompt_beside_decodes_is_chunked_to_the_cap_and_decodes_run_every_step():
    sched = scheduler(256)
    for i in range(8):
        sched.add(request(f"d{i}", 20, float(i)))
    assert sum(step(sched).values()) == 8 * 20  # no decodes yet: all prompts at once
    sched.add(request("long", 1024, 100.0))
    chunks = []
    while sched.running[-1].request_id != "long" or sched.running[-1].num_computed_tokens < 1024:
        tokens = step(sched)
        assert all(tokens.get(f"d{i}") == 1 for i in range(8))  # every decode, every step
        chunks.append(tokens.get("long", 0))
    assert chunks == [256, 256, 256, 256]


def test_prefill_only_steps_and_the_uncapped_engine_take_the_whole_budget():
    sched = scheduler(256)
    sched.add(request("a", 1500, 0.0))
    sched.add(request("b", 1500, 1.0))
    assert step(sched) == {"a": 1500, "b": 548}  # nothing decodes: the whole 2,048
    assert step(sched) == {"a": 1, "b": 256}  # a decodes now: b gets the 256-token share
    uncapped = scheduler(None)
    for i in range(4):
        uncapped.add(request(f"d{i}", 20, float(i)))
    step(uncapped)
    uncapped.add(request("long", 1024, 100.0))
    assert step(uncapped)["long"] == 1024


def test_several_prompts_share_one_cap():
    sched = Scheduler(KVCacheManager(20, BLOCK, enable_prefix_caching=False), max_num_seqs=8,
                      max_num_batched_tokens=2048, max_prefill_tokens_beside_decodes=96)
    sched.add(request("d", 10, 0.0))
    step(sched)
    for i, n in enumerate((80, 80)):
        sched.add(request(f"p{i}", n, 10.0 + i))
    tokens = step(sched)
    assert tokens == {"d": 1, "p0": 80, "p1": 16}  # one 96-token share between them
    assert sum(n for rid, n in tokens.items() if rid != "d") <= 96
