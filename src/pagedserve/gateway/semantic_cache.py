"""Semantic cache: answers keyed by the embedding of the normalised question, one faiss HNSW
inner-product index per scope (tenant + route + every answer-shaping parameter).

An entry remembers the versions of the knowledge sources it was answered against, and for a retrieval
route the chunks its answer was built from (content hashes). A near-enough entry is a hit only while those
versions are current, every one of its chunks is still in the index unchanged, and its TTL has not passed;
otherwise it is stale, dropped, and the fresh answer that follows is stored against today's versions.
"""
from __future__ import annotations

import hashlib
import json
import sqlite3
import threading
import time
import unicodedata
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import faiss
import numpy as np

from pagedserve.gateway.near_miss import compatible

SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (entry_id INTEGER PRIMARY KEY, scope TEXT NOT NULL, query TEXT NOT NULL,
    vector BLOB NOT NULL, response TEXT NOT NULL, sources TEXT NOT NULL, created_at REAL NOT NULL,
    expires_at REAL NOT NULL, max_tokens INTEGER, finish_reason TEXT, completion_tokens INTEGER NOT NULL,
    chunks TEXT NOT NULL DEFAULT '{}');
"""
ENTRY_COLUMNS = ("entry_id, scope, query, response, sources, created_at, expires_at, max_tokens, finish_reason, "
                 "completion_tokens, chunks")

# Body fields that do not change which answer is right: they are left out of the scope hash.
SCOPE_FREE_FIELDS = {"model", "messages", "prompt", "max_tokens", "max_completion_tokens", "stream",
                     "stream_options", "user", "route", "sources", "cache"}


def normalise(text: str) -> str:
    return " ".join(unicodedata.normalize("NFKC", text).lower().split())


def scope_key(tenant: str, route: str, body: dict, context: list) -> str:
    """Entries are only ever compared within one scope: same tenant, route, earlier turns and parameters."""
    shaping = {k: v for k, v in body.items() if k not in SCOPE_FREE_FIELDS}
    digest = hashlib.sha256(json.dumps([shaping, context], sort_keys=True, default=str).encode()).hexdigest()
    return f"{tenant}|{route}|{digest[:16]}"


@dataclass(slots=True)
class CacheEntry:
    entry_id: int
    scope: str
    query: str
    response: dict
    sources: dict[str, str]
    created_at: float
    expires_at: float
    max_tokens: int | None
    finish_reason: str | None
    completion_tokens: int
    chunks: dict[str, dict[str, str]] = field(default_factory=dict)  # source -> chunk hash -> "document > heading"

    def fits(self, max_tokens: int | None) -> bool:
        """A stored answer serves a request whose max_tokens would have produced the same text."""
        if self.finish_reason == "stop":
            return max_tokens is None or self.completion_tokens <= max_tokens
        return max_tokens == self.max_tokens


@dataclass(slots=True)
class Lookup:
    result: str  # hit | stale | miss
    entry: CacheEntry | None = None
    similarity: float | None = None
    stale_reason: str | None = None
    guard_rejected: float | None = None  # a miss only because the near-miss guard refused an entry this similar


@dataclass(slots=True)
class Rejection:
    """A question the near-miss guard kept from a cached answer it was close enough to (the console lists them)."""
    at: float
    scope: str
    query: str
    cached_query: str
    similarity: float


@dataclass(slots=True)
class _ScopeIndex:
    index: faiss.IndexHNSWFlat
    entry_ids: list[int] = field(default_factory=list)  # faiss position -> entry_id
    dead: set[int] = field(default_factory=set)  # positions whose entry was dropped


def stale_reason(entry: CacheEntry, current: dict[str, str], now: float) -> str | None:
    if now >= entry.expires_at:
        return f"ttl passed {now - entry.expires_at:.0f}s ago"
    for name, version in sorted(current.items()):
        cached = entry.sources.get(name)
        if cached != version:
            return f"source {name} changed: cached against {cached}, now {version}"
    return None


class SemanticCache:
    def __init__(self, path: Path, dim: int, clock: Callable[[], float] = time.time, hnsw_m: int = 32,
                 ef_search: int = 128, candidates: int = 4):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.rejections: deque[Rejection] = deque(maxlen=50)  # the guard's latest, in memory only
        self.dim, self.clock, self.hnsw_m, self.ef_search, self.k = dim, clock, hnsw_m, ef_search, candidates
        self.lock = threading.Lock()
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA busy_timeout=5000")
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        if "chunks" not in {row[1] for row in self.db.execute("PRAGMA table_info(entries)")}:
            self.db.execute("ALTER TABLE entries ADD COLUMN chunks TEXT NOT NULL DEFAULT '{}'")  # a cache from before
        self.scopes: dict[str, _ScopeIndex] = {}
        self.positions: dict[int, tuple[str, int]] = {}  # entry_id -> (scope, position)
        self._load()

    def __len__(self) -> int:
        return len(self.positions)

    def _load(self) -> None:
        self.db.execute("DELETE FROM entries WHERE expires_at <= ?", (self.clock(),))
        rows = self.db.execute("SELECT entry_id, scope, vector FROM entries ORDER BY entry_id").fetchall()
        by_scope: dict[str, list[tuple[int, bytes]]] = {}
        for entry_id, scope, vector in rows:
            by_scope.setdefault(scope, []).append((entry_id, vector))
        for scope, items in by_scope.items():
            vectors = np.frombuffer(b"".join(v for _, v in items), dtype=np.float32).reshape(len(items), self.dim)
            self._add(scope, [i for i, _ in items], vectors)

    def _new_index(self) -> faiss.IndexHNSWFlat:
        index = faiss.IndexHNSWFlat(self.dim, self.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efSearch = self.ef_search
        return index

    def _add(self, scope: str, entry_ids: list[int], vectors: np.ndarray) -> None:
        s = self.scopes.get(scope) or self.scopes.setdefault(scope, _ScopeIndex(self._new_index()))
        start = len(s.entry_ids)
        s.index.add(np.ascontiguousarray(vectors, dtype=np.float32))
        s.entry_ids.extend(entry_ids)
        for offset, entry_id in enumerate(entry_ids):
            self.positions[entry_id] = (scope, start + offset)

    def search(self, scope: str, vector: np.ndarray, max_tokens: int | None,
               query: str | None = None) -> tuple[CacheEntry | None, float]:
        """The nearest live entry of the scope that fits the request (and, given the query, passes the
        near-miss guard: same polarity, numbers and named entities), and its cosine similarity."""
        entry, similarity, _ = self._nearest(scope, vector, max_tokens, query)
        return entry, similarity

    def _nearest(self, scope: str, vector: np.ndarray, max_tokens: int | None,
                 query: str | None) -> tuple[CacheEntry | None, float, tuple[float, CacheEntry] | None]:
        """search()'s answer, and the closest entry the guard refused on the way (if any)."""
        with self.lock:
            s = self.scopes.get(scope)
            if s is None or len(s.dead) == len(s.entry_ids):
                return None, 0.0, None
            sims, found = s.index.search(vector.reshape(1, -1).astype(np.float32), self.k)
            hits = [(float(sim), s.entry_ids[pos]) for sim, pos in zip(sims[0], found[0])
                    if pos >= 0 and pos not in s.dead]
        refused = None
        for sim, entry_id in sorted(hits, reverse=True):
            entry = self.get(entry_id)
            if entry is None or not entry.fits(max_tokens):
                continue
            # Embeddings barely see a digit, a negation or a country: the guard compares those exactly.
            if query is None or compatible(query, entry.query):
                return entry, sim, refused
            refused = refused or (sim, entry)
        return None, 0.0, refused

    def lookup(self, scope: str, vector: np.ndarray, threshold: float, current: dict[str, str],
               max_tokens: int | None, query: str | None = None,
               chunks_gone: Callable[[CacheEntry], str | None] | None = None) -> Lookup:
        """chunks_gone(entry): why the entry's chunks are no longer all in the index, or None."""
        entry, similarity, refused = self._nearest(scope, vector, max_tokens, query)
        if entry is None or similarity < threshold:
            guarded = None
            if refused is not None and refused[0] >= threshold:  # it would have been a hit but for the guard
                guarded = round(refused[0], 4)
                self.rejections.append(Rejection(self.clock(), scope, query, refused[1].query, guarded))
            return Lookup("miss", None, round(similarity, 4) if entry else None, guard_rejected=guarded)
        reason = stale_reason(entry, current, self.clock())
        if reason is None and chunks_gone is not None:
            reason = chunks_gone(entry)
        if reason is not None:
            self.drop(entry.entry_id)
            return Lookup("stale", entry, round(similarity, 4), reason)
        return Lookup("hit", entry, round(similarity, 4))

    def get(self, entry_id: int) -> CacheEntry | None:
        with self.lock:
            row = self.db.execute(f"SELECT {ENTRY_COLUMNS} FROM entries WHERE entry_id = ?", (entry_id,)).fetchone()
        if row is None:
            return None
        return CacheEntry(row[0], row[1], row[2], json.loads(row[3]), json.loads(row[4]), *row[5:10],
                          json.loads(row[10]))

    def put(self, scope: str, query: str, vector: np.ndarray, response: dict, sources: dict[str, str],
            ttl_s: float, max_tokens: int | None, finish_reason: str | None, completion_tokens: int,
            chunks: dict[str, dict[str, str]] | None = None) -> int:
        now = self.clock()
        vector = np.ascontiguousarray(vector, dtype=np.float32).reshape(1, self.dim)
        with self.lock:
            cursor = self.db.execute(
                "INSERT INTO entries(scope, query, vector, response, sources, created_at, expires_at, max_tokens, "
                "finish_reason, completion_tokens, chunks) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (scope, query, vector.tobytes(), json.dumps(response), json.dumps(sources), now, now + ttl_s,
                 max_tokens, finish_reason, completion_tokens, json.dumps(chunks or {})))
            entry_id = int(cursor.lastrowid)
            self._add(scope, [entry_id], vector)
        return entry_id

    def put_many(self, scope: str, queries: list[str], vectors: np.ndarray, response: dict,
                 sources: dict[str, str], ttl_s: float) -> None:
        """Bulk insert (benchmarks, warm-up): one transaction and one index add."""
        now = self.clock()
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        body = json.dumps(response)
        with self.lock:
            self.db.execute("BEGIN")
            ids = [int(self.db.execute(
                "INSERT INTO entries(scope, query, vector, response, sources, created_at, expires_at, max_tokens, "
                "finish_reason, completion_tokens) VALUES (?, ?, ?, ?, ?, ?, ?, NULL, 'stop', 0)",
                (scope, q, v.tobytes(), body, json.dumps(sources), now, now + ttl_s)).lastrowid)
                for q, v in zip(queries, vectors)]
            self.db.execute("COMMIT")
            self._add(scope, ids, vectors)

    def drop(self, entry_id: int) -> None:
        with self.lock:
            self.db.execute("DELETE FROM entries WHERE entry_id = ?", (entry_id,))
            place = self.positions.pop(entry_id, None)
            if place is None:
                return
            s = self.scopes[place[0]]
            s.dead.add(place[1])
            if len(s.dead) > 1024 and len(s.dead) > len(s.entry_ids) // 2:
                self._rebuild(place[0])

    def _rebuild(self, scope: str) -> None:
        """HNSW cannot delete: when most of a scope is dead, rebuild it from the live vectors."""
        s = self.scopes.pop(scope)
        live = [(i, entry_id) for i, entry_id in enumerate(s.entry_ids) if i not in s.dead]
        if live:
            vectors = np.vstack([s.index.reconstruct(i) for i, _ in live])
            self._add(scope, [entry_id for _, entry_id in live], vectors)

    def close(self) -> None:
        self.db.close()
