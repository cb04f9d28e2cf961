"""What the completion and chat endpoints share: model checks, sampling params, request streams, usage."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedserve.engine.async_engine import AsyncLLM, EngineDeadError, RequestFailedError, RequestStream
from pagedserve.lora_request import LoRARequest
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import GuidedDecodingParams, SamplingParams
from pagedserve.server.admission import AdmissionConfig, AdmissionController, Rejected, Ticket, parse_priority
from pagedserve.server.errors import APIError
from pagedserve.server.kv_transfer import (
    Disaggregation,
    check_role,
    first_token,
    lease,
    pull,
    pull_then_run,
    release,
)
from pagedserve.server.metrics import RequestTimer, ServerMetrics
from pagedserve.server.peer_auth import PeerKey
from pagedserve.server.protocol import (
    KVTransferParams,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    SamplingFields,
    Usage,
    ignored_fields,
)
from pagedserve.server.tool_parsers import HermesParser, ToolParser

ENGINE_RETRY_AFTER_S = 5  # what a 503 for a dead engine tells clients; a supervisor restarts us meanwhile
logger = logging.getLogger(__name__)


@dataclass
class ServerState:
    engine: AsyncLLM
    model_name: str  # the name clients use for the LLM
    metrics: ServerMetrics
    embedder: Any = None  # pagedserve.embedding.Embedder, or None when embeddings are off
    admission: AdmissionController = field(default_factory=lambda: AdmissionController(AdmissionConfig()))
    tool_parser: ToolParser = field(default_factory=HermesParser)  # how this model family writes tool calls
    loras: dict[str, LoRARequest] = field(default_factory=dict)  # adapters served, by the name clients use
    disagg: Disaggregation = field(default_factory=Disaggregation)  # --kv-role and the transfer's settings
    background: set = field(default_factory=set)  # fire-and-forget tasks (lease acknowledgements)
    peer_key: PeerKey | None = None  # the cluster secret: what internal routes check (server/peer_auth.py)

    def response_model(self, requested: str | None) -> str:
        """The `model` a response names: the adapter asked for, else the base model."""
        return requested if requested in self.loras else self.model_name

    def check_generation_model(self, requested: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names (None: the base model); 404 for an unknown model."""
        if requested is None or requested == self.model_name:
            return None
        if requested in self.loras:
            return self.loras[requested]
        if self.embedder is not None and requested == self.embedder.model_name:
            raise APIError(400, f"model '{requested}' is an embedding model; use /v1/embeddings", "model")
        raise APIError(404, f"The model '{requested}' does not exist.", "model", "model_not_found")


def sampling_params(state: ServerState, req: SamplingFields, max_tokens: int | None, logprobs: int | None,
                    guided: GuidedDecodingParams | None = None, prompt_logprobs: int | None = None,
                    n: int | None = None) -> SamplingParams:
    """prompt_logprobs: how many alternatives each prompt token's logprob needs (default: the request's own
    prompt_logprobs); n: samples per prompt (default: the request's n)."""
    for name in sorted(ignored_fields(req)):
        logger.debug("%s: accepted and ignored (not supported by this server)", name)
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    vocab = getattr(state.engine.tokenizer, "vocab_size", None)
    if vocab is not None and any(t >= vocab for t in req.stop_token_ids or []):
        raise APIError(400, f"stop_token_ids must be below the vocabulary size {vocab}", "stop_token_ids")
    bias = {int(t): b for t, b in (req.logit_bias or {}).items()}
    if vocab is not None and (outside := [t for t in bias if t >= vocab]):
        raise APIError(400, f"logit_bias names token {outside[0]}, outside the vocabulary (size {vocab})",
                       "logit_bias")
    try:
        return SamplingParams(
            n=req.n if n is None else n, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
            repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty, seed=req.seed, stop=stop,
            stop_token_ids=list(req.stop_token_ids or []), max_tokens=max_tokens, min_tokens=req.min_tokens,
            ignore_eos=req.ignore_eos, logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output, guided_decoding=guided,
            prompt_logprobs=req.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            logit_bias=bias or None,
        )
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc


