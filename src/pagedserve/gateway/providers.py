"""Calls to upstream OpenAI-compatible providers: a deadline per attempt and per request, one jittered
retry on 5xx / 529 / 429 / timeout, then the next provider of the route, and a circuit breaker per provider.

A stream is committed to a provider once its first event arrives; a failure after that ends the stream
with an error rather than splicing in a second provider's text.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field

import aiohttp

from pagedserve.gateway.gateway_config import BreakerConfig, GatewayConfig, RetryConfig, Target

log = logging.getLogger(__name__)

RETRYABLE = {408, 429, 500, 502, 503, 504, 529}
MIN_ATTEMPT_S = 0.05  # with less time than this left before the request's deadline, no attempt is started


@dataclass(slots=True)
class Attempt:
    provider: str
    model: str
    status: str  # HTTP status, "timeout", "connect_error", "bad_response", "circuit_open" or "stream_error"
    latency_ms: float = 0.0
    error: str | None = None
    started_at: float = 0.0  # epoch seconds

    def to_dict(self) -> dict:
        return asdict(self)


class UpstreamRejected(Exception):
    """A non-retryable 4xx from the provider (the request's own fault): passed on to the client."""

    def __init__(self, status: int, body: dict, attempts: list[Attempt]):
        super().__init__(f"upstream returned {status}")
        self.status, self.body, self.attempts = status, body, attempts


class AllProvidersFailed(Exception):
    def __init__(self, message: str, attempts: list[Attempt]):
        super().__init__(message)
        self.attempts = attempts


class StreamFailed(Exception):
    """The provider failed after the first event of a stream."""


class _Retryable(Exception):
    def __init__(self, status: str, error: str):
        super().__init__(error)
        self.status = status


@dataclass(slots=True)
class CircuitBreaker:
    """Closed -> open after `failure_threshold` consecutive failures -> half-open after `reset_s`, where one
    probe is let through: its success closes the breaker, its failure opens it again."""
    config: BreakerConfig
    state: str = "closed"
    failures: int = 0
    opened_at: float = 0.0
    probing: bool = False

    def allow(self) -> bool:
        if self.state == "open" and time.monotonic() - self.opened_at >= self.config.reset_s:
            self.state = "half_open"
        if self.state == "closed":
            return True
        if self.state == "half_open" and not self.probing:
            self.probing = True
            return True
        return False

    def record(self, ok: bool) -> None:
        self.probing = False
        if ok:
            self.state, self.failures = "closed", 0
            return
        self.failures += 1
        if self.state == "half_open" or self.failures >= self.config.failure_threshold:
            if self.state != "open":
                log.warning("circuit breaker opened after %d consecutive failures", self.failures)
            self.state, self.opened_at = "open", time.monotonic()

    def release(self) -> None:
        """An attempt ended without a verdict (the client went away): let another probe through."""
        self.probing = False


@dataclass(slots=True)
class StreamResult:
    target: Target
    attempts: list[Attempt]
    events: AsyncIterator[str]  # SSE data payloads, the first one already received


@dataclass(slots=True)
class CallResult:
    target: Target
    attempts: list[Attempt]
    body: dict = field(default_factory=dict)


class ProviderPool:
    """One aiohttp session per provider (keep-alive connections; about a quarter of httpx's CPU per call)."""

    def __init__(self, config: GatewayConfig, rng: random.Random | None = None):
        self.config = config
        self.retry: RetryConfig = config.retry
        self.rng = rng or random.Random()
        self.sessions: dict[str, aiohttp.ClientSession] = {}  # made on first use: a session needs the running loop
        self.breakers = {name: CircuitBreaker(config.breaker) for name in config.providers}

    async def close(self) -> None:
        for session in self.sessions.values():
            await session.close()

    def breaker_states(self) -> dict[str, dict]:
        return {n: {"state": b.state, "failures": b.failures} for n, b in self.breakers.items()}

    def _session(self, provider: str) -> aiohttp.ClientSession:
        session = self.sessions.get(provider)
        if session is None:
            trace = aiohttp.TraceConfig()
            trace.on_request_chunk_sent.append(_body_sent)
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=256), trace_configs=[trace],
                                            timeout=aiohttp.ClientTimeout(total=None), read_bufsize=1 << 20)
            self.sessions[provider] = session
        return session

    def _post(self, target: Target, path: str, body: dict, headers: dict[str, str], sent: asyncio.Event | None):
        provider = self.config.providers[target.provider]
        headers = {**headers, "content-type": "application/json"}
        if provider.api_key:
            headers["authorization"] = f"Bearer {provider.api_key}"
        data = json.dumps({**body, "model": provider.models[target.model].name}).encode()
        return self._session(target.provider).post(provider.base_url + path, data=data, headers=headers,
                                                   trace_request_ctx={"sent": sent})

    async def call(self, targets: list[Target], path: str, body: dict, headers: dict[str, str],
                   sent: asyncio.Event | None = None) -> CallResult:
        """`sent`, if given, is set once a request has been written to a provider."""
        async def once(target: Target, timeout: float) -> dict:
            async with asyncio.timeout(timeout), self._post(target, path, body, headers, sent) as response:
                return _json_or_raise(response.status, await response.read())
        return await self._with_fallback(targets, once, CallResult)

    async def stream(self, targets: list[Target], path: str, body: dict, headers: dict[str, str],
                     sent: asyncio.Event | None = None) -> StreamResult:
        async def once(target: Target, timeout: float) -> AsyncIterator[str]:
            deadline = time.monotonic() + timeout
            response = await asyncio.wait_for(self._post(target, path, body, headers, sent), timeout)
            if response.status != 200:
                try:
                    raw = await asyncio.wait_for(response.read(), max(deadline - time.monotonic(), 0.001))
                finally:
                    response.close()
                _json_or_raise(response.status, raw)
                raise _Retryable("bad_response", f"status {response.status} instead of an event stream")
            events = _sse_events(response, deadline)
            try:
                first = await anext(events)
            except StopAsyncIteration:
                raise _Retryable("bad_response", "stream ended before its first event") from None
            return _prepend(first, events)
        return await self._with_fallback(targets, once, StreamResult)

    async def _with_fallback(self, targets: list[Target], once, result_type):
        attempts: list[Attempt] = []
        deadline = time.monotonic() + self.retry.request_deadline_s
        for target in targets:
            breaker = self.breakers[target.provider]
            for n in range(self.retry.attempts_per_provider):
                if n > 0:
                    pause = self.retry.backoff_s * self.rng.uniform(0.5, 1.5)
                    if time.monotonic() + pause >= deadline:
                        break
                    await asyncio.sleep(pause)
                if not breaker.allow():
                    attempts.append(Attempt(target.provider, target.model, "circuit_open", started_at=time.time()))
                    break
                remaining = deadline - time.monotonic()
                if remaining <= MIN_ATTEMPT_S:  # asyncio's timers may fire a hair early: no sliver attempts
                    break
                timeout = min(self.config.providers[target.provider].timeout_s, remaining)
                try:
                    record, out = await self._attempt(target, once, timeout)
                except UpstreamRejected as e:
                    e.attempts = attempts + e.attempts
                    raise
                attempts.append(record)
                if out is None:
                    continue
                if result_type is CallResult:
                    return CallResult(target, attempts, out)
                return StreamResult(target, attempts, self._watch(target, out))
        raise AllProvidersFailed("every provider of this route failed or is unavailable: " +
                                 ", ".join(f"{a.provider}/{a.model} {a.status}" for a in attempts), attempts)

    async def _attempt(self, target: Target, once, timeout: float) -> tuple[Attempt, object | None]:
        """One call; the output is None after a retryable failure. Feeds the provider's breaker."""
        breaker = self.breakers[target.provider]
        start, wall = time.perf_counter(), time.time()

        def record(status: str, error: str | None = None) -> Attempt:
            return Attempt(target.provider, target.model, status, _ms(start), error, wall)
        try:
            out = await once(target, timeout)
        except _Retryable as e:
            failure = record(e.status, str(e)[:300])
        except UpstreamRejected as e:
            breaker.record(True)
            e.attempts = [record(str(e.status))]
            raise
        except TimeoutError:
            failure = record("timeout", f"no complete answer within {timeout:.1f}s")
        except aiohttp.ClientError as e:
            failure = record("connect_error", repr(e))
        except BaseException:
            breaker.release()
            raise
        else:
            breaker.record(True)
            return record("200"), out
        breaker.record(False)
        log.warning("provider %s failed (%s): %s", target.label, failure.status, failure.error)
        return failure, None

    async def _watch(self, target: Target, events: AsyncIterator[str]) -> AsyncIterator[str]:
        """Counts a failure after the first event against the provider's breaker."""
        try:
            async for event in events:
                yield event
        except (TimeoutError, aiohttp.ClientError, _Retryable) as e:
            self.breakers[target.provider].record(False)
            raise StreamFailed(f"{type(e).__name__}: {e}") from e
        finally:  # closing this closes the upstream response now, not when the garbage collector gets to it
            await events.aclose()


