"""Shared pieces of the router tests: replica arguments, a router subprocess, replica counters, a
fault-injecting TCP forwarder (network failure between router and replica, the one thing a test
cannot get from a real process cheaply), and a stand-in replica that answers 5xx / 429 or drops a
connection on demand in front of a real one."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Self

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.cluster.launcher import free_port
from tests.polling import wait_for

# Small replicas: 2 share 2 cores, one thread each.
REPLICA_ARGS = ["--kv-cache-memory", "32MiB", "--max-num-seqs", "8", "--num-threads", "1",
                "--max-model-len", "1024", "--embedding-model", "none", "--disable-access-log"]


def router_command(config_path: Path, port: int) -> list[str]:
    return [sys.executable, "-m", "pagedserve.cli", "router", "--config", str(config_path), "--port", str(port)]


class RouterProcess:
    """`pagedserve router` in a subprocess on a free port, configured by a YAML file."""

    def __init__(self, tmp: Path, **config) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config_path = tmp / f"router-{self.port}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = tmp / f"router-{self.port}.log"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> Self:
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(router_command(self.config_path, self.port), stdout=log,
                                            stderr=subprocess.STDOUT)
        try:
            wait_for(self._up, 60, "the router to answer /health")
        except TimeoutError:
            self.__exit__()
            raise RuntimeError(f"router did not start:\n{self.log_path.read_text()[-3000:]}") from None
        return self

    def _up(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"router exited:\n{self.log_path.read_text()[-3000:]}")
        try:
            httpx.get(self.url + "/health", timeout=1.0)
            return True
        except httpx.HTTPError:
            return False

    def replica_states(self) -> dict[str, bool]:
        body = httpx.get(self.url + "/health", timeout=5.0).json()
        return {r["name"]: r["healthy"] for r in body["replicas"]}

    def wait_healthy(self, names, timeout: float = 30.0) -> None:
        wait_for(lambda: all(self.replica_states().get(n) for n in names), timeout, f"{names} healthy")

    def metric(self, name: str, **labels) -> float:
        return metric_sum(self.url, name, **labels)

    def __exit__(self, *exc) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def metric_sum(url: str, name: str, **labels) -> float:
    """Sum of a Prometheus sample over the series whose labels contain `labels`."""
    text = httpx.get(url + "/metrics", timeout=5.0).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def completions_served(url: str) -> float:
    """A replica's own count of answered completion and chat requests."""
    text = httpx.get(url + "/metrics", timeout=5.0).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "pagedserve_requests_total" and "completions" in s.labels.get("endpoint", ""))


def served_by(urls, send):
    """Runs send() and returns the index of the one replica whose counter moved (a replica counts a
    request as its response ends, so the counters are polled briefly)."""
    before = [completions_served(u) for u in urls]
    result = send()

    def moved():
        deltas = [completions_served(u) - b for u, b in zip(urls, before, strict=True)]
        return deltas if sum(deltas) >= 1 else None
    deltas = wait_for(moved, 10, "a replica to count the request")
    assert sorted(deltas) == [0, 1], deltas
    return deltas.index(1), result


def replica_snapshot(url: str) -> tuple[bool, float]:
    """(busy, completion requests answered) from one scrape of a replica's /metrics."""
    text = httpx.get(url + "/metrics", timeout=5.0).text
    busy, served = False, 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("pagedserve_num_requests_running", "pagedserve_num_requests_waiting") and s.value:
                busy = True
            if s.name == "pagedserve_requests_total" and "completions" in s.labels.get("endpoint", ""):
                served += s.value
    return busy, served


