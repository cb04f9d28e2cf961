"""The router's decision core: which replica gets a request (no HTTP here; see app.py for the proxy).

Order of filters: residency (hard), health, already-tried replicas (failover), model, then region
(nearest by RTT + measured latency), and only then the policy among what is left.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import httpx

from pagedserve.cluster.cluster_config import ClusterConfig
from pagedserve.cluster.health import HealthMonitor
from pagedserve.cluster.metrics import RouterMetrics
from pagedserve.cluster.policies import Decision, PrefixAffinity, RoutingRequest, make_policy
from pagedserve.cluster.regions import RegionMap, allowed_by_residency
from pagedserve.cluster.replica import Replica

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4  # the prefix index counts characters; English BPE averages about four per token


class NoReplicaError(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Router:
    def __init__(self, config: ClusterConfig, client: httpx.AsyncClient) -> None:
        self.config = config
        self.replicas = [Replica(s.name, s.url, s.region, frozenset(t.lower() for t in s.tags))
                         for s in config.replicas]
        options = {}
        if config.policy == "prefix_affinity":
            options = {"cache_threshold": config.cache_threshold, "balance_abs": config.balance_abs,
                       "balance_rel": config.balance_rel, "max_index_size": config.max_index_size}
        self.policy = make_policy(config.policy, **options)
        self.regions = RegionMap(config.rtt_ms, config.default_rtt_ms, config.region_slack_ms,
                                 config.spill_inflight)
        self.metrics = RouterMetrics()
        index_size = self.policy.index.size if isinstance(self.policy, PrefixAffinity) else (lambda _: 0)
        for replica in self.replicas:
            self.metrics.watch(replica, index_size)
        self.health = HealthMonitor(
            self.replicas, client, interval_s=config.health_interval_s, timeout_s=config.health_timeout_s,
            unhealthy_threshold=config.unhealthy_threshold, healthy_threshold=config.healthy_threshold,
            passive_failures=config.passive_failures, on_eject=self._ejected, on_readmit=self._readmitted,
            on_confirm=self._confirmed)

    def select(self, req: RoutingRequest, *, residency: frozenset[str] = frozenset(),
               client_region: str | None = None, model: str | None = None,
               exclude: Sequence[str] = ()) -> Decision:
        allowed = [r for r in self.replicas if allowed_by_residency(r, residency)]
        if not allowed:
            raise NoReplicaError(f"no replica carries the residency tags {sorted(residency)} this request "
                                 "requires")
        candidates = [r for r in allowed if r.healthy and r.name not in exclude]
        if not candidates:
            raise NoReplicaError(self._unavailable_reason(allowed, residency, exclude))
        serving = [r for r in candidates if not r.models or model in r.models]
        candidates = serving or candidates  # an unknown model goes through, for the replica's own 404
        near = self.regions.nearest(client_region or self.config.region, candidates)
        decision = self.policy.choose(req, near)
        self._record(req, decision)
        return decision

    def _record(self, req: RoutingRequest, decision: Decision) -> None:
        self.policy.on_routed(req, decision.replica)
        self.metrics.decisions.labels(self.policy.name, decision.reason).inc()
        self.metrics.prefix_query.inc(len(req.prefix_key))
        self.metrics.prefix_hit.labels(decision.replica.name).inc(decision.matched)
        log.debug("routed to %s (%s, matched %d/%d)", decision.replica.name, decision.reason,
                  decision.matched, len(req.prefix_key))

    @staticmethod
    def _unavailable_reason(allowed: list[Replica], residency: frozenset[str], exclude: Sequence[str]) -> str:
        scope = f"satisfying residency {sorted(residency)}" if residency else "at all"
        states = "; ".join(f"{r.name}: " + ("failed on this request" if r.name in exclude else r.ejected_reason)
                           for r in allowed)
        return f"no healthy replica {scope} ({states})"

    def _ejected(self, replica: Replica, source: str) -> None:
        self.metrics.ejections.labels(replica.name, source).inc()
        self.policy.forget(replica)

    def _confirmed(self, replica: Replica, ok: bool) -> None:
        self.metrics.confirm_probes.labels(replica.name, str(ok).lower()).inc()

    def _readmitted(self, replica: Replica) -> None:
        self.metrics.readmissions.labels(replica.name).inc()
        self.policy.forget(replica)  # whatever it held before is not to be trusted now
        if isinstance(self.policy, PrefixAffinity) and replica.kv_tokens:
            self.policy.index.budgets[replica.name] = replica.kv_tokens * CHARS_PER_TOKEN
