"""Routing policies: given the allowed, healthy replicas for one request, pick one.

A policy sees only replicas the router already filtered (health, model, residency, region), so
none of them can break a constraint; they differ only in what they optimise.
"""
from __future__ import annotations

import hashlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedserve.cluster.prefix_index import PrefixIndex
from pagedserve.cluster.replica import Replica


@dataclass(slots=True)
class RoutingRequest:
    prefix_key: Sequence = ""  # prompt text, or a tuple of token ids
    session: str | None = None  # session / user id for session affinity
    est_tokens: int = 1  # prompt + max output tokens, a load estimate
    prompt_tokens: int = 0  # the prompt's part of it
    seq: int = field(default_factory=itertools.count(1).__next__)  # names the request in the console's journal


@dataclass(slots=True)
class Decision:
    replica: Replica
    reason: str  # label for metrics: round_robin, least_load, prefix_match, imbalance, no_match, session
    matched: int = 0  # prefix length the index expects the replica to hold
    load_adapter: str | None = None  # a LoRA adapter to load on the replica before forwarding


def _rendezvous_score(session: str, replica: str) -> int:
    return int.from_bytes(hashlib.blake2b(f"{session}\0{replica}".encode(), digest_size=8).digest(), "big")


class RoundRobin:
    name = "round_robin"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, req: RoutingRequest, candidates: list[Replica]) -> Decision:
        return Decision(candidates[next(self._counter) % len(candidates)], "round_robin")

    def on_routed(self, req: RoutingRequest, replica: Replica) -> None:
        pass

    def forget(self, replica: Replica) -> None:
        pass


class LeastLoad:
    """Fewest in-flight tokens (prompt + max output, as the router counts them); ties rotate."""

    name = "least_load"

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, req: RoutingRequest, candidates: list[Replica]) -> Decision:
        return Decision(self.pick(candidates), "least_load")

    def pick(self, candidates: list[Replica]) -> Replica:
        low = min((r.inflight_tokens, r.inflight_requests) for r in candidates)
        tied = [r for r in candidates if (r.inflight_tokens, r.inflight_requests) == low]
        return tied[next(self._counter) % len(tied)]

    def on_routed(self, req: RoutingRequest, replica: Replica) -> None:
        pass

    def forget(self, replica: Replica) -> None:
        pass


class PrefixAffinity:
    """SGLang-style cache-aware routing.

    When loads are balanced, the replica with the longest indexed prefix wins if the match covers at
    least `cache_threshold` of the prompt; below that the least loaded replica takes the request (and
    so the new prefix). When the busiest and idlest replicas differ by more than `balance_abs` requests
    and by a factor of `balance_rel`, locality gives way to least load.
    """

    name = "prefix_affinity"

    def __init__(self, cache_threshold: float = 0.5, balance_abs: int = 8, balance_rel: float = 1.5,
                 max_index_size: int = 1_000_000) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.index = PrefixIndex(max_index_size)
        self.least_load = LeastLoad()

    def choose(self, req: RoutingRequest, candidates: list[Replica]) -> Decision:
        loads = [r.inflight_requests for r in candidates]
        if max(loads) - min(loads) > self.balance_abs and max(loads) > min(loads) * self.balance_rel:
            return Decision(self.least_load.pick(candidates), "imbalance")
        matched = self.index.match(req.prefix_key) if req.prefix_key else {}
        best = max(candidates, key=lambda r: (matched.get(r.name, 0), -r.inflight_requests))
        length = matched.get(best.name, 0)
        if req.prefix_key and length / len(req.prefix_key) >= self.cache_threshold:
            return Decision(best, "prefix_match", length)
        low = min(loads)
        idle = [r for r in candidates if r.inflight_requests == low]
        pick = min(idle, key=lambda r: self.index.size(r.name)) if len(idle) > 1 else idle[0]
        return Decision(pick, "no_match", matched.get(pick.name, 0))

    def on_routed(self, req: RoutingRequest, replica: Replica) -> None:
        if req.prefix_key:
            self.index.insert(req.prefix_key, replica.name)

    def forget(self, replica: Replica) -> None:
        self.index.remove_replica(replica.name)


class SessionAffinity:
    """Rendezvous hashing of the session id: a session stays on its replica, and only the sessions of
    a replica that fails move. Requests without a session go to the least loaded replica."""

    name = "session_affinity"

    def __init__(self) -> None:
        self.least_load = LeastLoad()

    def choose(self, req: RoutingRequest, candidates: list[Replica]) -> Decision:
        if req.session is None:
            return Decision(self.least_load.pick(candidates), "no_session")
        return Decision(max(candidates, key=lambda r: _rendezvous_score(req.session, r.name)), "session")

    def on_routed(self, req: RoutingRequest, replica: Replica) -> None:
        pass

    def forget(self, replica: Replica) -> None:
        pass


POLICIES = {p.name: p for p in (RoundRobin, LeastLoad, PrefixAffinity, SessionAffinity)}


def make_policy(name: str, **options) -> RoundRobin | LeastLoad | PrefixAffinity | SessionAffinity:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name](**options) if name == "prefix_affinity" else POLICIES[name]()
