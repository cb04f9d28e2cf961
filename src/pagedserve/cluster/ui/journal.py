"""The last requests' routing, as the console shows it: for each request, every choice of a replica (the pool, the
policy's reason, how much of the prompt the chosen replica is thought to hold, the candidates' loads, the replicas
already tried) and, disaggregated, its prefill hand-off (the prefill replica, the result, the time, the blocks
leased). The router tells it through its `listeners` (router.py, disagg.py); it keeps a bounded window."""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedserve.cluster.policies import Decision, RoutingRequest
from pagedserve.cluster.replica import Replica

PREVIEW_CHARS = 160  # of the prompt: enough to recognise a request, never the whole of a long prompt


@dataclass(slots=True)
class Candidate:
    name: str
    inflight_requests: int
    inflight_tokens: int


@dataclass(slots=True)
class Choice:
    at: float
    pool: str  # prefill | decode | all
    replica: str
    reason: str
    matched: int  # prompt units the chosen replica is expected to hold in its prefix cache
    candidates: list[Candidate]
    tried: list[str]  # replicas that already failed this request
    adapter: str | None = None  # a LoRA adapter loaded there first


@dataclass(slots=True)
class Handoff:
    at: float
    replica: str
    result: str  # handed_off, or why not
    seconds: float
    blocks: int | None = None


@dataclass(slots=True)
class Entry:
    seq: int
    started_at: float
    preview: str
    prompt_units: int  # characters of the prompt as the prefix index reads it, or token ids
    est_tokens: int
    session: str | None
    choices: list[Choice] = field(default_factory=list)
    handoffs: list[Handoff] = field(default_factory=list)

    @property
    def matched_fraction(self) -> float | None:
        last = self.choices[-1] if self.choices else None
        return last.matched / self.prompt_units if last and self.prompt_units else None


class RequestJournal:
    def __init__(self, size: int = 100, clock=time.time):
        self.size, self.clock = size, clock
        self.entries: OrderedDict[int, Entry] = OrderedDict()

    def _entry(self, req: RoutingRequest) -> Entry:
        entry = self.entries.get(req.seq)
        if entry is None:
            key = req.prefix_key
            preview = key[:PREVIEW_CHARS] if isinstance(key, str) else f"{len(key)} token ids"
            entry = self.entries[req.seq] = Entry(req.seq, self.clock(), preview, len(key), req.est_tokens, req.session)
            while len(self.entries) > self.size:
                self.entries.popitem(last=False)
        return entry

    def decided(self, req: RoutingRequest, decision: Decision, candidates: Sequence[Replica], prefill: bool,
                disaggregated: bool, tried: Sequence[str]) -> None:
        pool = ("prefill" if prefill else "decode") if disaggregated else "all"
        self._entry(req).choices.append(Choice(
            self.clock(), pool, decision.replica.name, decision.reason, decision.matched,
            [Candidate(r.name, r.inflight_requests, r.inflight_tokens) for r in candidates], list(tried),
            decision.load_adapter))

    def prefilled(self, req: RoutingRequest, replica: str, result: str, seconds: float,
                  handle: dict | None = None) -> None:
        blocks = handle.get("num_blocks") if handle else None
        self._entry(req).handoffs.append(Handoff(self.clock(), replica, result, seconds,
                                                 blocks if isinstance(blocks, int) else None))

    def recent(self, limit: int = 50) -> list[Entry]:
        return list(reversed(self.entries.values()))[:limit]
