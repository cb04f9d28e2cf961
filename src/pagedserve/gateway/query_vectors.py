"""The query's embedding, computed once per distinct (normalised) text and shared by the cache lookup and
the classifier: the one MiniLM pass is most of the gateway's own latency on a miss."""
from __future__ import annotations

import asyncio
from collections import OrderedDict

import numpy as np

from pagedserve.gateway.semantic_cache import normalise


class QueryVectors:
    def __init__(self, embedder, capacity: int = 4096):
        self.embedder = embedder
        self.capacity = capacity
        self._vectors: OrderedDict[str, np.ndarray] = OrderedDict()

    async def vector(self, text: str) -> np.ndarray:
        text = normalise(text)
        cached = self._vectors.get(text)
        if cached is None:
            cached = (await asyncio.to_thread(self.embedder.embed, [text]))[0]
            self._vectors[text] = cached
            if len(self._vectors) > self.capacity:
                self._vectors.popitem(last=False)
        else:
            self._vectors.move_to_end(text)
        return cached
