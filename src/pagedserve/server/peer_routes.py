"""The routes only a cluster's own peers may call, under /internal and signed with the cluster secret
(server/peer_auth.py): the halves of a disaggregated request, which carry `kv_transfer_params`, and the
export and release of a lease's KV blocks. Mounted only on a worker started with `--kv-role`; the public API
refuses `kv_transfer_params` outright, so a client can neither plant KV in the prefix cache nor make a worker
contact a URL it chose."""
from __future__ import annotations

import asyncio
from typing import Annotated, Literal

import torch
from fastapi import APIRouter, Depends, Path, Request
from fastapi.responses import JSONResponse, Response

from pagedserve.server import kv_ray, kv_shm
from pagedserve.server.chat import create_chat_completion
from pagedserve.server.completions import create_completion
from pagedserve.server.errors import APIError
from pagedserve.server.kv_transfer import discard_exports, sealed
from pagedserve.server.peer_auth import PEER_PREFIX, peer_dependency
from pagedserve.server.protocol import ChatCompletionRequest, CompletionRequest, KVTransferParams
from pagedserve.server.serving import RequestContext, ServerState, respond, until_disconnect

LeaseId = Annotated[str, Path(pattern=r"^[0-9a-f]{32}$")]


class PeerCompletionRequest(CompletionRequest):
    kv_transfer_params: KVTransferParams | None = None


class PeerChatCompletionRequest(ChatCompletionRequest):
    kv_transfer_params: KVTransferParams | None = None


def peer_routes(state: ServerState) -> APIRouter:
    r = APIRouter(prefix=PEER_PREFIX, include_in_schema=False,
                  dependencies=[Depends(peer_dependency(state.peer_key, "this route"))])
    engine = state.engine.engine

    @r.post("/v1/completions")
    async def completions(req: PeerCompletionRequest, request: Request) -> Response:
        ctx = RequestContext.build(req.priority, req.timeout, request.headers)
        kv = sealed(state, req.kv_transfer_params)
        return await until_disconnect(request, respond(create_completion(state, req, ctx, kv), ctx))

    @r.post("/v1/chat/completions")
    async def chat_completions(req: PeerChatCompletionRequest, request: Request) -> Response:
        ctx = RequestContext.build(req.priority, req.timeout, request.headers)
        kv = sealed(state, req.kv_transfer_params)
        return await until_disconnect(request, respond(create_chat_completion(state, req, ctx, kv), ctx))

    @r.get("/v1/kv/info")
    async def info() -> dict:
        """What a router checks before pairing workers: same model, block size and KV format; and the Ray cluster
        this worker joined (its GCS address), if any."""
        return {"kv_role": state.disagg.role, "model": state.model_name, "block_size": engine.kv.block_size,
                "kv_format": engine.kv_format.name, "lease_s": engine.kv_transfer.lease_s,
                "ray_cluster": state.disagg.ray_cluster}

    @r.get("/v1/kv/leases/{lease_id}", response_class=Response)
    async def export(lease_id: LeaseId, start: int = 0, via: Literal["tcp", "shm", "ray"] = "tcp") -> Response:
        """The lease's blocks from `start` on, in the body (tcp), or named in a JSON body: a shared-memory
        segment (shm; for a decode worker on this host, which unlinks it) or an object in the Ray object store
        (ray; for a decode worker in this worker's Ray cluster, which the body names). A lease holds one
        export at a time: a new one drops the last."""
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
        if via == "tcp":
            return Response(data, media_type="application/octet-stream", headers=headers)
        discard_exports(state, lease_id)
        if via == "shm":
            state.disagg.segments[lease_id] = name
            return JSONResponse({"name": name, "bytes": size}, headers=headers)
        serialized, ref = await asyncio.to_thread(kv_ray.put, data)
        state.disagg.objects[lease_id] = ref
        return JSONResponse({"object_ref": serialized, "bytes": size, "cluster": state.disagg.ray_cluster},
                            headers=headers)

    @r.delete("/v1/kv/leases/{lease_id}")
    async def release(lease_id: LeaseId) -> dict:
        released = await state.engine.call(lambda: engine.kv_transfer.release(lease_id))
        discard_exports(state, lease_id)
        if not released:
            raise APIError(404, f"no live KV lease {lease_id!r}", code="kv_lease_not_found")
        return {"lease_id": lease_id, "released": True}

    return r


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
