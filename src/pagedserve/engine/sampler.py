"""Batched sampling: logit biases, penalties, temperature, top-k / top-p / min-p, seeded draws and logprobs.

Every row is sampled by inverse CDF with one uniform number derived from (seed, output position),
so a seeded request draws the same tokens whatever else shares its batch, and the whole batch is
sampled with a handful of tensor ops and no Python loop per row.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.engine.request import Request
from pagedserve.engine.structured_output import GrammarMask, apply_mask, restore_dead_rows
from pagedserve.model.kernels import cpu_kernels

M32 = 0xFFFFFFFF


@dataclass(slots=True)
class SamplingBatch:
    """Per-row sampling parameters as tensors, built once per step from the sampled requests."""
    temperature: torch.Tensor  # [S] float (0 for greedy rows)
    top_k: torch.Tensor  # [S] long (vocab size where disabled)
    top_p: torch.Tensor  # [S] float
    min_p: torch.Tensor  # [S] float
    seeds: torch.Tensor  # [S] long
    steps: torch.Tensor  # [S] long: output position of the token being drawn
    all_greedy: bool
    need_sort: bool  # some row uses top_k or top_p
    penalties: Penalties | None
    bias: LogitBias | None  # rows' logit_bias, None when no row has one
    banned: list[tuple[int, list[int]]]  # (row, token ids) masked out, e.g. EOS before min_tokens
    max_logprobs: int | None  # largest number of alternatives asked for; None: no row wants logprobs
    grammar: GrammarMask | None = None  # tokens the constrained rows' grammars allow

    @property
    def plain_greedy(self) -> bool:
        """Every row takes its raw logits' argmax: nothing to constrain, draw or report."""
        return (self.all_greedy and self.max_logprobs is None and self.bias is None and self.penalties is None
                and not self.banned and self.grammar is None)

    @classmethod
    def build(cls, reqs: list[Request], vocab_size: int, grammar: GrammarMask | None = None) -> SamplingBatch:
        ps = [r.params for r in reqs]
        temps = [0.0 if p.greedy else p.temperature for p in ps]
        top_k = [vocab_size if p.top_k <= 0 else min(p.top_k, vocab_size) for p in ps]
        wants = [p.logprobs for p in ps if p.logprobs is not None]
        return cls(
            temperature=torch.tensor(temps, dtype=torch.float32),
            top_k=torch.tensor(top_k, dtype=torch.long),
            top_p=torch.tensor([p.top_p for p in ps], dtype=torch.float32),
            min_p=torch.tensor([p.min_p for p in ps], dtype=torch.float32),
            seeds=torch.tensor([r.seed for r in reqs], dtype=torch.long),
            steps=torch.tensor([r.num_output_tokens for r in reqs], dtype=torch.long),
            all_greedy=all(t == 0.0 for t in temps),
            need_sort=any(k < vocab_size for k, t in zip(top_k, temps) if t > 0)
            or any(p.top_p < 1 for p, t in zip(ps, temps) if t > 0),
            penalties=Penalties.build(reqs),
            bias=LogitBias.build(reqs),
            banned=[(i, banned_tokens(r)) for i, r in enumerate(reqs) if r.num_output_tokens < r.params.min_tokens],
            max_logprobs=max(wants) if wants else None,
            grammar=grammar,
        )


def banned_tokens(req: Request) -> list[int]:
    return list(req.params.stop_token_ids) + ([] if req.params.ignore_eos else list(req.eos_token_ids))


@dataclass(slots=True)
class LogitBias:
    """Every biased (row, token) pair of the batch, flat: one indexed add applies them all."""
    rows: torch.Tensor  # [B] long
    tokens: torch.Tensor  # [B] long
    values: torch.Tensor  # [B] float32

    @classmethod
    def build(cls, reqs: list[Request]) -> LogitBias | None:
        biased = [(i, r.params.logit_bias) for i, r in enumerate(reqs) if r.params.logit_bias]
        if not biased:
            return None
        return cls(
            rows=torch.tensor([i for i, bias in biased for _ in bias], dtype=torch.long),
            tokens=torch.tensor([t for _, bias in biased for t in bias], dtype=torch.long),
            values=torch.tensor([v for _, bias in biased for v in bias.values()], dtype=torch.float32),
        )

    def apply(self, logits: torch.Tensor) -> None:
        logits.index_put_((self.rows, self.tokens), self.values, accumulate=True)


