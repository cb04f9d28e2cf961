"""Disaggregated prefill and decode, the worker's side (vLLM's `kv_transfer_params` vocabulary), on the peer
routes only (server/peer_routes.py: signed with the cluster secret; a client can send none of this).

- A prefill worker (`--kv-role prefill` or `both`) given `kv_transfer_params: {"do_remote_decode": true}`
  computes the prompt and its first token only, leases the prompt's full KV blocks and answers with a handle
  in `kv_transfer_params`, sealed with the cluster secret and expiring with the lease: lease id, block count,
  block size, KV format, a digest of the tokens (and of the LoRA adapter's weights, for a request under one:
  its blocks are cached under that identity on both sides) and the first token. Leases pin at most
  `--kv-lease-max-fraction` of the pool; past it a handle covers fewer blocks (the decode worker computes the
  rest).
- A decode worker (`decode` or `both`) given `kv_transfer_params: {"do_remote_prefill": true, "remote_url":
  <the prefill worker's origin>, <the handle>}` checks the seal, pulls the blocks its own prefix cache lacks from
  `GET {remote_url}/internal/v1/kv/leases/{id}` (signed), registers them in that cache, acknowledges (`DELETE`,
  which frees the lease into the prefill worker's prefix cache) and runs the request, which then finds its
  prompt cached. A pull that fails or times out, or a handle whose seal fails, is recomputed here
  (`--kv-load-failure recompute`, the default) or fails the request with a 502 (`fail`). A plain single sample
  goes on from the prefill worker's first token, which streams before the pull.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Literal
from urllib.parse import urlencode

import httpx

from pagedserve.engine.kv_transfer import tokens_sha
from pagedserve.engine.request import takes_output_from_elsewhere
from pagedserve.lora_request import LoRARequest
from pagedserve.server import kv_ray, kv_shm
from pagedserve.server.errors import APIError
from pagedserve.server.peer_auth import PEER_PREFIX
from pagedserve.server.protocol import KVTransferParams

log = logging.getLogger(__name__)
ROLES = ("prefill", "decode", "both")
# Blocks imported per call on the engine thread: ~2-3 ms of copying for the default model in bf16, so a long
# prompt's import pauses the requests decoding here for a part at a time, not for all of it at once.
IMPORT_PART_BLOCKS = 32


@dataclass
class Disaggregation:
    role: Literal["prefill", "decode", "both"] | None = None  # None: not a disaggregated worker (no peer routes)
    load_failure: Literal["recompute", "fail"] = "recompute"
    pull_timeout_s: float = 10.0
    # auto: shared memory with a worker on this host, the Ray object store with one in our Ray cluster, else TCP
    transport: Literal["auto", "tcp", "shm", "ray"] = "auto"
    ray_cluster: str | None = None  # the GCS address of the Ray cluster this worker joined
    client: httpx.AsyncClient | None = field(default=None, repr=False)
    # lease id -> the shared-memory segment or Ray object of its latest export (one each: a new export of the
    # same lease drops the one before, so repeated pulls of a lease hold no more memory than one)
    segments: dict[str, str] = field(default_factory=dict)
    objects: dict[str, object] = field(default_factory=dict)

    def http(self) -> httpx.AsyncClient:
        if self.client is None:
            self.client = httpx.AsyncClient(timeout=self.pull_timeout_s)
        return self.client


def check_role(state, kv: KVTransferParams, num_prompts: int, stream: bool) -> None:
    role = state.disagg.role
    if role is None:
        raise APIError(400, "this worker runs without --kv-role: it takes no part in disaggregated serving",
                       "kv_transfer_params", "kv_role_mismatch")
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


async def lease(state, prompt_ids: list[int], lora: LoRARequest | None, first_token_id: int | None) -> dict:
    """The prefill half is done: pin the prompt's blocks and describe them for the decode worker, sealed."""
    engine = state.engine.engine
    salt = await adapter_salt(state, lora)
    held = await state.engine.call(lambda: engine.kv_transfer.lease(prompt_ids, salt))
    handle = held.public(engine.kv.block_size, engine.kv_format.name, engine.kv_transfer.lease_s)
    if first_token_id is not None:
        handle["first_token_id"] = first_token_id
    return state.peer_key.seal(handle, engine.kv_transfer.lease_s)


