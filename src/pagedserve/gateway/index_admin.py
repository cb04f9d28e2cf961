"""The admin API of the retrieval index (/admin/index/...), behind the gateway's admin key: add documents
(text or base64 bytes in the body; the gateway never reads paths on its own disk), remove, list, search."""
from __future__ import annotations

import base64
import binascii
from typing import TypeVar

from fastapi import FastAPI, Request
from pydantic import BaseModel, ValidationError

from pagedserve.gateway.admin_models import IndexAdd, IndexSearch
from pagedserve.gateway.admission import read_body
from pagedserve.gateway.auth import bearer_token, is_admin
from pagedserve.gateway.errors import APIError
from pagedserve.gateway.gateway_config import GatewayConfig
from pagedserve.gateway.leases import LeaseBusy
from pagedserve.gateway.protocol import load_json_object, validation_error
from pagedserve.gateway.retrieval.indexer import IndexInputError
from pagedserve.gateway.retrieval.library import Library

M = TypeVar("M", bound=BaseModel)
INDEX_BODY_BYTES = 64 << 20  # documents are larger than chat requests


def add_index_routes(app: FastAPI, config: GatewayConfig, library: Library | None) -> None:
    async def admin(request: Request, model: type[M] | None = None) -> M | None:
        if not is_admin(bearer_token(request.headers.get("authorization")), config.admin_key):
            raise APIError(401, "this endpoint needs the gateway's admin key", code="invalid_admin_key")
        if library is None:
            raise APIError(404, "retrieval is off: the gateway has no embedder (no cache, classifier or "
                           "retrieval route)", code="retrieval_off")
        if model is None:
            return None
        raw = await read_body(request, max(config.max_body_bytes, INDEX_BODY_BYTES))
        try:
            return model.model_validate(load_json_object(raw) if raw.strip() else {})
        except ValidationError as e:
            raise validation_error(e) from None

    async def guarded(work):
        try:
            return await work
        except IndexInputError as e:
            raise APIError(400, str(e), code="invalid_document") from None
        except LookupError as e:
            raise APIError(404, str(e.args[0]), code="source_not_found") from None
        except LeaseBusy as e:
            raise APIError(409, str(e), code="source_busy") from None

    @app.get("/admin/index")
    async def list_sources(request: Request) -> dict:
        await admin(request)
        return {"data": await library.sources()}

    @app.get("/admin/index/{source}")
    async def list_documents(source: str, request: Request) -> dict:
        await admin(request)
        return {"source": source, "documents": await guarded(library.documents(source))}

    @app.post("/admin/index/{source}/documents")
    async def add_documents(source: str, request: Request) -> dict:
        body = await admin(request, IndexAdd)
        files = {}
        for i, doc in enumerate(body.documents):
            if (doc.content is None) == (doc.content_base64 is None):
                raise APIError(400, f"documents[{i}] ({doc.name}): give exactly one of content and content_base64",
                               param=f"documents.{i}", code="invalid_value")
            if doc.name in files:
                raise APIError(400, f"documents[{i}]: a second document named {doc.name!r}", param=f"documents.{i}",
                               code="invalid_value")
            try:
                files[doc.name] = (doc.content.encode() if doc.content is not None
                                   else base64.b64decode(doc.content_base64, validate=True))
            except (binascii.Error, ValueError, UnicodeEncodeError) as e:
                raise APIError(400, f"documents[{i}] ({doc.name}): {e}", param=f"documents.{i}",
                               code="invalid_value") from None
        prune = [body.prune_prefix] if body.prune_prefix else []
        return (await guarded(library.add(source, files, prune))).public()

    @app.delete("/admin/index/{source}")
    async def remove_source(source: str, request: Request) -> dict:
        await admin(request)
        return (await guarded(library.remove(source))).public()

    @app.delete("/admin/index/{source}/documents/{name:path}")
    async def remove_document(source: str, name: str, request: Request) -> dict:
        await admin(request)
        return (await guarded(library.remove(source, [name]))).public()

    @app.post("/admin/index/{source}/search")
    async def search(source: str, request: Request) -> dict:
        body = await admin(request, IndexSearch)
        version, hits = await guarded(library.search(source, body.query, body.k, body.mode, body.min_score))
        return {"source": source, "version": version, "data": [h.public() | {"text": h.chunk.text} for h in hits]}
