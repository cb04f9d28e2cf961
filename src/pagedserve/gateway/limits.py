"""Per-key rate limits: requests and tokens per minute as token buckets kept in the shared store.

Tokens are taken at admission as an estimate (prompt + max completion) and settled once the real usage
is known, so a short answer hands back what it did not use.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from pagedserve.gateway.auth import ApiKey
from pagedserve.gateway.store import Bucket, Store


@dataclass(slots=True)
class RateDecision:
    allowed: bool
    retry_after_s: float | None = None  # None with allowed=False: the request can never fit
    message: str = ""
    headers: dict[str, str] = field(default_factory=dict)


def _duration(seconds: float) -> str:
    return f"{max(seconds, 0.0):.3g}s"


class RateLimiter:
    def __init__(self, store: Store):
        self.store = store

    @staticmethod
    def buckets(key: ApiKey, tokens: int) -> list[tuple[str, Bucket]]:
        out = []
        if key.rpm:
            out.append(("requests", Bucket(f"{key.key_id}:rpm", key.rpm, 1)))
        if key.tpm:
            out.append(("tokens", Bucket(f"{key.key_id}:tpm", key.tpm, tokens)))
        return out

    async def admit(self, key: ApiKey, tokens: int) -> RateDecision:
        named = self.buckets(key, tokens)
        if not named:
            return RateDecision(True)
        if key.tpm and tokens > key.tpm:
            return RateDecision(False, None, f"this request needs about {tokens} tokens, more than the key's "
                                             f"limit of {key.tpm} tokens per minute; lower max_tokens")
        result = await self.store.take([b for _, b in named])
        headers = {}
        for (kind, bucket), level in zip(named, result.levels):
            headers[f"x-ratelimit-limit-{kind}"] = str(int(bucket.capacity))
            headers[f"x-ratelimit-remaining-{kind}"] = str(max(int(level), 0))
            headers[f"x-ratelimit-reset-{kind}"] = _duration((bucket.capacity - level) / bucket.rate)
        if result.allowed:
            return RateDecision(True, headers=headers)
        headers["retry-after"] = str(max(1, math.ceil(result.retry_after_s)))
        limits = ", ".join(f"{int(b.capacity)} {kind} per minute" for kind, b in named)
        return RateDecision(False, result.retry_after_s, headers=headers,
                            message=f"rate limit reached for key {key.key_id} ({limits}); "
                                    f"retry after {result.retry_after_s:.1f}s")

    async def settle(self, key: ApiKey, estimated: int, actual: int) -> None:
        if key.tpm and estimated != actual:
            await self.store.give_back(Bucket(f"{key.key_id}:tpm", key.tpm, 0), estimated - actual)
