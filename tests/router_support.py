"""Shared pieces of the router tests: replica arguments, a router subprocess, replica counters, and a
fault-injecting TCP forwarder (network failure between router and replica, the one thing a test
cannot get from a real process cheaply)."""
from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
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
    aborted, which is what the router sees when a replica's host or network fails."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.up = True
        self._transports: set[asyncio.Transport] = set()
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
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))
        self._transports.difference_update(pair)

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            writer.transport.abort() if writer.transport.is_closing() else writer.close()

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
