"""The semantic cache: hit, stale and miss rates over time (from the traces' verdicts), the near-miss guard's
rejections (counted in the traces; the latest question pairs from the cache's memory), live entries per source
and version against each source's current version, the latest entries, and a button per source that bumps its
version, so every answer cached against an earlier one is stale from then on."""
from __future__ import annotations

import time
from urllib.parse import urlencode

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse, Response

from pagedserve.cluster.ui.web import PREFIX, no_store
from pagedserve.gateway.admin import SOURCE
from pagedserve.gateway.ui.context import GatewayUI
from pagedserve.gateway.ui.reports import VERDICTS

WINDOWS = {"1h": (3600, 300), "24h": (86400, 3600), "7d": (7 * 86400, 6 * 3600)}  # span, bucket


def mount(app: FastAPI, ui: GatewayUI) -> None:
    async def cache(request: Request) -> Response:
        window = request.query_params.get("window", "24h")
        span, bucket = WINDOWS.get(window, WINDOWS["24h"])
        rows = await ui.reports.cache_verdicts(time.time() - span, bucket)
        rates, guard, totals = verdict_charts(rows)
        for chart in (rates, guard):
            chart["xrange"] = [time.time() - span, time.time()]
        entries = await ui.reports.entries_by_source()
        known = set(await ui.store.list_sources()) | {s for r in ui.config.routes.values() for s in r.sources} | {
            r.retrieval.source for r in ui.config.routes.values() if r.retrieval} | {s for s, _, _ in entries}
        known.discard("(none)")
        current = await ui.store.source_versions(sorted(known))
        bumped = request.query_params.get("bumped", "")
        return ui.web.render(
            request, "cache.html", heading="Cache", window=window if window in WINDOWS else "24h", windows=WINDOWS,
            rates=rates, guard=guard, totals=totals, entries=entries, current=current,
            size=len(ui.cache) if ui.cache is not None else None, threshold=ui.config.cache.threshold,
            rejections=list(reversed(ui.cache.rejections)) if ui.cache is not None else [],
            recent=await ui.reports.recent_entries(), bumped=bumped if bumped in current else None)

    async def invalidate(request: Request) -> Response:
        name = request.path_params["name"]
        if not SOURCE.fullmatch(name):
            return RedirectResponse(f"{PREFIX}/cache", status_code=303, headers=no_store())
        await ui.store.bump_source(name)
        return RedirectResponse(f"{PREFIX}/cache?{urlencode({'bumped': name})}", status_code=303, headers=no_store())

    ui.web.page(app, PREFIX + "/cache", cache)
    ui.web.action(app, PREFIX + "/cache/sources/{name:path}/invalidate", invalidate)  # names may hold a /


def verdict_charts(rows: list[tuple[int, str, int, int]]) -> tuple[dict, dict, dict]:
    """Hit / stale / miss / coalesced as shares of the cache's answers per bucket, the guard's rejections per
    bucket, and the window's totals per verdict."""
    buckets = sorted({r[0] for r in rows})
    counts = {(b, v): n for b, v, n, _ in rows}
    rejected = {}
    for b, _, _, g in rows:
        rejected[b] = rejected.get(b, 0) + (g or 0)
    totals = {v: sum(n for (_, verdict), n in counts.items() if verdict == v) for v in {r[1] for r in rows}}
    asked = [sum(counts.get((b, v), 0) for v in VERDICTS) for b in buckets]
    shown = [b for b, n in zip(buckets, asked) if n]
    data = [shown] + [[counts.get((b, v), 0) / n for b, n in zip(buckets, asked) if n] for v in VERDICTS]
    colors = {"hit": "#16794a", "stale": "#9a6700", "miss": "#b42318", "coalesced": "#2457c5"}
    rates = {"series": [{"label": v, "color": colors[v]} for v in VERDICTS], "data": data if shown else [],
             "y": "ratio", "empty": "No cacheable request in this window."}
    guard = {"series": [{"label": "rejected by the guard", "bars": True}],
             "data": [buckets, [rejected[b] for b in buckets]] if any(rejected.values()) else [], "y": "count",
             "empty": "The guard refused nothing in this window."}
    return rates, guard, totals
