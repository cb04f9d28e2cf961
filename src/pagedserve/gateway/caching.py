"""Stage 2, cache lookup with freshness: whether a request may use the semantic cache, the lookup against
the current versions of the route's knowledge sources (and, on a retrieval route, against the chunks each
answer was built from), the replay of a hit, and remembering new answers."""
from __future__ import annotations

from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.gateway.call import Call
from pagedserve.gateway.gateway_config import GatewayConfig
from pagedserve.gateway.query_vectors import QueryVectors
from pagedserve.gateway.retrieving import RetrievalStage, cached_chunks
from pagedserve.gateway.semantic_cache import SemanticCache, normalise, scope_key
from pagedserve.gateway.store import Store
from pagedserve.gateway.streaming import replay, replay_chunks

LEGACY_NO_TEAM = "default"  # what keys made without a team were given before teams became optional


class CacheStage:
    def __init__(self, config: GatewayConfig, store: Store, cache: SemanticCache | None, vectors: QueryVectors,
                 retrieval: RetrievalStage | None = None):
        self.config = config
        self.store = store
        self.cache = cache
        self.vectors = vectors
        self.retrieval = retrieval

    def cacheable(self, call: Call) -> bool:
        """Whether the cache is consulted for this request; if not, says why in the trace."""
        req, trace = call.request, call.trace
        if self.cache is None:
            trace.cache = "off"
            return False
        call.query, context = req.query()
        if (not req.cache or call.query is None or not req.text_only
                or (self.config.cache.deterministic_only and not req.deterministic)):
            trace.cache = "bypass"  # an image or audio part would be invisible to the key: not cached
            return False
        call.scope = scope_key(self.tenant(call), f"{call.kind}:{call.route.name}", call.body, context)
        return True

    def tenant(self, call: Call) -> str:
        """Who shares cached answers: the key's team under `scope: team`, but only when the key names one;
        a key without a team shares with its own user only."""
        key, scope = call.key, self.config.cache.scope
        if scope == "team" and key.team and key.team != LEGACY_NO_TEAM:
            return f"team:{key.team}"
        return f"key:{key.key_id}" if scope == "key" else f"user:{key.user}"

    async def look_up(self, call: Call) -> bool:
        """True on a fresh hit (call.lookup holds it)."""
        req, trace, retrieval = call.request, call.trace, call.route.retrieval
        named = set(call.route.sources) | set(req.sources)
        call.versions = await self.store.source_versions(sorted(named | ({retrieval.source} if retrieval else set())))
        trace.sources = call.versions
        current, chunks_gone = call.versions, None
        if retrieval is not None:  # the retrieval source is judged chunk by chunk, not by its version, even
            call.index_version = call.versions[retrieval.source]  # where sources names it too (logged at start-up)
            current = {s: v for s, v in call.versions.items() if s in named and s != retrieval.source}
            chunks_gone = await self.retrieval.freshness(call)
        call.vector = await self.vectors.vector(call.query)
        threshold = call.route.cache_threshold or self.config.cache.threshold
        call.lookup = self.cache.lookup(call.scope, call.vector, threshold, current,
                                        req.max_completion_tokens or req.max_tokens, normalise(call.query),
                                        chunks_gone)
        trace.cache, trace.cache_similarity = call.lookup.result, call.lookup.similarity
        trace.stale_reason, trace.guard_rejected = call.lookup.stale_reason, call.lookup.guard_rejected
        return call.lookup.result == "hit"

    @staticmethod
    def flight_key(call: Call) -> tuple:
        """Requests that would share one cache entry exactly (single_flight.py): the scope (tenant, route, every
        answer-shaping parameter, the conversation), the question as the cache normalises it, and max_tokens."""
        req = call.request
        return call.scope, normalise(call.query), req.max_completion_tokens or req.max_tokens

    def answer(self, call: Call, stored: dict) -> Response:
        """A stored answer (a cache hit's, or the one an identical request just stored), replayed in the shape
        (and streaming or not) the client asked for."""
        body = replay(stored, call.kind)
        call.served_sources = stored.get("sources")
        headers = call.response_headers(None)
        if call.request.stream:
            wants_usage = bool((call.body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(iter(replay_chunks(body, call.kind, wants_usage)),
                                     media_type="text/event-stream", headers=headers)
        return JSONResponse(body, headers=headers)

    def remember(self, call: Call, body: dict) -> bool:
        """Caches a fresh answer against the source versions current when it was asked; whether it did. Called
        before the answer is sent (or a stream's [DONE]), so the same question asked next is a hit."""
        choices = body.get("choices")
        if call.scope is None or call.vector is None or not isinstance(choices, list) or len(choices) != 1:
            return False
        choice = choices[0] if isinstance(choices[0], dict) else {}
        message = choice.get("message") if isinstance(choice.get("message"), dict) else {}
        if message.get("tool_calls") or choice.get("finish_reason") == "tool_calls":
            return False  # a call is an action on this exact request's arguments, not an answer to reuse
        finish = choice.get("finish_reason") if isinstance(choice.get("finish_reason"), str) else None
        usage = body.get("usage") if isinstance(body.get("usage"), dict) else {}
        completion_tokens = usage.get("completion_tokens")
        ttl = call.route.cache_ttl_s or self.config.cache.ttl_s
        retrieval = call.route.retrieval
        chunks = cached_chunks(retrieval.source, call.retrieved or []) if retrieval is not None else None
        self.cache.put(call.scope, call.query, call.vector, body, call.versions, ttl,
                       call.request.max_completion_tokens or call.request.max_tokens, finish,
                       completion_tokens if isinstance(completion_tokens, int) else 0, chunks)
        return True
