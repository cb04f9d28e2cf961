"""Stage 1, auth and limits: the API key, the route it may use, the rate limit and the daily budget.

Admission reserves the worst case (tokens and cost) before anything is spent; settle.py replaces the
reservation with what the request actually used.
"""
from __future__ import annotations

from dataclasses import replace

from fastapi import Request

from pagedserve.gateway.auth import ApiKey, bearer_token, hash_key
from pagedserve.gateway.budget import BudgetExceeded, BudgetKeeper
from pagedserve.gateway.call import Call
from pagedserve.gateway.errors import APIError
from pagedserve.gateway.gateway_config import GatewayConfig, RouteConfig
from pagedserve.gateway.limits import RateLimiter
from pagedserve.gateway.protocol import parse_request
from pagedserve.gateway.store import Store
from pagedserve.gateway.tracing import Trace

FORWARDED_HEADERS = ("x-session-id", "x-client-region")


class Admission:
    def __init__(self, config: GatewayConfig, store: Store, limiter: RateLimiter, budgets: BudgetKeeper):
        self.config = config
        self.store = store
        self.limiter = limiter
        self.budgets = budgets

    async def authenticate(self, request: Request) -> ApiKey:
        token = bearer_token(request.headers.get("authorization"))
        if token is None:
            raise APIError(401, "You didn't provide an API key: send 'Authorization: Bearer <key>'.",
                           code="missing_api_key")
        key = await self.store.key_by_hash(hash_key(token))
        if key is None or not key.active:
            raise APIError(401, "Incorrect API key provided" + (" (it was revoked)" if key else "") + ".",
                           code="invalid_api_key")
        d = self.config.key_defaults
        return replace(key, rpm=_first(key.rpm, d.rpm), tpm=_first(key.tpm, d.tpm),
                       daily_budget_usd=_first(key.daily_budget_usd, d.daily_budget_usd))

    async def admit(self, request: Request, kind: str, trace: Trace) -> Call:
        key = await self.authenticate(request)
        trace.key_id, trace.user, trace.team = key.key_id, key.user, key.team
        req, body = parse_request(await read_body(request, self.config.max_body_bytes), kind)
        trace.stream = req.stream
        route = self.config.routes.get(req.model)
        if route is None:
            raise APIError(404, f"The model '{req.model}' does not exist; this gateway serves "
                                f"{sorted(self.config.routes)}.", code="model_not_found", param="model")
        trace.route = route.name
        if not key.allows(route.name):
            raise APIError(403, f"API key {key.key_id} may not use the model '{route.name}'.",
                           code="model_not_allowed", param="model")
        cap = route.max_tokens or self.config.default_max_tokens
        if req.unbounded:
            body[req.limit_field] = req.completion_limit(cap)  # sent, so the provider cannot pass the bound below
        prompt_tokens, completion = req.prompt_bound(), req.completion_bound(cap)
        decision = await self.limiter.admit(key, prompt_tokens + completion)
        if not decision.allowed:
            raise APIError(429, decision.message, code="rate_limit_exceeded", headers=decision.headers)
        call = Call(kind, key, route, req, body, trace, prompt_tokens + completion, prompt_tokens,
                    headers=decision.headers)
        try:
            call.hold = await self.budgets.reserve(key, self.cost_estimate(route, prompt_tokens, completion))
        except BudgetExceeded as e:
            await self.limiter.settle(key, call.tokens_estimate, 0)
            raise APIError(429, str(e), code="budget_exceeded", kind="insufficient_quota") from None
        trace.budget_spent_usd, trace.budget_limit_usd = call.hold.spent_before[1], call.hold.limits[1]
        call.forward_headers = {"x-request-id": trace.trace_id}
        call.forward_headers.update({h: request.headers[h] for h in FORWARDED_HEADERS if h in request.headers})
        if key.residency:
            call.forward_headers["x-residency"] = key.residency
        return call

    def cost_estimate(self, route: RouteConfig, prompt_tokens: int, completion_tokens: int) -> float:
        """The worst case: both token bounds priced at the dearest model the route may fall back to."""
        return max(self.config.target_price(t).cost(prompt_tokens, completion_tokens) for t in route.small + route.large)


def _first(value, default):
    return default if value is None else value


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 as soon as it passes `limit` (chunked bodies too: counted while read)."""
    length = request.headers.get("content-length")
    if length and length.isdigit() and int(length) > limit:
        raise APIError(413, f"request body of {length} bytes exceeds the gateway's limit of {limit} bytes",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"request body exceeds the gateway's limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)
