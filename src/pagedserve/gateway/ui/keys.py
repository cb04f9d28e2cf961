"""Keys and teams: every key with its limits, budget and today's spend; create one (its secret shown once, in
that answer only), edit a key's team, routes, residency, limits and budget, revoke it. Teams are the keys' `team`
(the semantic cache's tenant): their keys, users and today's cost."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from fastapi import FastAPI, Request
from fastapi.responses import RedirectResponse, Response

from pagedserve.cluster.ui.web import PREFIX, no_store
from pagedserve.gateway.auth import ApiKey, mint_key
from pagedserve.gateway.ui.context import KEY_ID, GatewayUI
from pagedserve.gateway.ui.forms import KEY_FIELDS, read_key_form

EMPTY_FORM = dict.fromkeys(KEY_FIELDS, "")
SENT_ALREADY = ("This form was sent already: the key it made keeps its secret to that first answer. Create another "
                "if it was lost.")


def mount(app: FastAPI, ui: GatewayUI) -> None:
    async def page(request: Request, status: int = 200, **context) -> Response:
        keys = await ui.store.list_keys()
        today = ui.budgets.day()
        spend = await ui.spend(today)
        team_cost = (await ui.reports.cost_by("team", 1)).get(today, {})
        said = {name: value for name in ("saved", "revoked")  # after a redirect: which key; nothing else is echoed
                if KEY_ID.fullmatch(value := request.query_params.get(name, ""))}
        context = {"form": EMPTY_FORM, "errors": [], "secret": None, "created": None, "edit": None,
                   "edit_errors": [], "saved": said.get("saved"), "revoked": said.get("revoked"), **context}
        return ui.web.render(request, "keys.html", status, heading="Keys & teams", keys=keys, today=today,
                             spend={k.key_id: spend.get(f"key:{k.key_id}", {}).get(today, 0.0) for k in keys},
                             budgets={k.key_id: ui.key_budget(k) for k in keys}, defaults=ui.config.key_defaults,
                             teams=teams(keys, team_cost), routes=sorted(ui.config.routes), **context)

    async def keys(request: Request) -> Response:
        return await page(request)

    async def create(request: Request) -> Response:
        if not ui.web.first_send(request):
            return await page(request, 409, errors=[SENT_ALREADY])
        form = read_key_form(request.state.form)
        if form.key is None:
            return await page(request, 400, form=form.values, errors=form.errors)
        fields = form.key.model_dump()
        token, key = mint_key(fields.pop("user"), **fields)
        await ui.store.put_key(key)
        return await page(request, secret=token, created=key)  # the only answer that ever holds the secret

    async def edit(request: Request) -> Response:
        key = await ui.key(request.path_params["key_id"])
        if key is None or not key.active:
            return await page(request, 404, errors=["no active key with that id"])
        form = read_key_form(request.state.form, user=key.user)
        if form.key is None:
            return await page(request, 400, edit=key.key_id, edit_errors=form.errors)
        fields = form.key.model_dump(exclude={"user"})
        current = await ui.key(key.key_id)  # read again: a revocation in between must stand
        await ui.store.put_key(replace(current, **fields))
        return RedirectResponse(f"{PREFIX}/keys?saved={key.key_id}", status_code=303, headers=no_store())

    async def revoke(request: Request) -> Response:
        key = await ui.key(request.path_params["key_id"])
        if key is None or not await ui.store.revoke_key(key.key_id):
            return await page(request, 404, errors=["no key with that id"])
        return RedirectResponse(f"{PREFIX}/keys?revoked={key.key_id}", status_code=303, headers=no_store())

    ui.web.page(app, PREFIX + "/keys", keys)
    ui.web.action(app, PREFIX + "/keys", create)
    ui.web.action(app, PREFIX + "/keys/{key_id}/limits", edit)
    ui.web.action(app, PREFIX + "/keys/{key_id}/revoke", revoke)


@dataclass(slots=True)
class Team:
    name: str
    keys: int = 0
    active: int = 0
    users: set[str] = field(default_factory=set)
    cost: float = 0.0  # today
    requests: int = 0


def teams(keys: list[ApiKey], cost_today: dict[str, tuple[float, int]]) -> list[Team]:
    """One row per team (keys without one under "(none)"): keys active and in all, users, today's cost."""
    rows: dict[str, Team] = {}
    for key in keys:
        team = rows.setdefault(key.team or "(none)", Team(key.team or "(none)"))
        team.keys += 1
        team.active += key.active
        team.users.add(key.user)
    for team in rows.values():
        team.cost, team.requests = cost_today.get(team.name, (0.0, 0))
    return sorted(rows.values(), key=lambda t: t.name)
