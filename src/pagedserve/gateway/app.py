"""The gateway: an OpenAI-compatible service in front of providers. This module only wires the stages of
the seed's flow, each in a module of its own:

admission.py (auth, rate limit, daily budget) -> single_flight.py (an identical request already on its way?
wait for its answer) -> caching.py (semantic cache, fresh?) -> routing.py (small or large tier) -> retrieving.py
(context from the route's knowledge source) -> provider_call.py + speculation.py (timeout, retry, fallback,
breaker; a call started early) -> settle.py (real usage replaces the reservation, trace) -> caching.py
(remember the answer, before it is sent).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.gateway.admin import add_admin_routes
from pagedserve.gateway.admin_models import IndexAdd, IndexSearch, KeyCreate, SourceBump
from pagedserve.gateway.admission import Admission
from pagedserve.gateway.budget import BudgetKeeper
from pagedserve.gateway.caching import CacheStage
from pagedserve.gateway.call import Call
from pagedserve.gateway.errors import APIError, install_error_handlers
from pagedserve.gateway.gateway_config import GatewayConfig, Target
from pagedserve.gateway.index_admin import add_index_routes
from pagedserve.gateway.limits import RateLimiter
from pagedserve.gateway.openapi import install_openapi
from pagedserve.gateway.protocol import ChatRequest, CompletionRequest, ResponsesRequest
from pagedserve.gateway.provider_call import outcome, relay, upstream
from pagedserve.gateway.providers import CallResult, ProviderPool
from pagedserve.gateway.query_vectors import QueryVectors
from pagedserve.gateway.responses import handle_responses
from pagedserve.gateway.retrieval.library import Library
from pagedserve.gateway.retrieval.retriever import Retriever
from pagedserve.gateway.retrieving import RetrievalStage
from pagedserve.gateway.routing import TierRouter
from pagedserve.gateway.semantic_cache import SemanticCache
from pagedserve.gateway.settle import Settlement
from pagedserve.gateway.single_flight import Flight, Flights, StreamTee
from pagedserve.gateway.speculation import Speculation
from pagedserve.gateway.store import Store, open_store
from pagedserve.gateway.streaming import StreamAssembler, assemble
from pagedserve.gateway.tracing import Trace, TraceSink
from pagedserve.gateway.ui.console import mount_console

log = logging.getLogger(__name__)


class Gateway:
    def __init__(self, config: GatewayConfig, store: Store | None = None, embedder=None, span_exporter=None):
        self.config = config
        self.store = store or open_store(config.store, config.sqlite_path)
        limiter = RateLimiter(self.store)
        self.budgets = BudgetKeeper(self.store, config.tz, config.budgets)
        self.providers = ProviderPool(config)
        self.traces = TraceSink(config.data_dir / "traces.db", config.otlp_endpoint, span_exporter,
                                config.trace_retention_days)
        needs_classifier = any(r.large for r in config.routes.values())
        needs_embedder = needs_classifier or config.cache.enabled or any(r.retrieval for r in config.routes.values())
        self.embedder = embedder if embedder is not None else _load_embedder(config, needs_embedder)
        embedder = self.embedder
        vectors = QueryVectors(embedder)
        self.library = Library(self.store, embedder, Retriever(self.store, embedder.dim)) if embedder else None
        self.retrieval = RetrievalStage(self.store, self.library.retriever, vectors) if embedder else None
        for route in config.routes.values():
            if route.retrieval is not None and route.speculate:
                log.warning("route %s: speculate is off on a retrieval route (the early call would lack the "
                            "chunks)", route.name)
            if route.retrieval is not None:
                log.info("%s", route.freshness())
        cache = SemanticCache(config.data_dir / "cache.db", embedder.dim) if config.cache.enabled else None
        classifier = None
        if needs_classifier:
            from pagedserve.gateway.classify import load_or_train

            classifier = load_or_train(embedder)
        self.admission = Admission(config, self.store, limiter, self.budgets)
        self.caching = CacheStage(config, self.store, cache, vectors, self.retrieval)
        self.router = TierRouter(classifier, vectors)
        self.settlement = Settlement(config, self.budgets, limiter, self.traces)
        self.flights = Flights()
        self._background: set[asyncio.Task] = set()
        log.info("gateway ready: routes %s, providers %s, store %s, cache %s, classifier %s", sorted(config.routes),
                 sorted(config.providers), config.store, f"{len(cache)} entries" if cache is not None else "off",
                 "on" if classifier else "off")

    async def close(self) -> None:
        await asyncio.gather(*self._background, return_exceptions=True)
        await self.providers.close()
        await self.store.close()
        self.traces.close()
        if self.caching.cache is not None:
            self.caching.cache.close()

    async def handle(self, request: Request, kind: str) -> Response:
        trace = Trace(endpoint=kind)
        call = speculation = flight = None
        try:
            call = await self.admission.admit(request, kind, trace)
            cacheable = self.caching.cacheable(call)
            if cacheable:
                flight, served = await self.board(call)
                if served is not None:
                    return served
            speculation = self.speculate(call, cacheable)
            if speculation is not None:
                await speculation.on_the_wire()
            if cacheable and await self.caching.look_up(call):
                if speculation is not None:
                    self.cancel(speculation, "cache hit", trace)
                    speculation = None
                await self.settlement.finish(call, None, {})
                self.flights.land(flight, call.lookup.entry.response)
                return self.caching.answer(call, call.lookup.entry.response)
            await self.router.choose_tier(call)
            if call.route.retrieval is not None:
                await self.retrieval.retrieve(call)
            pending = None
            if speculation is not None:
                if speculation.tier == call.tier:
                    pending, trace.speculative = speculation.task, "used"
                else:
                    self.cancel(speculation, f"{call.tier} tier", trace)
                speculation = None
            result = await outcome(call, pending or upstream(self.providers, call, call.route.tier(call.tier)))
            if isinstance(result, CallResult):
                return await self.complete(call, result, flight)
            events = result.events
            if flight is not None:  # one pump reads the provider; this request and live waiters follow it
                tee = StreamTee(events, lambda got: self.land_stream(call, flight, got))
                self._track(tee.task)
                self.flights.stream(flight, tee, result.target, call.sources)
                events = tee.follow()
            return StreamingResponse(self.relay(call, result.target, events), media_type="text/event-stream",
                                     headers=call.response_headers(result.target))
        except Exception as e:
            if call is not None:
                await self.settlement.settle(call, None, {})
            trace.finish(e.status if isinstance(e, APIError) else 500, str(e))
            self.traces.write(trace)
            if isinstance(e, APIError):  # an error names its trace too, as every answer does
                e.headers = {**e.headers, "x-gateway-trace-id": trace.trace_id}
            raise
        finally:
            if speculation is not None:  # the lookup or the classifier failed
                self.cancel(speculation, "error", trace)
            if flight is not None and flight.tee is None:  # landed already, unless it failed on the way
                self.flights.land(flight, None)

    async def board(self, call: Call) -> tuple[Flight | None, Response | None]:
        """The flight a cacheable request takes: one it leads, or, when an identical request leads one, that
        one's answer (served: no flight of its own); released by it, or offering tools, it flies alone."""
        key, trace_id = self.caching.flight_key(call), call.trace.trace_id
        if not call.request.offers_tools:  # its answer is often a tool call, never shared: it would only wait longer
            flight, leads = self.flights.join(key, trace_id)
            if leads:
                return flight, None
            served = await self.wait(call, flight)
            if served is not None:
                return None, served
        return self.flights.alone(key, trace_id), None

    async def wait(self, call: Call, flight: Flight) -> Response | None:
        """An identical request leads a flight: its answer, as soon as there is one to give (None: go alone)."""
        call.trace.coalesced_with = flight.leader_trace
        flight.waiting += 1
        try:
            await flight.moved.wait()
            if flight.tee is not None and call.request.stream and not flight.landed.is_set():
                call.trace.cache = "coalesced"
                call.served_sources = flight.sources
                return StreamingResponse(self.relay(call, flight.target, flight.tee.follow(), charged=False),
                                         media_type="text/event-stream", headers=call.response_headers(flight.target))
            await flight.landed.wait()
        finally:
            flight.waiting -= 1
        if flight.answer is None:
            return None
        call.trace.cache = "coalesced"
        await self.settlement.finish(call, None, {})
        return self.caching.answer(call, flight.answer)

    def speculate(self, call: Call, cacheable: bool) -> Speculation | None:
        """Starts the likely tier's call now, when the cache lookup or the classifier would otherwise delay it."""
        if not call.route.speculate or call.route.retrieval is not None or not (cacheable or self.router.classifies(call)):
            return None
        tier, sent = self.router.guess_tier(call), asyncio.Event()
        return Speculation.start(tier, upstream(self.providers, call, call.route.tier(tier), sent), sent)

    def cancel(self, speculation: Speculation, why: str, trace: Trace) -> None:
        trace.speculative = speculation.verdict(why)
        self._spawn(speculation.cancel())

    async def complete(self, call: Call, result: CallResult, flight: Flight | None) -> Response:
        if call.retrieved is not None:
            result.body["sources"] = call.sources
        await self.settlement.finish(call, result.target, result.body.get("usage") or {})
        stored = self.caching.remember(call, result.body)  # before the answer leaves: the next one asking hits
        if flight is not None:
            self.flights.land(flight, result.body if stored else None)
        return JSONResponse(result.body, headers=call.response_headers(result.target))

    def land_stream(self, call: Call, flight: Flight, events: list[str] | None) -> None:
        """The pump's end of a flight's stream (before any reader sees it): the whole answer stored, if whole."""
        answer = None
        try:
            assembled = assemble(call.kind, events) if events is not None else None
            if assembled is not None and assembled.finish_reason is not None:
                body = assembled.body()
                if call.retrieved is not None:
                    body["sources"] = call.sources
                answer = body if self.caching.remember(call, body) else None
        finally:  # waiters must never be left waiting
            self.flights.land(flight, answer)

    def relay(self, call: Call, target: Target, events, charged: bool = True):
        """The stream to the client; its usage charged when it ends (a live waiter's is not: a hit's price)."""
        def on_end(assembled: StreamAssembler, status: int, error: str | None) -> None:
            usage = self.settlement.stream_usage(call, assembled.usage, assembled.chunks)
            self._spawn(self.settlement.finish(call, target if charged else None, usage, status, error))
        return relay(call, target, events, on_end, {"sources": call.sources} if call.sources is not None else None)

    def status(self) -> dict:
        cache = self.caching.cache
        return {"providers": self.providers.breaker_states(), "cache_entries": len(cache) if cache else 0,
                "flights": self.flights.status()}

    def _spawn(self, work: Awaitable) -> None:
        self._track(asyncio.get_running_loop().create_task(work))

    def _track(self, task: asyncio.Task) -> None:
        self._background.add(task)
        task.add_done_callback(self._background.discard)


