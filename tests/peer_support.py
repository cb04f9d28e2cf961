"""Requests a peer of the test session's cluster would send (signed with the secret conftest.py set), and what a
hostile client sends instead."""
from __future__ import annotations

import contextlib
import os
import socket
import threading
import time

import httpx

from pagedserve.server.peer_auth import PEER_PREFIX, SECRET_ENV, PeerKey


def key() -> PeerKey:
    return PeerKey.from_hex(os.environ[SECRET_ENV])


def peer_post(base_url: str, path: str, payload: dict, timeout: float = 300, **kwargs) -> httpx.Response:
    """POST path (a peer route: under /internal, or a run-time adapter load) signed as a peer's."""
    body, headers = key().signed_json("POST", path, payload)
    return httpx.post(base_url + path, content=body, headers=headers, timeout=timeout, **kwargs)


def peer_call(method: str, base_url: str, target: str, timeout: float = 60) -> httpx.Response:
    """GET or DELETE target (path and query) signed as a peer's."""
    return httpx.request(method, base_url + target, headers=key().sign(method, target), timeout=timeout)


def lease_target(lease_id: str, **query) -> str:
    suffix = "&".join(f"{k}={v}" for k, v in query.items())
    return f"{PEER_PREFIX}/v1/kv/leases/{lease_id}" + (f"?{suffix}" if suffix else "")


class Listener:
    """A TCP port that records every connection made to it: the URL a hostile client names."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.server.accept()
                self.connections += 1
                conn.close()

    def close(self) -> None:
        self.server.close()


def hostile_params(listener: Listener) -> list[dict]:
    """What an attacker sends: a pull from its own URL (with path and query to steer it), a lease request."""
    handle = {"lease_id": "0" * 32, "num_blocks": 2, "block_size": 16, "kv_format": "float32",
              "tokens_sha": "0" * 32, "expires_at": time.time() + 60, "signature": "0" * 64}
    return [{"do_remote_prefill": True, "remote_url": listener.url, **handle},
            {"do_remote_prefill": True, "remote_url": listener.url + "/admin?x=1#", **handle},
            {"do_remote_decode": True}]
