"""Sampler masks and penalties on synthetic logits (no model needed)."""
from __future__ import annotations

import pytest
import torch

from pagedserve.engine.request import Request
from pagedserve.engine.sampler import SamplingBatch, greedy_tokens, mask_top_k_top_p, sample, uniform_per_row
from pagedserve.model.kernels import cpu_kernels
from pagedserve.sampling_params import SamplingParams

V = 8


def req(params: SamplingParams, output: list[int] = (), prompt: list[int] = (0,), seed: int = 1) -> Request:
    r = Request("r", list(prompt), params, 0.0, seed=seed, eos_token_ids=[7])
    for t in output:
        r.append_token(t)
    return r


def draws(logits: list[float], params: SamplingParams, n: int = 400) -> set[int]:
    """The set of tokens drawn over n different seeds."""
    reqs = [req(params, seed=s) for s in range(n)]
    out = sample(torch.tensor([logits] * n), SamplingBatch.build(reqs, V))
    return set(out.token_ids.tolist())


LOGITS = [4.0, 3.5, 3.0, 2.0, 1.0, 0.0, -1.0, -2.0]


def test_greedy_takes_argmax():
    out = sample(torch.tensor([LOGITS[::-1]]), SamplingBatch.build([req(SamplingParams(temperature=0))], V))
    assert out.token_ids.tolist() == [7]


def test_top_k_keeps_only_k_tokens():
    assert draws(LOGITS, SamplingParams(temperature=5.0, top_k=3)) == {0, 1, 2}


def test_top_p_keeps_smallest_nucleus():
    probs = torch.softmax(torch.tensor(LOGITS), 0)
    # Tokens 0 and 1 hold under 0.8 of the mass, so the nucleus for 0.8 needs token 2 as well.
    assert probs[:2].sum() < 0.8 < probs[:3].sum()
    assert draws(LOGITS, SamplingParams(temperature=1.0, top_p=0.8)) == {0, 1, 2}


def test_min_p_drops_unlikely_tokens():
    # p(token) >= 0.3 * p(max) keeps tokens with logit >= 4 + ln 0.3 ~ 2.8: tokens 0, 1, 2.
    assert draws(LOGITS, SamplingParams(temperature=1.0, min_p=0.3)) == {0, 1, 2}


def test_full_distribution_is_reachable_and_roughly_right():
    n = 4000
    reqs = [req(SamplingParams(temperature=1.0), seed=s) for s in range(n)]
    tokens = sample(torch.tensor([LOGITS] * n), SamplingBatch.build(reqs, V)).token_ids
    freq = torch.bincount(tokens, minlength=V).float() / n
    assert torch.allclose(freq, torch.softmax(torch.tensor(LOGITS), 0), atol=0.03)


def test_uniform_depends_only_on_seed_and_step():
    seeds = torch.tensor([5, 6, 5], dtype=torch.long)
    steps = torch.tensor([0, 0, 1], dtype=torch.long)
    u = uniform_per_row(seeds, steps)
    assert u[0] != u[1] and u[0] != u[2]
    assert uniform_per_row(torch.tensor([5]), torch.tensor([0])).item() == u[0].item()
    assert bool(((u >= 0) & (u < 1)).all())


def test_repetition_penalty_discourages_seen_tokens():
    logits = [3.0, 2.9, 0, 0, 0, 0, 0, 0]
    p = SamplingParams(temperature=0, repetition_penalty=1.5)
    out = sample(torch.tensor([logits]), SamplingBatch.build([req(p, output=[0])], V))
    assert out.token_ids.tolist() == [1]


def test_presence_and_frequency_penalties():
    logits = torch.tensor([[3.0, 2.5, 0, 0, 0, 0, 0, 0]])
    seen_twice = req(SamplingParams(temperature=0, frequency_penalty=0.3), output=[0, 0])
    assert sample(logits.clone(), SamplingBatch.build([seen_twice], V)).token_ids.tolist() == [1]
    seen_once = req(SamplingParams(temperature=0, presence_penalty=0.3), output=[0])
    assert sample(logits.clone(), SamplingBatch.build([seen_once], V)).token_ids.tolist() == [0]
    seen_once_big = req(SamplingParams(temperature=0, presence_penalty=0.6), output=[0])
    assert sample(logits.clone(), SamplingBatch.build([seen_once_big], V)).token_ids.tolist() == [1]


def test_min_tokens_bans_eos_and_stop_ids():
    logits = torch.tensor([[0, 0, 0, 0, 0, 5.0, 0, 9.0]])
    early = req(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5]))
    assert sample(logits.clone(), SamplingBatch.build([early], V)).token_ids.tolist() == [0]
    done = req(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[5]), output=[1, 1])
    assert sample(logits.clone(), SamplingBatch.build([done], V)).token_ids.tolist() == [7]


def test_logprobs_and_ranks():
    p = SamplingParams(temperature=0, logprobs=3)
    out = sample(torch.tensor([LOGITS]), SamplingBatch.build([req(p)], V))
    expected = torch.log_softmax(torch.tensor(LOGITS), 0)
    assert out.ranks.tolist() == [1]
    assert torch.allclose(out.top_logprobs[0], expected[:3])
    assert out.top_ids[0].tolist() == [0, 1, 2]


def test_mask_keeps_most_likely_even_with_tiny_top_p():
    masked = mask_top_k_top_p(torch.tensor([LOGITS]), torch.tensor([V]), torch.tensor([1e-6]))
    assert torch.isfinite(masked).sum() == 1 and torch.isfinite(masked[0, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 49152, 262_145])
def test_greedy_tokens_are_torch_max_indices(dtype, vocab):
    """The C++ argmax against torch.max: ties (the first index wins, in any lane and in the tail), a NaN (its
    first index, as torch propagates it), all -inf rows, rows with a stride wider than the vocabulary."""
    assert cpu_kernels() is not None
    torch.manual_seed(vocab)
    wide = (torch.randn(9, vocab + 3) * 4).to(dtype)
    logits = wide[:, :vocab]  # rows 3 elements apart from their neighbours
    logits[1] = logits[1].round()  # many ties in bf16 and fp32
    logits[2, vocab // 2:] = logits[2].max() + 1  # a long run of the same maximum
    logits[3] = float("-inf")
    logits[4, vocab - 1] = float("nan")
    logits[5, vocab // 3] = float("nan")
    logits[5, vocab - 1] = float("nan")
    logits[6, :] = 0.0
    logits[7, vocab - 1] = logits[7].max() + 1  # the maximum in the scalar tail
    assert torch.equal(greedy_tokens(logits), logits.max(dim=-1).indices)
    assert torch.equal(greedy_tokens(logits.contiguous()), logits.max(dim=-1).indices)


def test_greedy_tokens_of_other_dtypes_fall_back_to_torch():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 1.0, 3.0, 0.0]], dtype=torch.float16)
    assert greedy_tokens(logits).tolist() == [1, 0]
