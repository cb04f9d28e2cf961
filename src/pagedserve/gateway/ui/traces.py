"""Traces: a filtered, paginated list (key, route, tier, provider, cache verdict, status, latency, cost, time
range), and one trace in full: its provider attempts with their errors and timings, the chunks it retrieved with
their scores, why a cached answer was stale, what it was charged."""
from __future__ import annotations

import re
import time
from urllib.parse import urlencode

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from pagedserve.cluster.ui.web import PREFIX, no_store
from pagedserve.gateway.ui.context import KEY_ID, GatewayUI
from pagedserve.gateway.ui.forms import parse_number, parse_time
from pagedserve.gateway.ui.reports import TraceFilter

PER_PAGE = 50
TRACE_ID = re.compile(r"[0-9a-f]{32}")
STATUS = re.compile(r"ok|4xx|5xx|\d{3}")
CHOICES = ("route", "tier", "provider", "cache")
FILTER_FIELDS = ("key", "route", "tier", "provider", "cache", "status", "min_latency_ms", "min_cost", "since", "until")


def mount(app: FastAPI, ui: GatewayUI) -> None:
    async def traces(request: Request) -> Response:
        params = {name: request.query_params.get(name, "").strip() for name in FILTER_FIELDS}
        tz = ui.config.tz
        where = TraceFilter(
            key_id=params["key"] if KEY_ID.fullmatch(params["key"]) else None,
            status=params["status"] if STATUS.fullmatch(params["status"]) else None,
            min_latency_ms=parse_number(params["min_latency_ms"]), min_cost_usd=parse_number(params["min_cost"]),
            since=parse_time(params["since"], tz), until=parse_time(params["until"], tz),
            **{name: params[name][:128] or None for name in CHOICES})
        page = int(p) if (p := request.query_params.get("page", "1")).isdigit() and 0 < int(p) < 100_000 else 1
        rows, total = await ui.reports.page(where, page, PER_PAGE)
        month = time.time() - 30 * 86400
        choices = {name: await ui.reports.distinct(name, month) for name in CHOICES}
        kept = {k: v for k, v in params.items() if v}
        return ui.web.render(
            request, "traces.html", heading="Traces", rows=rows, total=total, page=page, per_page=PER_PAGE,
            params=params, choices=choices, keys=await ui.store.list_keys(),
            previous=urlencode({**kept, "page": page - 1}) if page > 1 else None,
            next=urlencode({**kept, "page": page + 1}) if page * PER_PAGE < total else None)

    async def trace(request: Request) -> Response:
        trace_id = request.path_params["trace_id"]
        data = await ui.reports.trace(trace_id) if TRACE_ID.fullmatch(trace_id) else None
        if data is None:
            return PlainTextResponse("no such trace (traces older than the retention are deleted)", status_code=404,
                                     headers=no_store())
        return ui.web.render(request, "trace.html", heading=f"Trace {trace_id[:8]}", t=data)

    ui.web.page(app, PREFIX + "/traces", traces)
    ui.web.page(app, PREFIX + "/traces/{trace_id}", trace)
