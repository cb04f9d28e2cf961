"""Replicas as Ray actors: each actor runs one `pagedserve serve` process on its node and reports the URL,
so the same router fronts replicas on many machines. Fractional CPU reservations let a small machine
hold several replicas and the router."""
from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Self

from pagedserve.cluster.launcher import ReplicaProcess, free_port, serve_command, wait_healthy

log = logging.getLogger(__name__)


# Sets PR_SET_PDEATHSIG (kept across exec), then becomes the replica: a crashed actor leaks no process.
DIE_WITH_PARENT = "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); " \
                  "os.execv(sys.argv[1], sys.argv[1:])"


def die_with_parent(command: list[str]) -> list[str]:
    return [sys.executable, "-c", DIE_WITH_PARENT, *command]


class ReplicaActor:
    def __init__(self, name: str, serve_args: list[str], host: str | None) -> None:
        import ray

        host = host or ray.util.get_node_ip_address()
        port = free_port(host)
        log_path = Path(tempfile.gettempdir()) / f"pagedserve-ray-{name}-{os.getpid()}.log"
        self.replica = ReplicaProcess(name, f"http://{host}:{port}", port, 
                                      die_with_parent(serve_command(host, port, serve_args)), log_path)
        self.replica.start()

    def wait_url(self, timeout: float) -> str:
        wait_healthy(self.replica.url, time.monotonic() + timeout, self.replica)
        return self.replica.url

    def stop(self) -> None:
        self.replica.stop()


class RayCluster:
    def __init__(self, num_replicas: int, serve_args: list[str], *, address: str | None = None,
                 replica_cpus: float | None = None, host: str | None = None, num_cpus: int | None = None,
                 startup_timeout: float = 300.0, roles: list[str] | None = None) -> None:
        self.num_replicas = num_replicas
        self.serve_args = serve_args
        self.roles = roles or ["both"] * num_replicas  # --kv-role per replica
        self.address = address
        self.num_cpus = num_cpus or os.cpu_count() or 1
        self.replica_cpus = replica_cpus or self.num_cpus / (num_replicas + 1)  # one share left for the router
        self.host = host
        self.startup_timeout = startup_timeout
        self.actors: list = []
        self._urls: list[str] = []
        self._owns_ray = False

    def start(self) -> RayCluster:
        import ray

        if not ray.is_initialized():
            local = {} if self.address else {"num_cpus": self.num_cpus}
            ray.init(address=self.address, include_dashboard=False, log_to_driver=False, **local)
            self._owns_ray = True
        remote_actor = ray.remote(num_cpus=self.replica_cpus)(ReplicaActor)
        try:
            self.actors = [remote_actor.remote(f"ray-replica-{i}", [*self.serve_args, "--kv-role", self.roles[i]],
                                               self.host)
                           for i in range(self.num_replicas)]
            self._urls = ray.get([a.wait_url.remote(self.startup_timeout) for a in self.actors])
        except BaseException:
            self.stop()
            raise
        log.info("Ray replicas up: %s", self._urls)
        return self

    def urls(self) -> list[str]:
        return list(self._urls)

    def stop(self) -> None:
        import ray

        try:
            ray.get([a.stop.remote() for a in self.actors], timeout=30)
        except (ray.exceptions.RayError, TimeoutError) as exc:  # actor gone: its replica went with it
            log.warning("stopping Ray replicas: %s", exc)
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
