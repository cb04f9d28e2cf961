"""The gateway: an OpenAI-compatible service in front of providers.

One request: auth -> rate limit -> daily budget (estimate) -> semantic cache (fresh?) -> difficulty route
-> provider call (timeout, retry, fallback, breaker) -> settle budget and limits -> trace -> cache.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable
from dataclasses import dataclass, field, replace

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from pagedserve.gateway.auth import ApiKey, bearer_token, hash_key, is_admin, mint_key
from pagedserve.gateway.budget import BudgetExceeded, BudgetHold, BudgetKeeper
from pagedserve.gateway.errors import APIError, install_error_handlers
from pagedserve.gateway.gateway_config import GatewayConfig, RouteConfig, Target
from pagedserve.gateway.limits import RateLimiter
from pagedserve.gateway.protocol import GatewayRequest, parse_request
from pagedserve.gateway.providers import (
    AllProvidersFailed,
    CallResult,
    ProviderPool,
    StreamFailed,
    StreamResult,
    UpstreamRejected,
)
from pagedserve.gateway.semantic_cache import Lookup, SemanticCache, normalise, scope_key
from pagedserve.gateway.store import Store, open_store
from pagedserve.gateway.streaming import DONE, StreamAssembler, replay, replay_chunks, sse
from pagedserve.gateway.tracing import Trace, TraceSink

log = logging.getLogger(__name__)

PATHS = {"chat": "/chat/completions", "completions": "/completions"}
FORWARDED_HEADERS = ("x-session-id", "x-client-region")


@dataclass(slots=True)
class Call:
    """One admitted request on its way through the gateway."""
    kind: str
    key: ApiKey
    route: RouteConfig
    request: GatewayRequest
    body: dict
    trace: Trace
    tokens_estimate: int
    hold: BudgetHold | None = None
    headers: dict[str, str] = field(default_factory=dict)
    forward_headers: dict[str, str] = field(default_factory=dict)
    query: str | None = None
    scope: str | None = None
    vector: np.ndarray | None = None
    versions: dict[str, str] = field(default_factory=dict)
    lookup: Lookup | None = None
    tier: str = "small"


@dataclass(slots=True)
class Speculation:
    """A provider call started before the cache and the classifier have spoken."""
    tier: str
    task: asyncio.Task
    sent: asyncio.Event

    async def on_the_wire(self, patience_s: float = 0.025) -> None:
        """Returns once the request has been written to a provider (or the call ended without that, or a slow
        connect took patience_s). Only then may the query embedding start: its thread would otherwise hold the
        GIL while the request is built."""
        waiter = asyncio.ensure_future(self.sent.wait())
        try:
            await asyncio.wait({waiter, self.task}, timeout=patience_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()

    async def cancel(self) -> None:
        """Stops the call (an open upstream stream is closed, which aborts it at a pagedserve provider)."""
        self.task.cancel()
        try:
            result = await self.task
        except (asyncio.CancelledError, UpstreamRejected, AllProvidersFailed):  # nobody wants its answer
            return
        if isinstance(result, StreamResult):
            await result.events.aclose()


class Gateway:
    def __init__(self, config: GatewayConfig, store: Store | None = None, embedder=None, span_exporter=None):
        self.config = config
        self.store = store or open_store(config.store, config.sqlite_path)
        self.limiter = RateLimiter(self.store)
        self.budgets = BudgetKeeper(self.store, config.tz, config.budgets)
        self.providers = ProviderPool(config)
        self.traces = TraceSink(config.data_dir / "traces.db", config.otlp_endpoint, span_exporter,
                                config.trace_retention_days)
        needs_classifier = any(r.large for r in config.routes.values())
        self.embedder = embedder if embedder is not None else self._load_embedder(config, needs_classifier)
        self.cache = SemanticCache(config.data_dir / "cache.db", self.embedder.dim) if config.cache.enabled else None
        self.classifier = None
        if needs_classifier:
            from pagedserve.gateway.classify import load_or_train

            self.classifier = load_or_train(self.embedder)
        self._vectors: OrderedDict[str, np.ndarray] = OrderedDict()
        self._background: set[asyncio.Task] = set()
        log.info("gateway ready: routes %s, providers %s, store %s, cache %s, classifier %s", sorted(config.routes),
                 sorted(config.providers), config.store, f"{len(self.cache)} entries" if self.cache else "off",
                 "on" if self.classifier else "off")

    @staticmethod
    def _load_embedder(config: GatewayConfig, needs_classifier: bool):
        if not (config.cache.enabled or needs_classifier):
            return None
        import torch

        from pagedserve.embedding import Embedder

        torch.set_num_threads(config.embed_threads)  # one short query at a time: more threads only contend
        return Embedder.load().fast()  # fp16-weight kernels: same vectors (cosine > 0.9999), ~2x faster

    async def close(self) -> None:
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.providers.close()
        await self.store.close()
        self.traces.close()
        if self.cache is not None:
            self.cache.close()

    # ---- admission ----

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
        completion = req.completion_limit(self.config.default_max_tokens)
        prompt_tokens = math.ceil(req.prompt_chars() / 4)
        decision = await self.limiter.admit(key, prompt_tokens + completion)
        if not decision.allowed:
            raise APIError(429, decision.message, code="rate_limit_exceeded", headers=decision.headers)
        call = Call(kind, key, route, req, body, trace, prompt_tokens + completion, headers=decision.headers)
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
        """The dearest model the route may end up on: the reservation must cover any fallback."""
        return max(self.config.target_price(t).cost(prompt_tokens, completion_tokens) for t in route.small + route.large)

    # ---- cache and route ----

    async def vector(self, text: str) -> np.ndarray:
        text = normalise(text)
        cached = self._vectors.get(text)
        if cached is None:
            cached = (await asyncio.to_thread(self.embedder.embed, [text]))[0]
            self._vectors[text] = cached
            if len(self._vectors) > 4096:
                self._vectors.popitem(last=False)
        else:
            self._vectors.move_to_end(text)
        return cached

    def cacheable(self, call: Call) -> bool:
        """Whether the cache is consulted for this request; if not, says why in the trace."""
        req, trace = call.request, call.trace
        if self.cache is None:
            trace.cache = "off"
            return False
        call.query, context = req.query()
        if not req.cache or call.query is None or (self.config.cache.deterministic_only and not req.deterministic):
            trace.cache = "bypass"
            return False
        tenant = {"team": call.key.team, "user": call.key.user, "key": call.key.key_id}[self.config.cache.scope]
        call.scope = scope_key(tenant, call.route.name, call.body, context)
        return True

    async def look_up(self, call: Call) -> None:
        req, trace = call.request, call.trace
        call.versions = await self.store.source_versions(sorted(set(call.route.sources) | set(req.sources)))
        trace.sources = call.versions
        call.vector = await self.vector(call.query)
        threshold = call.route.cache_threshold or self.config.cache.threshold
        call.lookup = self.cache.lookup(call.scope, call.vector, threshold, call.versions,
                                        req.max_completion_tokens or req.max_tokens, normalise(call.query))
        trace.cache, trace.cache_similarity = call.lookup.result, call.lookup.similarity
        trace.stale_reason = call.lookup.stale_reason

    def classifies(self, call: Call) -> bool:
        return call.request.route is None and bool(call.route.large) and self.classifier is not None

    async def choose_tier(self, call: Call) -> None:
        req, trace = call.request, call.trace
        if req.route is not None:
            call.tier, trace.pinned = req.route, True
        elif self.classifies(call):
            text = call.query if call.query is not None else req.query()[0]
            if text:
                score = self.classifier.score(normalise(text), await self.vector(text))
                trace.classifier_score = round(score, 4)
                call.tier = "large" if score >= call.route.hard_threshold else "small"
        trace.tier = call.tier

    def speculate(self, call: Call, cacheable: bool) -> Speculation | None:
        """Starts the likely tier's call now, when the cache lookup or the classifier would otherwise delay it:
        the pinned tier, else the classifier's lexical guess."""
        if not call.route.speculate or not (cacheable or self.classifies(call)):
            return None
        tier, sent = call.request.route or "small", asyncio.Event()
        text = call.query if call.query is not None else call.request.query()[0]
        if text and self.classifies(call):
            tier = "large" if self.classifier.guess(normalise(text)) >= call.route.hard_threshold else "small"
        task = asyncio.get_running_loop().create_task(self.upstream(call, call.route.tier(tier), sent))
        return Speculation(tier, task, sent)

    def upstream(self, call: Call, targets: list[Target],
                 sent: asyncio.Event | None = None) -> Awaitable[CallResult | StreamResult]:
        if call.request.stream:
            options = {**(call.body.get("stream_options") or {}), "include_usage": True}
            return self.providers.stream(targets, PATHS[call.kind], {**call.body, "stream_options": options},
                                         call.forward_headers, sent)
        return self.providers.call(targets, PATHS[call.kind], call.body, call.forward_headers, sent)

    def cancel(self, speculation: Speculation, why: str, trace: Trace) -> None:
        # "discarded": the provider had already answered, so its work (and an external API's bill) was spent.
        done = speculation.task.done() and not speculation.task.cancelled()
        trace.speculative = f"{'discarded' if done else 'cancelled'} ({why})"
        self._spawn(speculation.cancel())

    def _spawn(self, work: Awaitable) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- the call ----

    async def handle(self, request: Request, kind: str) -> Response:
        trace = Trace(endpoint=kind)
        call = speculation = None
        try:
            call = await self.admit(request, kind, trace)
            cacheable = self.cacheable(call)
            speculation = self.speculate(call, cacheable)
            if speculation is not None:
                await speculation.on_the_wire()
            if cacheable:
                await self.look_up(call)
                if call.lookup.result == "hit":
                    if speculation is not None:
                        self.cancel(speculation, "cache hit", trace)
                        speculation = None
                    return await self.answer_from_cache(call)
            await self.choose_tier(call)
            pending = None
            if speculation is not None:
                if speculation.tier == call.tier:
                    pending, trace.speculative = speculation.task, "used"
                else:
                    self.cancel(speculation, f"{call.tier} tier", trace)
                speculation = None
            targets = call.route.tier(call.tier)
            try:
                result = await (pending or self.upstream(call, targets))
            except (UpstreamRejected, AllProvidersFailed) as e:
                raise self.provider_error(call, e) from None
            call.trace.attempts = [a.to_dict() for a in result.attempts]
            if isinstance(result, StreamResult):
                return StreamingResponse(self.relay(call, result.target, result.events),
                                         media_type="text/event-stream", headers=self.response_headers(call, result.target))
            return await self.complete(call, result)
        except Exception as e:
            if call is not None:
                await self.settle(call, None, {})
            trace.finish(e.status if isinstance(e, APIError) else 500, str(e))
            self.traces.write(trace)
            raise
        finally:
            if speculation is not None:  # the lookup or the classifier failed
                self.cancel(speculation, "error", trace)

    async def complete(self, call: Call, result: CallResult) -> Response:
        await self.settle(call, result.target, result.body.get("usage") or {})
        call.trace.finish(200)
        self.traces.write(call.trace)
        task = BackgroundTask(self.remember, call, result.body)
        return JSONResponse(result.body, headers=self.response_headers(call, result.target), background=task)

    async def relay(self, call: Call, target: Target, events):
        """Passes the provider's events through; a failure after the first one ends the stream with an error."""
        wants_usage = bool((call.body.get("stream_options") or {}).get("include_usage"))
        assembled = StreamAssembler(call.kind)
        status, error = 499, "the client closed the stream"  # until the stream ends one way or another
        try:
            async for data in events:
                event = json.loads(data)
                if "error" in event:
                    err = event["error"]
                    status, error = 502, str(err.get("message") if isinstance(err, dict) else err)
                    yield sse(data)
                    return
                assembled.add(event)
                if not wants_usage:
                    if not event.get("choices"):
                        continue
                    if event.get("usage") is not None:
                        event.pop("usage")
                        data = json.dumps(event)
                yield sse(data)
            status, error = 200, None
            yield DONE
        except (StreamFailed, ValueError) as e:  # no second provider may continue a text the client has seen
            status, error = 502, f"the provider {target.label} failed after the stream started: {e!r}"
            log.warning("%s", error)
            yield sse(APIError(502, error, code="upstream_stream_error").body())
        finally:
            self._spawn(self.finish_stream(call, target, assembled, status, error))

    async def finish_stream(self, call: Call, target: Target, assembled: StreamAssembler, status: int,
                            error: str | None) -> None:
        usage = assembled.usage or {"prompt_tokens": call.tokens_estimate - call.request.completion_limit(
            self.config.default_max_tokens), "completion_tokens": assembled.chunks}
        await self.settle(call, target, usage)
        call.trace.finish(status, error)
        self.traces.write(call.trace)
        if status == 200 and assembled.finish_reason is not None:
            self.remember(call, assembled.body())

    def provider_error(self, call: Call, e: UpstreamRejected | AllProvidersFailed) -> APIError:
        call.trace.attempts = [a.to_dict() for a in e.attempts]
        if isinstance(e, UpstreamRejected):
            err = e.body.get("error") if isinstance(e.body.get("error"), dict) else {"message": str(e.body)}
            return APIError(e.status, str(err.get("message")), code=err.get("code"), param=err.get("param"),
                            kind=err.get("type"))
        tried = any(a.status != "circuit_open" for a in e.attempts)
        return APIError(502 if tried else 503, str(e), code="providers_failed" if tried else "providers_unavailable")

    async def settle(self, call: Call, target: Target | None, usage: dict) -> None:
        """Real cost and tokens replace the estimates taken at admission (zero when nothing was served)."""
        trace = call.trace
        trace.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        trace.completion_tokens = int(usage.get("completion_tokens") or 0)
        trace.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        if target is not None:
            price = self.config.target_price(target)
            trace.provider, trace.upstream_model = target.provider, price.name
            trace.cost_usd = round(price.cost(trace.prompt_tokens, trace.completion_tokens, trace.cached_tokens), 9)
        if call.hold is not None:
            await self.budgets.settle(call.hold, trace.cost_usd)
            call.hold = None
        await self.limiter.settle(call.key, call.tokens_estimate, trace.prompt_tokens + trace.completion_tokens)

    def remember(self, call: Call, body: dict) -> None:
        """Caches a fresh answer against the source versions current when it was asked."""
        if call.scope is None or call.vector is None:
            return
        choice = (body.get("choices") or [{}])[0]
        ttl = call.route.cache_ttl_s or self.config.cache.ttl_s
        self.cache.put(call.scope, call.query, call.vector, body, call.versions, ttl,
                       call.request.max_completion_tokens or call.request.max_tokens, choice.get("finish_reason"),
                       int((body.get("usage") or {}).get("completion_tokens") or 0))

    async def answer_from_cache(self, call: Call) -> Response:
        await self.settle(call, None, {})
        call.trace.finish(200)
        self.traces.write(call.trace)
        body = replay(call.lookup.entry.response, call.kind)
        headers = self.response_headers(call, None)
        if call.request.stream:
            wants_usage = bool((call.body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(iter(replay_chunks(body, call.kind, wants_usage)),
                                     media_type="text/event-stream", headers=headers)
        return JSONResponse(body, headers=headers)

    def response_headers(self, call: Call, target: Target | None) -> dict[str, str]:
        headers = {**call.headers, "x-gateway-trace-id": call.trace.trace_id, "x-gateway-cache": str(call.trace.cache),
                   "x-gateway-tier": call.tier}
        if target is not None:
            headers["x-gateway-provider"] = target.label
        return headers


def _first(value, default):
    return default if value is None else value


async def read_body(request: Request, limit: int) -> bytes:
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


def create_app(config: GatewayConfig, gateway: Gateway | None = None, **kwargs) -> FastAPI:
    gw = gateway or Gateway(config, **kwargs)
    app = FastAPI(title="pagedserve gateway", lifespan=_lifespan(gw))
    app.state.gateway = gw
    install_error_handlers(app)
    _add_api_routes(app, gw)
    _add_admin_routes(app, gw)
    return app


def _lifespan(gw: Gateway):
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        await gw.close()
    return lifespan


def _add_api_routes(app: FastAPI, gw: Gateway) -> None:
    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await gw.handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gw.handle(request, "completions")

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        key = await gw.authenticate(request)
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "pagedserve-gateway"}
                for name in gw.config.routes if key.allows(name)]
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}


