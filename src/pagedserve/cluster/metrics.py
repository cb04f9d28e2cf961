"""The router's own Prometheus metrics (its own registry, so several routers can live in one process)."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedserve.cluster.replica import Replica

PREFIX = "pagedserve_router_"


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(PREFIX + "requests", "requests answered, by replica, endpoint and status",
                                ["replica", "endpoint", "status"], registry=r)
        self.decisions = Counter(PREFIX + "decisions", "routing decisions by policy and reason",
                                 ["policy", "reason"], registry=r)
        self.failovers = Counter(PREFIX + "failovers", "requests retried on another replica, by the one that "
                                 "failed and why", ["replica", "reason"], registry=r)
        self.stream_errors = Counter(PREFIX + "stream_errors", "streams ended by an error event because their "
                                     "replica failed mid-stream", ["replica"], registry=r)
        self.ejections = Counter(PREFIX + "ejections", "replicas taken out of rotation", ["replica", "source"],
                                 registry=r)
        self.confirm_probes = Counter(PREFIX + "confirm_probes", "immediate /health probes after a 5xx answer or "
                                      "a broken connection, by whether the replica answered (ok=false ejects)",
                                      ["replica", "ok"], registry=r)
        self.readmissions = Counter(PREFIX + "readmissions", "replicas put back in rotation", ["replica"],
                                    registry=r)
        self.rejections = Counter(PREFIX + "rejections", "requests answered 503 because no allowed replica was "
                                  "healthy", ["residency"], registry=r)
        self.client_disconnects = Counter(PREFIX + "client_disconnects", "requests whose client left before "
                                          "their answer began (their upstream request is cancelled)", registry=r)
        self.prefix_query = Counter(PREFIX + "prefix_query", "prefix-index units looked up", registry=r)
        self.prefix_hit = Counter(PREFIX + "prefix_hit", "prefix-index units the chosen replica is expected to "
                                  "hold (estimated hit rate = hit / query)", ["replica"], registry=r)
        self.lora_loads = Counter(PREFIX + "lora_loads", "LoRA adapters the router loaded on a replica, by "
                                  "adapter and result (loaded, or the failure)", ["replica", "adapter", "result"],
                                  registry=r)
        self.prefills = Counter(PREFIX + "prefills", "disaggregated requests' prefill halves by prefill replica and "
                                "result (handed_off, or the failure; a failed prefill is recomputed by the decode "
                                "replica)", ["replica", "result"], registry=r)
        self.prefill_seconds = Histogram(PREFIX + "prefill_seconds", "a prefill replica's time for the prefill half",
                                         buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_byte_seconds", "router-side time to the first streamed "
                              "chunk", buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30), registry=r)
        self.healthy = Gauge(PREFIX + "replica_healthy", "1 when the replica is in rotation", ["replica"],
                             registry=r)
        self.inflight = Gauge(PREFIX + "replica_inflight_requests", "requests in flight", ["replica"],
                              registry=r)
        self.inflight_tokens = Gauge(PREFIX + "replica_inflight_tokens", "estimated tokens in flight",
                                     ["replica"], registry=r)
        self.latency = Gauge(PREFIX + "replica_latency_ms", "measured probe latency (EWMA)", ["replica"],
                             registry=r)
        self.index_size = Gauge(PREFIX + "replica_prefix_index_size", "prefix-index units attributed to the "
                                "replica (its estimated cache)", ["replica"], registry=r)

    def watch(self, replica: Replica, index_size) -> None:
        """Gauges read the replica's live state at scrape time."""
        self.healthy.labels(replica.name).set_function(lambda: float(replica.healthy))
        self.inflight.labels(replica.name).set_function(lambda: replica.inflight_requests)
        self.inflight_tokens.labels(replica.name).set_function(lambda: replica.inflight_tokens)
        self.latency.labels(replica.name).set_function(lambda: replica.latency_ms or 0.0)
        self.index_size.labels(replica.name).set_function(lambda: index_size(replica.name))
