"""The router's decision core: which replica gets a request (no HTTP here; see app.py for the proxy).

Order of filters: residency (hard), health, already-tried replicas (failover), model, then region
(nearest by RTT + measured latency), and only then the policy among what is left.

A request for a LoRA adapter goes to the replicas that hold it (their /v1/models lists it), prefix affinity
within them. When none does, or every holder has `lora_spill_inflight` requests in flight, and the adapter is
one of the router's `lora_modules`, the policy picks among the others and the router loads it there first.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import httpx

from pagedserve.cluster.cluster_config import ClusterConfig
from pagedserve.cluster.health import HealthMonitor
from pagedserve.cluster.metrics import RouterMetrics
from pagedserve.cluster.policies import Decision, PrefixAffinity, RoutingRequest, make_policy
from pagedserve.cluster.regions import RegionMap, allowed_by_residency
from pagedserve.cluster.replica import Replica
from pagedserve.server.peer_auth import PeerKey

log = logging.getLogger(__name__)

CHARS_PER_TOKEN = 4  # the prefix index counts characters; English BPE averages about four per token


class NoReplicaError(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Router:
    def __init__(self, config: ClusterConfig, client: httpx.AsyncClient, peer_key: PeerKey | None = None,
                 fresh_client: httpx.AsyncClient | None = None) -> None:
        self.config = config
        self.peer_key = peer_key  # signs what the router asks of replicas' internal routes
        self.replicas = [Replica(s.name, s.url, s.region, frozenset(t.lower() for t in s.tags), kv_role=s.kv_role)
                         for s in config.replicas]
        self.disaggregated = any(r.kv_role == "prefill" for r in self.replicas)
        options = {}
        if config.policy == "prefix_affinity":
            options = {"cache_threshold": config.cache_threshold, "balance_abs": config.balance_abs,
                       "balance_rel": config.balance_rel, "max_index_size": config.max_index_size}
        self.policy = make_policy(config.policy, **options)
        self.regions = RegionMap(config.rtt_ms, config.default_rtt_ms, config.region_slack_ms,
                                 config.spill_inflight)
        self.metrics = RouterMetrics()
        # Told of every choice of a replica and every prefill hand-off (the console's journal, cluster/ui/).
        self.listeners: list = []
        self._loading: dict[tuple[str, str], asyncio.Task] = {}
        index_size = self.policy.index.size if isinstance(self.policy, PrefixAffinity) else (lambda _: 0)
        for replica in self.replicas:
            self.metrics.watch(replica, index_size)
        self.health = HealthMonitor(
            self.replicas, client, interval_s=config.health_interval_s, timeout_s=config.health_timeout_s,
            unhealthy_threshold=config.unhealthy_threshold, healthy_threshold=config.healthy_threshold,
            passive_failures=config.passive_failures, on_eject=self._ejected, on_readmit=self._readmitted,
            on_confirm=self._confirmed, peer_key=peer_key, fresh_client=fresh_client)

    def select(self, req: RoutingRequest, *, residency: frozenset[str] = frozenset(),
               client_region: str | None = None, model: str | None = None,
               exclude: Sequence[str] = (), prefill: bool = False) -> Decision:
        """prefill: choose among the prefill pool; otherwise among the replicas that decode (all when no
        replica is prefill-only). Residency rules apply to both pools."""
        pool = [r for r in self.replicas if (r.kv_role == "prefill") == prefill] if self.disaggregated \
            else self.replicas
        allowed = [r for r in pool if allowed_by_residency(r, residency)]
        if not allowed:
            raise NoReplicaError(f"no replica carries the residency tags {sorted(residency)} this request "
                                 "requires")
        candidates = [r for r in allowed if r.healthy and r.name not in exclude]
        if not candidates:
            raise NoReplicaError(self._unavailable_reason(allowed, residency, exclude))
        spill, loading = False, set()
        if model in self.config.lora_modules:  # a replica loading it counts as a holder: a burst loads it once
            loading = {name for name, adapter in self._loading if adapter == model}
            holders = [r for r in candidates if model in r.models or r.name in loading]
            others = [r for r in candidates if r not in holders]
            spill = bool(others) and all(r.inflight_requests >= self.config.lora_spill_inflight for r in holders)
            candidates = others if spill else holders or candidates
        else:
            serving = [r for r in candidates if not r.models or model in r.models]
            candidates = serving or candidates  # an unknown model goes through, for the replica's own 404
        nearest = self.regions.nearest(client_region or self.config.region, candidates)
        decision = self.policy.choose(req, nearest)
        if spill or decision.replica.name in loading:  # load it there first (or wait for the load under way)
            decision.load_adapter = model
            decision.reason = "lora_load" if spill else decision.reason
        self._record(req, decision)
        for listener in self.listeners:
            listener.decided(req, decision, nearest, prefill, self.disaggregated, exclude)
        return decision

    async def load_adapter(self, replica: Replica, name: str) -> str | None:
        """Loads a lora_modules adapter on replica (concurrent requests share one load): None once it is
        there, else what went wrong."""
        key = (replica.name, name)
        task = self._loading.get(key)
        if task is None:
            task = self._loading[key] = asyncio.create_task(self._load(replica, name))
            task.add_done_callback(lambda _: self._loading.pop(key, None))
        return await asyncio.shield(task)

    async def _load(self, replica: Replica, name: str) -> str | None:
        path = "/v1/load_lora_adapter"
        body, headers = self.peer_key.signed_json("POST", path, {"lora_name": name,
                                                                 "lora_path": self.config.lora_modules[name]})
        try:
            response = await self.health.client.post(replica.url + path, content=body, headers=headers,
                                                      timeout=self.config.request_timeout_s)
        except httpx.HTTPError as exc:
            problem = f"loading adapter {name} failed: {type(exc).__name__} {exc}".strip()
        else:  # a 400 "already served" means a load that raced ours (or an earlier one) got there first (the
            # replica answers it only once such a load settled)
            if response.status_code == 200 or (response.status_code == 400 and "already served" in response.text):
                if name not in replica.models:
                    replica.models.append(name)
                self.metrics.lora_loads.labels(replica.name, name, "loaded").inc()
                log.info("loaded LoRA adapter %s on %s", name, replica.name)
                return None
            problem = f"loading adapter {name} answered {response.status_code}: {response.text[:200]}"
        self.metrics.lora_loads.labels(replica.name, name, "failed").inc()
        log.warning("%s on %s", problem, replica.name)
        return problem

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
