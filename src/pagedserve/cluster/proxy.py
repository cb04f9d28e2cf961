"""Forwarding one request to the replicas: failover, and what each failure says about a replica.

Non-streamed requests are retried on another allowed replica whenever the chosen one fails, since
nothing reached the client yet. A stream is committed only once its first chunk arrived (so a
replica that fails before that is retried too); after that, chunks are relayed as they come, and a
replica failure ends the stream with an OpenAI-style error event.

Blame: a refused connection ejects the replica (nothing listens there); a timeout is passive evidence.
A 5xx answer or a connection broken mid-answer may be the request's own doing, so it only triggers an
immediate /health probe (ejection if that fails too), and the 5xx counts as passive evidence only once
another replica has served the same request. When two replicas answer 5xx, the request is the cause:
the client gets the replica's answer and no replica is blamed. A busy replica (429/503) is skipped for
this request without blame. A client that leaves cancels the upstream request, so its replica aborts it.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

import anyio
import httpx
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from pagedserve.cluster.client_input import Refusal
from pagedserve.cluster.disagg import prefill_first
from pagedserve.cluster.policies import RoutingRequest
from pagedserve.cluster.regions import allowed_by_residency
from pagedserve.cluster.replica import Replica
from pagedserve.cluster.router import NoReplicaError, Router
from pagedserve.server.errors import error_response
from pagedserve.server.responses_protocol import REPLICA_TAG_HEADER, replica_tag_of

log = logging.getLogger(__name__)

BUSY = {429, 503}  # the replica is busy, not broken
SERVER_ERRORS = {500, 502}  # not 504: a replica's 504 is the request's own deadline, passed everywhere
SERVER_ERROR_QUORUM = 2  # replicas answering 5xx to one request before the request is taken as the cause
REPLICA_HEADER = "x-pagedserve-replica"
PASSED_RESPONSE_HEADERS = {"retry-after", "x-pagedserve-degraded"}


@dataclass(slots=True)
class Forward:
    """One client request as the replicas will get it, with what routes it."""
    endpoint: str
    body: bytes
    headers: list[tuple[bytes, bytes]]
    req: RoutingRequest
    stream: bool
    residency: frozenset[str]
    client_region: str | None
    model: str | None
    path: str = ""  # where the replicas get it, when not at endpoint (a worker's peer route, signed)
    previous_response: str | None = None  # /v1/responses: the stored response it continues (on one replica)
    method: str = "POST"  # GET and DELETE of a stored response


@dataclass(slots=True)
class Failure:
    reason: str
    response: Response | None = None  # the replica's own busy or 5xx answer, for when nothing better comes
    server_error: bool = False


def error_event(message: str) -> bytes:
    body = {"error": {"message": message, "type": "server_error", "param": None, "code": "replica_failed"}}
    return f"data: {json.dumps(body)}\n\n".encode()


async def until_disconnect(request: Request, work: Awaitable[Response], on_disconnect: Callable[[], None]) -> Response:
    """Runs work; if the client leaves first, cancels it, which closes the upstream connection, which
    aborts the request on its replica."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # its cleanup closes the upstream request
    if task.cancelled():
        on_disconnect()
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def forward(router: Router, fwd: Forward) -> Response:
    if fwd.previous_response is not None and replica_tag_of(fwd.previous_response) is not None:
        return await _to_holder(router, fwd)
    if router.disaggregated:
        fwd = await prefill_first(router, fwd)
    tried: list[str] = []
    failures: list[str] = []
    erred: list[Replica] = []  # replicas that answered this request 5xx
    busy: Response | None = None
    server_error: Response | None = None
    for _ in range(router.config.max_attempts):
        try:
            decision = router.select(fwd.req, residency=fwd.residency, client_region=fwd.client_region,
                                     model=fwd.model, exclude=tried)
        except NoReplicaError as exc:
            if busy or server_error:
                return busy or server_error
            router.metrics.rejections.labels(",".join(sorted(fwd.residency)) or "-").inc()
            detail = f"; failures: {' | '.join(failures)}" if failures else ""
            return error_response(503, exc.reason + detail, code="no_replica")
        replica = decision.replica
        tried.append(replica.name)
        if decision.load_adapter and (problem := await router.load_adapter(replica, decision.load_adapter)):
            failures.append(f"{replica.name}: {problem}")
            continue
        result = await _attempt(router, replica, fwd)
        if not isinstance(result, Failure):
            if result.status_code == 200:  # so the 5xx of the others were not the request's doing
                for other in erred:
                    router.health.request_failed(other, f"answered 5xx to a request {replica.name} served")
            return result
        failures.append(f"{replica.name}: {result.reason}")
        if result.server_error:
            erred.append(replica)
            server_error = result.response
            if len(erred) >= SERVER_ERROR_QUORUM:
                router.metrics.requests.labels(replica.name, fwd.endpoint, str(server_error.status_code)).inc()
                return server_error
        elif result.response is not None:
            busy = result.response
        router.metrics.failovers.labels(replica.name, result.reason.split(":")[0]).inc()
        log.warning("request failed on %s (%s); trying another replica", replica.name, result.reason)
    scope = f" on replicas satisfying residency {sorted(fwd.residency)}" if fwd.residency else ""
    return busy or server_error or error_response(
        503, f"gave up after {len(tried)} attempts{scope}: {' | '.join(failures)}", code="replicas_failed")


