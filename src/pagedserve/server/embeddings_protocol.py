"""Request and response bodies of /v1/embeddings (pydantic), as served and as documented."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from pagedserve.server.protocol import Prompt, StrictModel, Text


class EmbeddingRequest(StrictModel):
    input: Prompt | Annotated[list[Prompt], Field(min_length=1, max_length=2048)] = Field(
        description="a non-empty string or a list of 1 to 2048 of them (token-id input is not supported)")
    model: Text | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: Text | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
