"""LoRA adapters over HTTP, as vLLM serves them: `--lora-modules` at start-up, `model: "<adapter>"` per
request, and loading or unloading at run time (POST /v1/load_lora_adapter, /v1/unload_lora_adapter).

An adapter loads on the engine's loader thread, never on its step thread. Unloading forgets the name at
once (new requests for it get a 404); requests already running under it finish with it. The engine may
evict an adapter's weights from memory (--max-cpu-loras): the server still knows it, and the next request
for it loads it again.

Loading names a folder on this server's disk, so the load and unload routes answer only a cluster's signed
peers (server/peer_auth.py: the router loading its lora_modules), never a client: 403 otherwise, and 403
always on a server without a cluster secret, whose adapters are the --lora-modules it started with. One name
loads once: a second load of a name being loaded is refused, not run beside the first.
"""
from __future__ import annotations

import asyncio
import itertools
import json
from typing import Annotated

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse
from pydantic import AfterValidator, Field

from pagedserve.lora_request import LoRARequest, check_lora_name
from pagedserve.server.errors import APIError
from pagedserve.server.peer_auth import peer_dependency
from pagedserve.server.protocol import StrictModel, Text
from pagedserve.server.serving import ServerState

_ids = itertools.count(1)
TEXT_DOC: dict[int | str, dict] = {200: {"content": {"text/plain": {}}, "description": "a line saying what was done"}}
LoRAName = Annotated[str, AfterValidator(check_lora_name)]


class LoadLoRAAdapterRequest(StrictModel):
    lora_name: LoRAName
    lora_path: Text = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(StrictModel):
    lora_name: LoRAName
    lora_int_id: int | None = None


def parse_lora_modules(items: list[str]) -> list[tuple[str, str, str | None]]:
    """--lora-modules entries, `name=path` or JSON {"name", "path", "base_model_name"}: (name, path, base)."""
    out = []
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                obj = json.loads(item)
                name, path, base = obj["name"], obj["path"], obj.get("base_model_name")
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise ValueError(f"--lora-modules {item!r}: expected JSON with name and path ({exc})") from None
            if not isinstance(path, str) or not (base is None or isinstance(base, str)):
                raise ValueError(f"--lora-modules {item!r}: path and base_model_name are strings")
        else:
            name, sep, path = item.partition("=")
            base = None
            if not sep or not path:
                raise ValueError(f"--lora-modules {item!r}: expected name=path")
        try:
            out.append((check_lora_name(name), path, base))
        except ValueError as exc:
            raise ValueError(f"--lora-modules {item!r}: {exc}") from None
    return out


def register_startup_adapters(state: ServerState, modules: list[tuple[str, str, str | None]]) -> None:
    """Loads (and pins) the adapters given at start-up; a bad one stops the server with the reason."""
    loras = state.engine.engine.loras
    if modules and loras is None:
        raise ValueError("--lora-modules needs --enable-lora")
    for name, path, base in modules:
        if base is not None and base != state.model_name:
            raise ValueError(f"--lora-modules {name}: made for base model {base!r}, this server runs "
                             f"{state.model_name!r}")
        request = LoRARequest(name, next(_ids), path)
        loras.load(request, pin=True)
        state.loras[name] = request


def lora_routes(state: ServerState) -> APIRouter:
    r = APIRouter(dependencies=[Depends(peer_dependency(state.peer_key, "run-time adapter loading"))])
    loading: dict[str, asyncio.Future] = {}  # loads under way by name (the event loop's own: no lock needed)

    @r.post("/v1/load_lora_adapter", response_model=None, responses=TEXT_DOC)
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> PlainTextResponse:
        loras, name = state.engine.engine.loras, req.lora_name
        if loras is None:
            raise APIError(400, "this server does not serve LoRA adapters (start it with --enable-lora)",
                           "lora_name")
        if name in loading:  # answer once the load under way settled, so "already served" is true when said
            await asyncio.wait([loading[name]])
            if name not in state.loras:
                raise APIError(400, f"a concurrent load of the adapter '{name}' failed", "lora_name")
        if name == state.model_name or name in state.loras:
            raise APIError(400, f"the model '{name}' is already served; unload it first", "lora_name")
        request = LoRARequest(name, next(_ids), req.lora_path)
        loading[name] = load = asyncio.wrap_future(loras.submit(request))
        try:
            await load
            state.loras[name] = request  # before the waiters on `load` look
        except ValueError as exc:
            raise APIError(400, str(exc), "lora_path") from None
        finally:
            del loading[name]
        return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")

    @r.post("/v1/unload_lora_adapter", response_model=None, responses=TEXT_DOC)
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        request = state.loras.pop(req.lora_name, None)
        if request is None:
            raise APIError(404, f"The LoRA adapter '{req.lora_name}' is not loaded.", "lora_name",
                           "model_not_found")
        state.engine.engine.loras.unload(req.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")

    return r
