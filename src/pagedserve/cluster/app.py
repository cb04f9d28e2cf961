"""The router's HTTP side: an OpenAI-compatible proxy in front of the replicas. This module reads the
client's request (body bounded as it arrives, routing headers read strictly: see client_input.py) and
its routing hints; proxy.py forwards it, with failover."""
from __future__ import annotations

import asyncio
import json
import logging
import re
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import ClientDisconnect

from pagedserve.cluster import client_input
from pagedserve.cluster.client_input import Refusal
from pagedserve.cluster.cluster_config import ClusterConfig
from pagedserve.cluster.policies import RoutingRequest
from pagedserve.cluster.proxy import Forward, forward, until_disconnect
from pagedserve.cluster.router import Router
from pagedserve.cluster.ui.console import mount_console
from pagedserve.server.errors import error_response, install_error_handlers
from pagedserve.server.peer_auth import HEADER as PEER_HEADER
from pagedserve.server.peer_auth import PeerKey
from pagedserve.server.responses_protocol import REPLICA_TAG_HEADER, RESPONSE_ID_PATTERN, replica_tag_of

log = logging.getLogger(__name__)

DROPPED_HEADERS = {b"host", b"content-length", b"connection", b"keep-alive", b"transfer-encoding", b"te",
                   b"upgrade", b"accept-encoding", b"proxy-authorization", b"proxy-connection",
                   PEER_HEADER.encode(), REPLICA_TAG_HEADER.encode()}
# Fields of the workers' peer routes that a client's body may not carry to a replica: dropped on the way in.
INTERNAL_FIELDS = frozenset({"kv_transfer_params"})
MAX_TOKENS_ESTIMATE = 1 << 20  # bounds the load one request can claim in the policies' estimates
# A Responses API item that is not a message: the turn it stands for in the prefix key, and its text field.
ITEM_TURNS = {"function_call": ("assistant", "arguments"), "function_call_output": ("tool", "output")}


def _text(content) -> str:
    if isinstance(content, list):  # content parts
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


def prefix_key(endpoint: str, payload: dict):
    """What the prefix index matches on: the prompt text (or token ids) as the replica will see it,
    in an order where a later turn of a conversation extends an earlier one."""
    if endpoint == "/v1/chat/completions":
        messages = payload.get("messages")
        if not isinstance(messages, list):
            return ""
        return "".join(f"<|{m.get('role', '')}|>{_text(m.get('content'))}\n" for m in messages
                       if isinstance(m, dict))
    if endpoint == "/v1/responses":  # instructions are the system turn; a string input is one user turn
        given, instructions = payload.get("input"), payload.get("instructions")
        items = [{"role": "user", "content": given}] if isinstance(given, str) else given
        turns = [("system", instructions)] if isinstance(instructions, str) else []
        for item in items if isinstance(items, list) else []:
            if isinstance(item, dict):
                role, text = ITEM_TURNS.get(item.get("type"), (item.get("role", ""), "content"))
                turns.append((role, item.get(text)))
        return "".join(f"<|{role}|>{_text(content)}\n" for role, content in turns)
    if endpoint == "/v1/completions":
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch goes to one replica; its first prompt stands for it
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return tuple(prompt)
        return prompt if isinstance(prompt, str) else ""
    return ""


def routing_request(endpoint: str, payload: dict, session: str | None) -> RoutingRequest:
    key = prefix_key(endpoint, payload)
    prompt_tokens = len(key) // 4 + 1 if isinstance(key, str) else len(key)
    max_tokens = _count(payload.get("max_completion_tokens") or payload.get("max_tokens")
                        or payload.get("max_output_tokens"), 16)
    samples = _count(payload.get("n"), 1) or 1
    session = session or payload.get("user")
    return RoutingRequest(prefix_key=key, session=str(session) if session else None,
                          est_tokens=prompt_tokens + min(max_tokens * samples, MAX_TOKENS_ESTIMATE),
                          prompt_tokens=prompt_tokens)


def _count(value, default: int) -> int:
    """A client's count for the load estimate: the default unless an int, never below 0."""
    return max(value, 0) if isinstance(value, int) and not isinstance(value, bool) else default


def check_peer_key(config: ClusterConfig, peer_key: PeerKey | None) -> None:
    """What the router asks of replicas' internal routes needs the cluster secret to sign with."""
    if peer_key is None and (config.lora_modules or any(r.kv_role == "prefill" for r in config.replicas)):
        raise ValueError("disaggregated replicas and lora_modules need the cluster secret "
                         "(--cluster-secret-file or $PAGEDSERVE_CLUSTER_SECRET): the router signs those calls")


