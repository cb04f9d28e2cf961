"""The router's HTTP side: an OpenAI-compatible proxy in front of the replicas.

Non-streamed requests are retried on another allowed replica whenever the chosen one fails, since
nothing reached the client yet. A stream is committed only once its first chunk arrived (so a
replica that fails before that is retried too); after that, chunks are relayed as they come, and a
replica failure ends the stream with an OpenAI-style error event.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pagedserve.cluster.cluster_config import ClusterConfig
from pagedserve.cluster.policies import RoutingRequest
from pagedserve.cluster.regions import parse_residency
from pagedserve.cluster.replica import Replica
from pagedserve.cluster.router import NoReplicaError, Router
from pagedserve.server.errors import error_response, install_error_handlers

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 16 * 2**20
RETRY_WITHOUT_PENALTY = {429, 503}  # the replica is busy, not broken
RETRY_WITH_PENALTY = {500, 502}  # not 504: a replica's 504 is the request's own deadline, passed everywhere
DROPPED_HEADERS = {"host", "content-length", "connection", "keep-alive", "transfer-encoding", "te", "upgrade",
                   "accept-encoding", "proxy-authorization", "proxy-connection"}
REPLICA_HEADER = "x-pagedserve-replica"
PASSED_RESPONSE_HEADERS = {"retry-after", "x-pagedserve-degraded"}


def error_event(message: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": "replica_failed"}}
    return f"data: {json.dumps(body)}\n\n".encode()


def _text(content) -> str:
    if isinstance(content, list):  # content parts
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
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
    if endpoint == "/v1/completions":
        prompt = payload.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch goes to one replica; its first prompt stands for it
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return tuple(prompt)
        return prompt if isinstance(prompt, str) else ""
    return ""


def routing_request(endpoint: str, payload: dict, headers, config: ClusterConfig) -> RoutingRequest:
    key = prefix_key(endpoint, payload)
    prompt_tokens = len(key) // 4 + 1 if isinstance(key, str) else len(key)
    max_tokens = payload.get("max_completion_tokens") or payload.get("max_tokens") or 16
    session = headers.get(config.session_header) or payload.get("user")
    return RoutingRequest(prefix_key=key, session=str(session) if session else None,
                          est_tokens=prompt_tokens + (max_tokens if isinstance(max_tokens, int) else 16))


@dataclass(slots=True)
class Failure:
    reason: str
    busy_response: Response | None = None  # a replica's own 429/503, returned if every replica is busy


def create_app(config: ClusterConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
        async with httpx.AsyncClient(limits=limits, timeout=config.request_timeout_s) as client:
            router = Router(config, client)
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

    @app.get("/health")
    async def health(request: Request) -> JSONResponse:
        router: Router = request.app.state.router
        replicas = [r.describe() for r in router.replicas]
        ok = any(r.healthy for r in router.replicas)
        return JSONResponse({"status": "ok" if ok else "unavailable", "policy": router.policy.name,
                             "replicas": replicas}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models(request: Request) -> JSONResponse:
        router: Router = request.app.state.router
        ids = sorted({m for r in router.replicas if r.healthy for m in r.models})
        return JSONResponse({"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "pagedserve"} for m in ids]})

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(generate_latest(request.app.state.router.metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    for endpoint in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize", "/detokenize"):
        app.add_api_route(endpoint, _proxy_handler(endpoint), methods=["POST"], include_in_schema=False)
    return app


def _proxy_handler(endpoint: str):
    async def handler(request: Request) -> Response:
        return await proxy(request, endpoint)
    return handler


async def proxy(request: Request, endpoint: str) -> Response:
    router: Router = request.app.state.router
    config = router.config
    if int(request.headers.get("content-length") or 0) > MAX_BODY_BYTES:
        return error_response(413, f"request body over {MAX_BODY_BYTES} bytes")
    body = await request.body()
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        return error_response(400, f"request body is not valid JSON: {exc}")
    if not isinstance(payload, dict):
        return error_response(400, "request body must be a JSON object")
    req = routing_request(endpoint, payload, request.headers, config)
    residency = parse_residency(request.headers.get(config.residency_header))
    client_region = request.headers.get(config.client_region_header)
    model = payload.get("model") if isinstance(payload.get("model"), str) else None
    headers = {k: v for k, v in request.headers.items() if k.lower() not in DROPPED_HEADERS}
    tried: list[str] = []
    failures: list[str] = []
    busy: Response | None = None
    for _ in range(config.max_attempts):
        try:
            decision = router.select(req, residency=residency, client_region=client_region, model=model,
                                     exclude=tried)
        except NoReplicaError as exc:
            if busy is not None:
                return busy
            router.metrics.rejections.labels(",".join(sorted(residency)) or "-").inc()
            detail = f"; failures: {' | '.join(failures)}" if failures else ""
            return error_response(503, exc.reason + detail, code="no_replica")
        replica = decision.replica
        tried.append(replica.name)
        result = await _attempt(router, replica, endpoint, body, headers, req, bool(payload.get("stream")))
        if not isinstance(result, Failure):
            return result
        failures.append(f"{replica.name}: {result.reason}")
        busy = result.busy_response or busy
        router.metrics.failovers.labels(replica.name, result.reason.split(":")[0]).inc()
        log.warning("request failed on %s (%s); trying another replica", replica.name, result.reason)
    scope = f" on replicas satisfying residency {sorted(residency)}" if residency else ""
    return busy or error_response(503, f"gave up after {len(tried)} attempts{scope}: {' | '.join(failures)}",
                                  code="replicas_failed")


async def _attempt(router: Router, replica: Replica, endpoint: str, body: bytes, headers: dict,
                   req: RoutingRequest, stream: bool) -> Response | Failure:
    """One try on one replica: a response for the client, or the Failure that allows a retry."""
    config = router.config
    timeout = httpx.Timeout(config.stream_idle_timeout_s if stream else config.request_timeout_s,
                            connect=config.connect_timeout_s)
    client: httpx.AsyncClient = router.health.client
    upstream_request = client.build_request("POST", replica.url + endpoint, content=body, headers=headers,
                                            timeout=timeout)
    replica.start_request(req.est_tokens)
    start = time.perf_counter()
    handed_over = False
    try:
        upstream = await client.send(upstream_request, stream=True)
        try:
            if upstream.status_code != 200 or not stream:
                content = await upstream.aread()
                return _finish_plain(router, replica, endpoint, upstream, content)
            chunks = upstream.aiter_raw()
            first = await anext(chunks, b"")
        except BaseException:
            await upstream.aclose()
            raise
        router.metrics.ttft.observe(time.perf_counter() - start)
        handed_over = True
        return StreamingResponse(_relay(router, replica, endpoint, upstream, chunks, first, req),
                                 status_code=200, media_type=upstream.headers.get("content-type"),
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no",
                                          REPLICA_HEADER: replica.name, **_passed_headers(upstream)})
    except httpx.HTTPError as exc:
        fatal = not isinstance(exc, (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout))
        reason = f"{type(exc).__name__}: {exc}".rstrip(": ")
        router.health.request_failed(replica, reason, fatal=fatal)
        return Failure(reason)
    finally:
        if not handed_over:
            replica.finish_request(req.est_tokens)


def _passed_headers(upstream: httpx.Response) -> dict[str, str]:
    """The replica's own word to the client: when to retry, and what it degraded under load."""
    return {k: v for k, v in upstream.headers.items() if k.lower() in PASSED_RESPONSE_HEADERS}