@dataclass(slots=True)
class Penalties:
    rows: torch.Tensor  # [P] long: which rows carry penalties
    repetition: torch.Tensor  # [P]
    presence: torch.Tensor  # [P]
    frequency: torch.Tensor  # [P]
    output_ids: torch.Tensor  # [P, L] long, padded with -1
    prompt_ids: torch.Tensor  # [P, L'] long, padded with -1

    @classmethod
    def build(cls, reqs: list[Request]) -> Penalties | None:
        rows = [i for i, r in enumerate(reqs) if r.params.repetition_penalty != 1.0
                or r.params.presence_penalty != 0.0 or r.params.frequency_penalty != 0.0]
        if not rows:
            return None
        sel = [reqs[i] for i in rows]
        return cls(
            rows=torch.tensor(rows, dtype=torch.long),
            repetition=torch.tensor([r.params.repetition_penalty for r in sel]),
            presence=torch.tensor([r.params.presence_penalty for r in sel]),
            frequency=torch.tensor([r.params.frequency_penalty for r in sel]),
            output_ids=pad([r.output_token_ids for r in sel]),
            prompt_ids=pad([r.prompt_token_ids for r in sel]),
        )

    def apply(self, logits: torch.Tensor) -> None:
        sub = logits[self.rows]
        vocab = sub.shape[1]
        counts = token_counts(self.output_ids, vocab)
        seen = (counts > 0) | (token_counts(self.prompt_ids, vocab) > 0)
        rep = self.repetition.unsqueeze(1)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub -= self.frequency.unsqueeze(1) * counts + self.presence.unsqueeze(1) * (counts > 0)
        logits[self.rows] = sub


def pad(seqs: list[list[int]]) -> torch.Tensor:
    width = max(1, max(len(s) for s in seqs))
    return torch.tensor([s + [-1] * (width - len(s)) for s in seqs], dtype=torch.long)


def token_counts(ids: torch.Tensor, vocab: int) -> torch.Tensor:
    counts = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.float32)
    counts.scatter_add_(1, ids.clamp(min=-1) % (vocab + 1), torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab]  # -1 padding lands in the last column, which is dropped


@dataclass(slots=True)
class SamplerOutput:
    token_ids: torch.Tensor  # [S]
    logprobs: torch.Tensor | None  # [S] logprob of the sampled token
    ranks: torch.Tensor | None  # [S] its rank (1 = most likely)
    top_ids: torch.Tensor | None  # [S, K]
    top_logprobs: torch.Tensor | None  # [S, K]


