"""Local replicas: N `pagedserve serve` processes on free loopback ports, started and stopped together."""
from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Self

import httpx

from pagedserve.config import EngineConfig
from pagedserve.server.peer_auth import SECRET_ENV, PeerKey
from pagedserve.speculative_config import SpeculativeConfig

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ReplicaProcess:
    name: str
    url: str
    port: int
    command: list[str]
    log_path: Path
    process: subprocess.Popen | None = None
    env: dict[str, str] | None = None  # added to this process's environment (the cluster secret)

    def start(self) -> None:
        env = {**os.environ, **self.env} if self.env else None
        with open(self.log_path, "ab") as out:
            self.process = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT,
                                            start_new_session=True, env=env)
        log.info("started %s (pid %d) at %s, log %s", self.name, self.process.pid, self.url, self.log_path)

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, timeout: float = 10.0) -> None:
        if not self.alive():
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.alive():
            self.process.kill()
            self.process.wait()

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def engine_flags(config: EngineConfig) -> list[str]:
    """The `pagedserve serve` flags that reproduce an EngineConfig (defaults left out)."""
    default = EngineConfig()
    flags: list[str] = []
    for f in fields(EngineConfig):
        value = getattr(config, f.name)
        if value == getattr(default, f.name):
            continue
        if f.name == "enable_prefix_caching":
            flags.append("--no-prefix-caching")
        elif f.name == "enable_lora":  # a store_true flag: a value after it would be a stray argument
            flags.append("--enable-lora")
        elif f.name == "speculative_config":  # a dict (a YAML file, LLM(...)) would print as Python's repr
            flags += ["--speculative-config", str(SpeculativeConfig.parse(value))]
        else:
            flags += ["--" + f.name.replace("_", "-"), str(value)]
    return flags


def serve_command(host: str, port: int, extra_args: list[str]) -> list[str]:
    return [sys.executable, "-m", "pagedserve.cli", "serve", "--host", host, "--port", str(port), *extra_args]


def role_flags(roles: list[str], i: int) -> list[str]:
    """--kv-role for replica i when the cluster is disaggregated (else none: plain replicas have no peer routes)."""
    return ["--kv-role", roles[i]] if set(roles) != {"both"} else []


def secret_env(peer_key: PeerKey | None) -> dict[str, str] | None:
    """How a replica gets the cluster secret: in its environment, never on its command line (which ps shows)."""
    return {SECRET_ENV: peer_key.hex()} if peer_key is not None else None


def wait_healthy(url: str, deadline: float, process: ReplicaProcess | None = None) -> None:
    while time.monotonic() < deadline:
        if process is not None and not process.alive():
            raise RuntimeError(f"{process.name} exited with {process.process.returncode}:\n{process.log_tail()}")
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    tail = process.log_tail() if process else ""
    raise TimeoutError(f"{url} did not become healthy in time\n{tail}")


class LocalCluster:
    """Starts replicas; `with LocalCluster(...) as cluster:` stops them all on exit, however it exits."""

    def __init__(self, num_replicas: int, serve_args: list[str], host: str = "127.0.0.1",
                 log_dir: Path | None = None, startup_timeout: float = 300.0, roles: list[str] | None = None,
                 peer_key: PeerKey | None = None) -> None:
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="pagedserve-cluster-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.host = host
        self.startup_timeout = startup_timeout
        self.replicas: list[ReplicaProcess] = []
        self.roles = roles or ["both"] * num_replicas  # --kv-role per replica (disaggregated prefill/decode)
        for i in range(num_replicas):
            port = free_port(host)
            self.replicas.append(ReplicaProcess(f"replica-{i}", f"http://{host}:{port}", port,
                                                serve_command(host, port, [*serve_args, *role_flags(self.roles, i)]),
                                                self.log_dir / f"replica-{i}.log", env=secret_env(peer_key)))

    def start(self) -> LocalCluster:
        try:
            for replica in self.replicas:
                replica.start()
            deadline = time.monotonic() + self.startup_timeout
            for replica in self.replicas:
                wait_healthy(replica.url, deadline, replica)
        except BaseException:
            self.stop()
            raise
        return self

    def urls(self) -> list[str]:
        return [r.url for r in self.replicas]

    def restart(self, replica: ReplicaProcess) -> None:
        replica.stop()
        replica.start()
        wait_healthy(replica.url, time.monotonic() + self.startup_timeout, replica)

    def stop(self) -> None:
        for replica in self.replicas:
            if replica.alive():
                replica.process.send_signal(signal.SIGTERM)
        for replica in self.replicas:
            replica.stop()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def threads_per_replica(num_replicas: int) -> int:
    return max(1, (os.cpu_count() or 1) // num_replicas)
