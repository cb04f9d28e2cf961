"""Disaggregated prefill and decode, the worker's side (vLLM's `kv_transfer_params` vocabulary).

- A prefill worker (`--kv-role prefill` or `both`) given `kv_transfer_params: {"do_remote_decode": true}`
  computes the prompt and its first token only, leases the prompt's full KV blocks and answers with a handle
  in `kv_transfer_params`: lease id, block count, block size, KV format, a digest of the tokens (and of the
  LoRA adapter's weights, for a request under one: its blocks are cached under that identity on both sides)
  and the first token.
- A decode worker (`decode` or `both`) given `kv_transfer_params: {"do_remote_prefill": true, "remote_url":
  ..., <the handle>}` pulls the blocks its own prefix cache lacks from `GET {remote_url}/v1/kv/leases/{id}`,
  registers them in that cache, acknowledges (`DELETE`, which frees the lease into the prefill worker's prefix
  cache) and runs the request, which then finds its prompt cached. A pull that fails or times out is
  recomputed here (`--kv-load-failure recompute`, the default) or fails the request with a 502 (`fail`).
  A plain single sample goes on from the prefill worker's first token, which streams before the pull.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Literal

import httpx
import torch
from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from pagedserve.engine.kv_transfer import tokens_sha
from pagedserve.engine.request import takes_output_from_elsewhere
from pagedserve.lora_request import LoRARequest
from pagedserve.server import kv_ray, kv_shm
from pagedserve.server.errors import APIError
from pagedserve.server.protocol import KVTransferParams

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode", "both")
# Blocks imported per call on the engine thread: ~2-3 ms of copying for the default model in bf16, so a long
# prompt's import pauses the requests decoding here for a part at a time, not for all of it at once.
IMPORT_PART_BLOCKS = 32


@dataclass
class Disaggregation:
    role: Literal["prefill", "decode", "both"] = "both"
    load_failure: Literal["recompute", "fail"] = "recompute"
    pull_timeout_s: float = 10.0
    # auto: shared memory with a worker on this host, the Ray object store with one in our Ray cluster, else TCP
    transport: Literal["auto", "tcp", "shm", "ray"] = "auto"
    ray_cluster: str | None = None  # the GCS address of the Ray cluster this worker joined
    client: httpx.AsyncClient | None = field(default=None, repr=False)
    segments: dict[str, list[str]] = field(default_factory=dict)  # lease id -> shared-memory segments written
    objects: dict[str, list] = field(default_factory=dict)  # lease id -> Ray object references put

    def http(self) -> httpx.AsyncClient:
        if self.client is None:
            self.client = httpx.AsyncClient(timeout=self.pull_timeout_s)
        return self.client


def check_role(state, kv: KVTransferParams, num_prompts: int, stream: bool) -> None:
    role = state.disagg.role
    if kv.do_remote_decode and role == "decode":
        raise APIError(400, "this worker runs with --kv-role decode: it does not prefill for others",
                       "kv_transfer_params", "kv_role_mismatch")
    if kv.do_remote_prefill and role == "prefill":
        raise APIError(400, "this worker runs with --kv-role prefill: it does not decode transferred prompts",
                       "kv_transfer_params", "kv_role_mismatch")
    if num_prompts != 1:
        raise APIError(400, "a disaggregated request has exactly one prompt", "kv_transfer_params")
    if kv.do_remote_decode and stream:
        raise APIError(400, "the prefill half of a disaggregated request is not streamed", "stream")


async def adapter_salt(state, lora: LoRARequest | None) -> str | None:
    """The prefix-cache salt of requests under this adapter (loaded off the step thread if it is not resident):
    the digest of its weights, the same on every worker that loaded the same adapter. ValueError when this
    engine cannot serve it."""
    loras = state.engine.engine.loras
    if lora is None:
        return None
    if loras is None:
        raise ValueError("this engine does not serve LoRA adapters")
    return (await asyncio.wrap_future(loras.submit(lora))).cache_key


async def lease(state, prompt_ids: list[int], lora: LoRARequest | None) -> dict:
    """The prefill half is done: pin the prompt's blocks and describe them for the decode worker."""
    engine = state.engine.engine
    salt = await adapter_salt(state, lora)
    held = await state.engine.call(lambda: engine.kv_transfer.lease(prompt_ids, salt))
    return held.public(engine.kv.block_size, engine.kv_format.name, engine.kv_transfer.lease_s)


