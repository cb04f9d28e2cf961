"""The router's health monitor on one replica, its HTTP answers held in place by an in-process transport so a
race can be staged step by step (the multi-process behaviour is in test_router_hardening.py)."""
import asyncio

import httpx

from pagedserve.cluster.health import HealthMonitor
from pagedserve.cluster.replica import Replica


def _monitor(replica: Replica, handler, readmitted: list[str]) -> HealthMonitor:
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return HealthMonitor([replica], client, interval_s=30, timeout_s=5, unhealthy_threshold=2,
                         healthy_threshold=1, passive_failures=3, on_eject=lambda r, source: None,
                         on_readmit=lambda r: readmitted.append(r.name), fresh_client=client)


def test_a_probe_begun_before_an_ejection_does_not_readmit():
    """A regular probe passes /health, then the replica fails a request and a confirming probe ejects it while
    the regular probe still reads /v1/models: that older good answer must not put it back in rotation."""
    async def scenario() -> tuple[bool, list[str], bool]:
        reading, release = asyncio.Event(), asyncio.Event()

        async def handler(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/v1/models":
                reading.set()
                await release.wait()
                return httpx.Response(200, json={"data": [{"id": "m"}]})
            if request.url.path == "/metrics":
                return httpx.Response(200, text="")
            return httpx.Response(200, json={"status": "ok"})

        replica, readmitted = Replica("r0", "http://r0.test", healthy=True), []
        monitor = _monitor(replica, handler, readmitted)
        regular = asyncio.create_task(monitor.probe(replica))
        await reading.wait()
        monitor.eject(replica, "answered 500; then /health answered 503", "confirmed")
        release.set()
        await regular
        after_stale = replica.healthy
        await monitor.probe(replica)  # begun after the ejection: its answer counts
        return after_stale, readmitted, replica.healthy

    after_stale, readmitted, after_fresh = asyncio.run(scenario())
    assert not after_stale
    assert readmitted == ["r0"] and after_fresh


def test_probe_reads_models_and_keeps_them_when_metrics_fail():
    async def scenario() -> Replica:
        async def handler(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/v1/models":
                return httpx.Response(200, json={"data": [{"id": "m"}, {"id": "adapter"}]})
            if request.url.path == "/metrics":
                raise httpx.ConnectError("metrics refused")
            return httpx.Response(200, json={"status": "ok"})

        replica = Replica("r0", "http://r0.test")
        await _monitor(replica, handler, []).probe(replica)
        return replica

    replica = asyncio.run(scenario())
    assert replica.healthy and replica.models == ["m", "adapter"] and replica.kv_tokens is None
