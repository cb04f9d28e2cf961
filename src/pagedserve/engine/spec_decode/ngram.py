"""Prompt lookup (n-gram) proposals: the tokens that followed the last time this request's last n tokens
appeared, in its prompt or its output so far. No model, so it costs microseconds a step.

Each request keeps an index of its n-grams (n in [prompt_lookup_min, prompt_lookup_max]) to the position just
after their latest occurrence; it grows by the tokens appended since the last proposal, so a proposal costs
O(new tokens) rather than a scan of the whole context.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.speculative_config import SpeculativeConfig


@dataclass(slots=True)
class NgramIndex:
    ends: dict[tuple[int, ...], int] = field(default_factory=dict)  # n-gram -> position after its latest occurrence
    indexed: int = 0  # n-grams ending before this position are in ends


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        assert config.prompt_lookup_min is not None and config.prompt_lookup_max is not None
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def new_state(self) -> NgramIndex:
        return NgramIndex()

    def finished(self, output_token_ids: list[int]) -> None:
        """Other requests' outputs are not looked up."""

    def propose(self, tokens: list[int], index: NgramIndex, k: int) -> list[int]:
        """Up to k tokens continuing the longest suffix of tokens (of at most max_n) seen before; [] if none.
        index: this sequence's, grown here by the tokens appended since its last proposal."""
        length = len(tokens)
        for end in range(max(index.indexed, self.min_n), length):  # an n-gram is indexed once its next token exists
            for n in range(self.min_n, min(self.max_n, end) + 1):
                index.ends[tuple(tokens[end - n:end])] = end
        index.indexed = max(index.indexed, length)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = index.ends.get(tuple(tokens[length - n:]))
            if end is not None:
                return tokens[end:end + k]
        return []
