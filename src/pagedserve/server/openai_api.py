"""The FastAPI app: OpenAI-compatible routes over one AsyncLLM (plus an optional embedding model)."""
from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from pagedserve.server.chat import create_chat_completion, render_prompt
from pagedserve.server.completions import create_completion
from pagedserve.server.embeddings import create_embeddings
from pagedserve.server.embeddings_protocol import EmbeddingRequest, EmbeddingResponse
from pagedserve.server.errors import APIError, install_error_handlers
from pagedserve.server.kv_transfer import expire_leases
from pagedserve.server.lora_routes import lora_routes
from pagedserve.server.middleware import RequestGuard
from pagedserve.server.peer_routes import peer_routes
from pagedserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
)
from pagedserve.server.responses import responses_routes
from pagedserve.server.serving import RequestContext, ServerState, respond, until_disconnect
from pagedserve.server.tools import ToolPlan

DEFAULT_MAX_BODY_BYTES = 8 * 2**20
ROUTE_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 403, 404, 413, 429, 500, 503, 504)
}
STREAM_DOC = {200: {"content": {"text/event-stream": {}}, "description": "JSON body, or server-sent events "
                                                                          "when stream is true"}}
KNOWN_PATHS = {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/models",
               "/tokenize", "/detokenize", "/tokenizer_info", "/health", "/metrics", "/v1/load_lora_adapter", "/v1/unload_lora_adapter",
               "/internal/v1/completions", "/internal/v1/chat/completions", "/internal/v1/kv/info"}


def create_app(state: ServerState, api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if not state.engine.is_running:
            state.engine.start()
        expiry = asyncio.get_running_loop().create_task(expire_leases(state))
        yield
        expiry.cancel()
        if state.disagg.client is not None:
            await state.disagg.client.aclose()
        state.engine.shutdown()

    # strict_content_type=False: a body is read as JSON even when a client forgets the Content-Type.
    app = FastAPI(title="pagedserve", version="0.1.0", lifespan=lifespan, strict_content_type=False,
                  description="OpenAI-compatible API over pagedserve's paged-KV engine.")
    install_error_handlers(app)
    state.metrics.watch_engine(lambda: state.engine.stats)
    state.metrics.describe_weights(state.engine.engine.weights_info)
    state.metrics.watch_admission(state.admission)
    state.metrics.watch_transfers()
    auth = [] if api_key is None else [Depends(_auth_dependency(api_key))]
    app.include_router(_api_routes(state, auth))
    app.include_router(responses_routes(state), dependencies=auth, responses=ROUTE_ERRORS)
    # Adapter loads name files on this host: a peer's signature is their authentication, not --api-key's.
    app.include_router(lora_routes(state), responses=ROUTE_ERRORS)
    if state.disagg.role is not None:  # a disaggregated worker: its peers' routes, signed, not --api-key's
        app.include_router(peer_routes(state))
    app.include_router(_open_routes(state))
    app.add_middleware(RequestGuard, max_body_bytes=max_body_bytes,
                       on_response=lambda path, status: state.metrics.record_request(
                           path if path in KNOWN_PATHS else "other", status))
    app.openapi = lambda: _openapi(app, state)
    return app


# Declared (and so documented as the routes' security) only when the server runs with --api-key.
BEARER = HTTPBearer(auto_error=False, description="the server's --api-key")


def _auth_dependency(api_key: str):
    async def check(credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(BEARER)]) -> None:
        given = credentials.credentials if credentials else ""
        if not secrets.compare_digest(given.encode(), api_key.encode()):
            message = "Incorrect API key provided." if given else "Missing API key: send Authorization: Bearer KEY."
            raise APIError(401, message, code="invalid_api_key")

    return check


