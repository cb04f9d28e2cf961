"""Replicas as Ray actors: each actor runs one `pagedserve serve` process on its node and reports the URL,
so the same router fronts replicas on many machines. Fractional CPU reservations let a small machine
hold several replicas and the router. A cluster started here is one machine's: its node and actors are addressed
on loopback. Disaggregated replicas join the cluster themselves (`serve --ray-address`), so that KV blocks move
between them through its object store."""
from __future__ import annotations

import logging
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Self

from pagedserve.cluster.launcher import (
    ReplicaProcess,
    free_port,
    role_flags,
    secret_env,
    serve_command,
    wait_healthy,
)
from pagedserve.server.peer_auth import PeerKey

log = logging.getLogger(__name__)
SINGLE_MACHINE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": a one-machine cluster, addressed on loopback


# Sets PR_SET_PDEATHSIG (kept across exec), then becomes the replica: a crashed actor leaks no process.
DIE_WITH_PARENT = "import ctypes, os, signal, sys; ctypes.CDLL(None).prctl(1, signal.SIGTERM); " \
                  "os.execv(sys.argv[1], sys.argv[1:])"


def die_with_parent(command: list[str]) -> list[str]:
    return [sys.executable, "-c", DIE_WITH_PARENT, *command]


def use_loopback() -> None:
    """Makes a Ray cluster started by this process a single machine's, on 127.0.0.1: Ray otherwise binds and
    advertises the host's outward address. Its switch for single-machine clusters is read when Ray is first
    imported, and its processes inherit it."""
    if "ray" in sys.modules and os.environ.get(SINGLE_MACHINE_ENV) != "0":
        log.warning("Ray was imported before the local cluster started: it will use the host's address, not "
                    "loopback")
    os.environ[SINGLE_MACHINE_ENV] = "0"


class ReplicaActor:
    def __init__(self, name: str, serve_args: list[str], host: str | None, env: dict[str, str] | None) -> None:
        import ray

        host = host or ray.util.get_node_ip_address()
        port = free_port(host)
        log_path = Path(tempfile.gettempdir()) / f"pagedserve-ray-{name}-{os.getpid()}.log"
        self.replica = ReplicaProcess(name, f"http://{host}:{port}", port, 
                                      die_with_parent(serve_command(host, port, serve_args)), log_path, env=env)
        self.replica.start()

    def wait_url(self, timeout: float) -> str:
        wait_healthy(self.replica.url, time.monotonic() + timeout, self.replica)
        return self.replica.url

    def stop(self) -> None:
        self.replica.stop()


class RayCluster:
    def __init__(self, num_replicas: int, serve_args: list[str], *, address: str | None = None,
                 replica_cpus: float | None = None, host: str | None = None, num_cpus: int | None = None,
                 startup_timeout: float = 300.0, roles: list[str] | None = None,
                 peer_key: PeerKey | None = None) -> None:
        self.num_replicas = num_replicas
        self.serve_args = serve_args
        self.roles = roles or ["both"] * num_replicas  # --kv-role per replica
        self.address = address
        self.num_cpus = num_cpus or os.cpu_count() or 1
        self.replica_cpus = replica_cpus or self.num_cpus / (num_replicas + 1)  # one share left for the router
        self.host = host
        self.startup_timeout = startup_timeout
        self.env = secret_env(peer_key)
        self.actors: list = []
        self._urls: list[str] = []
        self._owns_ray = False

    def start(self) -> RayCluster:
        if not self.address:
            use_loopback()
        import ray

        if not ray.is_initialized():
            local = {} if self.address else {"num_cpus": self.num_cpus}
            ray.init(address=self.address, include_dashboard=False, log_to_driver=False, **local)
            self._owns_ray = True
        remote_actor = ray.remote(num_cpus=self.replica_cpus)(ReplicaActor)
        join = ["--ray-address", ray.get_runtime_context().gcs_address] if set(self.roles) != {"both"} else []
        try:
            self.actors = [remote_actor.remote(f"ray-replica-{i}",
                                               [*self.serve_args, *role_flags(self.roles, i), *join], self.host,
                                               self.env)
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