async def _to_holder(router: Router, fwd: Forward) -> Response:
    """A request continuing a stored response goes to the replica whose tag its id carries, the only one that
    holds it: no failover (elsewhere it is unknown), and a 404 when that replica is gone."""
    response_id = fwd.previous_response
    holder = next((r for r in router.replicas if r.tag == replica_tag_of(response_id)), None)
    why = _unreachable(holder, fwd.residency)
    if why is not None:
        if fwd.method != "POST":  # GET or DELETE of the stored response itself
            return error_response(404, f"Response with id '{response_id}' not found: {why}.", "response_id",
                                  "response_not_found")
        return error_response(404, f"Previous response with id '{response_id}' not found: {why}. Stored responses "
                                   "live in the memory of the replica that made them; send the conversation as input "
                                   "instead.", "previous_response_id", "previous_response_not_found")
    result = await _attempt(router, holder, fwd)
    if isinstance(result, Failure):
        return result.response or error_response(
            503, f"replica {holder.name}, which holds previous response '{response_id}', failed: {result.reason}",
            code="replica_failed")
    return result


def _unreachable(holder: Replica | None, residency: frozenset[str]) -> str | None:
    """Why a stored response's replica cannot answer for it (None: it can)."""
    if holder is None:
        return "no replica of this router made it"
    if not allowed_by_residency(holder, residency):
        return f"replica {holder.name}, which holds it, is outside this request's residency {sorted(residency)}"
    if not holder.healthy:
        return f"replica {holder.name}, which holds it, is unavailable ({holder.ejected_reason})"
    return None


def _tagged(fwd: Forward, replica: Replica) -> Forward:
    """/v1/responses: the replica writes its tag into the ids of the responses it makes."""
    if fwd.endpoint != "/v1/responses":
        return fwd
    return dataclasses.replace(fwd, headers=[*fwd.headers, (REPLICA_TAG_HEADER.encode(), replica.tag.encode())])


async def _attempt(router: Router, replica: Replica, fwd: Forward) -> Response | Failure:
    """One try on one replica: a response for the client, or the Failure that allows a retry."""
    fwd = _tagged(fwd, replica)
    config = router.config
    timeout = httpx.Timeout(config.stream_idle_timeout_s if fwd.stream else config.request_timeout_s,
                            connect=config.connect_timeout_s)
    client: httpx.AsyncClient = router.health.client
    replica.start_request(fwd.req.est_tokens)
    start = time.perf_counter()
    handed_over = False
    try:
        url = replica.url + (fwd.path or fwd.endpoint)
        try:
            upstream, chunks, first = await _exchange(client, url, fwd, timeout)
        except (httpx.RemoteProtocolError, httpx.ReadError):
            # A pooled connection the replica closed under this request (uvicorn closes a connection after an
            # unhandled exception, cutting short whatever else it had begun on it): nothing reached the client,
            # so once more, on a connection of its own, before the replica is blamed.
            upstream, chunks, first = await _exchange(router.health.fresh_client, url, fwd, timeout)
        if chunks is None:
            return _finish_plain(router, replica, fwd.endpoint, upstream, first)
        router.metrics.ttft.observe(time.perf_counter() - start)
        handed_over = True
        return StreamingResponse(_relay(router, replica, fwd, upstream, chunks, first),
                                 status_code=200, media_type=upstream.headers.get("content-type"),
                                 headers={"cache-control": "no-cache", "x-accel-buffering": "no",
                                          REPLICA_HEADER: replica.name, **_passed_headers(upstream)})
    except httpx.LocalProtocolError as exc:  # the request itself cannot be sent as it is
        raise Refusal(400, f"request cannot be forwarded: {exc}") from None
    except httpx.HTTPError as exc:
        reason = _describe(exc)
        _blame_transport(router, replica, exc, reason)
        return Failure(reason)
    finally:
        if not handed_over:
            replica.finish_request(fwd.req.est_tokens)


