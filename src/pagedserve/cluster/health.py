"""Replica health: active /health probes, passive ejection on request failures, re-admission.

A replica leaves rotation after `unhealthy_threshold` failed probes; at once when a request cannot
connect (nothing listens there); after `passive_failures` consecutive timeouts, or 5xx answers to
requests another replica then served; and when a request's connection broke or it answered 5xx and
an immediate /health probe fails too. What one request provokes (a 5xx, a dropped connection) never
ejects a replica whose probe still answers, so a client sending bad requests cannot take replicas
out of service. Ejected replicas keep being probed and come back after `healthy_threshold` good
probes; their prefix-cache estimate is dropped, since a restarted replica starts cold.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.cluster.replica import Replica
from pagedserve.config import EngineConfig
from pagedserve.server.peer_auth import PEER_PREFIX, PeerKey

BLOCK_TOKENS = EngineConfig().block_size  # replicas do not publish theirs; the default is assumed

log = logging.getLogger(__name__)


class HealthMonitor:
    def __init__(self, replicas: list[Replica], client: httpx.AsyncClient, *, interval_s: float,
                 timeout_s: float, unhealthy_threshold: int, healthy_threshold: int, passive_failures: int,
                 on_eject: Callable[[Replica, str], None], on_readmit: Callable[[Replica], None],
                 on_confirm: Callable[[Replica, bool], None] = lambda replica, ok: None,
                 peer_key: PeerKey | None = None, fresh_client: httpx.AsyncClient | None = None) -> None:
        self.replicas = replicas
        self.client = client
        # No connection kept: a connection of its own per request, for when a pooled one cannot be trusted.
        self.fresh_client = fresh_client or httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0))
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.unhealthy_threshold = unhealthy_threshold
        self.healthy_threshold = healthy_threshold
        self.passive_failures = passive_failures
        self.on_eject = on_eject
        self.on_readmit = on_readmit
        self.on_confirm = on_confirm
        self.peer_key = peer_key
        self._passive: dict[str, int] = {}
        self._confirming: dict[str, asyncio.Task] = {}
        self.disaggregated = any(r.kv_role == "prefill" for r in replicas)

    async def run(self) -> None:
        while True:
            await self.probe_all()
            await asyncio.sleep(self.interval_s)

    async def probe_all(self) -> None:
        # The prefill pool first: its KV layout is what the others are checked against, so a decode replica
        # whose blocks could not move is never admitted for want of a layout to compare with.
        await asyncio.gather(*(self.probe(r) for r in self.replicas if r.kv_role == "prefill"))
        await asyncio.gather(*(self.probe(r) for r in self.replicas if r.kv_role != "prefill"))

    async def probe(self, replica: Replica) -> None:
        ejections = replica.ejections
        ok, reason = await self._check(replica)
        if ok and self.disaggregated:
            reason = await self._kv_mismatch(replica)
            ok = reason is None
        # What it serves changes at run time (LoRA adapters loaded, unloaded): read it on every probe.
        info = await self._load_info(replica) if ok else None
        if replica.ejections != ejections:  # begun before an ejection: it says nothing of the replica since
            return
        if ok:
            replica.models, replica.kv_tokens = info
            self._probe_succeeded(replica)
        else:
            self._probe_failed(replica, reason)

    async def _kv_mismatch(self, replica: Replica) -> str | None:
        """Disaggregated: a replica whose KV blocks could not move to or from the prefill pool (another model,
        block size or KV format), or that runs another role than configured, stays out of rotation."""
        try:
            path = PEER_PREFIX + "/v1/kv/info"
            response = await self.client.get(replica.url + path, headers=self.peer_key.sign("GET", path),
                                             timeout=self.timeout_s)
            info = response.json()
            replica.kv_layout = (info["model"], int(info["block_size"]), info["kv_format"])
            role = info["kv_role"]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            return f"/internal/v1/kv/info failed: {type(exc).__name__} {exc}".strip()
        if role not in (replica.kv_role, "both"):
            return f"configured as a {replica.kv_role} replica, but it runs with --kv-role {role}"
        reference = next((r for r in self.replicas if r.kv_role == "prefill" and r.kv_layout is not None), None)
        if reference is not None and reference is not replica and reference.kv_layout != replica.kv_layout:
            model, size, fmt = replica.kv_layout
            return (f"its KV blocks ({model}, {size}-token blocks, {fmt}) cannot be transferred from "
                    f"{reference.name}'s ({reference.kv_layout[0]}, {reference.kv_layout[1]}-token blocks, "
                    f"{reference.kv_layout[2]}): start both pools with the same model, --block-size and "
                    "--kv-cache-dtype")
        return None

    async def _check(self, replica: Replica, client: httpx.AsyncClient | None = None) -> tuple[bool, str]:
        """One GET /health: whether it answered 200, and what went wrong if not."""
        start = time.perf_counter()
        try:
            response = await (client or self.client).get(replica.url + "/health", timeout=self.timeout_s)
        except httpx.HTTPError as exc:
            return False, f"/health failed: {type(exc).__name__} {exc}".strip()
        if response.status_code != 200:
            return False, f"/health answered {response.status_code}"
        replica.observe_latency((time.perf_counter() - start) * 1000)
        return True, ""

    async def _load_info(self, replica: Replica) -> tuple[list[str], int | None]:
        """What the replica serves and how large its KV pool is (for the prefix index's budget)."""
        try:
            response = await self.client.get(replica.url + "/v1/models", timeout=self.timeout_s)
            models = [m["id"] for m in response.json().get("data", [])]
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            return [], replica.kv_tokens
        try:
            metrics = await self.client.get(replica.url + "/metrics", timeout=self.timeout_s)
            blocks = sum(s.value for f in text_string_to_metric_families(metrics.text) for s in f.samples
                         if s.name == "pagedserve_kv_blocks_total")
            return models, int(blocks * BLOCK_TOKENS) or None
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
            return models, replica.kv_tokens

    def _probe_succeeded(self, replica: Replica) -> None:
        replica.consecutive_failures = 0
        replica.consecutive_successes += 1
        if not replica.healthy and replica.consecutive_successes >= self.healthy_threshold:
            replica.healthy = True
            replica.ejected_reason = ""
            self._passive[replica.name] = 0
            log.info("replica %s (%s) is healthy: in rotation", replica.name, replica.url)
            self.on_readmit(replica)

    def _probe_failed(self, replica: Replica, reason: str) -> None:
        replica.consecutive_successes = 0
        replica.consecutive_failures += 1
        if replica.healthy and replica.consecutive_failures >= self.unhealthy_threshold:
            self.eject(replica, reason, "active")
        elif not replica.healthy:
            replica.ejected_reason = reason

    def unreachable(self, replica: Replica, reason: str) -> None:
        """A request could not connect: nothing listens there, whatever the request was."""
        if replica.healthy:
            self.eject(replica, reason, "passive")

    def request_failed(self, replica: Replica, reason: str) -> None:
        """Passive evidence the request does not explain (a timeout, or a 5xx another replica did not
        repeat): ejects after `passive_failures` in a row."""
        count = self._passive.get(replica.name, 0) + 1
        self._passive[replica.name] = count
        if replica.healthy and count >= self.passive_failures:
            self.eject(replica, reason, "passive")

    def suspect(self, replica: Replica, reason: str) -> None:
        """A failure the request itself may have caused (a 5xx answer, a connection broken mid-answer):
        ejects only if an immediate /health probe fails too. One probe per replica at a time."""
        running = self._confirming.get(replica.name)
        if replica.healthy and (running is None or running.done()):
            self._confirming[replica.name] = asyncio.create_task(self._confirm(replica, reason))

    async def _confirm(self, replica: Replica, reason: str) -> None:
        # On a connection of its own: a pooled one may be the very connection the failed request left broken (a
        # replica closes it after an unhandled error), and a read error on that says nothing of the replica.
        ok, probe_reason = await self._check(replica, self.fresh_client)
        self.on_confirm(replica, ok)
        if not ok and replica.healthy:
            self.eject(replica, f"{reason}; then {probe_reason}", "confirmed")

    def request_succeeded(self, replica: Replica) -> None:
        self._passive[replica.name] = 0

    def eject(self, replica: Replica, reason: str, source: str) -> None:
        replica.healthy = False
        replica.ejections += 1
        replica.ejected_reason = reason
        replica.consecutive_successes = 0
        replica.models = []
        log.warning("replica %s (%s) ejected (%s): %s", replica.name, replica.url, source, reason)
        self.on_eject(replica, source)
