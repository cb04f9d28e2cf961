"""The gateway's web console at /ui: an overview, keys and teams, spend, traces, the semantic cache, providers and
retrieval, one module each beside this one; the login, sessions, CSRF checks and security headers are the
console kit's (cluster/ui/web.py), shared with the router's console. It opens only with the gateway's admin key.

The pages read the gateway's own objects (store, budgets, breakers, library, cache) and, through read-only
connections, its traces and cached answers; what they change (keys, limits, a source's version) goes through
the same store calls as the admin API."""
from __future__ import annotations

import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from pagedserve.cluster.ui.web import PREFIX, Console
from pagedserve.gateway.ui import cache, keys, providers, retrieval, spend, traces
from pagedserve.gateway.ui.context import GatewayUI
from pagedserve.gateway.ui.reports import Reports

HERE = Path(__file__).parent
NAV = [(PREFIX, "Overview"), (PREFIX + "/keys", "Keys & teams"), (PREFIX + "/spend", "Spend"),
       (PREFIX + "/traces", "Traces"), (PREFIX + "/cache", "Cache"), (PREFIX + "/providers", "Providers"),
       (PREFIX + "/retrieval", "Retrieval")]
BUCKET_S = 600


def mount_console(app: FastAPI, gw) -> GatewayUI | None:
    """gw: the Gateway (app.py). Without an admin key, /ui only says how to turn the console on."""
    config = gw.config
    if not config.admin_key:
        async def off(_: Request) -> Response:
            return PlainTextResponse("the gateway's console is off: set admin_key_env (or admin_key) in its config",
                                     status_code=404)
        app.add_api_route(PREFIX, off, methods=["GET"], include_in_schema=False)
        return None
    cached = gw.caching.cache
    ui = GatewayUI(config, gw.store, gw.budgets, gw.providers, gw.library, cached, gw.status,
                   Console("pagedserve gateway", config.admin_key, NAV, [HERE / "templates"], [], config.docs_dir,
                           config.tz),
                   Reports(gw.traces.path, cached.path if cached is not None else None, config.tz))
    ui.web.mount(app)
    ui.web.page(app, PREFIX, lambda request: overview(ui, request))
    for module in (keys, spend, traces, cache, providers, retrieval):
        module.mount(app, ui)
    return ui


async def overview(ui: GatewayUI, request: Request) -> Response:
    now = time.time()
    rows = await ui.reports.volume(now - 86400, BUCKET_S)
    last_hour = [r for r in rows if r[0] >= now - 3600]
    today = ui.budgets.day()
    spend_today = sum(days.get(today, 0.0) for scope, days in (await ui.spend(today)).items()
                      if scope.startswith("key:"))
    verdicts = {v: n for _, v, n, _ in await ui.reports.cache_verdicts(now - 86400, 86400)}
    asked = sum(verdicts.get(v, 0) for v in ("hit", "stale", "miss", "coalesced"))
    all_keys = await ui.store.list_keys()
    breakers = ui.providers.breaker_states()
    volume = {"series": [{"label": "requests"}, {"label": "errors", "color": "#b42318"}],
              "data": [[r[0] for r in rows], [r[1] for r in rows], [r[2] or 0 for r in rows]] if rows else [],
              "y": "count", "empty": "No request in the last 24 hours."}
    cost = {"series": [{"label": "cost", "bars": True}], "data": [[r[0] for r in rows], [r[3] or 0.0 for r in rows]]
            if rows else [], "y": "usd", "empty": "No request in the last 24 hours."}
    for chart in (volume, cost):
        chart["xrange"] = [now - 86400, now]
    return ui.web.render(
        request, "overview.html", heading="Overview", requests_hour=sum(r[1] for r in last_hour),
        errors_hour=sum(r[2] or 0 for r in last_hour), spend_today=spend_today, today=today,
        hit_rate=(verdicts.get("hit", 0) + verdicts.get("coalesced", 0)) / asked if asked else None,
        active_keys=sum(k.active for k in all_keys), keys=len(all_keys), breakers=breakers,
        state=ui.status(), volume=volume, cost=cost, routes=ui.config.routes)
