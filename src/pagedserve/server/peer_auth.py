"""Peers of a pagedserve cluster: what proves that a request came from one.

A worker's internal machinery (disaggregated requests with their KV-transfer parameters, lease export and
release, run-time adapter loading) answers only requests signed with the cluster's secret, which
`cluster up` generates and hands to its router and workers, never to clients. A signature is an
HMAC-SHA256 over the method, the path with its query, a digest of the body and a timestamp: it cannot be
moved to another request, expires after MAX_SKEW_S, and the secret itself never crosses the wire. Handles a
prefill worker gives out (a lease on KV blocks) are sealed with the same key and carry their own expiry, so
a decode worker takes only handles that a peer issued and that are still live.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass

from fastapi import Request

from pagedserve.server.errors import APIError

HEADER = "x-pagedserve-peer"
PEER_PREFIX = "/internal"  # where a worker's peer routes live (server/peer_routes.py)
SECRET_ENV = "PAGEDSERVE_CLUSTER_SECRET"
MAX_SKEW_S = 30.0  # a signed request older (or newer) than this is refused: clocks of one cluster agree closely
MIN_SECRET_BYTES = 16


@dataclass(frozen=True, slots=True)
class PeerKey:
    secret: bytes

    @classmethod
    def generate(cls) -> PeerKey:
        return cls(secrets.token_bytes(32))

    @classmethod
    def from_hex(cls, text: str) -> PeerKey:
        try:
            secret = bytes.fromhex(text.strip())
        except ValueError:
            raise ValueError("a cluster secret is written in hex (pagedserve cluster secret writes one)") from None
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"a cluster secret has at least {MIN_SECRET_BYTES} bytes ({2 * MIN_SECRET_BYTES} "
                             "hex digits)")
        return cls(secret)

    def hex(self) -> str:
        return self.secret.hex()

    def sign(self, method: str, target: str, body: bytes = b"", now: float | None = None) -> dict[str, str]:
        """The header that makes this request a peer's: target is the path with its query string."""
        stamp = f"{(time.time() if now is None else now):.3f}"
        return {HEADER: f"{stamp}:{self._mac(stamp, method, target, body)}"}

    def signed_json(self, method: str, target: str, payload: dict) -> tuple[bytes, dict[str, str]]:
        """(body, headers) of a JSON request signed as sent: the body is serialized once, here."""
        body = json.dumps(payload).encode()
        return body, {**self.sign(method, target, body), "content-type": "application/json"}

    def verify(self, header: str | None, method: str, target: str, body: bytes) -> bool:
        if not header:
            return False
        stamp, _, mac = header.partition(":")
        try:
            age = abs(time.time() - float(stamp))
        except ValueError:
            return False
        return age <= MAX_SKEW_S and hmac.compare_digest(mac, self._mac(stamp, method, target, body))

    def seal(self, fields: dict, ttl_s: float) -> dict:
        """fields with an expiry and a signature over both (for a handle that travels through the router)."""
        sealed = {**fields, "expires_at": round(time.time() + ttl_s, 3)}
        return {**sealed, "signature": self._digest(_canonical(sealed))}

    def unseal(self, handle: dict) -> dict:
        """The handle's fields, once its signature and expiry hold; ValueError otherwise."""
        fields = {k: v for k, v in handle.items() if k != "signature"}
        signature = handle.get("signature")
        if not isinstance(signature, str) or not hmac.compare_digest(signature, self._digest(_canonical(fields))):
            raise ValueError("the KV handle is not signed by a peer of this cluster")
        expires_at = fields.get("expires_at")
        if not isinstance(expires_at, int | float) or expires_at < time.time():
            raise ValueError("the KV handle has expired")
        return fields

    def _mac(self, stamp: str, method: str, target: str, body: bytes) -> str:
        message = "\n".join((stamp, method.upper(), target, hashlib.sha256(body).hexdigest()))
        return self._digest(message)

    def _digest(self, message: str) -> str:
        return hmac.new(self.secret, message.encode(), hashlib.sha256).hexdigest()


def _canonical(fields: dict) -> str:
    return json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


def load_key(path: str | None) -> PeerKey | None:
    """The cluster secret from a file (hex), else from $PAGEDSERVE_CLUSTER_SECRET, else None (no peers)."""
    if path:
        with open(path, encoding="ascii") as f:
            return PeerKey.from_hex(f.read(4096))
    text = os.environ.get(SECRET_ENV)
    return PeerKey.from_hex(text) if text else None


def request_target(request: Request) -> str:
    query = request.url.query
    return request.url.path + (f"?{query}" if query else "")


def peer_dependency(key: PeerKey | None, what: str):
    """A FastAPI dependency that lets only signed peer requests through (403 otherwise, 403 too where this
    server has no cluster secret: then nothing here is a peer's)."""
    async def check(request: Request) -> None:
        if key is None:
            raise APIError(403, f"{what} is internal to a pagedserve cluster and this server has no cluster "
                                "secret (--cluster-secret-file or $PAGEDSERVE_CLUSTER_SECRET)",
                           code="peer_auth_required")
        body = await request.body()
        if not key.verify(request.headers.get(HEADER), request.method, request_target(request), body):
            raise APIError(403, f"{what} is internal to a pagedserve cluster: only its signed peers may call it",
                           code="peer_auth_required")

    return check