def create_app(config: ClusterConfig, peer_key: PeerKey | None = None) -> FastAPI:
    """peer_key: the cluster secret, which the router signs its internal calls to replicas with (disaggregated
    halves, KV layout checks, adapter loads)."""
    check_peer_key(config, peer_key)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
        async with (httpx.AsyncClient(limits=limits, timeout=config.request_timeout_s) as client,
                    httpx.AsyncClient(limits=httpx.Limits(max_keepalive_connections=0),
                                      timeout=config.request_timeout_s) as fresh):
            router = Router(config, client, peer_key, fresh)
            if console is not None:
                console.attach(router, client)
            await router.health.probe_all()
            probes = asyncio.create_task(router.health.run())
            app.state.router, app.state.client = router, client
            healthy = [r.name for r in router.replicas if r.healthy]
            log.info("router up: policy %s, %d/%d replicas healthy %s", config.policy, len(healthy),
                     len(router.replicas), healthy)
            yield
            probes.cancel()

    app = FastAPI(title="pagedserve router", lifespan=lifespan)
    install_error_handlers(app)
    console = mount_console(app, config)  # the web console at /ui, when the router has an admin key

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        router: Router = request.app.state.router
        replicas = [r.describe() for r in router.replicas]
        ok = any(r.healthy for r in router.replicas)
        return JSONResponse({"status": "ok" if ok else "unavailable", "policy": router.policy.name,
                             "replicas": replicas}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        """What healthy replicas serve, and the adapters the router can load on them."""
        router: Router = request.app.state.router
        ids = sorted({m for r in router.replicas if r.healthy for m in r.models}
                     | (set(router.config.lora_modules) if any(r.healthy for r in router.replicas) else set()))
        return JSONResponse({"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "pagedserve"} for m in ids]})

    @app.get("/tokenizer_info")
    async def tokenizer_info(request: Request) -> Response:
        """A healthy replica's (every replica serves the same model): remote tokenizers (lm-eval) read it."""
        router: Router = request.app.state.router
        for replica in [r for r in router.replicas if r.healthy and r.kv_role != "prefill"]:
            try:
                answer = await router.health.client.get(replica.url + "/tokenizer_info",
                                                        timeout=router.config.health_timeout_s)
            except httpx.HTTPError:
                continue
            if answer.status_code == 200:
                return Response(answer.content, media_type="application/json")
        return error_response(503, "no healthy replica answered /tokenizer_info", code="no_replica")

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(request.app.state.router.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    for endpoint in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/tokenize",
                     "/detokenize"):
        app.add_api_route(endpoint, _proxy_handler(endpoint), methods=["POST"], include_in_schema=False)
    app.add_api_route("/v1/responses/{response_id}", stored_response, methods=["GET", "DELETE"],
                      include_in_schema=False)
    return app


async def stored_response(request: Request, response_id: str) -> Response:
    """GET / DELETE of a stored response: at the replica whose tag its id carries (the only one holding it)."""
    router: Router = request.app.state.router
    # The id becomes part of a replica's URL; one without a replica's tag was not made through this router.
    if not re.fullmatch(RESPONSE_ID_PATTERN, response_id) or replica_tag_of(response_id) is None:
        return error_response(404, f"Response with id '{response_id[:200]}' not found.", "response_id",
                              "response_not_found")
    headers = request.headers
    passed = [(k, v) for k, v in headers.raw if k.lower() not in DROPPED_HEADERS]
    fwd = Forward("/v1/responses", b"", passed, RoutingRequest(prefix_key="", session=None, est_tokens=1),
                  False, client_input.residency(headers, router.config.residency_header),
                  client_input.client_region(headers, router.config.client_region_header), None,
                  path=f"/v1/responses/{response_id}", previous_response=response_id, method=request.method)
    try:
        return await forward(router, fwd)
    except Refusal as exc:
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code)


def _proxy_handler(endpoint: str):
    async def handler(request: Request) -> Response:
        return await proxy(request, endpoint)
    return handler


async def proxy(request: Request, endpoint: str) -> Response:
    router: Router = request.app.state.router
    try:
        fwd = await read_request(request, endpoint, router.config)
        return await until_disconnect(request, forward(router, fwd), router.metrics.client_disconnects.inc)
    except Refusal as exc:
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code)
    except ClientDisconnect:  # left while sending its body
        router.metrics.client_disconnects.inc()
        return Response(status_code=499)


async def read_request(request: Request, endpoint: str, config: ClusterConfig) -> Forward:
    body = await client_input.read_body(request, config.max_body_bytes)
    payload = client_input.json_object(body)
    if INTERNAL_FIELDS & payload.keys():
        log.warning("dropped internal fields %s from a client's request", sorted(INTERNAL_FIELDS & payload.keys()))
        payload = {k: v for k, v in payload.items() if k not in INTERNAL_FIELDS}
        body = json.dumps(payload).encode()
    headers = request.headers
    residency = client_input.residency(headers, config.residency_header)
    client_region = client_input.client_region(headers, config.client_region_header)
    req = routing_request(endpoint, payload, client_input.single(headers, config.session_header))
    model = payload.get("model") if isinstance(payload.get("model"), str) else None
    passed = [(k, v) for k, v in headers.raw if k.lower() not in DROPPED_HEADERS]  # repeats kept, as sent
    previous = payload.get("previous_response_id") if endpoint == "/v1/responses" else None
    return Forward(endpoint, body, passed, req, bool(payload.get("stream")), residency, client_region, model,
                   previous_response=previous if isinstance(previous, str) else None)
