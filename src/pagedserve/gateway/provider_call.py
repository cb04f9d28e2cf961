"""Stage 4, the provider call: the request sent to a tier's targets (timeouts, retry, fallback and circuit
breakers live in providers.py), provider failures turned into the client's error, and a stream relayed."""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from pagedserve.gateway.call import Call
from pagedserve.gateway.errors import APIError
from pagedserve.gateway.gateway_config import Target
from pagedserve.gateway.providers import (
    AllProvidersFailed,
    CallResult,
    ProviderPool,
    StreamFailed,
    StreamResult,
    UpstreamRejected,
)
from pagedserve.gateway.streaming import DONE, StreamAssembler, sse

log = logging.getLogger(__name__)

PATHS = {"chat": "/chat/completions", "completions": "/completions"}


def upstream(providers: ProviderPool, call: Call, targets: list[Target],
             sent=None) -> Awaitable[CallResult | StreamResult]:
    """The call to the first healthy target of `targets`; `sent` is set once the request is on the wire."""
    if call.request.stream:
        options = {**(call.body.get("stream_options") or {}), "include_usage": True}
        return providers.stream(targets, PATHS[call.kind], {**call.body, "stream_options": options},
                                call.forward_headers, sent)
    return providers.call(targets, PATHS[call.kind], call.body, call.forward_headers, sent)


async def outcome(call: Call, pending: Awaitable[CallResult | StreamResult]) -> CallResult | StreamResult:
    """The call's result with its attempts in the trace; a provider failure becomes the client's APIError."""
    try:
        result = await pending
    except (UpstreamRejected, AllProvidersFailed) as e:
        call.trace.attempts = [a.to_dict() for a in e.attempts]
        raise provider_error(e) from None
    call.trace.attempts = [a.to_dict() for a in result.attempts]
    return result


def provider_error(e: UpstreamRejected | AllProvidersFailed) -> APIError:
    if isinstance(e, UpstreamRejected):  # passed on in OpenAI's shape, whatever shape the provider used
        err = e.body.get("error") if isinstance(e.body.get("error"), dict) else {"message": str(e.body)}
        code, param, kind = (_text(err.get(f)) for f in ("code", "param", "type"))
        return APIError(e.status, _text(err.get("message")) or f"the provider answered {e.status}", code=code,
                        param=param, kind=kind)
    tried = any(a.status != "circuit_open" for a in e.attempts)
    return APIError(502 if tried else 503, str(e), code="providers_failed" if tried else "providers_unavailable")


def _text(value) -> str | None:
    return None if value is None else value if isinstance(value, str) else json.dumps(value)


async def relay(call: Call, target: Target, events: AsyncIterator[str],
                on_end: Callable[[StreamAssembler, int, str | None], None],
                first_extra: dict | None = None) -> AsyncIterator[bytes]:
    """Passes the provider's events through; a failure after the first one ends the stream with an error.
    on_end(assembled, status, error) runs however the stream ends (499 when the client went away).
    first_extra: fields added to the first event with choices (the gateway's `sources`)."""
    wants_usage = bool((call.body.get("stream_options") or {}).get("include_usage"))
    assembled = StreamAssembler(call.kind)
    status, error = 499, "the client closed the stream"  # until the stream ends one way or another
    try:
        async for data in events:
            event = json.loads(data)
            if not isinstance(event, dict):
                raise StreamFailed(f"a stream event that is not a JSON object: {data[:100]!r}")
            if "error" in event:
                err = event["error"]
                status, error = 502, str(err.get("message") if isinstance(err, dict) else err)
                yield sse(data)
                return
            assembled.add(event)
            if not wants_usage:
                if not event.get("choices"):
                    continue
                if event.get("usage") is not None:
                    event.pop("usage")
                    data = json.dumps(event)
            if first_extra is not None and event.get("choices"):
                data, first_extra = json.dumps({**event, **first_extra}), None
            yield sse(data)
        status, error = 200, None
        yield DONE
    except (StreamFailed, ValueError) as e:  # no second provider may continue a text the client has seen
        status, error = 502, f"the provider {target.label} failed after the stream started: {e!r}"
        log.warning("%s", error)
        yield sse(APIError(502, error, code="upstream_stream_error").body())
    finally:
        on_end(assembled, status, error)