def _add_admin_routes(app: FastAPI, gw: Gateway) -> None:
    def admin(request: Request) -> None:
        if not is_admin(bearer_token(request.headers.get("authorization")), gw.config.admin_key):
            raise APIError(401, "this endpoint needs the gateway's admin key", code="invalid_admin_key")

    async def json_body(request: Request) -> dict:
        try:
            data = json.loads(await read_body(request, gw.config.max_body_bytes) or b"{}")
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
        await gw.store.put_key(key)
        return {"key": token, **key.public()}

    @app.get("/admin/keys")
    async def list_keys(request: Request) -> dict:
        admin(request)
        return {"data": [k.public() for k in await gw.store.list_keys()]}

    @app.delete("/admin/keys/{key_id}")
    async def revoke_key(key_id: str, request: Request) -> dict:
        admin(request)
        if not await gw.store.revoke_key(key_id):
            raise APIError(404, f"no key with id {key_id!r}", code="key_not_found")
        return {"key_id": key_id, "revoked": True}

    @app.post("/admin/sources/{name}/bump")
    async def bump_source(name: str, request: Request) -> dict:
        admin(request)
        version = (await json_body(request)).get("version")
        return {"name": name, "version": await gw.store.bump_source(name, str(version) if version else None)}

    @app.get("/admin/sources")
    async def sources(request: Request) -> dict:
        admin(request)
        return {"data": await gw.store.list_sources()}

    @app.get("/admin/usage")
    async def usage(request: Request, day: str | None = None) -> dict:
        admin(request)
        return {"timezone": gw.config.timezone, "today": gw.budgets.day(), "data": await gw.budgets.usage(day)}

    @app.get("/admin/traces")
    async def traces(request: Request, limit: int = 20, key_id: str | None = None, user: str | None = None) -> dict:
        admin(request)
        return {"data": gw.traces.recent(min(max(limit, 1), 1000), key_id, user)}

    @app.get("/admin/status")
    async def status(request: Request) -> dict:
        admin(request)
        return {"providers": gw.providers.breaker_states(), "cache_entries": len(gw.cache) if gw.cache else 0,
                "time": time.time()}
