"""Which requests get proposals after a step, and how many: the proposer of the configured method, bounded so
that a request never computes past its max_tokens, and skipped where speculation would not pay.

The cost model. A step's time is nearly flat in its rows while the weights dominate (one stream: ~7 ms for 1
row and about the same for 5), so verifying k proposals costs a factor c = t(rows + k) / t(rows) that starts
near 1 (plus the C++ decode stack's Python savings lost: a step with a proposal runs the layers in Python) and
grows with the batch until the step is compute bound. It yields E = 1 + a + a^2 + ... + a^k tokens per
request per step for an acceptance rate a. Speculation pays while E > c, so:
- per request: after a few drafts whose accepted share (a moving average) falls below min_acceptance_rate
  (E < 1.25, about c for one stream), the request stops proposing; it probes again every PROBE_EVERY steps,
  so a request that starts quoting its context later gets proposals back;
- per step: with more running requests than disable_by_batch_size, nobody proposes (a batch that large is
  close to compute bound on a CPU, where c ~ 1 + k / rows... measured in docs/benchmarks.md).
"""
from __future__ import annotations

from dataclasses import dataclass

from pagedserve.engine.request import Request
from pagedserve.engine.spec_decode.ngram import NgramIndex, NgramProposer
from pagedserve.engine.spec_decode.suffix import SuffixProposer, SuffixState
from pagedserve.speculative_config import SpeculativeConfig

PROBE_EVERY = 16  # steps a request with low acceptance waits before it proposes again
EMA = 0.3  # weight of the latest draft in a request's acceptance average


@dataclass(slots=True)
class SpecState:
    """A request's proposal state: the method's own (its index of the sequence) and how its proposals fared."""
    index: NgramIndex | SuffixState
    acceptance: float = 1.0  # moving average of accepted / proposed
    skipped: int = 0  # steps without proposals since acceptance fell low


class Proposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.method = NgramProposer(config) if config.method == "ngram" else SuffixProposer(config)

    def propose(self, reqs: list[Request], num_running: int) -> None:
        """Sets spec_token_ids of the running requests among reqs (just sampled, so all decoding); the finished
        ones' outputs go to the method (suffix: the shared trie)."""
        for req in reqs:
            if req.is_finished:
                self.method.finished(req.output_token_ids)
        if num_running > self.config.disable_by_batch_size:
            return
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
            req.spec_token_ids = self.method.propose(req.all_token_ids, state.index, k) if k > 0 else []


def record_acceptance(req: Request, proposed: int, accepted: int) -> None:
    state = req.spec_state
    state.acceptance = (1 - EMA) * state.acceptance + EMA * accepted / proposed
