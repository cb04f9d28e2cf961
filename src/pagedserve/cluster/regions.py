"""Regions and data residency: which replicas a request may use, and which of those are near.

Residency is a hard filter applied before any policy and on every retry; latency (the configured RTT
from the client's region plus the replica's measured latency) only orders what residency allows.
"""
from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

from pagedserve.cluster.replica import Replica

NAME = re.compile(r"[a-z0-9][a-z0-9_.:-]*")  # a residency tag or region name, lowercased
OPTIONAL_WHITESPACE = " \t"  # RFC 9110's OWS; anything else around a value is part of it


def parse_name(text: str) -> str:
    """A tag or region name, lowercased; ValueError unless it is one."""
    name = text.strip(OPTIONAL_WHITESPACE).lower()
    if not NAME.fullmatch(name):
        raise ValueError(f"{text!r} is not a valid name (ASCII letters, digits, '_', '.', ':', '-')")
    return name


def parse_residency(value: str | None) -> frozenset[str]:
    """'eu' or 'eu, gdpr' -> tags a replica must all carry (empty parts skipped); ValueError on a part
    that is not a tag, so a malformed value is refused rather than read as a weaker constraint."""
    return frozenset(parse_name(t) for t in (value or "").split(",") if t.strip(OPTIONAL_WHITESPACE))


def allowed_by_residency(replica: Replica, residency: frozenset[str]) -> bool:
    return residency <= replica.tags


@dataclass(slots=True)
class RegionMap:
    rtt_ms: dict[str, dict[str, float]]
    default_rtt_ms: float = 100.0
    slack_ms: float = 25.0
    spill_inflight: int = 16

    def __post_init__(self) -> None:
        self.rtt_ms = {a.lower(): {b.lower(): ms for b, ms in row.items()} for a, row in self.rtt_ms.items()}

    def rtt(self, client_region: str, replica_region: str) -> float:
        """Region names compare case-insensitively, as client headers are read."""
        client_region, replica_region = client_region.lower(), replica_region.lower()
        row = self.rtt_ms.get(client_region, {})
        if replica_region in row:
            return float(row[replica_region])
        back = self.rtt_ms.get(replica_region, {})
        if client_region in back:
            return float(back[client_region])
        return 0.0 if client_region == replica_region else self.default_rtt_ms

    def region_latency(self, client_region: str, candidates: list[Replica]) -> dict[str, float]:
        """Per region: configured RTT plus the median measured latency of its replicas. Per region, not
        per replica, so probe noise on one busy replica cannot push it out of its own region."""
        measured: dict[str, list[float]] = {}
        for r in candidates:
            measured.setdefault(r.region, []).append(r.latency_ms or 0.0)
        return {region: self.rtt(client_region, region) + statistics.median(values)
                for region, values in measured.items()}

    def nearest(self, client_region: str, candidates: list[Replica]) -> list[Replica]:
        """The replicas of the regions within slack of the nearest; all candidates when every near
        replica is saturated."""
        latency = self.region_latency(client_region, candidates)
        best = min(latency.values())
        near = [r for r in candidates if latency[r.region] <= best + self.slack_ms]
        if all(r.inflight_requests >= self.spill_inflight for r in near):
            return candidates
        return near
