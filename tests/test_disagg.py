"""Disaggregated prefill and decode with real processes: a prefill worker, decode workers and a router, against
a single `pagedserve serve` as the reference (fp32 greedy: token-identical). Failures (forged, expired or
unreachable handles, mismatched workers, a dead prefill worker) end in a recomputed answer or a clear error,
and the block counts on both sides return to their baseline. The halves go to the workers' peer routes, signed
with the session's cluster secret (tests/peer_support.py), as the router sends them."""
from __future__ import annotations

import concurrent.futures
import contextlib
import json
import socket
import subprocess
import sys
import threading

import httpx
import pytest
from gateway_support import pagedserve_server, start_all
from router_support import RouterProcess, metric_sum, wait_for

from pagedserve.cluster.launcher import free_port
from tests.lora_support import make_adapters
from tests.peer_support import key, lease_target, peer_call, peer_post

pytestmark = pytest.mark.slow

PROMPTS = ["Write a short story about a robot who learns to paint, with a twist at the end. " * 2,
           "The three laws of robotics are, in the words of the stories that made them famous,",
           "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number, iteratively and with a docstring.\"\"\"\n"]
CHAT = [{"role": "user", "content": "Explain how a paged KV cache works, in detail, for a new engineer joining."}]


@pytest.fixture(scope="module")
def workers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("disagg")
    lora = ["--enable-lora", "--max-lora-rank", "16"]
    # Plain requests, and the decode half of a handle over TCP
    reference, ref_url = pagedserve_server("reference", tmp, ["--kv-role", "both", "--kv-transport", "tcp", *lora])
    prefill, prefill_url = pagedserve_server("prefill", tmp, ["--kv-role", "prefill", "--kv-lease-s", "4", *lora])
    decode, decode_url = pagedserve_server("decode", tmp, ["--kv-role", "decode", *lora])
    strict, strict_url = pagedserve_server("decode-strict", tmp, ["--kv-role", "decode", "--kv-load-failure", "fail",
                                                                   "--block-size", "32"])
    with contextlib.ExitStack() as stack:
        start_all(stack, reference, prefill, decode, strict)
        model = httpx.get(ref_url + "/v1/models", timeout=10).json()["data"][0]["id"]
        router = stack.enter_context(RouterProcess(tmp, disagg_min_prompt_tokens=0, replicas=[
            {"url": prefill_url, "name": "prefill-0", "kv_role": "prefill"},
            {"url": decode_url, "name": "decode-0", "kv_role": "decode"}]))
        router.wait_healthy(["prefill-0", "decode-0"], timeout=60)
        yield {"reference": ref_url, "prefill": prefill_url, "decode": decode_url, "strict": strict_url,
               "router": router, "model": model, "prefill_process": prefill}


