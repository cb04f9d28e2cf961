"""Speculative sampling (Leviathan et al. 2023, Chen et al. 2023) for sampled draft-model proposals.

The draft drew x ~ q, q its distribution after the same processing the target's sampler applies (penalties,
bias, grammar mask, bans, temperature, top-k/top-p/min-p: sampler.constrain and sampler.probabilities). The
target's processed distribution p at that position accepts x with probability min(1, p(x) / q(x)); a rejected
x is replaced by a draw from normalize(max(0, p - q)). Whatever q is, the token kept is distributed as p.

Three independent uniforms per (seed, output position): the draft's draw (DRAFT_SALT), the acceptance test
(ACCEPT_SALT) and the replacement, which is the plain sampler's own uniform (the bonus token after k accepted
proposals is an ordinary draw from p with it). So a seeded request repeats its output run after run, as long
as the same steps propose: the measured rule (proposer.py) decides from timings, so exact repeats need an
explicit disable_by_batch_size (ngram and suffix draw exactly the tokens of a run without speculation anyway).
"""
from __future__ import annotations

import torch

from pagedserve.engine.sampler import (
    Check,
    SamplingBatch,
    constrain,
    draw_from,
    probabilities,
    uniform_per_row,
)

DRAFT_SALT = 0x5DEECE66D5A5A5A5
ACCEPT_SALT = 0x2545F4914F6CDD1D


def draft_sample(logits: torch.Tensor, batch: SamplingBatch) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The draft's tokens, drawn as the target's sampler would (argmax for greedy rows), and q: each row's
    normalized distribution (None when every row is greedy, where a proposal is a point mass)."""
    constrain(logits, batch)
    greedy = logits.max(dim=-1).indices
    if batch.all_greedy:
        return greedy, None
    q = probabilities(logits, batch)
    q = q / q.sum(dim=-1, keepdim=True)
    drawn = draw_from(q, uniform_per_row(batch.seeds ^ DRAFT_SALT, batch.steps))
    return torch.where(batch.temperature > 0, drawn, greedy), q


def rejection_check(tokens: list[int | None], qs: list[torch.Tensor | None]) -> Check:
    """sampler.sample's check for one position: row r's proposal tokens[r] drawn from qs[r] (None: the row has
    no sampled proposal here and keeps the plain draw: ngram's point masses, the bonus position)."""
    rows = [r for r, q in enumerate(qs) if q is not None]

    def check(probs: torch.Tensor, drawn: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if not rows:
            return drawn
        idx = torch.tensor(rows, dtype=torch.long)
        p = probs[idx].double()
        p = p / p.sum(dim=-1, keepdim=True)
        q = torch.stack([qs[r] for r in rows]).double()
        x = torch.tensor([tokens[r] for r in rows], dtype=torch.long).unsqueeze(1)
        r = uniform_per_row(batch.seeds[idx] ^ ACCEPT_SALT, batch.steps[idx])
        accept = r * q.gather(1, x).squeeze(1) < p.gather(1, x).squeeze(1)
        residual = (p - q).clamp_min(0)
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p)  # p == q: never rejected
        replaced = draw_from(residual, uniform_per_row(batch.seeds[idx], batch.steps[idx]))
        out = drawn.clone()
        out[idx] = torch.where(accept, x.squeeze(1), replaced)
        return out

    return check
