"""Gateway state: keys, rate-limit buckets, daily spend, knowledge-source versions and the retrieval index's
documents (one record per document: its chunks and their vectors, so no instance re-embeds another's work).

SQLiteStore (default, sqlite_store.py) keeps one instance's state in a WAL file that survives a restart or a
crash of the process. RedisStore (redis_store.py) lets many gateway instances share it: every check-and-update
is one Lua script, so N instances enforce one limit, not N. Money is kept as integer nanodollars
(store_types.py) so sums never drift.
"""
from __future__ import annotations

from pathlib import Path

from pagedserve.gateway.redis_store import RedisStore
from pagedserve.gateway.sqlite_store import SQLiteStore
from pagedserve.gateway.store_types import NANO, Bucket, to_nano

__all__ = ["NANO", "Bucket", "RedisStore", "SQLiteStore", "Store", "open_store", "to_nano"]

Store = SQLiteStore | RedisStore


def open_store(spec: str, sqlite_path: Path) -> Store:
    """'sqlite' (the default file under data_dir), 'sqlite:///path' or 'redis://host:port/db'."""
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(spec)
    if spec.startswith("sqlite:///"):
        return SQLiteStore(spec.removeprefix("sqlite:///"))
    if spec == "sqlite":
        return SQLiteStore(sqlite_path)
    raise ValueError(f"unknown store {spec!r}: use 'sqlite', 'sqlite:///path' or 'redis://host:port/db'")
