"""Providers, live: each one's circuit breaker as it stands in this gateway, and over the last minutes its
attempts, error rate (its own failures: 5xx, 429, timeouts, broken answers; not a request's 4xx) and latency
percentiles of the attempts that answered. The table refreshes itself every two seconds."""
from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pagedserve.cluster.ui.web import PREFIX
from pagedserve.gateway.ui.context import GatewayUI

WINDOW_S = 15 * 60


def mount(app: FastAPI, ui: GatewayUI) -> None:
    async def rows() -> list[dict]:
        stats = await ui.reports.providers(time.time() - WINDOW_S)
        now = time.monotonic()
        out = []
        for name, provider in ui.config.providers.items():
            breaker = ui.providers.breakers[name]
            reopens = max(0.0, breaker.opened_at + breaker.config.reset_s - now) if breaker.state == "open" else None
            out.append({"name": name, "base_url": provider.base_url, "timeout_s": provider.timeout_s,
                        "models": sorted(provider.models), "state": breaker.state, "failures": breaker.failures,
                        "reopens_in": reopens, "stats": stats.get(name)})
        return out

    async def page(request: Request) -> Response:
        return ui.web.render(request, "providers.html", heading="Providers", providers=await rows(),
                             window_min=WINDOW_S // 60, threshold=ui.config.breaker.failure_threshold)

    async def fragment(request: Request) -> Response:
        return ui.web.render(request, "provider_rows.html", providers=await rows(), window_min=WINDOW_S // 60,
                             threshold=ui.config.breaker.failure_threshold)

    ui.web.page(app, PREFIX + "/providers", page)
    ui.web.page(app, PREFIX + "/providers/rows", fragment)
