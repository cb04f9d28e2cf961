"""Providers, live: each one's circuit breaker as it stands in this gateway, and over the last minutes its
attempts, error rate (its own failures: 5xx, 429, timeouts, broken answers; not a request's 4xx) and latency
percentiles of the attempts that answered. The table refreshes itself every two seconds."""
from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pagedserve.cluster.ui.web import PREFIX
from pagedserve.gateway.ui.context import GatewayUI
from pagedserve.gateway.ui.reports import ProviderStats, percentile

WINDOW_S = 15 * 60
BUCKET_S = 60


def mount(app: FastAPI, ui: GatewayUI) -> None:
    async def rows() -> tuple[list[dict], dict, dict]:
        stats = await ui.reports.providers(time.time() - WINDOW_S)
        now = time.monotonic()
        out = []
        for name, provider in ui.config.providers.items():
            breaker = ui.providers.breakers[name]
            reopens = max(0.0, breaker.opened_at + breaker.config.reset_s - now) if breaker.state == "open" else None
            out.append({"name": name, "base_url": provider.base_url, "timeout_s": provider.timeout_s,
                        "models": sorted(provider.models), "state": breaker.state, "failures": breaker.failures,
                        "reopens_in": reopens, "stats": stats.get(name)})
        return out, *timelines(stats)

    async def context() -> dict:
        providers, latency, errors = await rows()
        return {"providers": providers, "latency_chart": latency, "error_chart": errors, "window_min": WINDOW_S // 60,
                "threshold": ui.config.breaker.failure_threshold}

    async def page(request: Request) -> Response:
        return ui.web.render(request, "providers.html", heading="Providers", **await context())

    async def fragment(request: Request) -> Response:
        return ui.web.render(request, "provider_rows.html", **await context())

    ui.web.page(app, PREFIX + "/providers", page)
    ui.web.page(app, PREFIX + "/providers/rows", fragment)


def timelines(stats: dict[str, ProviderStats]) -> tuple[dict, dict]:
    """Per minute of the window and per provider: the p95 latency of the attempts that answered, and the share
    that failed."""
    now = time.time()
    minutes = list(range(int((now - WINDOW_S) // BUCKET_S) * BUCKET_S, int(now) + 1, BUCKET_S))
    latency, errors = [minutes], [minutes]
    for s in stats.values():
        per: dict[int, list] = {}
        for at, ms in s.samples:
            per.setdefault(int(at // BUCKET_S) * BUCKET_S, []).append(ms)
        latency.append([percentile([v for v in per.get(m, []) if v is not None], 0.95) for m in minutes])
        errors.append([sum(v is None for v in per[m]) / len(per[m]) if per.get(m) else None for m in minutes])
    series = [{"label": name} for name in stats]
    window = [now - WINDOW_S, now]
    return ({"series": series, "data": latency if stats else [], "y": "ms", "xrange": window,
             "empty": "No attempt in the window."},
            {"series": series, "data": errors if stats else [], "y": "ratio", "xrange": window,
             "empty": "No attempt in the window."})
