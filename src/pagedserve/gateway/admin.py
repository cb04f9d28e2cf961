"""The admin API (/admin/...): keys, knowledge-source versions, usage, traces and provider status, all behind
the gateway's admin key. Bodies and parameters are validated by admin_models.py (400 in OpenAI's shape)."""
from __future__ import annotations

import re
import time
from collections.abc import Callable
from typing import TypeVar

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError

from pagedserve.gateway.admin_models import KeyCreate, SourceBump
from pagedserve.gateway.admission import read_body
from pagedserve.gateway.auth import bearer_token, is_admin, mint_key
from pagedserve.gateway.budget import BudgetKeeper
from pagedserve.gateway.errors import APIError
from pagedserve.gateway.gateway_config import GatewayConfig
from pagedserve.gateway.protocol import load_json_object, validation_error
from pagedserve.gateway.store import Store
from pagedserve.gateway.tracing import TraceSink

M = TypeVar("M", bound=BaseModel)
SOURCE = re.compile(r"[\w.:/-]{1,128}")
DAY = re.compile(r"\d{4}-\d{2}-\d{2}")


def add_admin_routes(app: FastAPI, config: GatewayConfig, store: Store, budgets: BudgetKeeper, traces: TraceSink,
                     status_of: Callable[[], dict]) -> None:
    def admin(request: Request) -> None:
        if not is_admin(bearer_token(request.headers.get("authorization")), config.admin_key):
            raise APIError(401, "this endpoint needs the gateway's admin key", code="invalid_admin_key")

    async def body_as(request: Request, model: type[M]) -> M:
        raw = await read_body(request, config.max_body_bytes)
        try:
            return model.model_validate(load_json_object(raw) if raw.strip() else {})
        except ValidationError as e:
            raise validation_error(e) from None

    @app.post("/admin/keys")
    async def create_key(request: Request) -> dict:
        admin(request)
        fields = (await body_as(request, KeyCreate)).model_dump()
        token, key = mint_key(fields.pop("user"), **fields)
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
        if not SOURCE.fullmatch(name):
            raise APIError(400, "a source name is 1-128 letters, digits or . : / _ -", param="name",
                           code="invalid_value")
        version = (await body_as(request, SourceBump)).version
        return {"name": name, "version": await store.bump_source(name, None if version is None else str(version))}

    @app.get("/admin/sources")
    async def list_sources(request: Request) -> dict:
        admin(request)
        return {"data": await store.list_sources()}

    @app.get("/admin/usage")
    async def show_usage(request: Request, day: str | None = None) -> dict:
        admin(request)
        if day is not None and not DAY.fullmatch(day):
            raise APIError(400, "day must be YYYY-MM-DD", param="day", code="invalid_value")
        return {"timezone": config.timezone, "today": budgets.day(), "data": await budgets.usage(day)}

    @app.get("/admin/traces")
    async def list_traces(request: Request, limit: int = 20, key_id: str | None = None, user: str | None = None) -> dict:
        admin(request)
        return {"data": traces.recent(min(max(limit, 1), 1000), key_id, user)}

    @app.get("/admin/status")
    async def show_status(request: Request) -> dict:
        admin(request)
        return {**status_of(), "time": time.time()}
