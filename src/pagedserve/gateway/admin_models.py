"""Admin input, validated the same way whether it comes from `POST /admin/keys` or `gateway keys create`.

Strict types: "10" is not a number of requests, a string is not a list of models. Names and tags are
restricted to characters that are safe in a header and a log line (no CR/LF: residency goes upstream as the
`x-residency` header). A limit is a positive number or absent: absent means the config's key_defaults,
and there is no 0 (it used to mean unlimited, silently overriding key_defaults).
"""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, StringConstraints

Name = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[\w.@+-]+$")]
Tag = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
Version = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=r"^[\w.:+-]+$")]


class KeyCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    user: Name
    team: Name | None = Field(None, description="the semantic cache's tenant; absent: answers shared with the user only")
    models: list[Name] = Field(default_factory=list, max_length=256, description="routes the key may use; empty: all")
    residency: Tag | None = Field(None, description="data residency tag sent upstream as x-residency")
    rpm: int | None = Field(None, ge=1, le=10**9, description="requests per minute; absent: key_defaults")
    tpm: int | None = Field(None, ge=1, le=10**12, description="tokens per minute; absent: key_defaults")
    daily_budget_usd: float | None = Field(None, ge=0, le=10**6, allow_inf_nan=False,
                                           description="0 allows nothing; absent: key_defaults")


class SourceBump(BaseModel):
    model_config = ConfigDict(extra="forbid")
    version: Version | Annotated[int, Field(ge=0, strict=True)] | None = None



DocName = Annotated[str, StringConstraints(min_length=1, max_length=512, pattern=r"^[^\x00-\x1f]+$")]


class IndexDocument(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: DocName = Field(description="document id; its suffix (.md .txt .html ...) says how it is parsed")
    content: str | None = Field(None, description="the document's text")
    content_base64: str | None = Field(None, description="or its raw bytes, base64-encoded (checked as UTF-8)")


class IndexAdd(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    documents: list[IndexDocument] = Field(min_length=1, max_length=10_000)
    prune_prefix: DocName | None = Field(None, description="also remove this prefix's documents not listed here")


class IndexSearch(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    query: str = Field(min_length=1, max_length=100_000)
    k: int = Field(3, ge=1, le=50)
    mode: str = Field("hybrid", pattern="^(hybrid|lexical|dense)$")
    min_score: float | None = Field(None, ge=-1, le=1)
