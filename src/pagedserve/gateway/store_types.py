"""What every gateway store speaks: token buckets, the results of taking and reserving, money as integer
nanodollars (so sums never drift), and source versions."""
from __future__ import annotations

from dataclasses import dataclass

NANO = 10**9  # nanodollars per dollar


@dataclass(slots=True)
class Bucket:
    """A token bucket: `capacity` units, refilled at capacity per `period_s`."""
    name: str
    capacity: float
    cost: float
    period_s: float = 60.0

    @property
    def rate(self) -> float:
        return self.capacity / self.period_s


@dataclass(slots=True)
class TakeResult:
    allowed: bool
    retry_after_s: float  # 0 when allowed
    levels: list[float]  # what is left in each bucket afterwards


@dataclass(slots=True)
class ReserveResult:
    allowed: bool
    spent: list[int]  # nanodollars actually spent per scope before this reservation
    held: list[int]  # nanodollars reserved per scope by requests still in flight
    failed_index: int | None = None  # the scope whose limit would be crossed


MAX_NANO = 10**15  # $1M: any one amount is clamped here, so sums of them stay far inside int64


def to_nano(dollars: float) -> int:
    """Dollars as integer nanodollars; an absurd estimate (10^17 tokens, inf) saturates instead of overflowing."""
    nanos = dollars * NANO
    return MAX_NANO if not nanos < MAX_NANO else max(round(nanos), -MAX_NANO)


def next_version(current: str | None) -> str:
    return str(int(current) + 1) if current and current.isdigit() else "1"
