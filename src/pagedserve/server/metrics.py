"""Prometheus metrics of one server: request outcomes and latencies, plus the engine's own counters."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0)


class EngineStatsCollector(Collector):
    """Reads the latest EngineStats snapshot at scrape time (no work on the engine thread)."""

    def __init__(self, get_stats: Callable[[], Any], model_name: str):
        self.get_stats = get_stats
        self.labels = {"model_name": model_name}

    def collect(self) -> Iterator:
        s = self.get_stats()
        names, values = list(self.labels), list(self.labels.values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(f"pagedserve_{name}", doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(f"pagedserve_{name}", doc, labels=names)
            c.add_metric(values, value)
            return c

        queried = s.prefix_cache_query_tokens
        yield gauge("num_requests_running", "requests in the running batch", s.num_running)
        yield gauge("num_requests_waiting", "requests waiting to be scheduled", s.num_waiting)
        yield gauge("kv_blocks_total", "KV cache blocks in the pool", s.blocks_total)
        yield gauge("kv_blocks_used", "KV cache blocks held by requests", s.blocks_used)
        yield gauge("kv_blocks_cached", "free KV blocks still holding a cached prefix", s.blocks_cached)
        yield gauge("kv_cache_usage_ratio", "fraction of KV blocks held by requests",
                    s.blocks_used / s.blocks_total if s.blocks_total else 0.0)
        yield gauge("prefix_cache_hit_rate", "prompt tokens served from the prefix cache / prompt tokens looked up",
                    s.prefix_cache_hit_tokens / queried if queried else 0.0)
        yield counter("prefix_cache_hit_tokens", "prompt tokens served from the prefix cache",
                      s.prefix_cache_hit_tokens)
        yield counter("prefix_cache_query_tokens", "prompt tokens looked up in the prefix cache", queried)
        yield counter("num_preemptions", "requests preempted (recomputed later)", s.num_preemptions)
        yield gauge("kv_transfer_leases", "KV transfer leases held for decode workers (disaggregation)", s.kv_leases)
        yield gauge("kv_transfer_leased_blocks", "KV blocks pinned by those leases", s.kv_leased_blocks)
        by_reason = CounterMetricFamily("pagedserve_preemptions_by_reason", "preemptions by reason: kv_pressure "
                                        "(blocks ran out) or priority (a more important request waited)",
                                        labels=[*names, "reason"])
        for reason, count in s.preemptions_by_reason.items():
            by_reason.add_metric([*values, reason], count)
        yield by_reason
        yield gauge("lora_adapters_loaded", "LoRA adapters held in memory", s.lora_adapters)
        yield gauge("lora_adapter_bytes", "bytes of the LoRA adapters held in memory", s.lora_bytes)
        yield counter("lora_loads", "LoRA adapter loads (a reload counts again)", s.lora_loads)
        yield counter("lora_evictions", "LoRA adapters evicted least-recently-used (--max-cpu-loras)",
                      s.lora_evictions)
        if s.expert_tokens:
            experts = CounterMetricFamily("pagedserve_moe_expert_tokens", "tokens routed to each expert of a "
                                          "mixture-of-experts model, all sparse layers summed", labels=[*names, "expert"])
            for expert, count in enumerate(s.expert_tokens):
                experts.add_metric([*values, str(expert)], count)
            yield experts
            yield gauge("moe_expert_load_imbalance", "busiest expert's routed tokens over the mean, averaged over "
                        "sparse layers (1.0: perfectly balanced)", s.expert_load_imbalance)
        if s.spec_decode is not None:
            yield from spec_decode_metrics(s.spec_decode, names, values)
        yield counter("prompt_tokens", "prompt tokens processed", s.prompt_tokens_total)
        yield counter("generation_tokens", "tokens generated", s.generation_tokens_total)


def spec_decode_metrics(s: Any, names: list[str], values: list[str]) -> Iterator:
    """vLLM's spec_decode counters (vllm:spec_decode_num_drafts, ...), per method, and how many proposals each
    verified draft had accepted as a histogram (bucket le=a: drafts with at most a accepted)."""
    labels, labelled = [*names, "method"], [*values, s.method]
    for name, doc, value in [("num_drafts", "verified proposal runs (a request's proposals in one step)", s.num_drafts),
                             ("num_draft_tokens", "tokens proposed and verified", s.num_draft_tokens),
                             ("num_accepted_tokens", "proposed tokens accepted", s.num_accepted_tokens)]:
        c = CounterMetricFamily(f"pagedserve_spec_decode_{name}", doc, labels=labels)
        c.add_metric(labelled, value)
        yield c
    # vLLM's num_accepted_tokens_per_pos: a draft is accepted as a prefix, so position p was accepted by every
    # draft with more than p proposals accepted
    c = CounterMetricFamily("pagedserve_spec_decode_num_accepted_tokens_per_pos",
                            "proposed tokens accepted at each position of a draft (0: the first)",
                            labels=[*labels, "position"])
    for p in range(len(s.acceptance_lengths) - 1):
        c.add_metric([*labelled, str(p)], sum(s.acceptance_lengths[p + 1:]))
    yield c
    h = HistogramMetricFamily("pagedserve_spec_decode_acceptance_length", "proposals accepted per verified draft",
                              labels=labels)
    cumulative = [sum(s.acceptance_lengths[:a + 1]) for a in range(len(s.acceptance_lengths))]
    h.add_metric(labelled, [(str(float(a)), n) for a, n in enumerate(cumulative)] + [("+Inf", s.num_drafts)],
                 s.num_accepted_tokens)
    yield h


class AdmissionCollector(Collector):
    """Admission control's counters and its adaptive bound, read at scrape time."""

    def __init__(self, admission: Any):
        self.admission = admission

    def collect(self) -> Iterator:
        a = self.admission
        admitted = CounterMetricFamily("pagedserve_admission_admitted", "requests admitted, by priority class",
                                       labels=["priority_class"])
        degraded = CounterMetricFamily("pagedserve_admission_degraded",
                                       "requests served degraded under pressure, by class", labels=["priority_class"])
        for cls in a.admitted:
            admitted.add_metric([cls], a.admitted[cls])
            degraded.add_metric([cls], a.degraded[cls])
        rejected = CounterMetricFamily("pagedserve_admission_rejected", "requests refused, by class and reason",
                                       labels=["priority_class", "reason"])
        for (cls, code), count in a.rejected.items():
            rejected.add_metric([cls, code], count)
        queued = GaugeMetricFamily("pagedserve_admission_queued_tokens", "cost tokens admitted and not started",
                                   labels=["priority_class"])
        for cls, tokens in a.queued_tokens.items():
            queued.add_metric([cls], tokens)
        yield from (admitted, degraded, rejected, queued)
        yield GaugeMetricFamily("pagedserve_admission_limit_tokens", "current adaptive bound on queued tokens",
                                value=a.limit_tokens)
        yield GaugeMetricFamily("pagedserve_admission_drain_rate", "cost tokens started per second when saturated",
                                value=a.rate or 0.0)
        yield GaugeMetricFamily("pagedserve_admission_gain", "AIMD gain on the drain-rate bound", value=a.gain)
        yield GaugeMetricFamily("pagedserve_admission_in_flight", "admitted requests not yet finished",
                                value=a.in_flight)


