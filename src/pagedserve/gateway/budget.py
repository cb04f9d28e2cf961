"""Daily money budgets per key and per user: hold the worst case before the call, settle real cost after.

A hold is kept apart from spend (the store's `holds`), so reservations of requests in flight bind the
limit atomically, while usage and the "exhausted" message report what was really spent.

A day is a calendar day in the configured time zone, so budgets reset at that zone's midnight (DST
included). Spend is kept per (day, scope); a new day simply starts a new row, nothing has to be reset.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from zoneinfo import ZoneInfo

from pagedserve.gateway.auth import ApiKey
from pagedserve.gateway.gateway_config import BudgetConfig
from pagedserve.gateway.store import NANO, Store, to_nano


@dataclass(slots=True)
class BudgetHold:
    day: str
    scopes: list[str]
    reserved: int  # nanodollars
    spent_before: list[float]  # dollars really spent per scope, holds of other requests not included
    limits: list[float | None]


def usd(dollars: float) -> str:
    """Dollars with cents, and more digits only where they matter: $2.00, $0.25, $0.00105."""
    cents = f"{dollars:.2f}"
    return f"${cents}" if abs(float(cents) - dollars) < 5e-10 else f"${dollars:.9f}".rstrip("0")


class BudgetExceeded(Exception):
    pass


class BudgetKeeper:
    def __init__(self, store: Store, tz: ZoneInfo, config: BudgetConfig, clock: Callable[[], float] = time.time):
        self.store, self.tz, self.config, self.clock = store, tz, config, clock

    def day(self) -> str:
        return datetime.fromtimestamp(self.clock(), self.tz).date().isoformat()

    def resets_at(self) -> datetime:
        today = datetime.fromtimestamp(self.clock(), self.tz).date()
        return datetime.combine(today + timedelta(days=1), datetime.min.time(), self.tz)

    def scopes(self, key: ApiKey) -> tuple[list[str], list[float | None]]:
        return [f"key:{key.key_id}", f"user:{key.user}"], [key.daily_budget_usd, self.config.for_user(key.user)]

    async def reserve(self, key: ApiKey, estimate_usd: float) -> BudgetHold:
        """Raises BudgetExceeded with a message saying whose budget, how much is spent and when it resets."""
        day = self.day()
        scopes, limits = self.scopes(key)
        amount = to_nano(estimate_usd)
        result = await self.store.reserve(day, scopes, [None if x is None else to_nano(x) for x in limits], amount)
        spent = [s / NANO for s in result.spent]
        if not result.allowed:
            i = result.failed_index
            who = f"key {key.key_id}" if i == 0 else f"user {key.user}"
            reset = self.resets_at().strftime("%Y-%m-%d %H:%M %Z")
            held = result.held[i] / NANO
            in_flight = f" ({usd(held)} more is held by requests in flight)" if held > 0 else ""
            raise BudgetExceeded(f"daily budget of {who} is exhausted: spent {usd(spent[i])} of {usd(limits[i])} "
                                 f"today{in_flight} and this request may cost up to {usd(amount / NANO)}; "
                                 f"it resets at {reset}")
        return BudgetHold(day, scopes, amount, spent, limits)

    async def settle(self, hold: BudgetHold, actual_usd: float) -> None:
        await self.store.settle(hold.day, hold.scopes, hold.reserved, to_nano(actual_usd))

    async def usage(self, day: str | None = None) -> list[dict]:
        return [{"day": d, "scope": scope, "spend_usd": nanos / NANO} for d, scope, nanos in await self.store.usage(day)]
