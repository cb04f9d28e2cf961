"""A discrete-event SIMULATION of routing over large clusters (a cost model, not a measurement).

The router side is the real code: the policies, the prefix index, the region map and the residency
filter from this package decide every request. The replicas are modelled: a FIFO server whose service
time is `warm_s + prefill_s_per_token * uncached + decode_s_per_token * output` (figures calibrated
on a real replica by routing.py), and an LRU prefix cache of `cache_tokens` holding system-prompt
and conversation segments. Clients sit in three regions; TTFT adds the RTT to the serving replica.
Continuous batching is ignored (decode is charged serially), so absolute latencies are pessimistic;
the comparison between policies is the point.
"""
from __future__ import annotations

import heapq
import random
import statistics
from collections import OrderedDict
from dataclasses import dataclass, field

from pagedserve.cluster.policies import RoutingRequest, make_policy
from pagedserve.cluster.regions import RegionMap, allowed_by_residency
from pagedserve.cluster.replica import Replica

DEFAULT_CALIBRATION = {"prefill_s_per_token": 0.0015, "decode_s_per_token": 0.03, "warm_s": 0.08,
                       "note": "defaults; run the real benchmark to calibrate"}
REGIONS = ("us-east", "eu-west", "ap-south")
RTT_MS = {"us-east": {"eu-west": 80, "ap-south": 190, "us-east": 2},
          "eu-west": {"ap-south": 120, "eu-west": 2}, "ap-south": {"ap-south": 2}}


@dataclass(slots=True)
class SimConfig:
    replicas: int
    policy: str
    tenants: int
    users: int = 4
    turns: int = 4
    system_tokens: int = 1000
    turn_tokens: int = 40
    output_tokens: int = 8
    cache_tokens: int = 5500
    requests_per_replica: int = 40
    utilization: float = 0.3  # offered load / capacity if every prompt but the last turn were cached
    seed: int = 0


@dataclass(slots=True)
class SimReplica:
    replica: Replica
    cache: OrderedDict = field(default_factory=OrderedDict)
    cached_tokens: int = 0
    busy_until: float = 0.0

    def cached_prefix(self, segments: list[tuple]) -> int:
        total = 0
        for key, size in segments:
            if key not in self.cache:
                break
            total += size
        return total

    def store(self, segments: list[tuple], capacity: int) -> None:
        for key, size in segments:
            if key in self.cache:
                self.cache.move_to_end(key)
            else:
                self.cache[key] = size
                self.cached_tokens += size
        while self.cached_tokens > capacity:
            _, size = self.cache.popitem(last=False)
            self.cached_tokens -= size


def _segments(config: SimConfig, tenant: int, conv: tuple, turn: int) -> list[tuple]:
    return [(("sys", tenant), config.system_tokens)] + [(("turn", conv, j), config.turn_tokens)
                                                        for j in range(turn + 1)]


def _prefix_key(segments: list[tuple], ids: dict) -> tuple:
    """Token ids standing for the segments: each segment gets its own range of ids."""
    key: list[int] = []
    for name, size in segments:
        base = ids.setdefault(name, len(ids)) * 4096
        key.extend(range(base, base + size))
    return tuple(key)


