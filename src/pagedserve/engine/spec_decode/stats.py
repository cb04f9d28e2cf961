"""Speculative decoding's counters, vLLM's spec_decode metrics: drafts, proposed and accepted tokens, and how
many of a draft's proposals were accepted (the acceptance-length histogram, index = proposals accepted)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeStats:
    method: str
    num_drafts: int = 0  # verified proposal runs (one per request per step that had proposals)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)  # [a]: drafts with a proposals accepted

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.acceptance_lengths) <= accepted:
            self.acceptance_lengths += [0] * (accepted + 1 - len(self.acceptance_lengths))
        self.acceptance_lengths[accepted] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a verified draft yields: accepted proposals plus the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.method, self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.acceptance_lengths))
