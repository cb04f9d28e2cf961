"""Shared pieces of the gateway tests: free ports, polling, and real subprocesses (redis-server,
`pagedserve serve`, `pagedserve gateway`, the fault-injecting proxy), each stopped on exit."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Self

import httpx
import yaml

from pagedserve.cluster.launcher import free_port
from tests.polling import wait_for

TESTS = Path(__file__).parent
# Small replicas: two share 2 cores, one thread each.
# fp32: tests compare greedy outputs across requests, and bf16 logits move with the prefill shape (a prefix-cache
# hit prefills fewer tokens), which can flip an argmax.
SERVER_ARGS = ["--dtype", "float32", "--kv-cache-memory", "32MiB", "--max-num-seqs", "8", "--num-threads", "1",
               "--max-model-len", "1024", "--embedding-model", "none", "--disable-access-log"]


class Process:
    """A command in a subprocess, logging to a file, ready once `ready()` is true."""

    def __init__(self, name: str, command: list[str], log_dir: Path, ready, timeout: float = 120.0,
                 env: dict | None = None):
        self.name, self.command, self.ready, self.timeout = name, command, ready, timeout
        self.log_path = log_dir / f"{name}.log"
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen | None = None

    def start(self) -> Self:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self.command, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        return self

    def wait_ready(self) -> Self:
        try:
            wait_for(self._ready, self.timeout, f"{self.name} to start")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __enter__(self) -> Self:
        return self.start().wait_ready()

    def _ready(self) -> bool:
        if self.process.poll() is not None:
            raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log()}")
        return bool(self.ready())

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def __exit__(self, *exc) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def redis_server(log_dir: Path, port: int | None = None, aof_dir: Path | None = None) -> tuple[Process, str]:
    """Debian's redis-server on a free loopback port, without persistence unless `aof_dir` is given (an
    append-only file there, so a restart on the same port keeps the data)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed: apt-get install redis-server (make install does it)")
    port = port or free_port()
    import redis

    client = redis.Redis(port=port, socket_connect_timeout=0.5)

    def up() -> bool:
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False
    persistence = ["--appendonly", "yes", "--dir", str(aof_dir)] if aof_dir else ["--appendonly", "no"]
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", *persistence]
    return Process(f"redis-{port}", command, log_dir, up, timeout=20), f"redis://127.0.0.1:{port}/0"


def pagedserve_server(name: str, log_dir: Path, extra: list[str] = ()) -> tuple[Process, str]:
    """`pagedserve serve` with SERVER_ARGS; `extra` flags come last, so they override."""
    port = free_port()
    command = [sys.executable, "-m", "pagedserve.cli", "serve", "--port", str(port), *SERVER_ARGS, *extra]
    url = f"http://127.0.0.1:{port}"
    return Process(name, command, log_dir, lambda: http_ok(url + "/health"), timeout=180), url


def fault_proxy(name: str, upstream: str, log_dir: Path) -> tuple[Process, str]:
    port = free_port()
    command = [sys.executable, str(TESTS / "gateway_fault_proxy.py"), "--upstream", upstream, "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    return Process(name, command, log_dir, lambda: http_ok(url + "/_fault"), timeout=60), url


def set_fault(proxy_url: str, mode: str) -> None:
    httpx.post(proxy_url + "/_fault", json={"mode": mode}, timeout=5).raise_for_status()


def gateway(name: str, config: dict, tmp: Path, admin_key: str, extra: list[str] = ()) -> tuple[Process, str]:
    """`pagedserve gateway --config` in a subprocess; its data_dir lives under tmp unless the config says."""
    port = free_port()
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"admin_key": admin_key, "data_dir": str(tmp / f"{name}-data"), **config}))
    command = [sys.executable, "-m", "pagedserve.cli", "gateway", "--config", str(path), "--port", str(port), *extra]
    url = f"http://127.0.0.1:{port}"
    return Process(name, command, tmp, lambda: http_ok(url + "/health"), timeout=120), url


def cli(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "pagedserve.cli", *args], check=False, capture_output=True,
                         text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"pagedserve {' '.join(args)} failed:\n{out.stdout}\n{out.stderr}")
    return out.stdout


def start_all(stack, *processes: Process) -> None:
    """Starts the processes side by side (model loads overlap), then waits for each; stopped by the stack."""
    for p in processes:
        stack.callback(p.__exit__)
        p.start()
    for p in processes:
        p.wait_ready()


def stub_provider(name: str, log_dir: Path) -> tuple[Process, str]:
    """The stand-in provider of gateway_stub_provider.py (not pagedserve: for behaviours a real one lacks)."""
    port = free_port()
    command = [sys.executable, str(TESTS / "gateway_stub_provider.py"), "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    return Process(name, command, log_dir, lambda: http_ok(url + "/_mode"), timeout=60), url


def set_stub_mode(url: str, mode: str) -> None:
    httpx.post(url + "/_mode", json={"mode": mode}, timeout=5).raise_for_status()


def set_stub_gate(url: str, is_open: bool) -> None:
    """Holds the stand-in's answers at its gate (a stream after its first event), or lets them all through."""
    httpx.post(url + "/_gate", json={"open": is_open}, timeout=5).raise_for_status()


def stub_state(url: str) -> dict:
    """The stand-in's counters: requests asked, callers that gave up, answers held at the gate, the last body."""
    return httpx.get(url + "/_mode", timeout=5).json()
