"""The admin API (/admin/...): keys, knowledge-source versions, usage, traces and provider status, all behind
the gateway's admin key."""
from __future__ import annotations

import json
import time
from collections.abc import Callable

from fastapi import FastAPI, Request

from pagedserve.gateway.admission import read_body
from pagedserve.gateway.auth import bearer_token, is_admin, mint_key
from pagedserve.gateway.budget import BudgetKeeper
from pagedserve.gateway.errors import APIError
from pagedserve.gateway.gateway_config import GatewayConfig
from pagedserve.gateway.store import Store
from pagedserve.gateway.tracing import TraceSink


def add_admin_routes(app: FastAPI, config: GatewayConfig, store: Store, budgets: BudgetKeeper, traces: TraceSink,
                     status_of: Callable[[], dict]) -> None:
    def admin(request: Request) -> None:
        if not is_admin(bearer_token(request.headers.get("authorization")), config.admin_key):
            raise APIError(401, "this endpoint needs the gateway's admin key", code="invalid_admin_key")

    async def json_body(request: Request) -> dict:
        try:
            data = json.loads(await read_body(request, config.max_body_bytes) or b"{}")
        except ValueError:
            raise APIError(400, "request body is not valid JSON", code="invalid_json") from None
        if not isinstance(data, dict):
            raise APIError(400, "request body must be a JSON object", code="invalid_json")
        return data

    @app.post("/admin/keys")
    async def create_key(request: Request) -> dict:
        admin(request)
        data = await json_body(request)
        if not isinstance(data.get("user"), str) or not data["user"]:
            raise APIError(400, "'user' is a required property", param="user")
        allowed = {"team", "models", "residency", "rpm", "tpm", "daily_budget_usd"}
        unknown = set(data) - allowed - {"user"}
        if unknown:
            raise APIError(400, f"Unrecognized argument(s): {sorted(unknown)}", param=min(unknown))
        try:
            token, key = mint_key(data["user"], **{k: v for k, v in data.items() if k in allowed})
        except TypeError as e:
            raise APIError(400, str(e)) from None
        await store.put_key(key)
        return {"key": token, **key.public()}

    @app.get("/admin/keys")
    async def list_keys(request: Request) -> dict:
        admin(request)
        return {"data": [k.public() for k in await store.list_keys()]}

    @app.delete("/admin/keys/{key_id}")
    async def revoke_key(key_id: str, request: Request) -> dict:
        admin(request)
        if not await store.revoke_key(key_id):
            raise APIError(404, f"no key with id {key_id!r}", code="key_not_found")
        return {"key_id": key_id, "revoked": True}

    @app.post("/admin/sources/{name}/bump")
    async def bump_source(name: str, request: Request) -> dict:
        admin(request)
        version = (await json_body(request)).get("version")
        return {"name": name, "version": await store.bump_source(name, str(version) if version else None)}

    @app.get("/admin/sources")
    async def list_sources(request: Request) -> dict:
        admin(request)
        return {"data": await store.list_sources()}

    @app.get("/admin/usage")
    async def show_usage(request: Request, day: str | None = None) -> dict:
        admin(request)
        return {"timezone": config.timezone, "today": budgets.day(), "data": await budgets.usage(day)}

    @app.get("/admin/traces")
    async def list_traces(request: Request, limit: int = 20, key_id: str | None = None, user: str | None = None) -> dict:
        admin(request)
        return {"data": traces.recent(min(max(limit, 1), 1000), key_id, user)}

    @app.get("/admin/status")
    async def show_status(request: Request) -> dict:
        admin(request)
        return {**status_of(), "time": time.time()}