def _ms(start: float) -> float:
    return round((time.perf_counter() - start) * 1000, 2)


async def _body_sent(session: aiohttp.ClientSession, context, params) -> None:
    sent = (context.trace_request_ctx or {}).get("sent")
    if sent is not None:
        sent.set()


def _json_or_raise(status: int, raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if status in RETRYABLE or status >= 500:
        raise _Retryable(str(status), raw[:300].decode(errors="replace"))
    if status >= 400:  # the body may be anything, even bytes that are not UTF-8
        message = raw[:1000].decode(errors="replace") or f"the provider answered {status}"
        raise UpstreamRejected(status, body if isinstance(body, dict) else {"error": {"message": message}}, [])
    if not isinstance(body, dict):
        raise _Retryable("bad_response", f"not a JSON object: {raw[:200]!r}")
    return body


async def _sse_events(response: aiohttp.ClientResponse, deadline: float) -> AsyncIterator[str]:
    """The `data:` payloads of an SSE response until [DONE], each read within the request's deadline."""
    done = False
    try:
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("the stream did not finish within the provider's timeout")
            line = (await asyncio.wait_for(response.content.readline(), remaining)).decode(errors="replace")
            if not line:
                raise _Retryable("stream_error", "the stream ended without [DONE]")
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                done = True
                return
            yield data
    finally:
        if done:
            response.release()  # the connection goes back to the pool
        else:
            response.close()  # mid-stream: drops the connection, which aborts the request at a pagedserve provider


async def _prepend(first: str, rest: AsyncIterator[str]) -> AsyncIterator[str]:
    try:
        yield first
        async for event in rest:
            yield event
    finally:
        await rest.aclose()