def sealed(state, kv: KVTransferParams | None) -> KVTransferParams | None:
    """A decode half's parameters when its handle's seal holds; None (compute the prompt here, first token
    included) when it does not, or a 502 under --kv-load-failure fail."""
    if kv is None or not kv.do_remote_prefill:
        return kv
    try:
        state.peer_key.unseal(kv.handle())
    except ValueError as e:
        state.metrics.kv_failures.labels("bad_handle").inc()
        log.warning("KV handle from %s refused (%s); %s", kv.remote_url, e,
                    "computing the prompt here" if state.disagg.load_failure == "recompute" else "failing the request")
        if state.disagg.load_failure == "fail":
            raise APIError(502, f"KV transfer refused: {e}", code="kv_transfer_failed") from None
        return None
    return kv


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
    try:
        state.peer_key.unseal(kv.handle())
    except ValueError as e:  # a handle that expired while this request waited
        raise TransferFailed("bad_handle", str(e)) from None
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
    transport = _transport(state.disagg, kv.remote_url)
    if transport == "tcp":
        return "tcp", (await _get(state, kv, {"start": start})).content
    if transport == "ray" and state.disagg.ray_cluster is None:
        raise TransferFailed("mismatch", "--kv-transport ray needs --ray-address (this worker is not in a Ray "
                                         "cluster)")
    handle = _json_object(await _get(state, kv, {"start": start, "via": transport}))
    size = handle.get("bytes")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise TransferFailed("bad_payload", "the export's answer names no byte count")
    if transport == "shm":
        try:
            return "shm", await asyncio.to_thread(kv_shm.take, handle.get("name"), size)
        except FileNotFoundError:  # the same name, another machine after all
            return "tcp", (await _get(state, kv, {"start": start})).content
        except (ValueError, OSError) as e:
            raise TransferFailed("bad_payload", str(e)) from None
    if handle.get("cluster") != state.disagg.ray_cluster or not isinstance(handle.get("object_ref"), str):
        return "tcp", (await _get(state, kv, {"start": start})).content
    try:
        data = await asyncio.to_thread(kv_ray.take, handle["object_ref"], state.disagg.pull_timeout_s)
    except kv_ray.errors() as e:
        raise TransferFailed("timeout" if isinstance(e, TimeoutError) else "unreachable", repr(e)) from None
    except ValueError as e:
        raise TransferFailed("bad_payload", str(e)) from None
    if len(data) != size:
        raise TransferFailed("bad_payload", f"{len(data)} bytes in the object store; the handle said {size}")
    return "ray", data


def _json_object(response: httpx.Response) -> dict:
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise TransferFailed("bad_payload", "the export's answer is not a JSON object")
    return body


def lease_target(lease_id: str, params: dict | None = None) -> str:
    """The peer route of a lease (its id is 32 hex digits: checked by KVTransferParams), with its query."""
    query = f"?{urlencode(params)}" if params else ""
    return f"{PEER_PREFIX}/v1/kv/leases/{lease_id}{query}"


async def _get(state, kv: KVTransferParams, params: dict) -> httpx.Response:
    target = lease_target(kv.lease_id, params)
    try:
        response = await state.disagg.http().get(kv.remote_url.rstrip("/") + target,
                                                 headers=state.peer_key.sign("GET", target))
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
    target = lease_target(kv.lease_id)

    async def acknowledge() -> None:
        try:
            await state.disagg.http().delete(kv.remote_url.rstrip("/") + target,
                                             headers=state.peer_key.sign("DELETE", target))
        except httpx.HTTPError:
            pass
    task = asyncio.get_running_loop().create_task(acknowledge())
    state.background.add(task)
    task.add_done_callback(state.background.discard)


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
            discard_exports(state, lease_id)


def discard_exports(state, lease_id: str) -> None:
    """The segment and object of a lease's last export (its decode worker took the segment, if it came)."""
    if (name := state.disagg.segments.pop(lease_id, None)) is not None:
        kv_shm.discard(name)
    if (ref := state.disagg.objects.pop(lease_id, None)) is not None:
        kv_ray.free([ref])
