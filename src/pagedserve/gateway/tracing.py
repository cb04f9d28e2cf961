"""One trace per request: who, which route and why, the cache verdict, every provider attempt, tokens,
cost and latency. Rows go to SQLite; spans go to OpenTelemetry when an OTLP endpoint (or exporter) is set.
"""
from __future__ import annotations

import json
import sqlite3
import threading
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS traces (trace_id TEXT PRIMARY KEY, ts REAL NOT NULL, key_id TEXT, user TEXT,
                                   data TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS traces_ts ON traces (ts);
"""


@dataclass(slots=True)
class Trace:
    trace_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    started_at: float = field(default_factory=time.time)
    endpoint: str = ""
    key_id: str | None = None
    user: str | None = None
    team: str | None = None
    route: str | None = None  # the model the client asked for
    tier: str | None = None  # small | large
    pinned: bool = False  # the request chose its tier itself
    classifier_score: float | None = None  # probability of "hard"
    # hit | miss | stale | off | bypass (not cacheable) | coalesced (served an identical request's answer, which
    # was in flight when this one came); None: rejected before
    cache: str | None = None
    coalesced_with: str | None = None  # the trace id of the identical request this one waited for
    cache_similarity: float | None = None
    stale_reason: str | None = None
    guard_rejected: float | None = None  # a miss only because the near-miss guard refused an entry this similar
    sources: dict[str, str] = field(default_factory=dict)  # versions the answer depends on
    retrieval: list[dict] | None = None  # chunks put into the request: document, heading, hash, scores
    retrieval_ms: float | None = None  # the index search (the query embedding is shared with the cache)
    retrieval_note: str | None = None  # why a retrieval route retrieved nothing
    retrieval_context: dict | None = None  # what went into the request: where (a user message ...) and its text
    budget_spent_usd: float | None = None  # the user's spend today before this request
    budget_limit_usd: float | None = None
    budget_note: str | None = None  # usage that passed its reservation, or was not reported
    attempts: list[dict] = field(default_factory=list)
    # used | cancelled (why) | discarded (why: it had already answered); why: cache hit, small/large tier, error.
    speculative: str | None = None  # None: no speculative call
    provider: str | None = None
    upstream_model: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cost_usd: float = 0.0
    latency_ms: float = 0.0
    status: int = 200
    error: str | None = None
    stream: bool = False

    def finish(self, status: int, error: str | None = None) -> None:
        self.status, self.error = status, error
        self.latency_ms = round((time.time() - self.started_at) * 1000, 2)

    def to_dict(self) -> dict:
        return asdict(self)


class TraceSink:
    def __init__(self, path: Path, otlp_endpoint: str | None = None, span_exporter=None,
                 retention_days: float | None = None):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.lock = threading.Lock()
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA busy_timeout=5000")
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        if retention_days is not None:
            self.db.execute("DELETE FROM traces WHERE ts < ?", (time.time() - retention_days * 86400,))
        self.otel = _otel_provider(otlp_endpoint, span_exporter)
        self.tracer = self.otel and self.otel.get_tracer("pagedserve.gateway")

    def write(self, trace: Trace) -> None:
        with self.lock:
            self.db.execute("INSERT OR REPLACE INTO traces(trace_id, ts, key_id, user, data) VALUES (?, ?, ?, ?, ?)",
                            (trace.trace_id, trace.started_at, trace.key_id, trace.user, json.dumps(trace.to_dict())))
        if self.tracer is not None:
            _export(self.tracer, trace)

    def recent(self, limit: int = 20, key_id: str | None = None, user: str | None = None) -> list[dict]:
        where, args = [], []
        for column, value in (("key_id", key_id), ("user", user)):
            if value:
                where.append(f"{column} = ?")
                args.append(value)
        sql = "SELECT data FROM traces" + (" WHERE " + " AND ".join(where) if where else "")
        with self.lock:
            rows = self.db.execute(sql + " ORDER BY ts DESC LIMIT ?", (*args, limit)).fetchall()
        return [json.loads(r[0]) for r in rows]

    def close(self) -> None:
        if self.otel is not None:
            self.otel.shutdown()
        self.db.close()


def _otel_provider(endpoint: str | None, exporter):
    if endpoint is None and exporter is None:
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "pagedserve-gateway"}))
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


def _export(tracer, trace: Trace) -> None:
    from opentelemetry.trace import Status, StatusCode, set_span_in_context

    attributes = {f"gateway.{k}": v for k, v in trace.to_dict().items()
                  if v is not None and isinstance(v, (str, bool, int, float))}
    for name in ("retrieval", "retrieval_context"):
        if getattr(trace, name) is not None:
            attributes[f"gateway.{name}"] = json.dumps(getattr(trace, name))
    attributes["gen_ai.usage.input_tokens"] = trace.prompt_tokens
    attributes["gen_ai.usage.output_tokens"] = trace.completion_tokens
    end = trace.started_at + trace.latency_ms / 1000
    span = tracer.start_span("gateway.request", start_time=_ns(trace.started_at), attributes=attributes)
    if trace.status >= 400:
        span.set_status(Status(StatusCode.ERROR, trace.error or str(trace.status)))
    context = set_span_in_context(span)
    for a in trace.attempts:
        child = tracer.start_span("gateway.provider_call", context=context, start_time=_ns(a["started_at"]),
                                  attributes={f"gateway.provider.{k}": v for k, v in a.items() if v is not None})
        if a["status"] != "200":
            child.set_status(Status(StatusCode.ERROR, a.get("error") or a["status"]))
        child.end(end_time=_ns(a["started_at"] + a["latency_ms"] / 1000))
    span.end(end_time=_ns(end))
