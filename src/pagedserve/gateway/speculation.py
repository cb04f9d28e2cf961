"""A provider call started before the cache and the classifier have spoken (route option `speculate`).

The gateway's own latency on a miss is mostly the query embedding; starting the likely tier's call first
hides it behind the provider's work. A cache hit or another verdict cancels the call.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import dataclass

from pagedserve.gateway.providers import AllProvidersFailed, StreamResult, UpstreamRejected


@dataclass(slots=True)
class Speculation:
    tier: str
    task: asyncio.Task
    sent: asyncio.Event

    @classmethod
    def start(cls, tier: str, call: Awaitable, sent: asyncio.Event) -> Speculation:
        return cls(tier, asyncio.get_running_loop().create_task(call), sent)

    async def on_the_wire(self, patience_s: float = 0.025) -> None:
        """Returns once the request has been written to a provider (or the call ended without that, or a slow
        connect took patience_s). Only then may the query embedding start: its thread would otherwise hold the
        GIL while the request is built."""
        waiter = asyncio.ensure_future(self.sent.wait())
        try:
            await asyncio.wait({waiter, self.task}, timeout=patience_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()

    def verdict(self, why: str) -> str:
        """The trace's word for a call nobody will use: "discarded" when the provider had already answered
        (its work, and an external API's bill, was spent), else "cancelled"."""
        done = self.task.done() and not self.task.cancelled()
        return f"{'discarded' if done else 'cancelled'} ({why})"

    async def cancel(self) -> None:
        """Stops the call (an open upstream stream is closed, which aborts it at a pagedserve provider)."""
        self.task.cancel()
        try:
            result = await self.task
        except (asyncio.CancelledError, UpstreamRejected, AllProvidersFailed):  # nobody wants its answer
            return
        if isinstance(result, StreamResult):
            await result.events.aclose()