def _api_routes(state: ServerState, auth: list) -> APIRouter:
    r = APIRouter(dependencies=auth, responses=ROUTE_ERRORS)

    @r.post("/v1/completions", response_model=CompletionResponse, responses=STREAM_DOC)
    async def completions(req: CompletionRequest, request: Request) -> Response:
        ctx = RequestContext.build(req.priority, req.timeout, request.headers)
        return await until_disconnect(request, respond(create_completion(state, req, ctx), ctx))

    @r.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=STREAM_DOC)
    async def chat_completions(req: ChatCompletionRequest, request: Request) -> Response:
        ctx = RequestContext.build(req.priority, req.timeout, request.headers)
        return await until_disconnect(request, respond(create_chat_completion(state, req, ctx), ctx))

    @r.post("/v1/embeddings", response_model=EmbeddingResponse)
    async def embeddings(req: EmbeddingRequest) -> EmbeddingResponse:
        return await create_embeddings(state, req)

    @r.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=_model_cards(state))

    @r.get("/v1/models/{model}", response_model=ModelCard)
    async def model(model: str) -> ModelCard:
        for card in _model_cards(state):
            if card.id == model:
                return card
        raise APIError(404, f"The model '{model}' does not exist.", "model", "model_not_found")

    @r.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(req: TokenizeRequest) -> TokenizeResponse:
        state.check_generation_model(req.model)
        plan = ToolPlan(req.tools, "auto", parser=state.tool_parser) if req.tools else None
        text = req.prompt if req.messages is None else render_prompt(state, req.messages, req.add_generation_prompt,
                                                                     plan)
        tokenizer = state.engine.tokenizer
        tokens = tokenizer.encode(text, add_special_tokens=req.add_special_tokens is not False)
        strs = [tokenizer.id_to_token(t) or "" for t in tokens] if req.return_token_strs else None
        return TokenizeResponse(count=len(tokens), max_model_len=state.engine.max_model_len, tokens=tokens,
                                token_strs=strs)

    @r.get("/tokenizer_info", response_model=TokenizerInfoResponse)
    async def tokenizer_info() -> TokenizerInfoResponse:
        tokenizer = state.engine.tokenizer

        def token(token_id: int | None) -> str | None:
            return None if token_id is None else tokenizer.id_to_token(token_id)
        return TokenizerInfoResponse(
            tokenizer_class="PreTrainedTokenizerFast", bos_token=token(tokenizer.bos_token_id),
            eos_token=token(tokenizer.eos_token_id),
            chat_template=tokenizer.chat_template, model_max_length=state.engine.max_model_len,
            vocab_size=tokenizer.vocab_size, add_bos_token=bool(tokenizer.add_bos))

    @r.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(req: DetokenizeRequest) -> DetokenizeResponse:
        state.check_generation_model(req.model)
        vocab = getattr(state.engine.tokenizer, "vocab_size", None)
        bad = [t for t in req.tokens if vocab is not None and t >= vocab]
        if bad:
            raise APIError(400, f"token id {bad[0]} is outside the vocabulary (size {vocab})", "tokens")
        return DetokenizeResponse(prompt=state.engine.tokenizer.decode(req.tokens))

    return r


def _open_routes(state: ServerState) -> APIRouter:
    r = APIRouter()

    @r.get("/health", response_model=HealthResponse, responses={503: {"model": HealthResponse}})
    async def health() -> JSONResponse:
        if not state.engine.is_running:
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        if state.admission.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @r.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return r


def _model_cards(state: ServerState) -> list[ModelCard]:
    info = state.engine.engine.weights_info
    cards = [ModelCard(id=state.model_name, max_model_len=state.engine.max_model_len, dtype=info["dtype"],
                       quantization=info["quantization"], quant_kernel=info["quant_kernel"],
                       kv_cache_dtype=info["kv_cache_dtype"])]
    cards += [ModelCard(id=name, root=lora.lora_path, parent=state.model_name, max_model_len=state.engine.max_model_len)
              for name, lora in state.loras.items()]
    if state.embedder is not None:
        cards.append(ModelCard(id=state.embedder.model_name, max_model_len=state.embedder.max_seq_length))
    return cards


def _openapi(app: FastAPI, state: ServerState) -> dict:
    """FastAPI's document, minus the 422 it would advertise (validation errors here are 400s), plus the
    limits only the loaded models know: the document refuses what the server refuses."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for path in schema["paths"].values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        schemas = schema.get("components", {}).get("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        _runtime_limits(schemas, state)
        app.openapi_schema = schema
    return app.openapi_schema


def _runtime_limits(schemas: dict, state: ServerState) -> None:
    vocab = getattr(state.engine.tokenizer, "vocab_size", None)
    if vocab is not None:
        for model, field in [("CompletionRequest", "prompt"), ("CompletionRequest", "stop_token_ids"),
                             ("ChatCompletionRequest", "stop_token_ids"), ("DetokenizeRequest", "tokens")]:
            _set_integer_maximum(schemas[model]["properties"][field], vocab - 1)
    if state.embedder is not None:  # the encoder has one width; asking for another is refused
        dimensions = schemas["EmbeddingRequest"]["properties"]["dimensions"]["anyOf"][0]
        dimensions["minimum"] = dimensions["maximum"] = state.embedder.dim


def _set_integer_maximum(node: Any, maximum: int) -> None:
    """Every integer inside one property's schema (the token ids of its lists) gets this maximum."""
    if isinstance(node, dict):
        if node.get("type") == "integer":
            node["maximum"] = maximum
        for value in node.values():
            _set_integer_maximum(value, maximum)
    elif isinstance(node, list):
        for value in node:
            _set_integer_maximum(value, maximum)