async def pull(state, prompt_ids: list[int], kv: KVTransferParams, lora: LoRARequest | None) -> None:
    """Brings the prompt's blocks over from the prefill worker (those not cached here already)."""
    engine, metrics, start = state.engine.engine, state.metrics, time.perf_counter()
    try:
        salt = await adapter_salt(state, lora)
    except BaseException as e:  # an adapter this worker cannot serve: the request is refused when added
        release(state, kv)
        if isinstance(e, ValueError):
            return
        raise
    try:
        await _pull(state, engine, prompt_ids, kv, salt)
    except TransferFailed as e:
        metrics.kv_failures.labels(e.cause).inc()
        log.warning("KV pull from %s failed (%s): %s; %s", kv.remote_url, e.cause, e,
                    "recomputing" if state.disagg.load_failure == "recompute" else "failing the request")
        release(state, kv)
        if state.disagg.load_failure == "fail":
            raise APIError(502, f"KV transfer from the prefill worker failed ({e.cause}): {e}",
                           code="kv_transfer_failed") from None
    except asyncio.CancelledError:  # the client went away mid-transfer: free the lease now, not at expiry
        release(state, kv)
        raise
    finally:
        metrics.kv_seconds.observe(time.perf_counter() - start)


def first_token(state, kv: KVTransferParams | None, params) -> int | None:
    """The prefill worker's first token, when this decode half can stream it before its pull and go on from it:
    a single sample without logprobs or a grammar (whose state it would lack), and a pull that may fail into a
    recompute (a failed one could no longer be a clean error once the token is out)."""
    if kv is None or not kv.do_remote_prefill or kv.first_token_id is None:
        return None
    if not takes_output_from_elsewhere(params) or state.disagg.load_failure != "recompute":
        return None
    return kv.first_token_id


async def pull_then_run(state, request_id: str, prompt_ids: list[int], kv: KVTransferParams,
                        lora: LoRARequest | None) -> None:
    """A held request's pull: its blocks come in (or the pull fails and it recomputes), then it runs."""
    try:
        await pull(state, prompt_ids, kv, lora)
    finally:
        with contextlib.suppress(Exception):  # an engine that is gone fails the request's stream itself
            await state.engine.release_held(request_id)


class TransferFailed(Exception):
    def __init__(self, cause: str, message: str):
        super().__init__(message)
        self.cause = cause


async def _pull(state, engine, prompt_ids: list[int], kv: KVTransferParams, salt: str | None) -> None:
    if kv.block_size != engine.kv.block_size or kv.kv_format != engine.kv_format.name:
        raise TransferFailed("mismatch", f"blocks of {kv.block_size} tokens in {kv.kv_format}; this worker has "
                                         f"{engine.kv.block_size} in {engine.kv_format.name}")
    covered = kv.num_blocks * kv.block_size
    if covered > len(prompt_ids) or tokens_sha(prompt_ids[:covered], salt) != kv.tokens_sha:
        raise TransferFailed("token_mismatch", "the handle's tokens differ from this worker's tokenization of "
                                               "the prompt (another model or chat template?) or were computed "
                                               "under another LoRA adapter's weights")
    have = await state.engine.call(lambda: engine.kv_transfer.cached_blocks(prompt_ids[:covered], salt))
    if have < kv.num_blocks:
        transport, data = await _fetch(state, kv, have)
        count = kv.num_blocks - have
        placed = 0
        while placed < count:  # a part per call: the steps of running requests go on in between
            part = min(IMPORT_PART_BLOCKS, count - placed)
            try:
                done = await state.engine.call(lambda first=placed, num=part: engine.kv_transfer.import_blocks(
                    prompt_ids, have, data, count, salt, first, num))
            except ValueError as e:
                raise TransferFailed("bad_payload", str(e)) from None
            placed += done
            if done < part:  # the pool is short or the cache changed meanwhile: the rest is recomputed
                break
        state.metrics.kv_blocks.labels("in", transport).inc(placed)
        state.metrics.kv_bytes.labels("in", transport).inc(len(data))
    release(state, kv)


