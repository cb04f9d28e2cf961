"""What the gateway console reads from the traces and the cached answers: filtered pages of traces, one trace,
cost by day and by team / route / model / key, the cache's verdicts over time, the providers' error rates and
latency percentiles, cache entries per source version.

The console opens its own read-only SQLite connections (`mode=ro`: nothing here can write; WAL lets them read
while the gateway writes) and runs each query off the event loop."""
from __future__ import annotations

import asyncio
import json
import sqlite3
import statistics
import threading
import time
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from pathlib import Path
from urllib.parse import quote
from zoneinfo import ZoneInfo

from pagedserve.gateway.tracing import Trace

SLICE_S = 900  # cost is summed per quarter hour in SQL, then per day in the gateway's time zone
DIMENSIONS = {"team": "team", "route": "route", "model": "upstream_model", "key": "key_id", "provider": "provider"}
VERDICTS = ("hit", "stale", "miss", "coalesced")  # the answers the cache was asked for (bypass and off were not)
FAILED_ATTEMPT = {"timeout", "connect_error", "bad_response", "stream_error", "408", "429"}


@dataclass(slots=True)
class TraceFilter:
    key_id: str | None = None
    route: str | None = None
    tier: str | None = None
    provider: str | None = None
    cache: str | None = None
    status: str | None = None  # an exact code, "ok" (2xx), "4xx" or "5xx"
    min_latency_ms: float | None = None
    min_cost_usd: float | None = None
    since: float | None = None
    until: float | None = None

    def where(self) -> tuple[str, list]:
        clauses, args = [], []
        for column, value in (("key_id", self.key_id),):
            if value:
                clauses.append(f"{column} = ?")
                args.append(value)
        for name, value in (("route", self.route), ("tier", self.tier), ("provider", self.provider),
                            ("cache", self.cache)):
            if value:
                clauses.append(f"json_extract(data, '$.{name}') = ?")
                args.append(value)
        if self.status == "ok":
            clauses.append("json_extract(data, '$.status') BETWEEN 200 AND 299")
        elif self.status in ("4xx", "5xx"):
            low = int(self.status[0]) * 100
            clauses.append("json_extract(data, '$.status') BETWEEN ? AND ?")
            args += [low, low + 99]
        elif self.status:
            clauses.append("json_extract(data, '$.status') = ?")
            args.append(int(self.status))
        for expression, value in (("json_extract(data, '$.latency_ms') >= ?", self.min_latency_ms),
                                  ("json_extract(data, '$.cost_usd') >= ?", self.min_cost_usd),
                                  ("ts >= ?", self.since), ("ts < ?", self.until)):
            if value is not None:
                clauses.append(expression)
                args.append(value)
        return (" WHERE " + " AND ".join(clauses)) if clauses else "", args


@dataclass(slots=True)
class ProviderStats:
    name: str
    attempts: int = 0
    failures: int = 0
    short_circuited: int = 0  # not called: its breaker was open
    latencies: list[float] = field(default_factory=list)  # of the attempts that answered 200
    samples: list[tuple[float, float | None]] = field(default_factory=list)  # (start, latency; None: it failed)
    last_error: str | None = None
    last_error_at: float | None = None

    @property
    def error_rate(self) -> float | None:
        return self.failures / self.attempts if self.attempts else None

    def percentile(self, q: float) -> float | None:
        return percentile(self.latencies, q)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def failed(status: str) -> bool:
    """A provider's own failure (5xx, timeout, a broken answer), not a 4xx the request itself caused."""
    return status in FAILED_ATTEMPT or status.startswith("5")


