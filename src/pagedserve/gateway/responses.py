"""POST /v1/responses through the gateway: OpenAI's Responses API forwarded to the route's providers, which must
speak it (pagedserve does, as OpenAI does), with the key, rate limit, daily budget and trace of every request.

Of the seed's flow only admission, the provider call (timeouts, retry, fallback, breakers) and settlement apply.
A response may continue a conversation stored at the provider that made it (previous_response_id), which the
body does not show, so it is never cached or coalesced, and not routed by difficulty (the small tier, unless the
request pins `route`: a conversation's turns then reach the same first healthy target), and a retrieval route
refuses it. Tokens and cost are settled
from the answer's usage (input_tokens, output_tokens, input_tokens_details.cached_tokens), or the admission
bound when none is reported.
"""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.gateway.call import Call
from pagedserve.gateway.errors import APIError
from pagedserve.gateway.provider_call import outcome
from pagedserve.gateway.providers import StreamFailed, StreamResult
from pagedserve.gateway.tracing import Trace

log = logging.getLogger(__name__)

PATH = "/responses"
ENDS = {"response.completed": 200, "response.incomplete": 200, "response.failed": 502}


def chat_usage(usage) -> dict | None:
    """A Responses usage object in the chat shape settlement reads; None when it is not one."""
    if not isinstance(usage, dict):
        return None
    details = usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else 0
    return {"prompt_tokens": usage.get("input_tokens"), "completion_tokens": usage.get("output_tokens"),
            "prompt_tokens_details": {"cached_tokens": cached}}


async def handle_responses(gw, request: Request) -> Response:
    """gw: the Gateway (app.py), whose stages this borrows."""
    trace = Trace(endpoint="responses")
    call = None
    try:
        call = await gw.admission.admit(request, "responses", trace)
        if call.route.retrieval is not None:
            raise APIError(400, f"route '{call.route.name}' answers from retrieved documents, which /v1/responses "
                                "does not carry; use /v1/chat/completions", code="unsupported_route", param="model")
        call.tier = call.request.route or "small"
        trace.tier, trace.pinned, targets = call.tier, call.request.route is not None, call.route.tier(call.tier)
        if call.request.stream:
            result = await outcome(call, gw.providers.stream(targets, PATH, call.body, call.forward_headers))
            return StreamingResponse(_relay(gw, call, result), media_type="text/event-stream",
                                     headers=call.response_headers(result.target))
        result = await outcome(call, gw.providers.call(targets, PATH, call.body, call.forward_headers))
        await gw.settlement.finish(call, result.target, chat_usage(result.body.get("usage")))
        return JSONResponse(result.body, headers=call.response_headers(result.target))
    except Exception as e:
        if call is not None:
            await gw.settlement.settle(call, None, {})
        trace.finish(e.status if isinstance(e, APIError) else 500, str(e))
        gw.traces.write(trace)
        if isinstance(e, APIError):
            e.headers = {**e.headers, "x-gateway-trace-id": trace.trace_id}
        raise


async def _relay(gw, call: Call, result: StreamResult) -> AsyncIterator[str]:
    """The provider's events, typed as they came; the stream ends at the response's last event (its usage is
    what is charged). A provider failure after the first event ends it with an `error` event."""
    usage, deltas, sequence = None, 0, -1
    status, error = 499, "the client closed the stream"
    try:
        async for data in result.events:
            event = json.loads(data)
            kind = event.get("type") if isinstance(event, dict) else None
            if not isinstance(kind, str):
                raise StreamFailed(f"a stream event without a type: {data[:100]!r}")
            sequence = event.get("sequence_number", sequence)
            deltas += kind.endswith(".delta")
            yield f"event: {kind}\ndata: {data}\n\n"
            if kind == "error":
                status, error = 502, str(event.get("message"))
                return
            if kind in ENDS:
                response = event.get("response")
                usage = chat_usage(response.get("usage")) if isinstance(response, dict) else None
                status, error = ENDS[kind], None if ENDS[kind] == 200 else kind
                return  # what follows (the provider's [DONE], if it sends one) carries nothing
        raise StreamFailed("the stream ended before the response did")
    except (StreamFailed, ValueError) as e:
        status, error = 502, f"the provider {result.target.label} failed after the stream started: {e!r}"
        log.warning("%s", error)
        body = {"type": "error", "code": "upstream_stream_error", "message": error, "param": None,
                "sequence_number": sequence + 1 if isinstance(sequence, int) else 0}
        yield f"event: error\ndata: {json.dumps(body)}\n\n"
    finally:
        await result.events.aclose()
        usage = usage if usage is not None else gw.settlement.stream_usage(call, None, deltas)
        gw._spawn(gw.settlement.finish(call, result.target, usage, status, error))
