"""POST /v1/embeddings: sentence embeddings from the packaged MiniLM encoder, off the event loop."""
from __future__ import annotations

import asyncio
import base64

import numpy as np

from pagedserve.server.embeddings_protocol import (
    Embedding,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from pagedserve.server.errors import APIError
from pagedserve.server.serving import ServerState


async def create_embeddings(state: ServerState, req: EmbeddingRequest) -> EmbeddingResponse:
    embedder = state.embedder
    if embedder is None:
        raise APIError(404, "this server serves no embedding model", "model", "model_not_found")
    if req.model not in (None, embedder.model_name):
        if req.model == state.model_name:
            raise APIError(400, f"model '{req.model}' is not an embedding model; use {embedder.model_name}",
                           "model")
        raise APIError(404, f"The model '{req.model}' does not exist.", "model", "model_not_found")
    if req.dimensions is not None and req.dimensions != embedder.dim:
        raise APIError(400, f"{embedder.model_name} only produces {embedder.dim} dimensions", "dimensions")
    texts = [req.input] if isinstance(req.input, str) else req.input
    if any(not t for t in texts):
        raise APIError(400, "input must not contain empty strings", "input")
    # The encoder runs in a worker thread so the event loop keeps streaming tokens meanwhile.
    vectors, counts = await asyncio.to_thread(lambda: (embedder.embed(texts), embedder.count_tokens(texts)))
    data = [Embedding(index=i, embedding=_encode(v, req.encoding_format)) for i, v in enumerate(vectors)]
    tokens = sum(counts)
    return EmbeddingResponse(data=data, model=embedder.model_name,
                             usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


def _encode(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()