def uniform_per_row(seeds: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """A reproducible uniform in [0, 1) per (seed, step), by a 32-bit integer hash in int64 lanes."""
    x = (mix32(seeds & M32) ^ mix32((seeds >> 32) & M32)) & M32
    x = mix32((x + steps * 0x9E3779B) & M32)
    return x.double() / 2**32


def mix32(x: torch.Tensor) -> torch.Tensor:
    for _ in range(2):
        x = (((x >> 16) ^ x) * 0x45D9F3B) & M32
    return (x >> 16) ^ x


def sample(logits: torch.Tensor, batch: SamplingBatch, check: Check | None = None) -> SamplerOutput:
    """logits: [S, V] float32 (a private copy: modified in place). Logprobs are the model's own (before any
    bias, penalty or mask), as vLLM's default; biases come before penalties, as in vLLM. check: speculative
    sampling's rejection rule (spec_decode/rejection.py), given the sampled rows' distributions and draws."""
    raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.max_logprobs is not None else None
    constrain(logits, batch)
    greedy = greedy_tokens(logits)
    if batch.all_greedy:
        tokens = greedy
    else:
        probs = probabilities(logits, batch)
        drawn = draw_from(probs, uniform_per_row(batch.seeds, batch.steps))
        if check is not None:
            drawn = check(probs, drawn, batch)
        tokens = torch.where(batch.temperature > 0, drawn, greedy)
    if raw_logprobs is None:
        return SamplerOutput(tokens, None, None, None, None)
    return logprobs_of(raw_logprobs, tokens, batch.max_logprobs)


Check = Callable[[torch.Tensor, torch.Tensor, SamplingBatch], torch.Tensor]


def sample_hidden(hidden: torch.Tensor, logits_of: Callable[..., torch.Tensor], batch: SamplingBatch) -> SamplerOutput:
    """The next tokens of the rows whose last hidden states these are. A plain greedy batch takes the argmax of the
    model-dtype logits (logits_of(hidden, upcast=False)): their fp32 copy would hold the same values."""
    if batch.plain_greedy:
        return SamplerOutput(greedy_tokens(logits_of(hidden, upcast=False)), None, None, None, None)
    return sample(logits_of(hidden), batch)


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first index of its largest value), fp32 or bf16 logits [S, V]."""
    kernels = cpu_kernels()
    if kernels is not None and logits.dtype in (torch.float32, torch.bfloat16) and logits.stride(-1) == 1:
        return kernels.greedy_argmax(logits)
    return logits.max(dim=-1).indices  # argmax's first index too, ~2.5x faster than argmax on CPU


def constrain(logits: torch.Tensor, batch: SamplingBatch) -> None:
    """Biases, penalties, the grammar mask and bans (min_tokens), in place: what every draw starts from."""
    if batch.bias is not None:
        batch.bias.apply(logits)
    if batch.penalties is not None:
        batch.penalties.apply(logits)
    masked = None
    if batch.grammar is not None:
        apply_mask(logits, batch.grammar)
        masked = logits[batch.grammar.rows] if batch.banned else None  # a copy, for restore_dead_rows
    for row, ids in batch.banned:
        logits[row, ids] = float("-inf")
    if masked is not None:
        restore_dead_rows(logits, batch.grammar, masked)


def score_tokens(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> SamplerOutput:
    """Logprob and rank of given tokens (a prompt's next tokens) under raw logits, plus the top k."""
    return logprobs_of(torch.log_softmax(logits, dim=-1), tokens, k)


def logprobs_of(raw_logprobs: torch.Tensor, tokens: torch.Tensor, k: int) -> SamplerOutput:
    chosen = raw_logprobs.gather(1, tokens.unsqueeze(1))
    out = SamplerOutput(tokens, chosen.squeeze(1), (raw_logprobs > chosen).sum(dim=1) + 1, None, None)
    if k:
        out.top_logprobs, out.top_ids = raw_logprobs.topk(k, dim=-1)
    return out


def probabilities(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Each sampled row's distribution after temperature, top-k/top-p and min-p (rows sum to 1 before min-p
    cuts: draw_from scales its uniform to the row's mass)."""
    temp = torch.where(batch.temperature > 0, batch.temperature, torch.ones_like(batch.temperature))
    logits = logits / temp.unsqueeze(1)
    if batch.need_sort:
        logits = mask_top_k_top_p(logits, batch.top_k, batch.top_p)
    probs = torch.softmax(logits, dim=-1)
    if bool((batch.min_p > 0).any()):
        probs = probs.masked_fill(probs < batch.min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs


def draw_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse CDF: one token per row for its uniform u in [0, 1)."""
    cdf = probs.double().cumsum(dim=-1)
    tokens = torch.searchsorted(cdf, u.unsqueeze(1) * cdf[:, -1:], right=True).squeeze(1)
    return tokens.clamp(max=probs.shape[1] - 1)


def mask_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[1]).unsqueeze(0)
    drop = ranks >= top_k.unsqueeze(1)
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
    before = probs.cumsum(dim=-1) - probs  # mass strictly ahead of each token: keep while < top_p
    drop |= before >= top_p.unsqueeze(1)
    drop[:, 0] = False  # the most likely token always survives
    return logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