def simulate(config: SimConfig, calibration: dict) -> dict:
    rng = random.Random(config.seed)
    p, d, w = (calibration["prefill_s_per_token"], calibration["decode_s_per_token"], calibration["warm_s"])
    sims = [SimReplica(Replica(f"r{i}", "", REGIONS[i % 3], frozenset({"eu"}) if REGIONS[i % 3] == "eu-west"
                               else frozenset(), healthy=True)) for i in range(config.replicas)]
    policy = make_policy(config.policy, **({"max_index_size": config.cache_tokens}
                                           if config.policy == "prefix_affinity" else {}))
    regions = RegionMap(RTT_MS, slack_ms=25, spill_inflight=8)
    hit_service = w + p * config.turn_tokens + d * config.output_tokens
    rate = config.utilization * config.replicas / hit_service
    conversations: dict[tuple, list] = {}
    ids: dict = {}
    events: list = []
    now, served, ttfts, hit, query, cross, violations = 0.0, 0, [], 0, 0, 0, 0
    for i in range(config.requests_per_replica * config.replicas):
        now += rng.expovariate(rate)
        heapq.heappush(events, (now, i, "arrive", None))
    last = 0.0
    while events:
        now, i, kind, data = heapq.heappop(events)
        if kind == "done":  # what the real router does when a response ends
            data[0].replica.finish_request(data[1])
            last = now
            continue
        tenant = rng.randrange(config.tenants)
        home = "eu-west" if tenant % 4 == 0 else REGIONS[tenant % 3]
        residency = frozenset({"eu"}) if tenant % 4 == 0 else frozenset()
        user = (tenant, rng.randrange(config.users))
        generation, turn = conversations.setdefault(user, [0, -1])
        turn += 1
        if turn == config.turns:
            generation, turn = generation + 1, 0
        conversations[user] = [generation, turn]
        segments = _segments(config, tenant, (*user, generation), turn)
        tokens = sum(s for _, s in segments)
        allowed = [s.replica for s in sims if allowed_by_residency(s.replica, residency)]
        req = RoutingRequest(_prefix_key(segments, ids), f"{user}", tokens + config.output_tokens)
        decision = policy.choose(req, regions.nearest(home, allowed))
        policy.on_routed(req, decision.replica)
        sim = sims[int(decision.replica.name[1:])]
        violations += not allowed_by_residency(sim.replica, residency)
        cross += sim.replica.region != home
        cached = sim.cached_prefix(segments)
        sim.store(segments, config.cache_tokens)
        hit, query = hit + cached, query + tokens
        rtt = regions.rtt(home, sim.replica.region) / 1000
        start = max(now + rtt / 2, sim.busy_until)
        prefill = w + p * (tokens - cached)
        sim.busy_until = start + prefill + d * config.output_tokens
        sim.replica.start_request(req.est_tokens)  # the in-flight tokens least load reads, as in the router
        heapq.heappush(events, (sim.busy_until, i, "done", (sim, req.est_tokens)))
        ttfts.append(start - now + prefill + rtt / 2)
        served += 1
    q = statistics.quantiles(ttfts, n=100)
    return {"replicas": config.replicas, "policy": config.policy, "hit_rate": hit / query, "ttft_p50": q[49],
            "ttft_p99": q[98], "req_s": served / last, "cross_region": cross / served,
            "residency_violations": violations}


def simulation_report(calibration: dict, seed: int = 0, sizes: tuple[int, ...] = (4, 16, 64)) -> str:
    lines = ["### SIMULATION, not a measurement: routing at cluster scale (3 regions)", "",
             ("Discrete-event model (src/pagedserve/bench/routing_sim.py): the real policies, prefix index, "
             "region map and residency filter route; replicas are modelled as FIFO servers with an LRU prefix "
             f"cache of 5,500 tokens, costs calibrated above ({calibration.get('note', 'measured')}). "
             "4 tenants per replica, 4 users each, 4-turn conversations, 1,000-token system prompts; a quarter "
             "of the tenants are EU-resident. Poisson arrivals at 30% of the capacity the replicas would have "
             "if every prompt but its last turn were cached, so a policy that loses the cache overloads them. "
             "Absolute latencies are pessimistic (decode is charged serially); compare policies."), "",
             ("| replicas | policy | hit rate | TTFT p50 (s) | TTFT p99 (s) | req/s | cross-region | "
             "residency violations |"), "|---|---|---|---|---|---|---|---|"]
    for n in sizes:
        for policy in ("round_robin", "least_load", "prefix_affinity"):
            r = simulate(SimConfig(replicas=n, policy=policy, tenants=4 * n, seed=seed), calibration)
            lines.append(f"| {n} | {policy} | {r['hit_rate']:.1%} | {r['ttft_p50']:.2f} | {r['ttft_p99']:.2f} | "
                         f"{r['req_s']:.1f} | {r['cross_region']:.0%} | {r['residency_violations']} |")
    return "\n".join(lines) + "\n"