def _load_embedder(config: GatewayConfig, needed: bool):
    if not needed:
        return None
    import torch

    from pagedserve.embedding import Embedder

    torch.set_num_threads(config.embed_threads)  # one short query at a time: more threads only contend
    return Embedder.load().fast()  # fp16-weight kernels: same vectors (cosine > 0.9999), ~2x faster


def create_app(config: GatewayConfig, gateway: Gateway | None = None, **kwargs) -> FastAPI:
    gw = gateway or Gateway(config, **kwargs)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        warning = await gw.store.persistence_warning()
        if warning:
            log.warning("%s", warning)
        yield
        await gw.close()

    app = FastAPI(title="pagedserve gateway", lifespan=lifespan)
    app.state.gateway = gw
    install_error_handlers(app)
    add_api_routes(app, gw)
    add_admin_routes(app, config, gw.store, gw.budgets, gw.traces, gw.status)
    add_index_routes(app, config, gw.library)
    mount_console(app, gw)  # the web console at /ui (gateway/ui/), when the gateway has an admin key
    install_openapi(app, {("/v1/chat/completions", "post"): ChatRequest, ("/v1/completions", "post"): CompletionRequest,
                          ("/v1/responses", "post"): ResponsesRequest,
                          ("/admin/keys", "post"): KeyCreate, ("/admin/sources/{name}/bump", "post"): SourceBump,
                          ("/admin/index/{source}/documents", "post"): IndexAdd,
                          ("/admin/index/{source}/search", "post"): IndexSearch},
                    {"/v1/chat/completions", "/v1/completions", "/v1/responses"})
    return app


def add_api_routes(app: FastAPI, gw: Gateway) -> None:
    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await gw.handle(request, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await gw.handle(request, "completions")

    @app.post("/v1/responses")
    async def responses(request: Request) -> Response:
        return await handle_responses(gw, request)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        key = await gw.admission.authenticate(request)
        data = [{"id": name, "object": "model", "created": 0, "owned_by": "pagedserve-gateway"}
                for name in gw.config.routes if key.allows(name)]
        return {"object": "list", "data": data}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}