async def _exchange(client: httpx.AsyncClient, url: str, fwd: Forward,
                    timeout: httpx.Timeout) -> tuple[httpx.Response, AsyncIterator[bytes] | None, bytes]:
    """Sends the request and reads the answer's first part: (the response, the rest of its stream or None when
    it is a plain body, the whole plain body or the stream's first chunk)."""
    upstream = await client.send(client.build_request(fwd.method, url, content=fwd.body or None, headers=fwd.headers,
                                                      timeout=timeout), stream=True)
    try:
        if upstream.status_code != 200 or not _is_event_stream(upstream):
            return upstream, None, await upstream.aread()
        chunks = upstream.aiter_raw()
        return upstream, chunks, await anext(chunks, b"")
    except BaseException:
        await upstream.aclose()
        raise


def _is_event_stream(upstream: httpx.Response) -> bool:
    """Relayed chunk by chunk: the replica's own reading of `stream` decides, not the router's."""
    return upstream.headers.get("content-type", "").startswith("text/event-stream")


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}".rstrip(": ")


def _blame_transport(router: Router, replica: Replica, exc: httpx.HTTPError, reason: str) -> None:
    if isinstance(exc, httpx.ConnectError):
        router.health.unreachable(replica, reason)
    elif isinstance(exc, httpx.PoolTimeout):
        pass  # the router's own connection pool is full: no word on the replica
    elif isinstance(exc, httpx.TimeoutException):
        router.health.request_failed(replica, reason)
    else:  # broken mid-answer: a dead replica, or one this request crashed; the probe tells which
        router.health.suspect(replica, reason)


def _passed_headers(upstream: httpx.Response) -> dict[str, str]:
    """The replica's own word to the client: when to retry, and what it degraded under load."""
    return {k: v for k, v in upstream.headers.items() if k.lower() in PASSED_RESPONSE_HEADERS}


def _finish_plain(router: Router, replica: Replica, endpoint: str, upstream: httpx.Response,
                  content: bytes) -> Response | Failure:
    status = upstream.status_code
    response = Response(content, status_code=status, media_type=upstream.headers.get("content-type"),
                        headers={REPLICA_HEADER: replica.name, **_passed_headers(upstream)})
    reason = f"status {status}: {content[:200].decode(errors='replace')}"
    if status in SERVER_ERRORS:
        router.health.suspect(replica, f"answered {status}")
        return Failure(reason, response, server_error=True)
    if status in BUSY:
        return Failure(reason, response)
    router.health.request_succeeded(replica)
    router.metrics.requests.labels(replica.name, endpoint, str(status)).inc()
    return response


async def _relay(router: Router, replica: Replica, fwd: Forward, upstream: httpx.Response, chunks,
                 first: bytes):
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
        reason = _describe(exc)
        _blame_transport(router, replica, exc, reason)
        router.metrics.stream_errors.labels(replica.name).inc()
        log.warning("stream from %s broke mid-way: %s", replica.name, reason)
        separator = b"" if last.endswith(b"\n\n") else b"\n\n"  # close a half-relayed event first
        yield separator + error_event(f"replica {replica.name} failed mid-stream: {reason}")
    finally:
        replica.finish_request(fwd.req.est_tokens)
        router.metrics.requests.labels(replica.name, fwd.endpoint, status).inc()
        with anyio.CancelScope(shield=True):
            await upstream.aclose()
