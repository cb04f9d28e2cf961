"""Goodput as a curve, not one threshold: SLO attainment of each server at each offered rate, over a grid
of TTFT and TPOT targets (as DistServe's SLO-scale plots), the highest rate each server sustains at 90%
attainment, and throughput at matched latency."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

TTFT_SLOS = (0.5, 1.0, 2.0)  # seconds
TPOT_SLOS = (0.05, 0.10, 0.15, 0.20)  # seconds per output token
TARGET = 0.9  # attainment a rate must reach to count as sustained


class Request(Protocol):
    ok: bool
    ttft: float
    tpot: float


class Rate(Protocol):
    server: str
    rate: float
    output_tok_s: float
    requests: Sequence[Request]


def attainment(requests: Sequence[Request], ttft_slo: float, tpot_slo: float) -> float:
    """Share of all offered requests (failures included) that finished within both targets."""
    good = sum(1 for r in requests if r.ok and r.ttft <= ttft_slo and r.tpot <= tpot_slo)
    return good / len(requests) if requests else 0.0


def sustained_rate(rows: Sequence[Rate], ttft_slo: float, tpot_slo: float) -> float:
    """The highest offered rate at which this server, and every lower rate tried, met TARGET (0 if none)."""
    best = 0.0
    for row in sorted(rows, key=lambda r: r.rate):
        if attainment(row.requests, ttft_slo, tpot_slo) < TARGET:
            break
        best = row.rate
    return best


def matched_latency(rows: Sequence[Rate], ttft_slo: float = 2.0, tpot_slo: float = 0.15) -> tuple[float, float]:
    """(rate, output tok/s) at the highest sustained rate under a loose common target: the throughput
    each server delivers while keeping the same latency promise."""
    rate = sustained_rate(rows, ttft_slo, tpot_slo)
    row = next((r for r in rows if r.rate == rate), None)
    return rate, row.output_tok_s if row else 0.0


def by_server(results: Sequence[Rate]) -> dict[str, list[Rate]]:
    out: dict[str, list[Rate]] = {}
    for r in results:
        out.setdefault(r.server, []).append(r)
    return out


def grid_markdown(results: Sequence[Rate], reference: str = "pagedserve") -> tuple[list[str], list[float]]:
    """The table of sustained rates per (TTFT, TPOT) target, and the ratios reference/peer over the grid
    where both sustained some rate."""
    servers = by_server(results)
    names = list(servers)
    lines = ["| TTFT target | TPOT target | " + " | ".join(f"{n} max rate at {TARGET:.0%}" for n in names) + " |",
             "|---|---|" + "---|" * len(names)]
    ratios = []
    for ttft in TTFT_SLOS:
        for tpot in TPOT_SLOS:
            rates = {n: sustained_rate(rows, ttft, tpot) for n, rows in servers.items()}
            cells = [f"{rates[n]:g}" if rates[n] else "< lowest" for n in names]
            lines.append(f"| {ttft:g} s | {tpot * 1e3:g} ms | " + " | ".join(cells) + " |")
            if reference in rates:
                ratios += [rates[reference] / v for n, v in rates.items() if n != reference and v > 0]
    return lines, ratios
