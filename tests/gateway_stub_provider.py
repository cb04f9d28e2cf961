"""A stand-in OpenAI-compatible provider for the gateway tests (it is NOT pagedserve, and says so in every
answer's `model` and `system_fingerprint`): used only where a real `pagedserve serve` cannot produce the
behaviour under test, or where a test needs thousands of instant answers (fuzzing the gateway's input).

Every answer names the request it answers ("stub answer 7" for the 7th completion asked), so a test can tell
one call's answer from another's.

POST /_mode {"mode": M}:
  ok          answer at once: "stub answer N", usage of 3 prompt + 2 completion tokens (streams too: "stub",
              then " answer N", a finishing chunk, usage)
  binary-4xx  a 400 whose body is not UTF-8 (nor JSON)
  bad-event   a stream whose second event is a JSON array, not an object
  bad-first   a stream whose first event is a JSON number
  no-usage    a non-streamed answer without usage
  fail        a 500 (a provider that is down)
  hang        no answer until the caller gives up (a provider that times out); counted as abandoned
A request answers in the mode set when it arrived.
POST /_gate {"open": false} holds every answer at a gate (a stream after its first event) until
POST /_gate {"open": true}; `waiting` counts the requests held there.
GET /_mode shows the mode, how many completions were asked, how many callers gave up, how many wait at
the gate, and the last request's body.
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


def answer(kind: str, n: int, usage: dict | None) -> dict:
    text = f"stub answer {n}"
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
              if kind == "chat" else {"index": 0, "text": text, "finish_reason": "stop"})
    body = {"id": f"stub-{n}", "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()), "model": MODEL, "system_fingerprint": "stand-in", "choices": [choice]}
    return {**body, "usage": usage} if usage else body


def chunk(kind: str, n: int, text: str | None, finish: str | None = None) -> str:
    piece = {"delta": {} if text is None else {"content": text}} if kind == "chat" else {"text": text or ""}
    event = {"id": f"stub-{n}", "model": MODEL, "choices": [{"index": 0, **piece, "finish_reason": finish}]}
    return f"data: {json.dumps(event)}\n\n"


async def events(kind: str, n: int, mode: str, through_gate, state: dict):
    """The stream; a caller that goes away before its end is counted as abandoned."""
    try:
        yield "data: 7\n\n" if mode == "bad-first" else chunk(kind, n, "stub")
        await through_gate()
        if mode == "bad-event":
            yield "data: [1, 2]\n\n"
        yield chunk(kind, n, f" answer {n}")
        yield chunk(kind, n, None, "stop")
        yield f"data: {json.dumps({'id': f'stub-{n}', 'model': MODEL, 'choices': [], 'usage': USAGE})}\n\n"
        yield "data: [DONE]\n\n"
    except (asyncio.CancelledError, GeneratorExit):
        state["abandoned"] += 1
        raise


def build() -> Starlette:
    state = {"mode": "ok", "requests": 0, "abandoned": 0, "waiting": 0, "last_body": None}
    gate = asyncio.Event()
    gate.set()

    async def through_gate() -> None:
        if gate.is_set():
            return
        state["waiting"] += 1
        try:
            await gate.wait()
        finally:
            state["waiting"] -= 1

    async def mode(request: Request) -> Response:
        if request.method == "POST":
            state["mode"] = (await request.json())["mode"]
        return JSONResponse(state)

    async def set_gate(request: Request) -> Response:
        if (await request.json())["open"]:
            gate.set()
        else:
            gate.clear()
        return JSONResponse(state)

    async def until_gone(request: Request) -> Response:
        while not await request.is_disconnected():
            await asyncio.sleep(0.05)
        state["abandoned"] += 1
        return Response(status_code=499)

    async def complete(request: Request) -> Response:
        state["requests"] += 1
        n, current = state["requests"], state["mode"]
        kind = "chat" if request.url.path.endswith("/chat/completions") else "completions"
        body = state["last_body"] = await request.json()
        if body.get("stream") and current not in ("fail", "hang", "binary-4xx"):
            return StreamingResponse(events(kind, n, current, through_gate, state), media_type="text/event-stream")
        gated = asyncio.ensure_future(through_gate())
        gone = asyncio.ensure_future(until_gone(request))
        await asyncio.wait({gated, gone}, return_when=asyncio.FIRST_COMPLETED)
        if gone.done():
            gated.cancel()
            return gone.result()
        gone.cancel()
        if current == "fail":
            return JSONResponse({"error": {"message": "stub is down", "type": "server_error"}}, status_code=500)
        if current == "hang":
            return await until_gone(request)
        if current == "binary-4xx":
            return Response(b"\xff\xfe\x80 bad request \xc3\x28", status_code=400, media_type="application/octet-stream")
        return JSONResponse(answer(kind, n, None if current == "no-usage" else USAGE))

    return Starlette(routes=[Route("/_mode", mode, methods=["GET", "POST"]), Route("/_gate", set_gate, methods=["POST"]),
                             Route("/v1/chat/completions", complete, methods=["POST"]),
                             Route("/v1/completions", complete, methods=["POST"])])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    uvicorn.run(build(), host="127.0.0.1", port=parser.parse_args().port, log_level="warning")


if __name__ == "__main__":
    main()
