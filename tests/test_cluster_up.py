"""`pagedserve cluster up`: replicas and router start together, answer, and all stop on SIGTERM."""
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from router_support import completions_served, wait_for

from pagedserve.cluster.launcher import free_port

ENGINE_ARGS = ["--kv-cache-memory", "32MiB", "--max-num-seqs", "4", "--max-model-len", "512"]
SERVE_ARGS = "--embedding-model none --disable-access-log"


def run_cluster(tmp_path, backend_args: list[str], startup: float):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "cluster.log", "wb")  # noqa: SIM115 - closed after the process ends
    process = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.cli", "cluster", "up", "--replicas", "2", "--port", str(port),
         "--policy", "round_robin", "--log-dir", str(tmp_path), "--serve-args", SERVE_ARGS,
         *backend_args, *ENGINE_ARGS], stdout=log, stderr=subprocess.STDOUT)

    def up() -> list[dict] | None:
        if process.poll() is not None:
            raise RuntimeError((tmp_path / "cluster.log").read_text()[-4000:])
        try:
            body = httpx.get(url + "/health", timeout=2).json()
        except httpx.HTTPError:
            return None
        return body["replicas"] if all(r["healthy"] for r in body["replicas"]) else None

    try:
        replicas = wait_for(up, startup, "cluster up", interval=0.5)
        check_and_stop(process, url, [r["url"] for r in replicas])
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()


def check_and_stop(process: subprocess.Popen, url: str, replica_urls: list[str]) -> None:
    assert len(replica_urls) == 2
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    before = [completions_served(u) for u in replica_urls]
    for _ in range(2):
        answer = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=2)
        assert answer.usage.completion_tokens == 2
    assert [completions_served(u) - b for u, b in zip(replica_urls, before, strict=True)] == [1, 1]
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) in (0, 15, 143, -signal.SIGTERM)  # Ray exits with the signal number
    for replica in [url, *replica_urls]:
        with pytest.raises(httpx.ConnectError):
            httpx.get(replica + "/health", timeout=2)


@pytest.mark.slow
def test_cluster_up_local(tmp_path):
    run_cluster(tmp_path, [], startup=180)


@pytest.mark.slow
def test_cluster_up_ray(tmp_path):
    run_cluster(tmp_path, ["--backend", "ray", "--replica-cpus", "0.5"], startup=240)