@dataclass(slots=True)
class RequestContext:
    """Overload options of one HTTP request (body fields win over headers) and the response headers
    the handler adds."""

    priority: int = 0
    timeout: float | None = None  # seconds from admission to the last token
    headers: dict[str, str] = field(default_factory=dict)
    degraded: list[str] | None = None

    @classmethod
    def build(cls, body_priority: int | str | None, body_timeout: float | None, headers: Any) -> RequestContext:
        try:
            priority = parse_priority(body_priority if body_priority is not None else headers.get("x-priority"))
        except ValueError as exc:
            raise APIError(400, str(exc), "priority") from exc
        timeout = body_timeout
        if timeout is None and (header := headers.get("x-request-timeout")) is not None:
            try:
                timeout = float(header)
            except ValueError:
                timeout = -1.0
            if not 0 < timeout < float("inf"):
                raise APIError(400, f"x-request-timeout must be a positive number of seconds, not {header!r}",
                               "timeout")
        return cls(priority, timeout)


@dataclass(slots=True)
class Call:
    """The engine requests of one API call, with its admission ticket and deadline."""

    streams: list[RequestStream]
    ticket: Ticket
    admission: AdmissionController
    deadline: float | None  # time.monotonic() by which the last token must be out
    prompt_ids: list[list[int]] = field(default_factory=list)
    kv_transfer: KVTransferParams | None = None
    lora: LoRARequest | None = None
    transfer: asyncio.Future | None = None  # a decode half's pull, when its first token streams before it

    def close(self) -> None:
        """Aborts what is still running and returns the ticket (idempotent)."""
        if self.transfer is not None:
            self.transfer.cancel()  # the pull frees the prefill worker's lease as it stops
        close_all(self.streams)
        self.admission.finished(self.ticket)


