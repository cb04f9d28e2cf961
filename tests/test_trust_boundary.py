"""A client against the machinery only a cluster's peers may use (issue 36's findings 1, 2 and 5), with real
processes: a default `pagedserve serve`, a prefill and a decode worker, and a router in front of the two. A
client's `kv_transfer_params` is refused by a server and dropped by the router; the workers' peer routes refuse
anything not signed with the cluster secret (no secret, another one, another body, a stale stamp); no request
makes any process contact a URL the client chose (a listener counts connections); a sealed handle changed on
the way is not trusted; leases pin a bounded share of the pool, and repeated exports of one lease hold one
shared-memory segment."""
from __future__ import annotations

import contextlib
import glob
import os
import time

import httpx
import pytest
from gateway_support import pagedserve_server, start_all
from router_support import RouterProcess, metric_sum

from pagedserve.server import kv_shm
from pagedserve.server.peer_auth import HEADER, PeerKey
from tests.peer_support import Listener, hostile_params, key, lease_target, peer_call, peer_post

PROMPT = "The trust boundary of a serving cluster runs between its clients and its own machinery, " * 3
WORKER_ARGS = ["--kv-cache-memory", "16MiB", "--max-model-len", "512"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trust")
    plain, plain_url = pagedserve_server("plain", tmp, WORKER_ARGS)
    prefill, prefill_url = pagedserve_server("prefill", tmp, [*WORKER_ARGS, "--kv-role", "prefill",
                                                              "--kv-lease-max-fraction", "0.25"])
    decode, decode_url = pagedserve_server("decode", tmp, [*WORKER_ARGS, "--kv-role", "decode"])
    listener = Listener()
    with contextlib.ExitStack() as stack:
        stack.callback(listener.close)
        start_all(stack, plain, prefill, decode)
        router = stack.enter_context(RouterProcess(tmp, disagg_min_prompt_tokens=0, replicas=[
            {"url": prefill_url, "name": "prefill-0", "kv_role": "prefill"},
            {"url": decode_url, "name": "decode-0", "kv_role": "decode"}]))
        router.wait_healthy(["prefill-0", "decode-0"], timeout=60)
        yield {"plain": plain_url, "prefill": prefill_url, "decode": decode_url, "router": router.url,
               "listener": listener}


def greedy(url: str, prompt: str = PROMPT, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120,
                      json={"prompt": prompt, "max_tokens": 8, "temperature": 0, **extra})


def test_a_default_server_refuses_internal_fields_and_has_no_peer_routes(cluster):
    plain, listener = cluster["plain"], cluster["listener"]
    for params in hostile_params(listener):
        for path, body in (("/v1/completions", {"prompt": PROMPT}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPT}]})):
            response = httpx.post(plain + path, json={**body, "kv_transfer_params": params}, timeout=30)
            assert response.status_code == 400, response.text
            error = response.json()["error"]
            assert "internal to a pagedserve cluster" in error["message"], error
    for method, path in (("POST", "/internal/v1/completions"), ("GET", "/internal/v1/kv/info"),
                         ("GET", lease_target("0" * 32)), ("DELETE", lease_target("0" * 32))):
        assert httpx.request(method, plain + path, timeout=10).status_code == 404, path  # not mounted
    assert listener.connections == 0


def test_peer_routes_answer_only_signed_requests(cluster):
    listener = cluster["listener"]
    stranger = PeerKey.generate()
    path = "/internal/v1/completions"
    for url in (cluster["prefill"], cluster["decode"]):
        for params in hostile_params(listener):
            body, signed = key().signed_json("POST", path, {"prompt": PROMPT, "kv_transfer_params": params})
            other_body, _ = key().signed_json("POST", path, {"prompt": "other", "kv_transfer_params": params})
            stale = key().sign("POST", path, body, now=time.time() - 120)
            forged = stranger.sign("POST", path, body)
            for headers, content in (({}, body), (forged, body), (stale, body), (signed, other_body),
                                     ({HEADER: "nonsense"}, body), ({HEADER: "nan:00"}, body)):
                response = httpx.post(url + path, content=content, timeout=30,
                                      headers={"content-type": "application/json", **headers})
                assert response.status_code == 403, (url, headers, response.text)
                assert response.json()["error"]["code"] == "peer_auth_required"
            # The public route, signed or not: the field is not a client's
            assert httpx.post(url + "/v1/completions", content=body, headers=signed, timeout=30).status_code == 400
        for method, target in (("GET", "/internal/v1/kv/info"), ("GET", lease_target("0" * 32)),
                               ("GET", lease_target("0" * 32, via="shm")), ("DELETE", lease_target("0" * 32))):
            assert httpx.request(method, url + target, timeout=10).status_code == 403, target
            forged = stranger.sign(method, target)
            assert httpx.request(method, url + target, headers=forged, timeout=10).status_code == 403, target
    assert listener.connections == 0