def complete(url: str, prompt: str, **extra) -> dict:
    """A plain request; with kv_transfer_params, a disaggregated half, as the router sends it (signed)."""
    body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, **extra}
    if "kv_transfer_params" in body:
        response = peer_post(url, "/internal/v1/completions", body)
    else:
        response = httpx.post(url + "/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return response.json()


def texts(body: dict) -> list[str]:
    return [c["text"] for c in body["choices"]]


def blocks_in(url: str) -> float:
    return metric_sum(url, "pagedserve_kv_transfer_blocks_total", direction="in")


def failures(url: str, cause: str) -> float:
    return metric_sum(url, "pagedserve_kv_transfer_failures_total", cause=cause)


def idle(url: str) -> bool:
    """No block held by a request or a lease (cached blocks are free)."""
    return (metric_sum(url, "pagedserve_kv_blocks_used") == 0
            and metric_sum(url, "pagedserve_kv_transfer_leased_blocks") == 0)


def test_greedy_output_through_prefill_and_decode_workers_matches_one_server(workers):
    router = workers["router"]
    for prompt in PROMPTS:
        expected = complete(workers["reference"], prompt, n=2)
        before = blocks_in(workers["decode"])
        got = complete(router.url, prompt, n=2)
        assert texts(got) == texts(expected), prompt
        assert blocks_in(workers["decode"]) > before  # the decode worker pulled this prompt's blocks
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    assert router.metric("pagedserve_router_prefills_total", result="handed_off") == len(PROMPTS)

    # Streamed chat: the same tokens as the reference's non-streamed answer.
    body = {"messages": CHAT, "max_tokens": 24, "temperature": 0}
    expected = httpx.post(workers["reference"] + "/v1/chat/completions", json=body, timeout=300).json()
    generated = metric_sum(workers["decode"], "pagedserve_generation_tokens_total")
    with httpx.stream("POST", router.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=300) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert streamed == expected["choices"][0]["message"]["content"]
    # Its first token was the prefill worker's: the decode worker generated the rest only.
    assert metric_sum(workers["decode"], "pagedserve_generation_tokens_total") - generated == \
        expected["usage"]["completion_tokens"] - 1

    # Again: the decode worker's own prefix cache holds the prompt now, so nothing is pulled.
    before = blocks_in(workers["decode"])
    assert texts(complete(router.url, PROMPTS[0], n=2)) == texts(complete(workers["reference"], PROMPTS[0], n=2))
    assert blocks_in(workers["decode"]) == before
    # Workers on one host hand blocks over through shared memory; the reference server (--kv-transport tcp)
    # pulls the same kind of handle over TCP.
    assert metric_sum(workers["decode"], "pagedserve_kv_transfer_blocks_total", direction="in", transport="shm") > 0
    prompt = "Over TCP this time: " + PROMPTS[0]
    expected = texts(complete(workers["decode"], prompt))  # a plain request: computed there, cached there only
    assert texts(complete(workers["reference"], prompt, kv_transfer_params=handle(workers, prompt))) == expected
    assert metric_sum(workers["reference"], "pagedserve_kv_transfer_blocks_total", direction="in",
                      transport="tcp") > 0
    wait_for(lambda: idle(workers["decode"]) and idle(workers["prefill"]), 15, "both workers to hold no block")


def handle(workers, prompt: str) -> dict:
    body = complete(workers["prefill"], prompt, kv_transfer_params={"do_remote_decode": True})
    assert body["usage"]["completion_tokens"] == 1  # the prefill half stops after the first token
    return {"do_remote_prefill": True, "remote_url": workers["prefill"], **body["kv_transfer_params"]}


def load_adapter(url: str, name: str, folder) -> None:
    peer_post(url, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)}).raise_for_status()


