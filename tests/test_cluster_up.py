"""`pagedserve cluster up`: replicas and router start together, answer, and all stop on SIGTERM. On Ray the
cluster runs disaggregated: a one-machine Ray cluster on loopback, whose object store moves the KV blocks."""
import os
import signal
import subprocess
import sys

import httpx
import openai
import pytest
from router_support import completions_served, metric_sum, wait_for

from pagedserve.cluster.launcher import free_port
from pagedserve.cluster.ray_launcher import SINGLE_MACHINE_ENV
from pagedserve.server.peer_auth import SECRET_ENV
from tests.peer_support import Listener, hostile_params, lease_target, peer_call, peer_post

ENGINE_ARGS = ["--kv-cache-memory", "32MiB", "--max-num-seqs", "4", "--max-model-len", "512"]
SERVE_ARGS = "--embedding-model none --disable-access-log"


def run_cluster(tmp_path, backend_args: list[str], startup: float, check=None, serve_args: str = SERVE_ARGS):
    """check(url, replicas) runs against the cluster; with backend_args naming no --cluster-secret-file, the
    cluster's secret is its own (the test cannot sign: a client's view)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "cluster.log", "wb")  # noqa: SIM115 - closed after the process ends
    process = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.cli", "cluster", "up", "--port", str(port),
         "--policy", "round_robin", "--log-dir", str(tmp_path), "--serve-args", serve_args,
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
        (check or check_round_robin)(url, replicas)
        stop(process, [url, *[r["url"] for r in replicas]])
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        log.close()


def check_round_robin(url: str, replicas: list[dict]) -> None:
    replica_urls = [r["url"] for r in replicas]
    assert len(replica_urls) == 2
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    before = [completions_served(u) for u in replica_urls]
    for _ in range(2):
        answer = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=2)
        assert answer.usage.completion_tokens == 2
    assert [completions_served(u) - b for u, b in zip(replica_urls, before, strict=True)] == [1, 1]


def stop(process: subprocess.Popen, urls: list[str]) -> None:
    process.send_signal(signal.SIGTERM)
    assert process.wait(60) in (0, 15, 143, -signal.SIGTERM)  # Ray exits with the signal number
    for url in urls:
        with pytest.raises(httpx.ConnectError):
            httpx.get(url + "/health", timeout=2)


# Run in a fresh interpreter, as a driver of the cluster: whether an object (its reference on stdin) is still in
# the object store. Ray reads its single-machine switch when first imported, hence the subprocess; `cluster up`
# started Ray with token authentication (Ray's default), whose token it saved in ~/.ray/auth_token.
PROBE = """
import base64, sys
import ray
ray.init(address=sys.argv[1], log_to_driver=False)
ref = ray.cloudpickle.loads(base64.b64decode(sys.stdin.read()))
try:
    print("ok", len(ray.get(ref, timeout=30)))
except (ray.exceptions.ObjectFreedError, ray.exceptions.ObjectLostError) as e:
    print("gone", type(e).__name__)
