"""A lease on a named piece of gateway state, kept in the store (SQLite or Redis), so it excludes every process
sharing that store: `gateway index add` from the CLI and the gateway beside it, or all instances on one Redis.

The store grants it (`lease(name, owner, ttl_s)`: taken when free, expired or already ours) and frees it
(`release(name, owner)`); the holder renews it while working, so a holder that died frees it after ttl_s.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

log = logging.getLogger(__name__)


class LeaseBusy(Exception):
    """Someone else held the lease for longer than we were willing to wait."""


@asynccontextmanager
async def held(store, name: str, ttl_s: float = 30.0, wait_s: float = 600.0) -> AsyncIterator[None]:
    """Waits (polling: a store has no way to notify) until the lease is ours, holds it through the block."""
    owner, deadline, pause = uuid.uuid4().hex, time.monotonic() + wait_s, 0.02
    while not await store.lease(name, owner, ttl_s):
        if pause == 0.02:
            log.info("waiting for the lease on %s: another process holds it", name)
        if time.monotonic() + pause > deadline:
            raise LeaseBusy(f"{name} is busy: another holder kept it for over {wait_s:.0f} s")
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.5)
    renewal = asyncio.get_running_loop().create_task(_renew(store, name, owner, ttl_s))
    try:
        yield
    finally:
        renewal.cancel()
        await asyncio.gather(renewal, return_exceptions=True)
        await store.release(name, owner)


async def _renew(store, name: str, owner: str, ttl_s: float) -> None:
    while True:
        await asyncio.sleep(ttl_s / 3)
        if not await store.lease(name, owner, ttl_s):
            log.warning("lost the lease on %s (held past %.0f s without renewal)", name, ttl_s)
            return