def _transport(disagg: Disaggregation, remote_url: str) -> str:
    if disagg.transport != "auto":
        return disagg.transport
    if kv_shm.same_host(remote_url):
        return "shm"
    return "ray" if disagg.ray_cluster is not None else "tcp"


async def _fetch(state, kv: KVTransferParams, start: int) -> tuple[str, bytes | memoryview]:
    """(transport, the blocks from `start` on): through shared memory from a worker on this host, the Ray
    object store from one in the same Ray cluster, else TCP. Where the chosen way turns out unavailable (another
    host after all, a prefill worker outside our Ray cluster), the lease is still there and TCP takes it."""
    url = f"{kv.remote_url.rstrip('/')}/v1/kv/leases/{kv.lease_id}"
    transport = _transport(state.disagg, kv.remote_url)
    if transport == "tcp":
        return "tcp", (await _get(state, url, {"start": start})).content
    if transport == "ray" and state.disagg.ray_cluster is None:
        raise TransferFailed("mismatch", "--kv-transport ray needs --ray-address (this worker is not in a Ray "
                                         "cluster)")
    handle = (await _get(state, url, {"start": start, "via": transport})).json()
    if transport == "shm":
        try:
            return "shm", await asyncio.to_thread(kv_shm.take, handle["name"], handle["bytes"])
        except FileNotFoundError:  # the same name, another machine after all
            return "tcp", (await _get(state, url, {"start": start})).content
        except ValueError as e:
            raise TransferFailed("bad_payload", str(e)) from None
    if handle.get("cluster") != state.disagg.ray_cluster:
        return "tcp", (await _get(state, url, {"start": start})).content
    try:
        data = await asyncio.to_thread(kv_ray.take, handle["object_ref"], state.disagg.pull_timeout_s)
    except kv_ray.errors() as e:
        raise TransferFailed("timeout" if isinstance(e, TimeoutError) else "unreachable", repr(e)) from None
    if len(data) != handle["bytes"]:
        raise TransferFailed("bad_payload", f"{len(data)} bytes in the object store; the handle said "
                                            f"{handle['bytes']}")
    return "ray", data


async def _get(state, url: str, params: dict) -> httpx.Response:
    try:
        response = await state.disagg.http().get(url, params=params)
    except httpx.TimeoutException as e:
        raise TransferFailed("timeout", repr(e)) from None
    except httpx.HTTPError as e:
        raise TransferFailed("unreachable", repr(e)) from None
    if response.status_code == 404:
        raise TransferFailed("lease_gone", response.text[:300])
    if response.status_code != 200:
        raise TransferFailed("http_error", f"{response.status_code}: {response.text[:300]}")
    return response


def release(state, kv: KVTransferParams) -> None:
    """Acknowledges the lease in the background; if that fails, the lease expires on its own."""
    async def acknowledge() -> None:
        try:
            await state.disagg.http().delete(f"{kv.remote_url.rstrip('/')}/v1/kv/leases/{kv.lease_id}")
        except httpx.HTTPError:
            pass
    task = asyncio.get_running_loop().create_task(acknowledge())
    state.background.add(task)
    task.add_done_callback(state.background.discard)


