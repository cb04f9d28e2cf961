"""Spend: one key's or user's daily cost over the last 30 days against its daily budget (the store's figures, the
ones budgets are enforced on), and cost by key, user, team, route and model, today and over 30 days (keys and
users from the store; teams, routes and models from the traces, which record each request's cost)."""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import Response

from pagedserve.cluster.ui.web import PREFIX
from pagedserve.gateway.ui.context import GatewayUI

DAYS = 30
TOP = 6  # series per chart; the rest are summed as "other"


def mount(app: FastAPI, ui: GatewayUI) -> None:
    async def spend(request: Request) -> Response:
        days = ui.reports.days(DAYS)
        today = days[-1]
        x = [ui.reports.midnight(d) for d in days]
        by_scope = await ui.spend()
        keys = await ui.store.list_keys()
        users = sorted({k.user for k in keys} | {s[5:] for s in by_scope if s.startswith("user:")})
        limits = {f"key:{k.key_id}": ui.key_budget(k) for k in keys} | {
            f"user:{u}": ui.config.budgets.for_user(u) for u in users}
        labels = {f"key:{k.key_id}": f"key {k.key_id} ({k.user})" for k in keys} | {f"user:{u}": f"user {u}" for u in users}
        scope = request.query_params.get("scope", "")
        if scope not in labels:  # the busiest key today, else the first
            spent = sorted(((v.get(today, 0.0), s) for s, v in by_scope.items() if s.startswith("key:")), reverse=True)
            scope = spent[0][1] if spent else next(iter(labels), "")
        daily = by_scope.get(scope, {})
        series, data = [{"label": "spend", "bars": True}], [x, [daily.get(d, 0.0) for d in days]]
        if limits.get(scope) is not None:
            series.append({"label": "daily budget", "color": "#b42318", "dash": True})
            data.append([limits[scope]] * len(days))
        xrange = [x[0] - 43200, x[-1] + 43200]  # half a day either side: the first and last bars show whole
        scope_chart = {"series": series, "data": data, "y": "usd", "empty": "No spend in 30 days.", "xrange": xrange}
        breakdowns = {}
        for dimension in ("team", "route", "model"):
            per_day = await ui.reports.cost_by(dimension, DAYS)
            breakdowns[dimension] = breakdown(per_day, days, x)
            breakdowns[dimension]["chart"]["xrange"] = xrange
        rows = [{"scope": s, "label": labels.get(s, s), "today": by_scope.get(s, {}).get(today, 0.0),
                 "month": sum(v for d, v in by_scope.get(s, {}).items() if d >= days[0]), "limit": limits.get(s)}
                for s in labels]
        return ui.web.render(request, "spend.html", heading="Spend", today=today, scope=scope, labels=labels,
                             scope_chart=scope_chart, breakdowns=breakdowns, rows=rows, timezone=ui.config.timezone)

    ui.web.page(app, PREFIX + "/spend", spend)


def breakdown(per_day: dict[str, dict[str, tuple[float, int]]], days: list[str], x: list[float]) -> dict:
    """Today's and the month's cost and requests per value, and a chart of the top values' daily cost."""
    month: dict[str, list] = {}
    for day, values in per_day.items():
        for name, (cost, count) in values.items():
            row = month.setdefault(name, [0.0, 0, 0.0, 0])
            row[2] += cost
            row[3] += count
            if day == days[-1]:
                row[0] += cost
                row[1] += count
    ranked = sorted(month, key=lambda n: month[n][2], reverse=True)
    top, rest = ranked[:TOP], ranked[TOP:]
    data = [x] + [[per_day.get(d, {}).get(n, (0.0, 0))[0] for d in days] for n in top]
    series = [{"label": n} for n in top]
    if rest:
        data.append([sum(per_day.get(d, {}).get(n, (0.0, 0))[0] for n in rest) for d in days])
        series.append({"label": "other"})
    rows = [{"name": n, "today": month[n][0], "today_requests": month[n][1], "month": month[n][2],
             "month_requests": month[n][3]} for n in ranked]
    return {"rows": rows, "chart": {"series": series, "data": data if top else [], "y": "usd",
                                    "empty": "No request in 30 days."}}
