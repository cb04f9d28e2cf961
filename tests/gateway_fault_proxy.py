"""A fault-injecting HTTP proxy for the gateway tests: a real process in front of a real pagedserve server.

POST /_fault {"mode": M} sets what it does with every other request:
  ok    forward to the upstream unchanged
  529   answer 529 "overloaded" without forwarding (an overloaded provider)
  cut   forward, but end a streamed answer right after its first event (a provider dying mid-stream)
  hang  never answer (a provider that times out); counts the callers that give up as abandoned
GET /_fault shows the mode, counts of requests seen, faulted and abandoned, and the last request's headers.
"""
from __future__ import annotations

import argparse
import asyncio

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}


def build(upstream: str) -> Starlette:
    state = {"mode": "ok", "requests": 0, "faulted": 0, "abandoned": 0, "last_headers": {}}
    client = httpx.AsyncClient(base_url=upstream, timeout=None, trust_env=False)

    async def fault(request: Request) -> Response:
        if request.method == "POST":
            mode = (await request.json())["mode"]
            if mode not in {"ok", "529", "cut", "hang"}:
                return JSONResponse({"error": f"unknown mode {mode}"}, status_code=400)
            state["mode"] = mode
        return JSONResponse(state)

    async def proxy(request: Request) -> Response:
        state["requests"] += 1
        state["last_headers"] = dict(request.headers)
        mode = state["mode"]
        if mode != "ok":
            state["faulted"] += 1
        if mode == "529":
            return JSONResponse({"error": {"message": "Overloaded", "type": "overloaded_error"}}, status_code=529)
        if mode == "hang":  # hold the request until the caller gives up, so shutdown is not blocked
            while not await request.is_disconnected():
                await asyncio.sleep(0.05)
            state["abandoned"] += 1
            return Response(status_code=499)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        upstream_request = client.build_request(request.method, request.url.path, headers=headers,
                                                content=await request.body(), params=request.query_params)
        response = await client.send(upstream_request, stream=True)
        out_headers = {k: v for k, v in response.headers.items() if k.lower() not in HOP_HEADERS}

        async def body():
            seen = b""
            try:
                async for chunk in response.aiter_raw():
                    if mode != "cut":
                        yield chunk
                        continue
                    seen += chunk
                    end = seen.find(b"\n\n", seen.find(b"data:"))
                    if seen.find(b"data:") >= 0 and end >= 0:
                        yield seen[:end + 2]
                        return  # drop the connection after the first event
            finally:
                await response.aclose()
        return StreamingResponse(body(), status_code=response.status_code, headers=out_headers)

    return Starlette(routes=[Route("/_fault", fault, methods=["GET", "POST"]),
                             Route("/{path:path}", proxy, methods=["GET", "POST", "DELETE"])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--upstream", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    uvicorn.run(build(args.upstream), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
