"""Identical concurrent cache misses share one provider call (single flight).

The first cacheable request of a cache key (scope, normalised question, max_tokens) leads a flight from before
its cache lookup until its answer is stored; identical requests arriving meanwhile wait for it instead of
calling the provider, and are served the answer it stored, in the shape each asked for (whole or streamed),
charged nothing, as a hit would be. Waiters get only what the cache would give them a moment later: when the
leader fails, or stores nothing (a tool call, a cut stream), they are released to call on their own, each
alone, so a failing provider is not tried once per waiter in a row.

A streamed leader's provider stream is read by a pump (StreamTee) that buffers its events, so a waiter that
streams follows the same events as they come, from the first, instead of waiting for the end; the upstream
call is dropped only when every reader has gone. The pump stores the answer before any reader sees the stream
end, so the same question asked after [DONE] is a hit. A request that offers tools flies alone: its answer is
often a tool call, which is never handed to another request, so waiting for it would only double a wait.
"""
from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from pagedserve.gateway.gateway_config import Target
from pagedserve.gateway.providers import StreamFailed


class StreamTee:
    """One provider stream read once by a pump task, followed by any number of readers, each from its start."""

    def __init__(self, events: AsyncIterator[str], on_end: Callable[[list[str] | None], None]):
        """on_end(events) runs in the pump before any reader sees the end: all events, or None if it failed."""
        self.events: list[str] = []
        self.error: str | None = None
        self.ended = False
        self.readers = 0
        self._on_end = on_end
        self._changed = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._pump(events))
        self.task.add_done_callback(lambda _: self._end(None))  # a pump cancelled before it ran ends too

    async def _pump(self, events: AsyncIterator[str]) -> None:
        try:
            async for data in events:
                self.events.append(data)
                self._notify()
        except asyncio.CancelledError:
            self.error = "every reader of the stream went away"
            raise
        except Exception as e:  # noqa: BLE001 (StreamFailed, or a bug: each reader ends with an error event)
            self.error = f"{type(e).__name__}: {e}"
        finally:
            await events.aclose()  # a pagedserve provider takes the dropped connection as an abort
            self._end(None if self.error else self.events)

    def _end(self, events: list[str] | None) -> None:
        if self.ended:
            return
        if events is None and self.error is None:
            self.error = "the stream's pump never ran"
        try:
            self._on_end(events)
        finally:
            self.ended = True
            self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def follow(self) -> AsyncIterator[str]:
        """A reader's events; counted from now, so the pump is not dropped before the reader's first read."""
        self.readers += 1
        return self._follow()

    async def _follow(self) -> AsyncIterator[str]:
        seen = 0
        try:
            while True:
                if seen < len(self.events):
                    seen += 1
                    yield self.events[seen - 1]
                elif self.ended:
                    if self.error is not None:
                        raise StreamFailed(self.error)
                    return
                else:
                    await self._changed.wait()
        finally:
            self.readers -= 1
            if self.readers == 0 and not self.ended:
                self.task.cancel()


@dataclass(slots=True, eq=False)
class Flight:
    key: tuple
    leader_trace: str  # the leading request's trace id, named in its waiters' traces
    registered: bool = True  # False: a released waiter's own flight, which nobody can join
    answer: dict | None = None  # once landed: the stored answer, or None (waiters try on their own)
    target: Target | None = None
    sources: list[dict] | None = None  # the leader's retrieved chunks, for live followers
    tee: StreamTee | None = None
    waiting: int = 0
    moved: asyncio.Event = field(default_factory=asyncio.Event)  # the leader started streaming, or landed
    landed: asyncio.Event = field(default_factory=asyncio.Event)


class Flights:
    def __init__(self):
        self.running: dict[tuple, Flight] = {}

    def join(self, key: tuple, trace_id: str) -> tuple[Flight, bool]:
        """The key's flight and whether this request leads it (else it waits)."""
        flight = self.running.get(key)
        if flight is not None:
            return flight, False
        flight = self.running[key] = Flight(key, trace_id)
        return flight, True

    @staticmethod
    def alone(key: tuple, trace_id: str) -> Flight:
        return Flight(key, trace_id, registered=False)

    def stream(self, flight: Flight, tee: StreamTee, target: Target, sources: list[dict] | None) -> None:
        flight.tee, flight.target, flight.sources = tee, target, sources
        flight.moved.set()

    def land(self, flight: Flight, answer: dict | None) -> None:
        """Ends the flight (once; later calls change nothing): waiters get the answer, or go on their own."""
        if flight.landed.is_set():
            return
        if flight.registered and self.running.get(flight.key) is flight:
            del self.running[flight.key]
        flight.answer = answer
        flight.landed.set()
        flight.moved.set()

    def status(self) -> dict:
        return {"running": len(self.running), "waiting": sum(f.waiting for f in self.running.values())}
