"""Which requests get proposals after a step, and how many: the proposer of the configured method, bounded so
that a request never computes past its max_tokens, and skipped where speculation would not pay.

The cost model. A decode step's time is nearly flat in its rows while reading the weights dominates (one
stream: a step over 1 row costs about what one over 5 does), so verifying k proposals costs a factor
c = t(rows + k) / t(rows) near 1 for small batches, and yields E = 1 + a + a^2 + ... + a^k tokens per request
per step for an acceptance rate a. Speculation pays while E > c, so:
- per request: once the moving average of its drafts' accepted share falls below min_acceptance_rate (0.2:
  E < 1.25, about c for one stream, where a step with proposals also leaves the pure-decode path), the
  request stops proposing; it probes again every PROBE_EVERY steps, so a request that starts quoting its
  context later gets proposals back. A request with no match proposes nothing and costs nothing.
- per step, measured (spec_decode/cost.py): the engine times every decode step's forward pass, and running
  least-squares fits give t_decode(rows) for steps without proposals and t_verify(rows) for steps verifying
  them (on CPU these also leave the C++ decode stack). With B running requests, proposals adding K rows and
  X = sum of a + a^2 + ... + a^k over the proposing requests (the accepted tokens expected), a step proposes
  only while (B + X) / (t_verify(B + K) + t_propose) > B / t_decode(B), tokens per second; when all B propose
  k, that is E * t_decode(B) > t_verify(B * (1 + k)) + t_propose for E = 1 + X / B. t_propose is the proposer's
  own time per step (the draft model's k passes). Until both fits have 4 steps it proposes, but every 8th step
  goes without; after that every 32nd step goes the other way, so that neither fit goes stale. A large batch
  stops being weight-bound, t_verify grows towards (1 + k) t_decode and proposals stop; a one-stream step over
  1 + k rows costs about what one over 1 does, and they go on.
- an explicit disable_by_batch_size replaces the measured rule with vLLM's static one: nobody proposes in a step
  with more running requests than that.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedserve.engine.request import Request
from pagedserve.engine.spec_decode.cost import StepCosts
from pagedserve.engine.spec_decode.draft_model import DraftModelProposer, DraftState
from pagedserve.engine.spec_decode.ngram import NgramIndex, NgramProposer
from pagedserve.engine.spec_decode.suffix import SuffixProposer, SuffixState
from pagedserve.engine.structured_output import GrammarMask
from pagedserve.speculative_config import SpeculativeConfig

GrammarMaskOf = Callable[[list[Request]], GrammarMask | None]
PROBE_EVERY = 16  # steps a request with low acceptance waits before it proposes again
EMA = 0.3  # weight of the latest draft in a request's acceptance average


@dataclass(slots=True)
class SpecState:
    """A request's proposal state: the method's own (its index of the sequence) and how its proposals fared."""
    index: NgramIndex | SuffixState | DraftState
    acceptance: float = 1.0  # moving average of accepted / proposed
    skipped: int = 0  # steps without proposals since acceptance fell low


class Proposer:
    def __init__(self, config: SpeculativeConfig, dtype: torch.dtype, block_size: int, vocab_size: int,
                 max_num_seqs: int) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.costs = StepCosts.new()  # decode steps' forward times (record_step) and proposing times
        if config.method == "draft_model":
            self.method = DraftModelProposer(config, dtype, block_size, vocab_size, max_num_seqs)
        else:
            self.method = NgramProposer(config) if config.method == "ngram" else SuffixProposer(config)

    def record_step(self, scheduled: list[tuple[Request, int]], seconds: float) -> None:
        """A step's forward time for the cost model, when it only decoded (and verified): prefill chunks say
        nothing of what a decode step costs."""
        if all(r.num_computed_tokens == r.num_tokens - 1 and n == 1 + len(r.spec_token_ids) for r, n in scheduled):
            self.costs.record(sum(n for _, n in scheduled), seconds, any(r.spec_token_ids for r, _ in scheduled))

    def propose(self, reqs: list[Request], running: list[Request], grammar_mask: GrammarMaskOf) -> None:
        """Sets spec_token_ids of the running requests among reqs (just sampled, so all decoding); the finished
        ones' outputs go to the method (suffix: the shared trie). grammar_mask: the engine's, for the draft's
        constrained draws."""
        for req in reqs:
            if req.is_finished:
                self.method.finished(req.output_token_ids)
        if isinstance(self.method, DraftModelProposer):
            self.method.release({r.request_id for r in running})
        limit = self.config.disable_by_batch_size
        if limit is not None and len(running) > limit:
            return
        items = []
        for req in reqs:
            if req.is_finished:
                continue
            state = req.spec_state if req.spec_state is not None else SpecState(self.method.new_state())
            req.spec_state = state
            if state.acceptance < self.config.min_acceptance_rate:
                state.skipped += 1
                if state.skipped < PROBE_EVERY:
                    continue
                state.skipped, state.acceptance = 0, self.config.min_acceptance_rate  # one probe
            k = min(self.k, req.max_tokens - req.num_output_tokens - 1)  # the target's own token comes on top
            if k > 0:
                items.append((req, state.index, k))
        if not items or limit is None and not self.costs.pays(len(running), sum(k for _, _, k in items),
                                                              extra_tokens(items)):
            return
        start = time.perf_counter()
        if isinstance(self.method, DraftModelProposer):
            proposals = self.method.propose_all(items, grammar_mask)
        else:
            proposals = [self.method.propose(req.all_token_ids, index, k) for req, index, k in items]
        for (req, _, _), tokens in zip(items, proposals):
            req.spec_token_ids = tokens
        self.costs.record_proposal(time.perf_counter() - start)


def extra_tokens(items: list[tuple[Request, object, int]]) -> float:
    """Accepted proposals expected in a step: a + ... + a^k per request, a its acceptance average."""
    return sum(sum(req.spec_state.acceptance ** j for j in range(1, k + 1)) for req, _, k in items)


def draft_probs(req: Request) -> torch.Tensor | None:
    """q of each of the request's sampled draft-model proposals ([k, V]); None for point-mass proposals."""
    index = req.spec_state.index if req.spec_state is not None else None
    return index.probs if isinstance(index, DraftState) else None


def clear_draft_probs(req: Request) -> None:
    if req.spec_state is not None and isinstance(req.spec_state.index, DraftState):
        req.spec_state.index.probs = None


def record_acceptance(req: Request, proposed: int, accepted: int) -> None:
    state = req.spec_state
    state.acceptance = (1 - EMA) * state.acceptance + EMA * accepted / proposed