def kv_routes(state) -> APIRouter:
    router = APIRouter()
    engine = state.engine.engine

    @router.get("/v1/kv/info")
    async def info() -> dict:
        """What a router checks before pairing workers: same model, block size and KV format; and the Ray cluster
        this worker joined (its GCS address), if any."""
        return {"kv_role": state.disagg.role, "model": state.model_name, "block_size": engine.kv.block_size,
                "kv_format": engine.kv_format.name, "lease_s": engine.kv_transfer.lease_s,
                "ray_cluster": state.disagg.ray_cluster}

    @router.get("/v1/kv/leases/{lease_id}", response_class=Response,
                responses={200: {"content": {"application/octet-stream": {}}, "description": "the blocks' KV"}})
    async def export(lease_id: str, start: int = 0, via: Literal["tcp", "shm", "ray"] = "tcp") -> Response:
        """The lease's blocks from `start` on, in the body (tcp), or named in a JSON body: a shared-memory
        segment (shm; for a decode worker on this host, which unlinks it) or an object in the Ray object store
        (ray; for a decode worker in this worker's Ray cluster, which the body names)."""
        if start < 0:
            raise APIError(400, "start must be >= 0", "start")
        if via == "ray" and state.disagg.ray_cluster is None:
            raise APIError(400, "this worker is not in a Ray cluster (serve --ray-address): pull over tcp",
                           "via", "kv_transport_unavailable")
        try:
            if via == "shm":  # gathered straight into the segment
                name, size, count = await state.engine.call(lambda: _export_to_segment(engine, lease_id, start))
            else:
                data, count = await state.engine.call(lambda: _export(engine, lease_id, start))
                size = len(data)
        except KeyError as e:
            raise APIError(404, e.args[0], code="kv_lease_not_found") from None
        state.metrics.kv_blocks.labels("out", via).inc(count)
        state.metrics.kv_bytes.labels("out", via).inc(size)
        headers = {"x-kv-blocks": str(count), "x-kv-format": engine.kv_format.name}
        if via == "shm":
            state.disagg.segments.setdefault(lease_id, []).append(name)
            return JSONResponse({"name": name, "bytes": size}, headers=headers)
        if via == "ray":
            serialized, ref = await asyncio.to_thread(kv_ray.put, data)
            state.disagg.objects.setdefault(lease_id, []).append(ref)
            return JSONResponse({"object_ref": serialized, "bytes": len(data), "cluster": state.disagg.ray_cluster},
                                headers=headers)
        return Response(data, media_type="application/octet-stream", headers=headers)

    @router.delete("/v1/kv/leases/{lease_id}")
    async def release(lease_id: str) -> dict:
        released = await state.engine.call(lambda: engine.kv_transfer.release(lease_id))
        _discard_segments(state, lease_id)
        if not released:
            raise APIError(404, f"no live KV lease {lease_id!r}", code="kv_lease_not_found")
        return {"lease_id": lease_id, "released": True}

    return router


def _export(engine, lease_id: str, start: int) -> tuple[memoryview, int]:
    lease = engine.kv_transfer.live(lease_id)
    count = max(len(lease.block_ids) - start, 0)
    return engine.kv_transfer.export(lease_id, start), count


def _export_to_segment(engine, lease_id: str, start: int) -> tuple[str, int, int]:
    """(segment name, bytes, blocks): the lease's blocks from start on, gathered into a new segment."""
    transfer = engine.kv_transfer
    count = max(len(transfer.live(lease_id).block_ids) - start, 0)
    size = transfer.export_size(lease_id, start)

    def fill(view: memoryview) -> None:
        if size:
            transfer.export(lease_id, start, out=torch.frombuffer(view, dtype=torch.uint8))
    return kv_shm.write_with(size, fill), size, count


async def expire_leases(state, every_s: float = 1.0) -> None:
    """Frees the blocks of leases no decode worker came for."""
    engine = state.engine.engine
    while True:
        await asyncio.sleep(every_s)
        if engine.kv_transfer.leases and state.engine.is_running:
            expired = await state.engine.call(engine.kv_transfer.expire)
            if expired:
                log.warning("%d KV lease(s) expired unclaimed; their blocks are free again", expired)
        for lease_id in {*state.disagg.segments, *state.disagg.objects} - engine.kv_transfer.leases.keys():
            _discard_segments(state, lease_id)


def _discard_segments(state, lease_id: str) -> None:
    """Segments and objects of a lease that is over: the segments its decode worker took are gone already."""
    for name in state.disagg.segments.pop(lease_id, []):
        kv_shm.discard(name)
    if refs := state.disagg.objects.pop(lease_id, []):
        kv_ray.free(refs)