"""


def in_store(cluster: str, object_ref: str) -> str:
    done = subprocess.run([sys.executable, "-c", PROBE, cluster], input=object_ref, capture_output=True, text=True, check=False,
                          timeout=120, env={**os.environ, SINGLE_MACHINE_ENV: "0", "RAY_AUTH_MODE": "token"})
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def check_disaggregated_on_ray(url: str, replicas: list[dict]) -> None:
    """The router hands a long prompt from the prefill replica to the decode replica; the blocks move through
    the object store (the workers joined the one-machine cluster, on loopback) and no object outlives its lease,
    released or expired."""
    by_role = {r["kv_role"]: r["url"] for r in replicas}
    prefill, decode = by_role["prefill"], by_role["decode"]
    infos = [peer_call("GET", u, "/internal/v1/kv/info").json() for u in (prefill, decode)]
    cluster = infos[0]["ray_cluster"]
    assert cluster and cluster == infos[1]["ray_cluster"] and cluster.startswith("127.0.0.1:")
    assert all(u.startswith("http://127.0.0.1:") for u in (prefill, decode))

    prompt = "The three laws of robotics are, in the words of the stories that made them famous, " * 16  # > 256
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    answer = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=16, temperature=0)
    assert answer.usage.prompt_tokens_details.cached_tokens >= 256  # the decode worker read the moved blocks
    assert metric_sum(decode, "pagedserve_kv_transfer_blocks_total", direction="in", transport="ray") >= 16
    assert metric_sum(decode, "pagedserve_kv_transfer_failures_total") == 0
    # fp32 on both: the prefill worker's own continuation of the prompt, from the blocks it sent, is the same text
    plain = httpx.post(prefill + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 16, "temperature": 0}).json()
    assert answer.choices[0].text == plain["choices"][0]["text"]

    # A lease's object: readable by any driver of the cluster while the lease lives, gone once it is released...
    for release in (True, False):
        handle = peer_post(prefill, "/internal/v1/completions", {
            "prompt": prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}).json()
        lease_id = handle["kv_transfer_params"]["lease_id"]
        obj = peer_call("GET", prefill, lease_target(lease_id, via="ray")).json()
        assert obj["cluster"] == cluster and in_store(cluster, obj["object_ref"]) == f"ok {obj['bytes']}"
        if release:
            assert peer_call("DELETE", prefill, lease_target(lease_id)).status_code == 200
        else:  # ... or once it expires unclaimed (--kv-lease-s 5)
            wait_for(lambda: metric_sum(prefill, "pagedserve_kv_transfer_leased_blocks") == 0, 30, "lease expiry")
            assert peer_call("GET", prefill, lease_target(lease_id)).status_code == 404
        # Ray frees it once every borrower (the probe above, a process that has exited) has let go: soon after
        ref = obj["object_ref"]
        wait_for(lambda ref=ref: in_store(cluster, ref).startswith("gone"), 60, "the object to be freed")


@pytest.mark.slow
def test_cluster_up_local(tmp_path):
    run_cluster(tmp_path, ["--replicas", "2"], startup=180)


@pytest.mark.slow
def test_cluster_up_ray_disaggregated(tmp_path):
    secret = tmp_path / "secret"  # the session's (conftest.py), so that the checks can sign as peers
    secret.write_text(os.environ[SECRET_ENV])
    run_cluster(tmp_path, ["--backend", "ray", "--prefill", "1", "--decode", "1", "--replica-cpus", "0.5",
                           "--dtype", "float32", "--cluster-secret-file", str(secret)], startup=240,
                check=check_disaggregated_on_ray, serve_args=SERVE_ARGS + " --kv-lease-s 5 --kv-transport ray")


def check_hostile_client(url: str, replicas: list[dict]) -> None:
    """A client of a disaggregated `cluster up` that knows every replica's address but not the cluster's secret:
    its poisoning and SSRF attempts reach no URL it chose, plant nothing in a prefix cache, and leave the
    replicas in rotation."""
    listener = Listener()
    try:
        prompt = "The decode worker's prefix cache is shared by every client that sends this prompt. " * 8  # > 256
        body = {"prompt": prompt, "max_tokens": 8, "temperature": 0}
        expected = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
        for params in hostile_params(listener):
            through_router = httpx.post(url + "/v1/completions", json={**body, "kv_transfer_params": params},
                                        timeout=120)
            assert through_router.status_code == 200 and through_router.json()["choices"][0]["text"] == expected
            for replica in replicas:
                public = httpx.post(replica["url"] + "/v1/completions", json={**body, "kv_transfer_params": params},
                                    timeout=60)
                assert public.status_code == 400, public.text
                internal = httpx.post(replica["url"] + "/internal/v1/completions", timeout=60,
                                      json={**body, "kv_transfer_params": params})
                assert internal.status_code == 403, internal.text
                for method, target in (("GET", lease_target("0" * 32, via="shm")), ("DELETE", lease_target("0" * 32)),
                                       ("GET", "/internal/v1/kv/info")):
                    assert httpx.request(method, replica["url"] + target, timeout=10).status_code == 403
        assert httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"] == expected
        assert listener.connections == 0
        assert all(r["healthy"] for r in httpx.get(url + "/health", timeout=5).json()["replicas"])
    finally:
        listener.close()


@pytest.mark.slow
def test_cluster_up_disaggregated_against_a_hostile_client(tmp_path):
    run_cluster(tmp_path, ["--prefill", "1", "--decode", "1", "--dtype", "float32"], startup=240,
                check=check_hostile_client)


def check_disaggregated_tensor_parallel(url: str, replicas: list[dict]) -> None:
    """Both replicas split over two ranks: the prefill worker's ranks gather their heads' shares into one
    payload, the decode worker's ranks each write theirs, and the answer is the prefill worker's own."""
    by_role = {r["kv_role"]: r["url"] for r in replicas}
    prompt = "Tensor parallel workers hand over their blocks one head share at a time, then decode on. " * 16  # > 256
    client = openai.OpenAI(base_url=url + "/v1", api_key="none")
    answer = client.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=16, temperature=0)
    assert answer.usage.prompt_tokens_details.cached_tokens >= 256  # the decode worker read the moved blocks
    assert metric_sum(by_role["decode"], "pagedserve_kv_transfer_blocks_total", direction="in") >= 16
    assert metric_sum(by_role["decode"], "pagedserve_kv_transfer_failures_total") == 0
    plain = httpx.post(by_role["prefill"] + "/v1/completions", timeout=120, json={
        "prompt": prompt, "max_tokens": 16, "temperature": 0}).json()
    assert answer.choices[0].text == plain["choices"][0]["text"]


@pytest.mark.slow
def test_cluster_up_disaggregated_tensor_parallel(tmp_path):
    run_cluster(tmp_path, ["--prefill", "1", "--decode", "1", "--dtype", "float32", "--tensor-parallel-size", "2",
                           "--cpu-binding", "none"], startup=300, check=check_disaggregated_tensor_parallel)
