"""A stand-in OpenAI-compatible provider for the gateway tests (it is NOT pagedserve, and says so in every
answer's `model` and `system_fingerprint`): used only where a real `pagedserve serve` cannot produce the
behaviour under test, or where a test needs thousands of instant answers (fuzzing the gateway's input).

POST /_mode {"mode": M}:
  ok          answer at once: "stub answer", usage of 3 prompt + 2 completion tokens (streams too)
  binary-4xx  a 400 whose body is not UTF-8 (nor JSON)
  bad-event   a stream whose second event is a JSON array, not an object
  bad-first   a stream whose first event is a JSON number
  no-usage    a non-streamed answer without usage
  fail        a 500 (a provider that is down)
  hang        no answer until the caller gives up (a provider that times out); counted as abandoned
GET /_mode shows the mode, how many completions were asked and how many callers gave up.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODEL = "stand-in-not-pagedserve"
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def answer(kind: str, usage: dict | None) -> dict:
    choice = ({"index": 0, "message": {"role": "assistant", "content": "stub answer"}, "finish_reason": "stop"}
              if kind == "chat" else {"index": 0, "text": "stub answer", "finish_reason": "stop"})
    body = {"id": "stub-1", "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": MODEL, "system_fingerprint": "stand-in", "choices": [choice]}
    return {**body, "usage": usage} if usage else body


def events(kind: str, mode: str):
    delta = {"delta": {"content": "stub"}} if kind == "chat" else {"text": "stub"}
    first = 7 if mode == "bad-first" else {"id": "stub-1", "model": MODEL, "choices": [{"index": 0, **delta}]}
    yield f"data: {json.dumps(first)}\n\n"
    if mode == "bad-event":
        yield "data: [1, 2]\n\n"
    yield f"data: {json.dumps({'id': 'stub-1', 'model': MODEL, 'choices': [], 'usage': USAGE})}\n\n"
    yield "data: [DONE]\n\n"


def build() -> Starlette:
    state = {"mode": "ok", "requests": 0, "abandoned": 0}

    async def mode(request: Request) -> Response:
        if request.method == "POST":
            state["mode"] = (await request.json())["mode"]
        return JSONResponse(state)

    async def complete(request: Request) -> Response:
        state["requests"] += 1
        kind = "chat" if request.url.path.endswith("/chat/completions") else "completions"
        body = await request.json()
        if state["mode"] == "fail":
            return JSONResponse({"error": {"message": "stub is down", "type": "server_error"}}, status_code=500)
        if state["mode"] == "hang":
            while not await request.is_disconnected():
                await asyncio.sleep(0.05)
            state["abandoned"] += 1
            return Response(status_code=499)
        if state["mode"] == "binary-4xx":
            return Response(b"\xff\xfe\x80 bad request \xc3\x28", status_code=400, media_type="application/octet-stream")
        if body.get("stream"):
            return StreamingResponse(events(kind, state["mode"]), media_type="text/event-stream")
        return JSONResponse(answer(kind, None if state["mode"] == "no-usage" else USAGE))

    return Starlette(routes=[Route("/_mode", mode, methods=["GET", "POST"]),
                             Route("/v1/chat/completions", complete, methods=["POST"]),
                             Route("/v1/completions", complete, methods=["POST"])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    uvicorn.run(build(), host="127.0.0.1", port=parser.parse_args().port, log_level="warning")


if __name__ == "__main__":
    main()
