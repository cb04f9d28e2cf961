"""This instance's search indexes, one per knowledge source, kept at the version the store says is current.

Every request reads the source's version from the store anyway (the cache's freshness check); when it moved,
the first request to see it rebuilds the index from the store's document records (chunks and vectors: no
embedding), re-reading only the documents whose content hash changed. Several instances sharing a Redis store
therefore serve the same version, each from its own in-memory copy.
"""
from __future__ import annotations

import asyncio
import logging
import time

from pagedserve.gateway.retrieval.document_record import DocumentRecord
from pagedserve.gateway.retrieval.hybrid_index import HybridIndex

log = logging.getLogger(__name__)


class Retriever:
    def __init__(self, store, dim: int, exact_max: int = 20_000):
        self.store = store
        self.dim = dim
        self.exact_max = exact_max
        self._indexes: dict[str, tuple[str, HybridIndex]] = {}
        self._locks: dict[str, asyncio.Lock] = {}

    async def index(self, source: str, version: str) -> HybridIndex:
        """The source's index at `version` (a source never indexed is empty)."""
        held = self._indexes.get(source)
        if held is not None and held[0] == version:
            return held[1]
        async with self._locks.setdefault(source, asyncio.Lock()):
            held = self._indexes.get(source)
            if held is not None and held[0] == version:
                return held[1]
            start = time.perf_counter()
            manifest = await self.store.index_manifest(source)
            old = held[1].records if held is not None else {}
            stale = [n for n, h in manifest.items() if n not in old or old[n].content_hash != h]
            fresh = await self.store.index_records(source, stale)
            records = [old[n] if n not in fresh else DocumentRecord.from_json(n, fresh[n])
                       for n in sorted(manifest) if n in fresh or n in old]
            index = await asyncio.to_thread(HybridIndex, records, self.dim, self.exact_max)
            self._indexes[source] = (version, index)
            log.info("retrieval index %s v%s: %d documents (%d re-read), %d chunks, built in %.0f ms", source,
                     version, len(records), len(fresh), len(index), (time.perf_counter() - start) * 1000)
            return index