def test_lora_requests_move_their_blocks_under_the_adapters_weights(workers, hf_model, tmp_path):
    """A prompt computed under an adapter travels as that adapter's KV: the decode worker registers it under
    the adapter's weights digest, so the base model never reads it, and a decode worker whose adapter of the
    same name has other weights recomputes instead of reading the prefill worker's blocks."""
    adapters = make_adapters(hf_model, tmp_path)
    router = workers["router"]
    for url in (workers["reference"], workers["prefill"], workers["decode"]):
        load_adapter(url, "attn8", adapters["attn8"][0])
    # "tuned": attn8's weights on the prefill worker, mlp4's on the decode worker and the reference.
    load_adapter(workers["prefill"], "tuned", adapters["attn8"][0])
    for url in (workers["decode"], workers["reference"]):
        load_adapter(url, "tuned", adapters["mlp4"][0])
    prompt = "Under an adapter: " + PROMPTS[0]
    expected = {model: texts(complete(workers["reference"], prompt, model=model))
                for model in ("attn8", "tuned", workers["model"])}
    assert len({tuple(t) for t in expected.values()}) == 3  # the adapters do change the answer

    before, mismatches = blocks_in(workers["decode"]), failures(workers["decode"], "token_mismatch")
    got = complete(router.url, prompt, model="attn8")
    assert texts(got) == expected["attn8"] and got["model"] == "attn8"
    assert blocks_in(workers["decode"]) > before and got["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16
    # The base model, same prompt: the adapter's blocks are not its KV, so its own are pulled.
    before = blocks_in(workers["decode"])
    assert texts(complete(router.url, prompt)) == expected[workers["model"]]
    assert blocks_in(workers["decode"]) > before
    # Same name, other weights: the handle's digest does not match, so the decode worker recomputes.
    before = blocks_in(workers["decode"])
    assert texts(complete(router.url, prompt, model="tuned")) == expected["tuned"]
    assert failures(workers["decode"], "token_mismatch") == mismatches + 1
    assert blocks_in(workers["decode"]) == before
    # An adapter neither worker holds, named in the router's lora_modules: loaded on each pool's replica first.
    replicas = [{"url": workers["prefill"], "name": "prefill-0", "kv_role": "prefill"},
                {"url": workers["decode"], "name": "decode-0", "kv_role": "decode"}]
    with RouterProcess(tmp_path, disagg_min_prompt_tokens=0, lora_modules={"mlp4": str(adapters["mlp4"][0])},
                       replicas=replicas) as on_demand:
        on_demand.wait_healthy(["prefill-0", "decode-0"], timeout=30)
        prompt = "Loaded on demand: " + PROMPTS[1]
        expected = texts(complete(workers["reference"], prompt, model="tuned"))  # mlp4's weights there
        before = blocks_in(workers["decode"])
        assert texts(complete(on_demand.url, prompt, model="mlp4")) == expected
        assert blocks_in(workers["decode"]) > before
        assert on_demand.metric("pagedserve_router_lora_loads_total", result="loaded") == 2
        assert on_demand.metric("pagedserve_router_prefills_total", result="handed_off") == 1
    wait_for(lambda: idle(workers["decode"]) and idle(workers["prefill"]), 15, "both workers to hold no block")


def released(workers, params: dict) -> dict:
    assert peer_call("DELETE", workers["prefill"], lease_target(params["lease_id"])).status_code == 200
    return params


def test_failed_pulls_are_recomputed_or_refused_and_leave_no_block_held(workers):
    decode = workers["decode"]
    spoil = {"lease_gone": lambda params, _: released(workers, params),
             "token_mismatch": lambda _, prompt: handle(workers, "Another prompt: " + prompt),
             "bad_handle": lambda params, _: {**params, "tokens_sha": "0" * 32},  # the seal breaks
             "unreachable": lambda params, _: {**params, "remote_url": f"http://127.0.0.1:{free_port()}"}}
    for cause, spoiled in spoil.items():  # a prompt of its own each: a recomputed one is cached here after
        prompt = f"Case {cause}: {PROMPTS[1]}"
        params = spoiled(handle(workers, prompt), prompt)
        before = failures(decode, cause)
        assert texts(complete(decode, prompt, kv_transfer_params=params)) == texts(
            complete(workers["reference"], prompt)), cause
        assert failures(decode, cause) == before + 1, cause
    prompt = "Once more, and differently: " + PROMPTS[1]
    expected = texts(complete(workers["reference"], prompt))
    good = handle(workers, prompt)
    # The same handle on a worker that must not recompute (and has other blocks): a clear 502.
    refused = peer_post(workers["strict"], "/internal/v1/completions", {
        "prompt": prompt, "max_tokens": 4, "kv_transfer_params": handle(workers, prompt)})
    assert refused.status_code == 502 and refused.json()["error"]["code"] == "kv_transfer_failed"
    assert "32" in refused.json()["error"]["message"]  # says what does not match
    # Roles and malformed handles.
    for url, params, code in ((decode, {"do_remote_decode": True}, "kv_role_mismatch"),
                              (workers["prefill"], good, "kv_role_mismatch"),
                              (decode, {"do_remote_prefill": True}, None),
                              (decode, {"do_remote_prefill": True, "do_remote_decode": True}, None)):
        response = peer_post(url, "/internal/v1/completions", {"prompt": prompt, "kv_transfer_params": params})
        assert response.status_code == 400 and (code is None or response.json()["error"]["code"] == code), params
    # The object store, asked of a worker outside any Ray cluster: a clear 400, and the lease stays for TCP.
    asked = peer_call("GET", workers["prefill"], lease_target(good["lease_id"], via="ray"))
    assert asked.status_code == 400 and asked.json()["error"]["code"] == "kv_transport_unavailable"
    # The good handle still works after all that, and its lease is then released.
    assert texts(complete(decode, prompt, kv_transfer_params=good)) == expected
    wait_for(lambda: idle(decode) and idle(workers["prefill"]) and idle(workers["strict"]), 15, "no block held")


def test_an_unclaimed_lease_expires_and_its_blocks_are_freed(workers):
    prefill = workers["prefill"]
    params = handle(workers, "# a fresh prompt\n" + PROMPTS[2])
    assert metric_sum(prefill, "pagedserve_kv_transfer_leased_blocks") >= 1
    wait_for(lambda: idle(prefill), 15, "the 4 s lease to expire")
    late = peer_call("GET", prefill, lease_target(params["lease_id"]))
    assert late.status_code == 404 and late.json()["error"]["code"] == "kv_lease_not_found"
    info = peer_call("GET", prefill, "/internal/v1/kv/info").json()
    assert info["kv_role"] == "prefill" and info["block_size"] == 16 and info["kv_format"] == "float32"


def test_short_prompts_skip_the_prefill_pool_by_default(workers, tmp_path):
    replicas = [{"url": workers["prefill"], "name": "prefill-0", "kv_role": "prefill"},
                {"url": workers["decode"], "name": "decode-0", "kv_role": "decode"}]
    with RouterProcess(tmp_path, replicas=replicas) as router:  # disagg_min_prompt_tokens: 256
        router.wait_healthy(["prefill-0", "decode-0"], timeout=30)
        short, long = "Short and to the point: " + PROMPTS[1], "A long one. " + PROMPTS[0] * 8
        for prompt in (short, long):
            assert texts(complete(router.url, prompt)) == texts(complete(workers["reference"], prompt))
        assert router.metric("pagedserve_router_prefills_total", result="handed_off") == 1  # the long one only


def test_a_decode_worker_whose_blocks_cannot_move_is_refused_at_registration(workers, tmp_path):
    replicas = [{"url": workers["prefill"], "name": "prefill-0", "kv_role": "prefill"},
                {"url": workers["strict"], "name": "decode-32", "kv_role": "decode"},
                {"url": workers["reference"], "name": "says-both", "kv_role": "prefill"}]
    with RouterProcess(tmp_path, replicas=replicas, health_interval_s=0.5) as router:
        router.wait_healthy(["prefill-0", "says-both"], timeout=30)
        states = {r["name"]: r for r in httpx.get(router.url + "/health", timeout=5).json()["replicas"]}
        assert not states["decode-32"]["healthy"] and "32-token blocks" in states["decode-32"]["reason"]
        response = httpx.post(router.url + "/v1/completions", json={"prompt": PROMPTS[1], "max_tokens": 4}, timeout=60)
        assert response.status_code == 503  # no decode replica it could hand the blocks to


class CutMidPull:
    """A TCP relay to a prefill worker for one pull: it passes the request and the first 256 KiB of the answer,
    then holds (`midway` set) until the test has killed the worker, and closes both ends (`release`). What the
    decode worker sees is a prefill worker dying in the middle of sending its blocks."""

    def __init__(self, upstream_url: str) -> None:
        self.upstream = httpx.URL(upstream_url)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.getsockname()[1]}"
        self.midway, self.release, self.relayed = threading.Event(), threading.Event(), 0
        threading.Thread(target=self._relay, daemon=True).start()

    def _relay(self) -> None:
        client, _ = self.server.accept()
        with client, socket.create_connection((self.upstream.host, self.upstream.port)) as up:
            request = b""
            while b"\r\n\r\n" not in request:  # a GET: headers only
                request += client.recv(65536)
            up.sendall(request)
            while self.relayed < 256 * 1024 and (chunk := up.recv(65536)):
                client.sendall(chunk)
                self.relayed += len(chunk)
            self.midway.set()
            self.release.wait(60)

    def close(self) -> None:
        self.release.set()
        self.server.close()


