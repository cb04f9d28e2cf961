"""Disaggregated prefill and decode, the router's side: with prefill replicas configured (`kv_role: prefill`),
a completion or chat request goes first to a prefill replica (non-streamed, `kv_transfer_params:
{do_remote_decode: true}`), which computes the prompt and answers with a sealed lease on its KV blocks; the
request then goes, with that handle and the prefill replica's URL, to a decode replica chosen as usual (policy,
prefix affinity, residency), which pulls the blocks it lacks and streams the answer to the client
(server/kv_transfer.py). Both halves go to the workers' peer routes (/internal/...), signed with the cluster
secret; a client's own `kv_transfer_params` never gets this far (app.py drops it).

A prefill replica that fails is retried on another; when none succeeds the request goes to the decode pool
without a handle and is computed there whole: slower, never lost. Prompts shorter than
`disagg_min_prompt_tokens` (default 256) go straight to the decode pool. A request for a LoRA adapter goes to
a prefill replica that holds it (or loads it there first, as for decoding); its blocks travel under the
adapter's identity (server/kv_transfer.py).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import time

import httpx

from pagedserve.cluster.router import NoReplicaError, Router
from pagedserve.server.peer_auth import PEER_PREFIX

log = logging.getLogger(__name__)
ENDPOINTS = {"/v1/completions", "/v1/chat/completions"}


async def prefill_first(router: Router, fwd):
    """The Forward the decode pool gets: with the prefill replica's handle, or unchanged (recompute)."""
    if fwd.endpoint not in ENDPOINTS or fwd.req.prompt_tokens < router.config.disagg_min_prompt_tokens:
        return fwd
    payload = json.loads(fwd.body)
    body = {k: v for k, v in payload.items() if k not in ("stream", "stream_options")}
    body["kv_transfer_params"] = {"do_remote_decode": True}
    target = PEER_PREFIX + fwd.endpoint
    content, signed = router.peer_key.signed_json("POST", target, body)
    timeout = httpx.Timeout(router.config.request_timeout_s, connect=router.config.connect_timeout_s)
    headers = [(k, v) for k, v in fwd.headers if k.lower() != b"content-type"] + [
        (k.encode(), v.encode()) for k, v in signed.items()]
    tried: list[str] = []
    for _ in range(router.config.max_attempts):
        try:
            decision = router.select(fwd.req, residency=fwd.residency, client_region=fwd.client_region,
                                     model=fwd.model, exclude=tried, prefill=True)
        except NoReplicaError as exc:
            log.warning("no prefill replica for a request (%s); the decode pool computes it whole", exc.reason)
            break
        replica = decision.replica
        tried.append(replica.name)
        if decision.load_adapter and (problem := await router.load_adapter(replica, decision.load_adapter)):
            router.metrics.prefills.labels(replica.name, "lora_load_failed").inc()
            log.warning("prefill on %s: %s; trying another", replica.name, problem)
            continue
        start = time.perf_counter()
        replica.start_request(fwd.req.est_tokens)
        try:
            response = await router.health.client.post(replica.url + target, content=content, headers=headers,
                                                       timeout=timeout)
        except httpx.HTTPError as exc:
            result = type(exc).__name__
            if isinstance(exc, httpx.ConnectError):
                router.health.unreachable(replica, f"{result}: {exc}")
            else:
                router.health.suspect(replica, f"{result}: {exc}")
        else:
            handle = _handle(response)
            if handle is not None:
                router.metrics.prefills.labels(replica.name, "handed_off").inc()
                router.metrics.prefill_seconds.observe(time.perf_counter() - start)
                _tell(router, fwd, replica.name, "handed_off", start, handle)
                payload["kv_transfer_params"] = {**handle, "do_remote_prefill": True, "remote_url": replica.url}
                decode_body, signed = router.peer_key.signed_json("POST", target, payload)
                return dataclasses.replace(fwd, body=decode_body, path=target, headers=[
                    *((k, v) for k, v in fwd.headers if k.lower() != b"content-type"),
                    *((k.encode(), v.encode()) for k, v in signed.items())])
            result = f"status_{response.status_code}"
            if 400 <= response.status_code < 500 and response.status_code not in (408, 429):
                router.metrics.prefills.labels(replica.name, result).inc()
                _tell(router, fwd, replica.name, result, start)
                return fwd  # the request's own fault: the decode replica gives the client the same answer
        finally:
            replica.finish_request(fwd.req.est_tokens)
        router.metrics.prefills.labels(replica.name, result).inc()
        _tell(router, fwd, replica.name, result, start)
        log.warning("prefill on %s failed (%s); trying another", replica.name, result)
    return fwd


def _tell(router: Router, fwd, replica: str, result: str, start: float, handle: dict | None = None) -> None:
    for listener in router.listeners:
        listener.prefilled(fwd.req, replica, result, time.perf_counter() - start, handle)


def _handle(response: httpx.Response) -> dict | None:
    if response.status_code != 200:
        return None
    try:
        handle = response.json().get("kv_transfer_params")
    except ValueError:
        return None
    return handle if isinstance(handle, dict) and handle.get("lease_id") else None
