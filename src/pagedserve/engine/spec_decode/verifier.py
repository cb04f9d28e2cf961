"""Verification of proposals: the target model scored every proposal in the step's one forward pass (a
request's 1 + k rows are a chunked-prefill chunk over its cached prefix); here each position is sampled in
turn and proposals are accepted while they match.

Position j of every request still accepting is sampled together with the ordinary sampler, from the request's
state after the j tokens accepted before it (penalties, min_tokens, grammar mask, logprobs, the seeded uniform
of output position j), so the target distribution is exactly the one the plain path would sample from.

Greedy: the longest prefix of proposals equal to the target's argmax, then the argmax after it (the
correction, or the bonus token when all were accepted). Sampled, ngram and suffix: they propose one token
per position, a point mass q = 1{x}. The rejection-sampling rule accepts x with min(1, p(x)/q(x)) = p(x) and on
rejection draws from the normalized residual max(0, p - q), which is p without x. Drawing t ~ p and accepting
iff t == x does exactly that: P(accept) = p(x), and a rejected draw is p conditioned on t != x. So the output
is distributed as the target's, and a seeded request even draws the same tokens as without speculation
(the uniform depends only on seed and output position). Sampled, draft_model: the draft sampled x ~ q and kept
q, and the general rule of rejection.py decides (the output is distributed as the target's, not draw for draw).

After acceptance the rejected proposals' KV is rolled back: num_computed_tokens counts the accepted tokens
only, the blocks holding nothing else return to the pool, and only then are full blocks hashed into the
prefix cache, so it never sees a rejected token.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from pagedserve.engine.kv_cache import KVCacheManager
from pagedserve.engine.request import Request
from pagedserve.engine.sampler import SamplerOutput, SamplingBatch, sample
from pagedserve.engine.spec_decode.proposer import clear_draft_probs, draft_probs, record_acceptance
from pagedserve.engine.spec_decode.rejection import rejection_check
from pagedserve.engine.spec_decode.stats import SpecDecodeStats


def verify(reqs: list[Request], rows: list[int], hidden: torch.Tensor, logits_of: Callable[[torch.Tensor], torch.Tensor],
           grammar_mask: Callable[[list[Request]], Any], accept: Callable[[list[Request], SamplerOutput], None]) -> None:
    """rows: each request's last row in hidden (its proposals' rows come just before). accept(reqs, out) appends
    out's tokens to the requests (and finishes those they end); called once per position."""
    drafts = [list(r.spec_token_ids) for r in reqs]
    probs = [draft_probs(r) for r in reqs]
    logits = logits_of(hidden[[row - len(d) + j for row, d in zip(rows, drafts) for j in range(len(d) + 1)]])
    first = [0]
    for d in drafts[:-1]:
        first.append(first[-1] + len(d) + 1)
    alive = list(range(len(reqs)))
    for j in range(max(len(d) for d in drafts) + 1):
        batch = [reqs[i] for i in alive]
        qs = [probs[i][j] if probs[i] is not None and j < len(drafts[i]) else None for i in alive]
        check = rejection_check([drafts[i][j] if j < len(drafts[i]) else None for i in alive], qs)
        out = sample(logits[[first[i] + j for i in alive]], SamplingBatch.build(batch, logits.shape[1],
                                                                                  grammar_mask(batch)), check)
        accept(batch, out)
        alive = [i for i, t in zip(alive, out.token_ids.tolist())
                 if j < len(drafts[i]) and t == drafts[i][j] and not reqs[i].is_finished]
        if not alive:
            break


def roll_back(reqs: list[Request], kv: KVCacheManager, stats: SpecDecodeStats) -> None:
    """After verify: counts what was accepted and gives back the rejected proposals' slots."""
    for req in reqs:
        if not req.spec_token_ids:
            continue
        accepted = req.num_tokens - req.num_computed_tokens + len(req.spec_token_ids) - 1  # bonus excluded
        accepted = min(accepted, len(req.spec_token_ids))
        stats.record(len(req.spec_token_ids), accepted)
        record_acceptance(req, len(req.spec_token_ids), accepted)
        req.spec_token_ids.clear()
        clear_draft_probs(req)
        if req.is_finished:  # its blocks are already free
            continue
        req.num_computed_tokens = req.num_tokens - 1
        kv.trim(req)
        kv.cache_full_blocks(req)