@dataclass
class ServerMetrics:
    model_name: str
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        labels = ["model_name"]
        self.requests = Counter("pagedserve_requests", "HTTP requests by endpoint and status",
                                ["endpoint", "status"], registry=self.registry)
        self.ttft = Histogram("pagedserve_time_to_first_token_seconds", "time to first token",
                              labels, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("pagedserve_time_per_output_token_seconds",
                              "mean time per output token after the first, per request",
                              labels, buckets=LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("pagedserve_e2e_request_latency_seconds", "request latency, arrival to last token",
                             labels, buckets=E2E_BUCKETS, registry=self.registry)

    def watch_transfers(self) -> None:
        """KV transfers between prefill and decode workers: blocks and bytes each way, pull latency, failures."""
        self.kv_blocks = Counter("pagedserve_kv_transfer_blocks", "KV blocks sent (out) or received (in), by "
                                 "transport (tcp, shm, ray)", ["direction", "transport"], registry=self.registry)
        self.kv_bytes = Counter("pagedserve_kv_transfer_bytes", "bytes of KV sent (out) or received (in), by "
                                "transport", ["direction", "transport"], registry=self.registry)
        self.kv_seconds = Histogram("pagedserve_kv_transfer_seconds", "a decode worker's pull of one prompt's blocks",
                                    buckets=LATENCY_BUCKETS, registry=self.registry)
        self.kv_failures = Counter("pagedserve_kv_transfer_failures", "pulls that failed, by cause (the request "
                                   "was then recomputed, or failed under --kv-load-failure fail)", ["cause"],
                                   registry=self.registry)

    def watch_engine(self, get_stats: Callable[[], Any]) -> None:
        self.registry.register(EngineStatsCollector(get_stats, self.model_name))

    def describe_weights(self, info: dict) -> None:
        """What runs: info gauges (vLLM's cache_config_info style), the weights' resident bytes and the KV pool's
        capacity in tokens."""
        labels = {"model_name": self.model_name, **{k: str(info[k]) for k in ("dtype", "quantization", "quant_kernel")}}
        Gauge("pagedserve_model_info", "the model's dtype, weight quantization and kernel path (value 1)",
              list(labels), registry=self.registry).labels(**labels).set(1)
        Gauge("pagedserve_model_weight_bytes", "resident bytes of the model's weights", ["model_name"],
              registry=self.registry).labels(self.model_name).set(info["weight_bytes"])
        Gauge("pagedserve_kv_cache_info", "the KV cache's storage dtype (value 1)", ["model_name", "kv_cache_dtype"],
              registry=self.registry).labels(self.model_name, info["kv_cache_dtype"]).set(1)
        Gauge("pagedserve_kv_cache_capacity_tokens", "tokens the KV pool holds", ["model_name"],
              registry=self.registry).labels(self.model_name).set(info["kv_cache_tokens"])

    def watch_admission(self, admission: Any) -> None:
        self.registry.register(AdmissionCollector(admission))

    def record_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint, str(status)).inc()

    def record_generation(self, timer: RequestTimer) -> None:
        if timer.first_token_time is None:
            return
        self.ttft.labels(self.model_name).observe(timer.ttft)
        self.e2e.labels(self.model_name).observe(timer.e2e)
        if timer.num_tokens > 1:
            self.tpot.labels(self.model_name).observe(timer.tpot)

    def render(self) -> bytes:
        return generate_latest(self.registry)


@dataclass(slots=True)
class RequestTimer:
    """Arrival, first token and last token times of one request (all its samples together)."""

    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_tokens: int = 0

    def tokens(self, total: int) -> None:
        """Called with the request's cumulative number of generated tokens after each engine step."""
        if total > self.num_tokens:
            now = time.perf_counter()
            if self.first_token_time is None:
                self.first_token_time = now
            self.last_token_time = now
            self.num_tokens = total

    @property
    def ttft(self) -> float:
        return (self.first_token_time or self.arrival) - self.arrival

    @property
    def e2e(self) -> float:
        return (self.last_token_time or self.arrival) - self.arrival

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / max(1, self.num_tokens - 1)
