"""API keys: minted once, stored only as a SHA-256 hash, mapped to a user, team, models, residency and limits."""
from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import asdict, dataclass, field

KEY_PREFIX = "sk-ps-"


@dataclass(slots=True)
class ApiKey:
    key_id: str  # public handle: the first 12 hex digits of the hash
    key_hash: str
    user: str
    team: str | None = None  # the semantic cache's tenant; None: the key's answers are shared only with its user
    models: list[str] = field(default_factory=list)  # allowed routes; empty: all
    residency: str | None = None  # passed to the router as x-residency
    rpm: int | None = None  # requests per minute; None: unlimited
    tpm: int | None = None  # tokens (prompt + max completion) per minute
    daily_budget_usd: float | None = None
    created_at: float = 0.0
    revoked_at: float | None = None

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    def allows(self, model: str) -> bool:
        return not self.models or model in self.models

    def to_dict(self) -> dict:
        return asdict(self)

    def public(self) -> dict:
        data = self.to_dict()
        data.pop("key_hash")
        return data


def hash_key(token: str) -> str:
    return hashlib.sha256(token.encode(errors="surrogatepass")).hexdigest()


def mint_key(user: str, **fields) -> tuple[str, ApiKey]:
    """Returns the secret (shown once) and the record to store."""
    token = KEY_PREFIX + secrets.token_urlsafe(32)
    digest = hash_key(token)
    return token, ApiKey(key_id=digest[:12], key_hash=digest, user=user, created_at=time.time(), **fields)


def bearer_token(authorization: str | None) -> str | None:
    if not authorization:
        return None
    scheme, _, token = authorization.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


def is_admin(token: str | None, admin_key: str | None) -> bool:
    """Constant-time comparison of bytes: compare_digest refuses str with non-ASCII characters."""
    return bool(token and admin_key and secrets.compare_digest(token.encode(), admin_key.encode()))
