"""The gateway's indexed knowledge sources as one service: add, remove, list and search. Both the admin API
(/admin/index/...) and the CLI (`pagedserve gateway index ...`) are thin layers over it."""
from __future__ import annotations

import asyncio
import re

from pagedserve.gateway.retrieval.hybrid_index import Hit
from pagedserve.gateway.retrieval.indexer import MAX_DOCUMENT_BYTES, Indexer, IndexInputError, IndexReport
from pagedserve.gateway.retrieval.retriever import Retriever

SOURCE_NAME = re.compile(r"[\w.:-]{1,128}")


def check_source_name(source: str) -> None:
    if not SOURCE_NAME.fullmatch(source):
        raise IndexInputError(f"a source name is 1-128 letters, digits or . : _ -, not {source[:140]!r}")


class Library:
    def __init__(self, store, embedder, retriever: Retriever | None = None):
        self.store = store
        self.embedder = embedder
        self.indexer = Indexer(store, embedder)
        self.retriever = retriever or Retriever(store, embedder.dim)

    async def add(self, source: str, files: dict[str, bytes], prune_prefixes: list[str] = ()) -> IndexReport:
        check_source_name(source)
        if not files:
            raise IndexInputError("no documents to index (supported: .md .markdown .txt .text .rst .html .htm)")
        large = [n for n, data in files.items() if len(data) > MAX_DOCUMENT_BYTES]
        if large:
            raise IndexInputError("; ".join(f"{n[:200]!r}: larger than {MAX_DOCUMENT_BYTES >> 20} MiB" for n in large))
        return await self.indexer.add(source, files, list(prune_prefixes))

    async def remove(self, source: str, names: list[str] | None = None) -> IndexReport:
        check_source_name(source)
        return await self.indexer.remove(source, names)

    async def sources(self) -> dict[str, dict]:
        counts = await self.store.indexed_sources()
        versions = await self.store.source_versions(sorted(counts))
        return {s: {"documents": n, "version": versions[s]} for s, n in counts.items()}

    async def documents(self, source: str) -> dict[str, str]:
        check_source_name(source)
        manifest = await self.store.index_manifest(source)
        if not manifest:
            raise LookupError(f"no indexed source {source!r}")
        return dict(sorted(manifest.items()))

    async def search(self, source: str, query: str, k: int = 3, mode: str = "hybrid",
                     min_score: float | None = None) -> tuple[str, list[Hit]]:
        """The source's version and its k best chunks for the query. A query longer than the encoder reads
        is refused rather than silently cut."""
        check_source_name(source)
        if not query.strip():
            raise IndexInputError("the query is empty")
        tokens = self.indexer.count_tokens(query) + 2  # [CLS] and [SEP]
        if tokens > self.embedder.max_seq_length:
            raise IndexInputError(f"the query is {tokens} tokens; the encoder ({self.embedder.model_name}) reads at "
                                  f"most {self.embedder.max_seq_length}: shorten it")
        if mode not in ("hybrid", "lexical", "dense"):
            raise IndexInputError(f"mode must be hybrid, lexical or dense, not {mode!r}")
        version = (await self.store.source_versions([source]))[source]
        if version == "0" or not await self.store.index_manifest(source):
            raise LookupError(f"no indexed source {source!r}")
        index = await self.retriever.index(source, version)
        vector = (await asyncio.to_thread(self.embedder.embed, [query]))[0]
        return version, index.search(query, vector, k, min_score, mode=mode)