def _finish_plain(router: Router, replica: Replica, endpoint: str, upstream: httpx.Response,
                  content: bytes) -> Response | Failure:
    status = upstream.status_code
    if status in RETRY_WITH_PENALTY:
        router.health.request_failed(replica, f"answered {status}", fatal=False)
        return Failure(f"status {status}: {content[:200].decode(errors='replace')}")
    response = Response(content, status_code=status, media_type=upstream.headers.get("content-type"),
                        headers={REPLICA_HEADER: replica.name, **_passed_headers(upstream)})
    if status in RETRY_WITHOUT_PENALTY:
        return Failure(f"status {status}: {content[:200].decode(errors='replace')}", response)
    router.health.request_succeeded(replica)
    router.metrics.requests.labels(replica.name, endpoint, str(status)).inc()
    return response


async def _relay(router: Router, replica: Replica, endpoint: str, upstream: httpx.Response, chunks,
                 first: bytes, req: RoutingRequest):
    """Relays a stream chunk by chunk; a replica failure becomes an error event, never a hang."""
    last = first
    status = "200"
    try:
        if first:
            yield first
        async for chunk in chunks:
            last = chunk
            yield chunk
        router.health.request_succeeded(replica)
    except httpx.HTTPError as exc:
        status = "stream_error"
        reason = f"{type(exc).__name__}: {exc}".rstrip(": ")
        fatal = not isinstance(exc, httpx.ReadTimeout)
        router.health.request_failed(replica, reason, fatal=fatal)
        router.metrics.stream_errors.labels(replica.name).inc()
        log.warning("stream from %s broke mid-way: %s", replica.name, reason)
        separator = b"" if last.endswith(b"\n\n") else b"\n\n"  # close a half-relayed event first
        yield separator + error_event(f"replica {replica.name} failed mid-stream: {reason}")
    finally:
        replica.finish_request(req.est_tokens)
        router.metrics.requests.labels(replica.name, endpoint, status).inc()
        with anyio.CancelScope(shield=True):
            await upstream.aclose()
