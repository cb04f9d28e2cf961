"""Stage 3b, retrieval: on a route with `retrieval`, the question's best chunks from the route's knowledge
source go into the request as context, and the answer says which ones (`sources` in the body,
`x-gateway-sources` in the headers). Also the per-chunk freshness the cache lookup applies to such routes.

Retrieved text is data, whoever wrote the documents: it goes in as a user-role block between <delimiter> tags
(never into a system message, where it would read as the operator's own instructions), with any such tag
inside a chunk defused so a document cannot close the block early. The trace records the block as sent.
"""
from __future__ import annotations

import re
import time
from collections.abc import Callable

from pagedserve.gateway.call import Call
from pagedserve.gateway.gateway_config import RetrievalConfig
from pagedserve.gateway.query_vectors import QueryVectors
from pagedserve.gateway.retrieval.hybrid_index import Hit, HybridIndex
from pagedserve.gateway.retrieval.retriever import Retriever
from pagedserve.gateway.semantic_cache import CacheEntry
from pagedserve.gateway.store import Store


class RetrievalStage:
    def __init__(self, store: Store, retriever: Retriever, vectors: QueryVectors):
        self.store = store
        self.retriever = retriever
        self.vectors = vectors

    async def index(self, call: Call) -> HybridIndex:
        """The route's source index at the version current for this request (read once per request)."""
        source = call.route.retrieval.source
        if call.index_version is None:
            call.index_version = (await self.store.source_versions([source]))[source]
        return await self.retriever.index(source, call.index_version)

    async def freshness(self, call: Call) -> Callable[[CacheEntry], str | None]:
        """Why a cached answer of this route is stale as far as its source goes: one of its chunks changed or
        went away; or, for an answer built from no chunk at all, the source's version moved."""
        source, index = call.route.retrieval.source, await self.index(call)

        def stale(entry: CacheEntry) -> str | None:
            chunks = entry.chunks.get(source)
            if not chunks:
                cached = entry.sources.get(source)
                return None if cached == call.index_version else (
                    f"source {source} changed (v{cached} -> v{call.index_version}) and the answer used none of it")
            gone = index.missing(list(chunks))
            if gone:
                return (f"{len(gone)} of its {len(chunks)} chunks of {source} changed or went away, e.g. "
                        f"{chunks[gone[0]]} ({gone[0][:12]})")
            return None
        return stale

    async def retrieve(self, call: Call) -> None:
        """Finds the chunks and puts them into call.body; a request without a text question goes as it is."""
        config = call.route.retrieval
        query = call.query if call.query is not None else call.request.query()[0]
        if not query or not query.strip():
            call.trace.retrieval_note = "no text question to retrieve for"
            return
        index = await self.index(call)
        vector = call.vector if call.vector is not None else await self.vectors.vector(query)
        start = time.perf_counter()
        hits = index.search(query, vector, config.k, config.min_score, config.candidates)
        call.trace.retrieval_ms = round((time.perf_counter() - start) * 1000, 3)
        call.retrieved = hits
        call.trace.retrieval = [h.public() for h in hits]
        if hits:
            text = context_text(config, hits)
            call.body, where = with_context(call.body, call.kind, text, config.placement)
            call.trace.retrieval_context = {"where": where, "text": text}


def context_text(config: RetrievalConfig, hits: list[Hit]) -> str:
    """The context block: the template around the chunks, which sit between <delimiter> tags."""
    tag = config.delimiter
    defuse = re.compile(rf"<(/?\s*{re.escape(tag)})", re.IGNORECASE)
    chunks = "\n\n".join(defuse.sub(r"&lt;\1", config.chunk_template.format(
        n=n, document=h.chunk.doc, heading=h.chunk.heading, text=h.chunk.text)) for n, h in enumerate(hits, 1))
    block = f'<{tag} source="{config.source}">\n{chunks}\n</{tag}>'
    return config.template.format(source=config.source, delimiter=tag, chunks=block)


def with_context(body: dict, kind: str, context: str, placement: str = "message") -> tuple[dict, str]:
    """The body with the context in it, and where it went. Chat: a user message of its own just before the
    question (the last user message), or in front of the question's own text; completions: before the prompt.
    The client's body is not changed in place."""
    if kind != "chat":
        return {**body, "prompt": f"{context}\n\n{body['prompt']}"}, "prompt (before the client's text)"
    messages = list(body["messages"])
    at = max(i for i, m in enumerate(messages) if isinstance(m, dict) and m.get("role") == "user")
    if placement == "message":
        messages.insert(at, {"role": "user", "content": context})
        return {**body, "messages": messages}, f"messages.{at} (a user message before the question)"
    content = messages[at].get("content")
    if isinstance(content, list):
        content = [{"type": "text", "text": context}, *content]
    else:
        content = f"{context}\n\n{content or ''}"
    messages[at] = {**messages[at], "content": content}
    return {**body, "messages": messages}, f"messages.{at} (before the question's text)"


def cached_chunks(source: str, hits: list[Hit]) -> dict[str, dict[str, str]]:
    """What a cache entry remembers of the chunks it was built from."""
    return {source: {h.chunk.content_hash: f"{h.chunk.doc} > {h.chunk.heading}" for h in hits}}