class FaultProxy:
    """A TCP forwarder that can be cut: while down, new connections are reset at once and open ones are
    aborted, which is what the router sees when a replica's host or network fails. `arm` runs an action
    (a cut, say) at a chosen point of one request: after its bytes and then `response_bytes` bytes of the
    answer have passed, with that connection held until the action returns."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.up = True
        self._transports: set[asyncio.Transport] = set()
        self._armed: tuple[bytes, int, Callable[[], None]] | None = None
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        self._ready.set()
        self._loop.run_forever()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.up:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.transport.abort()
            return
        pair = (writer.transport, up_writer.transport)
        self._transports.update(pair)
        trigger: dict = {}  # this connection's armed action, once its request has passed
        await asyncio.gather(self._pipe(reader, up_writer, trigger, request=True),
                             self._pipe(up_reader, writer, trigger, request=False))
        self._transports.difference_update(pair)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, trigger: dict,
                    request: bool) -> None:
        try:
            while data := await reader.read(65536):
                if not request and "left" in trigger:
                    trigger["left"] -= len(data)
                    if trigger["left"] <= 0:  # before these bytes go on: the client never holds the whole
                        await self._act(trigger)  # answer before the action has run
                writer.write(data)
                await writer.drain()
                if request and self._armed and self._armed[0] in data:
                    _, response_bytes, action = self._armed
                    self._armed = None
                    trigger.update(left=response_bytes, action=action)
                    if response_bytes <= 0:  # as soon as the request reached the replica
                        await self._act(trigger)
        except (ConnectionError, OSError):
            pass
        finally:
            writer.transport.abort() if writer.transport.is_closing() else writer.close()

    @staticmethod
    async def _act(trigger: dict) -> None:
        await asyncio.to_thread(trigger.pop("action"))  # off this loop: it may cut this proxy
        trigger.clear()

    def arm(self, marker: bytes, response_bytes: int, action: Callable[[], None]) -> None:
        """Runs `action` once, on the next request whose bytes contain `marker`: as soon as the request reached
        the replica (0), or once `response_bytes` bytes of its answer have arrived, before they are relayed."""
        self._armed = (marker, response_bytes, action)

    def disarm(self) -> None:
        self._armed = None

    def set_up(self, up: bool) -> None:
        def apply() -> None:
            self.up = up
            if not up:
                for transport in list(self._transports):
                    transport.abort()
        done = threading.Event()
        self._loop.call_soon_threadsafe(lambda: (apply(), done.set()))
        done.wait(5)

    def close(self) -> None:
        self.set_up(False)
        self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


class StandInReplica:
    """An in-process HTTP server in front of a real replica that forwards to it, except when told to
    misbehave: a real `pagedserve serve` cannot be made to answer 500 (or 429, or drop a connection
    after its headers) on demand, and the router's answer to exactly that is what these tests check.
    `fault` applies to every proxied request: "500", "429", "503", "drop" or "stall" (no answer until the
    caller gives up); a body containing POISON is answered 500 always (a replica failing one bad request), one
    containing CRASH is answered 500 and its connection then closed, as uvicorn closes it after an unhandled
    exception (the close comes a moment later, so a request sent on the same connection meanwhile is lost, as
    under load). `health_ok=False` fails /health."""

    POISON = b"POISON"
    CRASH = b"CRASH"
    CRASH_CLOSE_S = 0.3  # how long a crashing request's handling takes after its 500 is out

    def __init__(self, target_url: str) -> None:
        import uvicorn

        self.target_url = target_url
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.fault: str | None = None
        self.health_ok = True
        self.health_probes = 0
        self.seen: dict[str, int] = {}  # what it did with proxied requests: "forwarded", "500", ...
        config = uvicorn.Config(self._app, host="127.0.0.1", port=self.port, log_level="error",
                                lifespan="off", interface="asgi3")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        wait_for(lambda: self._server.started, 10, "the stand-in replica to listen")

    async def _app(self, scope, receive, send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/health":
            self.health_probes += 1
            if not self.health_ok:
                return await _send(send, 503, b'{"status": "failing"}')
        fault = "500" if self.POISON in body else "crash" if self.CRASH in body else \
            self.fault if scope["method"] == "POST" else None
        if fault:
            self.seen[fault] = self.seen.get(fault, 0) + 1
        if fault == "stall":  # the next message is the caller's disconnect
            while (await receive())["type"] != "http.disconnect":
                pass
            return None
        if fault == "drop":  # headers out, then the connection breaks
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")]})
            raise ConnectionAbortedError("stand-in dropped the connection")
        if fault == "crash":  # what uvicorn does after an exception escaped the app: the 500, then the close
            await _send(send, 500, b'{"error": {"message": "stand-in crashed", "type": "server_error"}}')
            await asyncio.sleep(self.CRASH_CLOSE_S)
            raise RuntimeError("stand-in crashed on this request")
        if fault:
            error = {"error": {"message": f"stand-in fault {fault}", "type": "server_error", "param": None,
                               "code": None}}
            headers = [(b"retry-after", b"1")] if fault in ("429", "503") else []
            return await _send(send, int(fault), json.dumps(error).encode(), headers)
        if scope["method"] == "POST":
            self.seen["forwarded"] = self.seen.get("forwarded", 0) + 1
        await self._forward(scope, body, send)

    async def _forward(self, scope, body: bytes, send) -> None:
        async with httpx.AsyncClient(timeout=60) as client:
            request = client.build_request(scope["method"], self.target_url + scope["path"], content=body,
                                           headers={"content-type": "application/json"})
            response = await client.send(request, stream=True)
            headers = [(k.encode(), v.encode()) for k, v in response.headers.items()
                       if k.lower() in ("content-type", "retry-after")]
            await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
            async for chunk in response.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            await response.aclose()

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(10)


async def _send(send, status: int, body: bytes, headers: list | None = None) -> None:
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *(headers or [])]})
    await send({"type": "http.response.body", "body": body})
