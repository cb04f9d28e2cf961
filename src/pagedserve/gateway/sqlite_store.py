"""SQLiteStore: one gateway instance's state (keys, buckets, spend, source versions, index documents) in a WAL
file that survives a restart or a crash of the process."""
from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path

from pagedserve.gateway.auth import ApiKey
from pagedserve.gateway.store_types import Bucket, ReserveResult, TakeResult, next_version


class SQLiteStore:
    def __init__(self, path: str | Path, clock: Callable[[], float] = time.time):
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.clock = clock
        self.lock = threading.Lock()
        self.db = sqlite3.connect(str(path), isolation_level=None, check_same_thread=False)
        self.db.execute("PRAGMA busy_timeout=5000")
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")  # WAL + NORMAL: a committed write survives a process crash
        self.db.executescript(SQLITE_SCHEMA)

    def _txn(self, fn: Callable[[sqlite3.Connection], object]) -> object:
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                result = fn(self.db)
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")
            return result

    async def close(self) -> None:
        self.db.close()

    async def persistence_warning(self) -> str | None:
        return None  # WAL on disk

    async def put_key(self, key: ApiKey) -> None:
        self._txn(lambda db: db.execute(
            "INSERT OR REPLACE INTO keys(key_id, key_hash, data) VALUES (?, ?, ?)",
            (key.key_id, key.key_hash, json.dumps(key.to_dict()))))

    async def key_by_hash(self, key_hash: str) -> ApiKey | None:
        with self.lock:
            row = self.db.execute("SELECT data FROM keys WHERE key_hash = ?", (key_hash,)).fetchone()
        return ApiKey(**json.loads(row[0])) if row else None

    async def revoke_key(self, key_id: str) -> bool:
        def revoke(db: sqlite3.Connection) -> bool:
            row = db.execute("SELECT data FROM keys WHERE key_id = ?", (key_id,)).fetchone()
            if row is None:
                return False
            data = json.loads(row[0])
            data["revoked_at"] = data["revoked_at"] or self.clock()
            db.execute("UPDATE keys SET data = ? WHERE key_id = ?", (json.dumps(data), key_id))
            return True
        return bool(self._txn(revoke))

    async def list_keys(self) -> list[ApiKey]:
        with self.lock:
            rows = self.db.execute("SELECT data FROM keys ORDER BY rowid").fetchall()
        return [ApiKey(**json.loads(r[0])) for r in rows]

    async def take(self, buckets: list[Bucket]) -> TakeResult:
        """Takes every bucket's cost, or none of them when any bucket is short."""
        def take(db: sqlite3.Connection) -> TakeResult:
            now = self.clock()
            levels = [self._level(db, b, now) for b in buckets]
            wait = max([(b.cost - lv) / b.rate for b, lv in zip(buckets, levels) if lv < b.cost], default=0.0)
            allowed = wait == 0.0
            if allowed:
                levels = [lv - b.cost for b, lv in zip(buckets, levels)]
            for b, lv in zip(buckets, levels):
                db.execute("INSERT OR REPLACE INTO buckets(name, level, ts) VALUES (?, ?, ?)", (b.name, lv, now))
            return TakeResult(allowed, wait, levels)
        return self._txn(take)

    async def give_back(self, bucket: Bucket, amount: float) -> None:
        """Returns (or, when negative, charges more of) a bucket, e.g. once a request's real usage is known."""
        def give(db: sqlite3.Connection) -> None:
            now = self.clock()
            level = min(bucket.capacity, self._level(db, bucket, now) + amount)
            db.execute("INSERT OR REPLACE INTO buckets(name, level, ts) VALUES (?, ?, ?)", (bucket.name, level, now))
        self._txn(give)

    @staticmethod
    def _level(db: sqlite3.Connection, bucket: Bucket, now: float) -> float:
        row = db.execute("SELECT level, ts FROM buckets WHERE name = ?", (bucket.name,)).fetchone()
        if row is None:
            return bucket.capacity
        return min(bucket.capacity, row[0] + max(0.0, now - row[1]) * bucket.rate)

    async def reserve(self, day: str, scopes: list[str], limits: list[int | None], amount: int) -> ReserveResult:
        """Holds `amount` for every scope on `day` unless spend + holds + amount would cross one of the limits."""
        def reserve(db: sqlite3.Connection) -> ReserveResult:
            spent = [self._spent(db, day, s) for s in scopes]
            held = [self._spent(db, day, s, "holds") for s in scopes]
            for i, (s, h, limit) in enumerate(zip(spent, held, limits)):
                if limit is not None and s + h + amount > limit:
                    return ReserveResult(False, spent, held, i)
            for scope in scopes:
                self._add(db, day, scope, amount, "holds")
            return ReserveResult(True, spent, held)
        return self._txn(reserve)

    async def settle(self, day: str, scopes: list[str], reserved: int, actual: int) -> None:
        """Releases a hold and records what the request really cost, in one transaction."""
        def settle(db: sqlite3.Connection) -> None:
            for scope in scopes:
                self._add(db, day, scope, -reserved, "holds")
                self._add(db, day, scope, actual)
        self._txn(settle)

    async def add_spend(self, day: str, scopes: list[str], amount: int) -> None:
        self._txn(lambda db: [self._add(db, day, s, amount) for s in scopes])

    async def usage(self, day: str | None = None) -> list[tuple[str, str, int]]:
        """(day, scope, nanodollars) rows, newest day first."""
        sql = "SELECT day, scope, nanos FROM spend" + (" WHERE day = ?" if day else "") + " ORDER BY day DESC, scope"
        with self.lock:
            return [tuple(r) for r in self.db.execute(sql, (day,) if day else ()).fetchall()]

    @staticmethod
    def _spent(db: sqlite3.Connection, day: str, scope: str, table: str = "spend") -> int:
        row = db.execute(f"SELECT nanos FROM {table} WHERE day = ? AND scope = ?", (day, scope)).fetchone()
        return row[0] if row else 0

    @staticmethod
    def _add(db: sqlite3.Connection, day: str, scope: str, amount: int, table: str = "spend") -> None:
        db.execute(f"INSERT INTO {table}(day, scope, nanos) VALUES (?, ?, ?) "
                   "ON CONFLICT(day, scope) DO UPDATE SET nanos = nanos + excluded.nanos", (day, scope, amount))

    async def source_versions(self, names: list[str]) -> dict[str, str]:
        with self.lock:
            rows = dict(self.db.execute("SELECT name, version FROM sources").fetchall())
        return {n: rows.get(n, "0") for n in names}

    def _set_version(self, db: sqlite3.Connection, name: str, current: tuple | None, version: str | None) -> str:
        """Records the source's next version (or the given one) inside the caller's transaction."""
        new = version or next_version(current[0] if current else None)
        db.execute("INSERT OR REPLACE INTO sources(name, version, updated_at) VALUES (?, ?, ?)",
                   (name, new, self.clock()))
        return new

    async def bump_source(self, name: str, version: str | None = None) -> str:
        def bump(db: sqlite3.Connection) -> str:
            row = db.execute("SELECT version FROM sources WHERE name = ?", (name,)).fetchone()
            return self._set_version(db, name, row, version)
        return self._txn(bump)

    async def list_sources(self) -> dict[str, dict]:
        with self.lock:
            rows = self.db.execute("SELECT name, version, updated_at FROM sources ORDER BY name").fetchall()
        return {n: {"version": v, "updated_at": t} for n, v, t in rows}

    async def index_manifest(self, source: str) -> dict[str, str]:
        """Document name -> content hash of what the source's index holds."""
        with self.lock:
            rows = self.db.execute("SELECT name, content_hash FROM index_docs WHERE source = ?", (source,)).fetchall()
        return dict(rows)

    async def index_records(self, source: str, names: list[str] | None = None) -> dict[str, str]:
        """Document name -> its record (JSON), for the named documents or all of them."""
        with self.lock:
            rows = self.db.execute("SELECT name, record FROM index_docs WHERE source = ?", (source,)).fetchall()
        wanted = None if names is None else set(names)
        return {n: r for n, r in rows if wanted is None or n in wanted}

    async def index_apply(self, source: str, put: dict[str, tuple[str, str]], remove: list[str]) -> str:
        """Writes (name -> (content hash, record)) and deletes names in one transaction; the source's version
        moves on only when a stored hash really changed or a document really went. Returns the version now current."""
        def apply(db: sqlite3.Connection) -> str:
            stored = dict(db.execute("SELECT name, content_hash FROM index_docs WHERE source = ?", (source,)).fetchall())
            changed = 0
            for name, (content_hash, record) in put.items():
                if stored.get(name) != content_hash:
                    db.execute("INSERT OR REPLACE INTO index_docs(source, name, content_hash, record) "
                               "VALUES (?, ?, ?, ?)", (source, name, content_hash, record))
                    changed += 1
            for name in remove:
                changed += db.execute("DELETE FROM index_docs WHERE source = ? AND name = ?", (source, name)).rowcount
            row = db.execute("SELECT version FROM sources WHERE name = ?", (source,)).fetchone()
            if not changed and row is not None:
                return row[0]
            return self._set_version(db, source, row, None)
        return self._txn(apply)

    async def lease(self, name: str, owner: str, ttl_s: float) -> bool:
        """Takes (or renews) the named lease for `owner` when it is free, expired or already theirs (leases.py)."""
        def take(db: sqlite3.Connection) -> bool:
            row = db.execute("SELECT owner, expires_at FROM leases WHERE name = ?", (name,)).fetchone()
            now = self.clock()
            if row is not None and row[0] != owner and row[1] > now:
                return False
            db.execute("INSERT OR REPLACE INTO leases(name, owner, expires_at) VALUES (?, ?, ?)", (name, owner, now + ttl_s))
            return True
        return bool(self._txn(take))

    async def release(self, name: str, owner: str) -> None:
        self._txn(lambda db: db.execute("DELETE FROM leases WHERE name = ? AND owner = ?", (name, owner)))

    async def indexed_sources(self) -> dict[str, int]:
        """Source -> number of indexed documents."""
        with self.lock:
            rows = self.db.execute("SELECT source, COUNT(*) FROM index_docs GROUP BY source ORDER BY source").fetchall()
        return dict(rows)


SQLITE_SCHEMA = """
CREATE TABLE IF NOT EXISTS keys (key_id TEXT PRIMARY KEY, key_hash TEXT UNIQUE NOT NULL, data TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS buckets (name TEXT PRIMARY KEY, level REAL NOT NULL, ts REAL NOT NULL);
CREATE TABLE IF NOT EXISTS spend (day TEXT NOT NULL, scope TEXT NOT NULL, nanos INTEGER NOT NULL,
                                  PRIMARY KEY (day, scope));
CREATE TABLE IF NOT EXISTS holds (day TEXT NOT NULL, scope TEXT NOT NULL, nanos INTEGER NOT NULL,
                                  PRIMARY KEY (day, scope));
CREATE TABLE IF NOT EXISTS sources (name TEXT PRIMARY KEY, version TEXT NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS index_docs (source TEXT NOT NULL, name TEXT NOT NULL, content_hash TEXT NOT NULL,
                                       record TEXT NOT NULL, PRIMARY KEY (source, name));
CREATE TABLE IF NOT EXISTS leases (name TEXT PRIMARY KEY, owner TEXT NOT NULL, expires_at REAL NOT NULL);
"""