class Reports:
    def __init__(self, traces_path: Path, cache_path: Path | None, tz: ZoneInfo):
        self.tz = tz
        self.lock = threading.Lock()  # one query at a time per connection (they run on worker threads)
        self.traces = _read_only(traces_path)
        self.cache = _read_only(cache_path) if cache_path is not None and cache_path.exists() else None

    def close(self) -> None:
        for db in (self.traces, self.cache):
            if db is not None:
                db.close()

    async def _rows(self, db: sqlite3.Connection, sql: str, args: list | tuple = ()) -> list[tuple]:
        def run() -> list[tuple]:
            with self.lock:
                return db.execute(sql, args).fetchall()
        return await asyncio.to_thread(run)

    def day(self, ts: float) -> str:
        return datetime.fromtimestamp(ts, self.tz).date().isoformat()

    def days(self, count: int) -> list[str]:
        """The last `count` days in the gateway's time zone, oldest first, today last."""
        today = datetime.now(self.tz).date()
        return [(today - timedelta(days=i)).isoformat() for i in range(count - 1, -1, -1)]

    def midnight(self, day: str) -> float:
        return datetime.combine(date.fromisoformat(day), datetime.min.time(), self.tz).timestamp()

    async def page(self, where: TraceFilter, page: int, per_page: int) -> tuple[list[dict], int]:
        clause, args = where.where()
        rows = await self._rows(self.traces, f"SELECT data FROM traces{clause} ORDER BY ts DESC LIMIT ? OFFSET ?",
                                [*args, per_page, (page - 1) * per_page])
        total = (await self._rows(self.traces, f"SELECT COUNT(*) FROM traces{clause}", args))[0][0]
        return [complete(r[0]) for r in rows], total

    async def trace(self, trace_id: str) -> dict | None:
        rows = await self._rows(self.traces, "SELECT data FROM traces WHERE trace_id = ?", (trace_id,))
        return complete(rows[0][0]) if rows else None

    async def distinct(self, name: str, since: float) -> list[str]:
        """The values a trace field took lately (for the filters' choices)."""
        column = (DIMENSIONS | {"tier": "tier", "cache": "cache"})[name]  # a known field, never the caller's text
        rows = await self._rows(self.traces, f"SELECT DISTINCT json_extract(data, '$.{column}') "
                                "FROM traces WHERE ts >= ? ORDER BY 1", (since,))
        return [str(r[0]) for r in rows if r[0] is not None]

    async def cost_by(self, dimension: str, days: int) -> dict[str, dict[str, tuple[float, int]]]:
        """day -> value of the dimension (team, route, model, key) -> (cost, requests), over the last `days`."""
        column = DIMENSIONS[dimension]
        since = self.midnight(self.days(days)[0])
        rows = await self._rows(
            self.traces, f"SELECT CAST(ts / {SLICE_S} AS INTEGER), json_extract(data, '$.{column}'), "
            "SUM(json_extract(data, '$.cost_usd')), COUNT(*) FROM traces WHERE ts >= ? GROUP BY 1, 2", (since,))
        out: dict[str, dict[str, tuple[float, int]]] = {}
        for slice_, value, cost, count in rows:
            per_day = out.setdefault(self.day(slice_ * SLICE_S), {})
            name = "(none)" if value is None else str(value)
            before = per_day.get(name, (0.0, 0))
            per_day[name] = (before[0] + (cost or 0.0), before[1] + count)
        return out

    async def volume(self, since: float, bucket_s: int) -> list[tuple[int, int, int, float, float]]:
        """(bucket start, requests answered, errors, cost, mean latency in ms) per bucket since `since`."""
        return await self._rows(
            self.traces, f"SELECT CAST(ts / {bucket_s} AS INTEGER) * {bucket_s}, COUNT(*), "
            "SUM(json_extract(data, '$.status') >= 400), SUM(json_extract(data, '$.cost_usd')), "
            "AVG(json_extract(data, '$.latency_ms')) FROM traces WHERE ts >= ? GROUP BY 1 ORDER BY 1", (since,))

    async def cache_verdicts(self, since: float, bucket_s: int) -> list[tuple[int, str, int, int]]:
        """(bucket start, verdict, requests, guard rejections) for the cache's verdicts since `since`."""
        return await self._rows(
            self.traces, f"SELECT CAST(ts / {bucket_s} AS INTEGER) * {bucket_s}, json_extract(data, '$.cache'), "
            "COUNT(*), SUM(json_extract(data, '$.guard_rejected') IS NOT NULL) FROM traces "
            "WHERE ts >= ? AND json_extract(data, '$.cache') IS NOT NULL GROUP BY 1, 2 ORDER BY 1", (since,))

    async def providers(self, since: float, limit: int = 20_000) -> dict[str, ProviderStats]:
        rows = await self._rows(self.traces, "SELECT json_extract(data, '$.attempts') FROM traces WHERE ts >= ? "
                                "AND json_array_length(json_extract(data, '$.attempts')) > 0 ORDER BY ts DESC LIMIT ?",
                                (since, limit))
        stats: dict[str, ProviderStats] = {}
        for (attempts,) in rows:
            for a in json.loads(attempts):
                s = stats.setdefault(a["provider"], ProviderStats(a["provider"]))
                status = str(a["status"])
                if status == "circuit_open":
                    s.short_circuited += 1
                    continue
                s.attempts += 1
                if status == "200":
                    s.latencies.append(a["latency_ms"])
                    s.samples.append((a["started_at"], a["latency_ms"]))
                elif failed(status):
                    s.failures += 1
                    s.samples.append((a["started_at"], None))
                    if s.last_error_at is None or a["started_at"] > s.last_error_at:
                        s.last_error, s.last_error_at = f"{status}: {a.get('error') or ''}".strip(": "), a["started_at"]
        return stats

    async def entries_by_source(self) -> list[tuple[str, str, int]]:
        """(source, version, live cached answers recorded against it); answers that depend on no source as
        ("(none)", "", n)."""
        if self.cache is None:
            return []
        now = time.time()
        rows = await self._rows(self.cache, "SELECT j.key, j.value, COUNT(*) FROM entries, json_each(entries.sources) "
                                "AS j WHERE expires_at > ? GROUP BY 1, 2 ORDER BY 1, 2", (now,))
        bare = await self._rows(self.cache, "SELECT COUNT(*) FROM entries WHERE expires_at > ? AND sources = '{}'",
                                (now,))
        return [(s, str(v), n) for s, v, n in rows] + ([("(none)", "", bare[0][0])] if bare[0][0] else [])

    async def recent_entries(self, limit: int = 20) -> list[dict]:
        if self.cache is None:
            return []
        rows = await self._rows(self.cache, "SELECT entry_id, scope, query, sources, created_at, expires_at FROM "
                                "entries ORDER BY entry_id DESC LIMIT ?", (limit,))
        out = []
        for entry_id, scope, query, sources, created, expires in rows:
            tenant, _, rest = scope.partition("|")
            out.append({"entry_id": entry_id, "tenant": tenant, "route": rest.partition("|")[0], "query": query,
                        "sources": json.loads(sources), "created_at": created, "expires_at": expires})
        return out


def complete(data: str) -> dict:
    """A stored trace with every field of today's Trace (one written by an older gateway may lack a few)."""
    return {**BLANK, **json.loads(data)}


BLANK = Trace().to_dict()


def _read_only(path: Path) -> sqlite3.Connection:
    db = sqlite3.connect(f"file:{quote(str(path.resolve()))}?mode=ro", uri=True, check_same_thread=False)
    db.execute("PRAGMA busy_timeout=5000")
    return db