async def start_streams(state: ServerState, ctx: RequestContext, request_id: str, prompts: list[str | list[int]],
                        params: SamplingParams, param: str = "prompt", lora: LoRARequest | None = None,
                        kv: KVTransferParams | None = None, stream: bool = False) -> Call:
    """Admits the call, then adds one engine request per prompt (all before the same step); any bad
    prompt fails the whole call with a 400 and withdraws the others. kv: this is one half of a
    disaggregated request (server/kv_transfer.py): the prefill half stops after the first token; the
    decode half first pulls the prompt's KV blocks from the prefill worker."""
    if not state.engine.is_running:
        raise APIError(503, "the engine is not running", code="engine_unavailable",
                       headers={"Retry-After": str(ENGINE_RETRY_AFTER_S)})
    prompt_ids = [state.engine.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
    if kv is not None:
        check_role(state, kv, len(prompt_ids), stream)
        if kv.do_remote_decode:  # the first token under the request's own EOS rule
            params = dataclasses.replace(params, n=1, max_tokens=1, min_tokens=min(params.min_tokens, 1))
    _check_size(state, prompt_ids, params, param)
    params = _degraded(state, ctx, params)
    ticket = _admit(state, ctx, prompt_ids, params)
    priority = ctx.priority if state.admission.config.enabled else 0
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    first = first_token(state, kv, params)
    if kv is not None and kv.do_remote_prefill and first is None:
        try:
            await pull(state, prompt_ids[0], kv, lora)
        except BaseException:
            state.admission.finished(ticket)
            raise
    resume = {} if first is None else {"output_token_ids": [first], "hold": True}
    try:
        added = await asyncio.gather(*(state.engine.add_request(rid, p, params, priority, lora, **resume)
                                       for rid, p in zip(ids, prompt_ids)), return_exceptions=True)
    except BaseException:  # cancelled (client gone): the engine side withdraws itself
        state.admission.finished(ticket)
        if first is not None:
            release(state, kv)
        raise
    streams = [s for s in added if isinstance(s, RequestStream)]
    errors = [e for e in added if isinstance(e, BaseException)]
    deadline = None if ctx.timeout is None else ticket.admitted_at + ctx.timeout
    call = Call(streams, ticket, state.admission, deadline, prompt_ids, kv, lora)
    if first is not None:
        if errors or streams[0].first.finished:  # nothing to pull: refused, or ended by the prefill's token
            release(state, kv)
        else:  # the first token streams now; the request runs once the blocks are in (or recomputes)
            call.transfer = asyncio.ensure_future(pull_then_run(state, ids[0], prompt_ids[0], kv, lora))
    if not errors:
        return call
    call.close()
    exc = errors[0]
    if isinstance(exc, ValueError):
        raise APIError(400, str(exc), param, _error_code(str(exc))) from exc
    if isinstance(exc, EngineDeadError):
        raise APIError(503, str(exc), code="engine_unavailable",
                       headers={"Retry-After": str(ENGINE_RETRY_AFTER_S)}) from exc
    raise exc


def _check_size(state: ServerState, prompt_ids: list[list[int]], params: SamplingParams, param: str) -> None:
    """Refuses a request that one server could never hold: more sequences (prompts x n) than the engine
    runs at once, or more KV tokens than the admission bound. An empty queue admits anything, so such a
    request would otherwise take every seat and block for minutes while everything after it is shed."""
    seats, sequences = state.engine.max_num_seqs, len(prompt_ids) * params.n
    if sequences > seats:
        raise APIError(400, f"this request asks for {sequences} sequences ({len(prompt_ids)} prompt(s) x "
                            f"n={params.n}); this server runs at most {seats} at once, so send at most that many "
                            "per request",
                       "n" if len(prompt_ids) == 1 else param, "request_too_large")
    max_len, bound = state.engine.max_model_len, state.admission.config.max_queued_tokens
    # A prompt past the context is the engine's to refuse (with the more telling message).
    cost = params.n * sum(min(max_len, len(ids) + (params.max_tokens or max_len)) for ids in prompt_ids)
    if cost > bound:
        raise APIError(400, f"this request may need {cost} KV tokens ({len(prompt_ids)} prompt(s) x n={params.n} x "
                            f"(prompt + max_tokens)), more than the {bound} this server admits at once; lower "
                            "max_tokens, n or the number of prompts", "max_tokens", "request_too_large")


def _admit(state: ServerState, ctx: RequestContext, prompt_ids: list[list[int]], params: SamplingParams) -> Ticket:
    max_len = state.engine.max_model_len
    cost = params.n * sum(len(ids) + max(0, params.max_tokens or max_len - len(ids)) for ids in prompt_ids)
    try:
        return state.admission.admit(ctx.priority, cost, ctx.timeout, len(prompt_ids) * params.n)
    except Rejected as exc:
        raise _refusal(exc) from exc


def _refusal(exc: Rejected) -> APIError:
    return APIError(exc.status, exc.message, code=exc.code, headers={"Retry-After": str(exc.retry_after)})


def _degraded(state: ServerState, ctx: RequestContext, params: SamplingParams) -> SamplingParams:
    """Under pressure a class may get a max_tokens cap and n = 1; the response says what was cut."""
    policy = state.admission.degrade(ctx.priority)
    if policy is None:
        return params
    notes, changes = [], {}
    if policy.max_tokens is not None and (params.max_tokens is None or params.max_tokens > policy.max_tokens):
        notes.append(f"max_tokens={policy.max_tokens}")
        changes["max_tokens"] = policy.max_tokens
    if policy.single_sample and params.n > 1:
        notes.append("n=1")
        changes["n"] = 1
    if not notes:
        return params
    ctx.degraded = notes
    ctx.headers["x-pagedserve-degraded"] = ",".join(notes)
    return dataclasses.replace(params, **changes)


def _error_code(message: str) -> str | None:
    lowered = message.lower()
    return "context_length_exceeded" if "context" in lowered or "too long" in lowered else None


def close_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.close()


async def merged(state: ServerState, call: Call) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(prompt index, cumulative output) from all streams as they come; records latency metrics and
    returns the admission ticket at the end. Past the call's deadline, a 504."""
    streams = call.streams
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
            i, item = await _next(queue, call)
            if isinstance(item, BaseException):
                raise _api_error(item)
            state.admission.started(call.ticket)
            if item.finished:
                remaining -= 1
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        call.close()


async def _next(queue: asyncio.Queue, call: Call) -> Any:
    """The next output, or a 429 when the call is shed before starting, or a 504 past its deadline."""
    while True:
        ticket, limit = call.ticket, call.deadline
        shedding = not ticket.started and ticket.shed_at is not None and (limit is None or ticket.shed_at < limit)
        if shedding:
            limit = ticket.shed_at
        if limit is None:
            return await queue.get()
        try:
            return await asyncio.wait_for(queue.get(), max(0.0, limit - time.monotonic()))
        except TimeoutError:
            if not shedding:
                raise APIError(504, "the request's deadline passed before it finished", "timeout",
                               "deadline_exceeded") from None
            if call.admission.should_shed(ticket):
                raise _refusal(call.admission.shed(ticket)) from None
            ticket.shed_at = None  # kept: it waits for its first token (or its deadline) like any other


async def primed(outputs: AsyncIterator[tuple[int, RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Waits for the first output, so that a stream refused or shed before its first token gets a
    plain HTTP error (which a router may retry elsewhere) instead of a 200 with an error event."""
    first = await anext(outputs)

    async def chained() -> AsyncIterator[tuple[int, RequestOutput]]:
        yield first
        async for item in outputs:
            yield item

    return chained()


def _api_error(exc: BaseException) -> BaseException:
    if isinstance(exc, RequestFailedError):
        return APIError(400, str(exc))
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_unavailable")
    return exc


async def final_outputs(state: ServerState, call: Call) -> list[RequestOutput]:
    last: list[RequestOutput | None] = [None] * len(call.streams)
    async for i, out in merged(state, call):
        last[i] = out
    return [out for out in last if out is not None]


async def prefill_handle(state: ServerState, call: Call, outputs: list[RequestOutput]) -> dict | None:
    """The prefill half of a disaggregated request is done: its lease on the prompt's blocks, and the first
    token it sampled."""
    if call.kv_transfer is None or not call.kv_transfer.do_remote_decode:
        return None
    tokens = outputs[0].outputs[0].token_ids if outputs and outputs[0].outputs else []
    return await lease(state, call.prompt_ids[0], call.lora, tokens[0] if tokens else None)


def usage(outputs: list[RequestOutput], generated: bool = True) -> Usage:
    """generated=False: the prompt's part alone (a stream's first chunks, before any token counts)."""
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs) if generated else 0
    cached = sum(o.num_cached_tokens for o in outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def token_text(state: ServerState, token_id: int, decoded: str | None) -> str:
    return decoded if decoded is not None else state.engine.tokenizer.decode([token_id])


def prompt_logprobs(state: ServerState, out: RequestOutput, top: int | None) -> PromptLogprobs | None:
    """vLLM's prompt_logprobs of one prompt: per token, its own and the top alternatives' (by id); the first null."""
    if top is None or out.prompt_logprobs is None:
        return None
    result: PromptLogprobs = []
    for token_id, entry in zip(out.prompt_token_ids, out.prompt_logprobs, strict=False):
        if entry is None:
            result.append(None)
            continue
        ranked = sorted(entry.items(), key=lambda kv: kv[1].logprob, reverse=True)[:top]
        kept = dict(ranked) | ({token_id: entry[token_id]} if token_id in entry else {})
        result.append({str(t): PromptLogprob(logprob=lp.logprob, rank=lp.rank,
                                             decoded_token=token_text(state, t, lp.decoded_token))
                       for t, lp in kept.items()})
    return result


# ---- client disconnects ----

async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def respond(work: Awaitable[Any], ctx: RequestContext) -> Response:
    """An endpoint's result as the HTTP response: a stream as it is, a body as JSON with ctx's headers."""
    result = await work
    if isinstance(result, Response):
        return result
    return JSONResponse(result.model_dump(mode="json"), headers=ctx.headers)


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
    await asyncio.wait({task})  # cancelling takes effect only when the task runs again (and closes its call)
    if task.cancelled():
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request", counted as such
    return task.result()


class EventStream(StreamingResponse):
    """Server-sent events that stop (and abort their requests) as soon as the client disconnects,
    even while no token is being sent."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], call: Call, headers: dict[str, str] | None = None):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self.call = call  # closed however the response ends, even if the body never started

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
            self.call.close()


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"