def test_a_prefill_worker_killed_during_the_pull_costs_recomputation(workers, tmp_path):
    """The decode side (the reference server, pulling over TCP) is mid-transfer when the prefill worker is
    killed: the truncated pull is recomputed, the answer is right, and the decode side holds no block after."""
    doomed, doomed_url = pagedserve_server("prefill-doomed", tmp_path, ["--kv-role", "prefill"])
    decode = workers["reference"]
    prompt = "Killed mid-pull: " + PROMPTS[0]
    with contextlib.ExitStack() as stack:
        start_all(stack, doomed)
        body = complete(doomed_url, prompt, kv_transfer_params={"do_remote_decode": True})
        cut = CutMidPull(doomed_url)
        stack.callback(cut.close)
        params = {"do_remote_prefill": True, **body["kv_transfer_params"], "remote_url": cut.url}
        assert params["num_blocks"] * 16 * 30 * 3 * 64 * 2 * 4 > 512 * 1024  # fp32 blocks: the cut is mid-payload
        before = failures(decode, "unreachable")
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            answer = pool.submit(complete, decode, prompt, kv_transfer_params=params)
            assert cut.midway.wait(120), "the pull never started"
            assert cut.relayed >= 256 * 1024
            doomed.process.kill()
            doomed.process.wait(10)
            cut.release.set()
            got = answer.result(300)
    assert texts(got) == texts(complete(workers["decode"], prompt))
    assert failures(decode, "unreachable") == before + 1
    wait_for(lambda: idle(decode), 15, "the decode side to hold no block")