def test_the_router_drops_a_clients_internal_fields(cluster):
    """Through the router the poisoning attempt is a plain request: the answer is the one a default server gives
    (fp32 greedy), nothing reaches the attacker's URL, and the next client's identical prompt gets the same."""
    listener, expected = cluster["listener"], greedy(cluster["plain"]).json()["choices"][0]["text"]
    for params in hostile_params(listener):
        response = greedy(cluster["router"], kv_transfer_params=params)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["text"] == expected
        assert response.json().get("kv_transfer_params") is None
    assert greedy(cluster["router"]).json()["choices"][0]["text"] == expected
    assert listener.connections == 0


def test_a_changed_handle_is_not_trusted_and_no_pull_goes_to_its_url(cluster):
    """A peer's request whose sealed handle was changed (its URL, tokens or first token): the decode worker
    computes the prompt itself and contacts nobody."""
    listener = cluster["listener"]
    made = peer_post(cluster["prefill"], "/internal/v1/completions",
                     {"prompt": PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    assert made.status_code == 200, made.text
    handle = made.json()["kv_transfer_params"]
    expected = greedy(cluster["plain"]).json()["choices"][0]["text"]
    before = metric_sum(cluster["decode"], "pagedserve_kv_transfer_failures_total", cause="bad_handle")
    for change in ({"first_token_id": (handle.get("first_token_id") or 0) + 1}, {"tokens_sha": "f" * 32},
                   {"expires_at": handle["expires_at"] + 3600}):
        params = {**handle, **change, "do_remote_prefill": True, "remote_url": listener.url}
        response = peer_post(cluster["decode"], "/internal/v1/completions",
                             {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "kv_transfer_params": params})
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == expected, response.text
    assert metric_sum(cluster["decode"], "pagedserve_kv_transfer_failures_total", cause="bad_handle") == before + 3
    assert listener.connections == 0
    assert peer_call("DELETE", cluster["prefill"], lease_target(handle["lease_id"])).status_code == 200


def test_leases_pin_a_bounded_share_and_one_segment_each(cluster):
    prefill = cluster["prefill"]
    pool = metric_sum(prefill, "pagedserve_kv_blocks_total")
    handles = []
    for i in range(12):  # each prompt ~5 blocks: 60 blocks asked of a pool whose quarter is less
        made = peer_post(prefill, "/internal/v1/completions", {
            "prompt": f"Lease {i}: " + PROMPT, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
        assert made.status_code == 200, made.text
        handles.append(made.json()["kv_transfer_params"])
    pinned = metric_sum(prefill, "pagedserve_kv_transfer_leased_blocks")
    print(f"leases pinned {pinned:.0f} of {pool:.0f} blocks (bound 25%); handles "
          f"{[h['num_blocks'] for h in handles]}")
    assert 0 < pinned <= 0.25 * pool
    assert any(h["num_blocks"] == 0 for h in handles)  # past the bound: handles cover less, the rest recomputed
    assert greedy(prefill).status_code == 200  # plain requests still find blocks

    lease = next(h for h in handles if h["num_blocks"] > 0)["lease_id"]
    before = set(glob.glob("/dev/shm/pagedserve-kv-*"))
    for _ in range(10):
        exported = peer_call("GET", prefill, lease_target(lease, via="shm"))
        assert exported.status_code == 200, exported.text
    held = set(glob.glob("/dev/shm/pagedserve-kv-*")) - before
    assert len(held) == 1 and os.path.basename(held.pop()) == exported.json()["name"]
    for h in handles:
        peer_call("DELETE", prefill, lease_target(h["lease_id"]))
    assert metric_sum(prefill, "pagedserve_kv_transfer_leased_blocks") == 0
    assert not set(glob.glob("/dev/shm/pagedserve-kv-*")) - before


def test_a_segment_name_is_ours_or_refused(tmp_path):
    """What a decode worker maps and unlinks: only names of our pattern, only regular files, no links."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    for name in ("../../etc/passwd", "/etc/passwd", "psm_0000", "pagedserve-kv-" + "0" * 31, None, 7):
        with pytest.raises(ValueError):
            kv_shm.take(name, 0)
    link = "pagedserve-kv-" + "a" * 32
    fifo = "pagedserve-kv-" + "b" * 32
    os.symlink(victim, os.path.join(kv_shm.SHM_DIR, link))
    os.mkfifo(os.path.join(kv_shm.SHM_DIR, fifo))
    try:
        with pytest.raises(OSError):  # O_NOFOLLOW: a link is not opened, let alone its target unlinked
            kv_shm.take(link, 0)
        with pytest.raises(ValueError):  # a FIFO: refused at once, without blocking
            kv_shm.take(fifo, 0)
        assert victim.read_text() == "keep me"
    finally:
        for name in (link, fifo):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(kv_shm.SHM_DIR, name))
    name = kv_shm.write_with(3, lambda view: view.__setitem__(slice(0, 3), b"abc"))
    assert kv_shm.NAME_PATTERN.fullmatch(name) and bytes(kv_shm.take(name, 3)) == b"abc"
    assert not os.path.exists(os.path.join(kv_shm.SHM_DIR, name))
