"""What the completion and chat endpoints share: model checks, sampling params, request streams, usage."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedserve.engine.async_engine import AsyncLLM, EngineDeadError, RequestFailedError, RequestStream
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.errors import APIError
from pagedserve.server.metrics import RequestTimer, ServerMetrics
from pagedserve.server.protocol import PromptTokensDetails, SamplingFields, Usage


@dataclass
class ServerState:
    engine: AsyncLLM
    model_name: str  # the name clients use for the LLM
    metrics: ServerMetrics
    embedder: Any = None  # pagedserve.embedding.Embedder, or None when embeddings are off

    def check_generation_model(self, requested: str | None) -> None:
        if requested is None or requested == self.model_name:
            return
        if self.embedder is not None and requested == self.embedder.model_name:
            raise APIError(400, f"model '{requested}' is an embedding model; use /v1/embeddings", "model")
        raise APIError(404, f"The model '{requested}' does not exist.", "model", "model_not_found")


def sampling_params(state: ServerState, req: SamplingFields, max_tokens: int | None,
                    logprobs: int | None) -> SamplingParams:
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    vocab = getattr(state.engine.tokenizer, "vocab_size", None)
    if vocab is not None and any(t >= vocab for t in req.stop_token_ids or []):
        raise APIError(400, f"stop_token_ids must be below the vocabulary size {vocab}", "stop_token_ids")
    try:
        return SamplingParams(
            n=req.n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
            repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, seed=req.seed, stop=stop,
            stop_token_ids=list(req.stop_token_ids or []), max_tokens=max_tokens, min_tokens=req.min_tokens,
            ignore_eos=req.ignore_eos, logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc


async def start_streams(state: ServerState, request_id: str, prompts: list[str | list[int]],
                        params: SamplingParams, param: str = "prompt") -> list[RequestStream]:
    """Adds one engine request per prompt (all before the same step); any bad prompt fails the whole
    call with a 400 and withdraws the others."""
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    added = await asyncio.gather(*(state.engine.add_request(rid, p, params) for rid, p in zip(ids, prompts)),
                                 return_exceptions=True)
    streams = [s for s in added if isinstance(s, RequestStream)]
    errors = [e for e in added if isinstance(e, BaseException)]
    if not errors:
        return streams
    close_all(streams)
    exc = errors[0]
    if isinstance(exc, ValueError):
        raise APIError(400, str(exc), param, _error_code(str(exc))) from exc
    if isinstance(exc, EngineDeadError):
        raise APIError(503, str(exc), code="engine_unavailable") from exc
    raise exc


def _error_code(message: str) -> str | None:
    lowered = message.lower()
    return "context_length_exceeded" if "context" in lowered or "too long" in lowered else None


def close_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.close()


async def merged(state: ServerState, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, cumulative output) from all streams as they come; records latency metrics."""
    timers = [RequestTimer() for _ in streams]
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                timers[i].tokens(max((len(c.token_ids) for c in out.outputs), default=0))
                await queue.put((i, out))
            state.metrics.record_generation(timers[i])
        except Exception as exc:  # noqa: BLE001 -- handed to the consumer below
            queue.put_nowait((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise _api_error(item)
            if item.finished:
                remaining -= 1
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        close_all(streams)


def _api_error(exc: BaseException) -> BaseException:
    if isinstance(exc, RequestFailedError):
        return APIError(400, str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_unavailable")
    return exc


async def final_outputs(state: ServerState, streams: list[RequestStream]) -> list[RequestOutput]:
    last: list[RequestOutput | None] = [None] * len(streams)
    async for i, out in merged(state, streams):
        last[i] = out
    return [out for out in last if out is not None]


def usage(outputs: list[RequestOutput]) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def token_text(state: ServerState, token_id: int, decoded: str | None) -> str:
    return decoded if decoded is not None else state.engine.tokenizer.decode([token_id])


# ---- client disconnects ----

async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[Response]) -> Response:
    """Runs work; if the client goes away first, cancels it (which aborts its engine requests)."""
    task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_wait_for_disconnect(request.receive))
    try:
        await asyncio.wait({task, listener}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        listener.cancel()
        if not task.done():
            task.cancel()
    if task.cancelled():
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
    return task.result()


class EventStream(StreamingResponse):
    """Server-sent events that stop (and abort their requests) as soon as the client disconnects,
    even while no token is being sent."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.ensure_future(self.stream_response(send))
        listener = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({streaming, listener}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (streaming, listener):
                task.cancel()
            for task in (streaming, listener):
                with contextlib.suppress(asyncio.CancelledError, OSError):
                    await task
            await self.body_iterator.aclose()


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"