def test_the_first_token_streams_before_the_pull_and_a_client_leaving_mid_pull_frees_both_sides(workers):
    """The decode worker streams the prefill worker's first token at once, while the pull is still held midway
    (so it came before the blocks); the client then disconnects: the pull stops, the decode side holds nothing
    and the prefill side's lease ends (released, or expired: its --kv-lease-s is 4)."""
    decode = workers["reference"]  # pulls over TCP, through the relay
    prompt = "Leaving mid-pull: " + PROMPTS[0]
    body = complete(workers["prefill"], prompt, kv_transfer_params={"do_remote_decode": True})
    cut = CutMidPull(workers["prefill"])
    try:
        params = {"do_remote_prefill": True, **body["kv_transfer_params"], "remote_url": cut.url}
        request = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True, "kv_transfer_params": params}
        timeouts = failures(decode, "timeout")
        content, headers = key().signed_json("POST", "/internal/v1/completions", request)
        with httpx.stream("POST", decode + "/internal/v1/completions", content=content, headers=headers,
                          timeout=120) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: {"))[6:])
            assert first["choices"][0]["text"] == body["choices"][0]["text"]  # the prefill worker's token
            # ... out while the pull is held midway, before it could time out (the old order: pull, then sample)
            assert cut.midway.wait(60) and failures(decode, "timeout") == timeouts
        wait_for(lambda: idle(decode), 15, "the decode side to hold no block")
        wait_for(lambda: metric_sum(workers["prefill"], "pagedserve_kv_transfer_leased_blocks") == 0, 15,
                 "the prefill side's lease to end")
    finally:
        cut.close()


def test_a_dead_prefill_worker_costs_recomputation_not_the_request(workers):
    router, decode = workers["router"], workers["decode"]
    orphan_prompt = "After the handoff: " + PROMPTS[2]
    orphan = handle(workers, orphan_prompt)  # handed off, then the prefill worker dies before the pull
    workers["prefill_process"].process.kill()
    workers["prefill_process"].process.wait(10)
    before = failures(decode, "unreachable")
    assert texts(complete(decode, orphan_prompt, kv_transfer_params=orphan)) == texts(
        complete(workers["reference"], orphan_prompt))
    assert failures(decode, "unreachable") == before + 1
    prompt = PROMPTS[0] + " The robot's name was Ada."
    assert texts(complete(router.url, prompt)) == texts(complete(workers["reference"], prompt))
    assert router.metric("pagedserve_router_prefills_total", replica="prefill-0", result="ConnectError") >= 1 \
        or router.replica_states()["prefill-0"] is False
    wait_for(lambda: idle(workers["decode"]), 15, "the decode worker to hold no block")


def test_the_object_store_transport_needs_a_ray_cluster():
    done = subprocess.run([sys.executable, "-m", "pagedserve.cli", "serve", "--kv-transport", "ray",
                           "--port", str(free_port())], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0 and "--kv-transport ray needs --ray-address" in done.stderr
