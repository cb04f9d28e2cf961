"""The router against hostile or careless clients, with two real replicas (one pair for the module) and
the real router process: residency that no header trick weakens, replicas that one bad client cannot
take out of service, disconnects that reach the replica, bodies bounded while they are read.

Where a replica must answer 5xx / 429 or drop a connection on demand, a StandInReplica (in-process,
forwarding everything else to a real replica) plays that part: a real replica cannot be made to."""
import asyncio
import socket
import time
from pathlib import Path

import httpx
import pytest
from router_support import (
    REPLICA_ARGS,
    FaultProxy,
    RouterProcess,
    StandInReplica,
    completions_served,
    metric_sum,
    replica_snapshot,
    wait_for,
)

from pagedserve.cluster.cluster_config import ClusterConfig
from pagedserve.cluster.launcher import LocalCluster

# Clusters of several replica processes under hostile clients: behind make test-all.
pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"
BODY = {"model": MODEL, "prompt": "Where does my data live?", "max_tokens": 1}
RAW_BODY = b'{"model": "%s", "prompt": "Where does my data live?", "max_tokens": 1}' % MODEL.encode()


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(2, REPLICA_ARGS) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def stand_ins(cluster):
    pair = [StandInReplica(r.url) for r in cluster.replicas]
    yield pair
    for stand_in in pair:
        stand_in.close()


@pytest.fixture
def faulty(stand_ins):
    """The stand-ins, behaving until a test says otherwise."""
    for stand_in in stand_ins:
        stand_in.fault, stand_in.health_ok, stand_in.seen = None, True, {}
    return stand_ins


def config(urls, **extra) -> dict:
    return {"policy": "round_robin", "health_interval_s": 0.5,
            "replicas": [{"url": u, "name": f"r{i}"} for i, u in enumerate(urls)], **extra}


def raw_request(port: int, data: bytes) -> tuple[int | None, bytes]:
    """Sends hand-made bytes (what httpx refuses to send); (status, whole answer), or (None, b"") when
    the connection closed without an answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    status = int(answer.split(b" ", 2)[1]) if answer.startswith(b"HTTP/1.1 ") else None
    return status, answer


def completion_bytes(extra_headers: bytes, body: bytes) -> bytes:
    """A whole POST /v1/completions as sent on the wire, with extra header lines."""
    return (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/json\r\n"
            + extra_headers + b"content-length: %d\r\n\r\n" % len(body) + body)


def wait_idle(urls) -> None:
    wait_for(lambda: not any(replica_snapshot(u)[0] for u in urls), 30, "the replicas to be idle")


# --- residency -----------------------------------------------------------------------------------

RESIDENCY_VARIANTS = [  # header list -> status, and for 200 the replica that must serve it
    ([("x-residency", ""), ("x-residency", "eu")], 200),
    ([("x-residency", "eu"), ("x-residency", "")], 200),
    ([("X-Residency", "EU")], 200),
    ([("x-residency", "eu,"), ("x-residency", ",")], 200),
    ([("x-residency", "eu"), ("x-residency", "us")], 503),  # both required: no replica carries both
    ([("x-residency", "eu, us")], 503),
    ([("x-residency", "")], 400),
    ([("x-residency", ", ,")], 400),
    ([("x-residency", "eu us")], 400),
    ([("x-residency", "eu;us")], 400),
    ([(b"x-residency", b"\xe9u")], 400),
]
RAW_RESIDENCY = [  # hand-made header blocks: refused by the router or the HTTP parser, or served in eu
    b"x-residency:\r\nx-residency: eu\r\n",
    b"X-RESIDENCY: \t EU \t\r\n",
    b"x-residency: \r\n eu\r\n",  # obsolete line folding
    b"x-residency : eu\r\n",
    b"x-residency: eu\rx-residency: \r\n",
    b"x-residency: e\x00u\r\n",
    b"x-residency: eu\x0b\r\n",
    b"x-residency: eu\r\nx-residency\r\n",
]


def test_residency_cannot_be_weakened_by_headers(cluster, tmp_path):
    eu_link = FaultProxy(cluster.replicas[0].port)  # so the eu replica can be cut off without a kill
    urls = [eu_link.url, cluster.replicas[1].url]
    setup = config(urls, health_interval_s=0.2, unhealthy_threshold=1)
    setup["replicas"][0]["tags"] = ["eu"]
    us_before = completions_served(cluster.replicas[1].url)
    try:
        with RouterProcess(tmp_path, **setup) as router:
            router.wait_healthy(["r0", "r1"])
            for eu_up in (True, False):
                eu_link.set_up(eu_up)
                wait_for(lambda u=eu_up: router.replica_states()["r0"] == u, 10, "the router to see the eu link")
                for headers, status in RESIDENCY_VARIANTS:
                    response = httpx.post(router.url + "/v1/completions", json=BODY, headers=headers, timeout=30)
                    expected = status if eu_up or status == 400 else 503
                    assert response.status_code == expected, (headers, eu_up, response.text)
                    assert "error" in response.json() or response.headers["x-pagedserve-replica"] == "r0"
                for head in RAW_RESIDENCY:
                    status, answer = raw_request(router.port, completion_bytes(head, RAW_BODY))
                    assert status in (400, 503) or (status == 200 and b"x-pagedserve-replica: r0" in answer), \
                        (head, answer[:300])
        wait_idle([cluster.replicas[1].url])
        assert completions_served(cluster.replicas[1].url) == us_before  # nothing ever reached the us replica
    finally:
        eu_link.close()


def test_routing_headers_are_read_strictly(cluster, tmp_path):
    with RouterProcess(tmp_path, **config(cluster.urls(), policy="session_affinity")) as router:
        router.wait_healthy(["r0", "r1"])
        cases = [
            ([("x-client-region", "eu-west"), ("x-client-region", "us-east")], 400),
            ([("x-client-region", "eu-west,us-east")], 400),
            ([("x-client-region", "EU-West"), ("x-client-region", "eu-west")], 200),
            ([("x-client-region", "")], 200),  # empty: the router's own region
            ([("x-session-id", "alice"), ("x-session-id", "bob")], 400),
            ([("x-session-id", "alice"), ("x-session-id", "alice")], 200),
        ]
        for headers, status in cases:
            response = httpx.post(router.url + "/v1/completions", json=BODY, headers=headers, timeout=30)
            assert response.status_code == status, (headers, response.text)
            if status == 400:
                assert response.json()["error"]["param"] == headers[0][0]
        # what the router only reads to route is never a 500, whatever its shape
        odd = {"model": MODEL, "max_tokens": 1,
               "messages": [{"role": ["user"], "content": [{"type": "text", "text": 5}, "x", None]}]}
        assert httpx.post(router.url + "/v1/chat/completions", json=odd, timeout=30).status_code < 500
        deep = b"[" * 100_000 + b"]" * 100_000
        assert httpx.post(router.url + "/v1/completions", content=deep, timeout=30).status_code == 400
        status, answer = raw_request(router.port, completion_bytes(b"x-note: caf\xe9\r\n", RAW_BODY))
        assert status == 200, answer[:300]  # a latin-1 header is forwarded as sent
        assert router.metric("pagedserve_router_ejections_total") == 0


# --- one bad client, or one bad replica ----------------------------------------------------------

async def _poison_while_serving(url: str, seconds: float, per_second: int,
                                marker: str = "POISON") -> tuple[list, list]:
    """Poisoned requests (prompt `marker`) at a fixed rate, and normal ones back to back, for `seconds`."""
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        stop = time.monotonic() + seconds

        async def poison():
            sent = []
            while time.monotonic() < stop:
                sent.append(asyncio.create_task(client.post("/v1/completions", json={**BODY, "prompt": marker})))
                await asyncio.sleep(1 / per_second)  # pacing the attack, not waiting for a condition
            return await asyncio.gather(*sent)

        async def normal():
            answers = []
            while time.monotonic() < stop:
                answers.append(await client.post("/v1/completions", json=BODY))
            return answers

        return await asyncio.gather(poison(), normal())


def test_poisoning_client_ejects_no_replica(faulty, tmp_path):
    with RouterProcess(tmp_path, **config([s.url for s in faulty], policy="least_load")) as router:
        router.wait_healthy(["r0", "r1"])
        poisoned, normal = asyncio.run(_poison_while_serving(router.url, seconds=6, per_second=20))
        served = sum(r.status_code == 200 for r in normal)
        print(f"normal requests served while poisoning: {served}/{len(normal)}; poisoned {len(poisoned)}")
        assert served == len(normal) and served >= 5, [r.text for r in normal if r.status_code != 200][:3]
        for response in poisoned:  # the replicas' own 500 in OpenAI's shape, after two replicas agreed
            assert response.status_code == 500 and response.json()["error"]["message"].startswith("stand-in")
        assert sum(s.seen.get("500", 0) for s in faulty) <= 2 * len(poisoned)
        assert router.replica_states() == {"r0": True, "r1": True}
        assert router.metric("pagedserve_router_ejections_total") == 0


def test_replica_crashing_on_a_request_stays_in_rotation(faulty, tmp_path):
    """A replica whose unhandled exception answers 500 and then closes the connection (uvicorn's way): the
    router's confirming probe goes out on a fresh connection, finds /health fine, and ejects nothing (it used
    to reuse the dying connection, read an error and eject: 25 of 30 normal requests then got 503)."""
    with RouterProcess(tmp_path, **config([s.url for s in faulty], policy="least_load")) as router:
        router.wait_healthy(["r0", "r1"])
        crashed, normal = asyncio.run(_poison_while_serving(router.url, seconds=6, per_second=4, marker="CRASH"))
        served = sum(r.status_code == 200 for r in normal)
        print(f"normal requests served while crashing replicas: {served}/{len(normal)}; crashing {len(crashed)} "
              f"({sum(s.seen.get('crash', 0) for s in faulty)} crashes)")
        assert served == len(normal) and served >= 5, [r.text for r in normal if r.status_code != 200][:3]
        assert all(r.status_code == 500 for r in crashed)
        wait_for(lambda: router.metric("pagedserve_router_confirm_probes_total", ok="true") >= 1, 10,
                 "a confirming probe")
        assert router.metric("pagedserve_router_confirm_probes_total", ok="false") == 0
        assert router.replica_states() == {"r0": True, "r1": True}
        assert router.metric("pagedserve_router_ejections_total") == 0


def test_replica_failing_what_others_serve_is_ejected(faulty, tmp_path):
    faulty[0].fault = "500"
    with RouterProcess(tmp_path, **config([s.url for s in faulty], health_interval_s=30)) as router:
        router.wait_healthy(["r0", "r1"])
        for _ in range(4):  # passive_failures is 3: r0's 500s are not the requests' doing, r1 serves them
            response = httpx.post(router.url + "/v1/completions", json=BODY, timeout=30)
            assert response.status_code == 200 and response.headers["x-pagedserve-replica"] == "r1"
        assert router.replica_states() == {"r0": False, "r1": True}
        assert router.metric("pagedserve_router_ejections_total", replica="r0", source="passive") == 1


def test_5xx_with_a_failing_probe_ejects_at_once(faulty, tmp_path):
    with RouterProcess(tmp_path, **config([s.url for s in faulty], health_interval_s=30)) as router:
        router.wait_healthy(["r0", "r1"])
        faulty[0].fault, faulty[0].health_ok = "500", False  # no regular probe comes for 30 s
        for _ in range(10):  # the policy may pick r1 first (probe latencies break ties): until r0 was tried
            response = httpx.post(router.url + "/v1/completions", json=BODY, timeout=30)
            assert response.status_code == 200 and response.headers["x-pagedserve-replica"] == "r1"
            if router.metric("pagedserve_router_failovers_total", replica="r0") >= 1:
                break
        wait_for(lambda: not router.replica_states()["r0"], 30, "r0 ejected by the confirming probe")
        assert router.metric("pagedserve_router_ejections_total", replica="r0", source="confirmed") == 1


@pytest.mark.parametrize("stream", [False, True])
def test_dropped_connection_with_a_good_probe_keeps_the_replica(faulty, tmp_path, stream):
    faulty[0].fault = "drop"
    with RouterProcess(tmp_path, **config([s.url for s in faulty], health_interval_s=30)) as router:
        router.wait_healthy(["r0", "r1"])
        response = httpx.post(router.url + "/v1/completions", json={**BODY, "stream": stream}, timeout=30)
        assert response.status_code == 200 and response.headers["x-pagedserve-replica"] == "r1"
        assert faulty[0].seen == {"drop": 2}  # once more on a connection of its own (proxy._attempt), then r1
        wait_for(lambda: router.metric("pagedserve_router_confirm_probes_total", replica="r0", ok="true"), 10,
                 "the confirming probe")
        assert router.replica_states() == {"r0": True, "r1": True}
        assert router.metric("pagedserve_router_ejections_total") == 0


def test_busy_replica_is_skipped_not_ejected(faulty, tmp_path):
    with RouterProcess(tmp_path, **config([s.url for s in faulty], health_interval_s=30)) as router:
        router.wait_healthy(["r0", "r1"])
        faulty[0].fault = "429"
        for _ in range(4):
            response = httpx.post(router.url + "/v1/completions", json=BODY, timeout=30)
            assert response.status_code == 200 and response.headers["x-pagedserve-replica"] == "r1"
        faulty[1].fault = "503"
        for stream in (False, True):  # every replica busy: the client gets a replica's own answer
            response = httpx.post(router.url + "/v1/completions", json={**BODY, "stream": stream}, timeout=30)
            assert response.status_code in (429, 503) and response.headers["retry-after"] == "1"
        assert router.replica_states() == {"r0": True, "r1": True}
        assert router.metric("pagedserve_router_ejections_total") == 0
        assert router.metric("pagedserve_router_failovers_total", replica="r0", reason="status 429") >= 4


def test_replica_answering_503_alone_is_skipped_not_ejected(faulty, tmp_path):
    with RouterProcess(tmp_path, **config([s.url for s in faulty], health_interval_s=30)) as router:
        router.wait_healthy(["r0", "r1"])
        faulty[0].fault = "503"  # draining or overloaded: busy, not broken
        for _ in range(4):  # more than passive_failures (3)
            response = httpx.post(router.url + "/v1/completions", json=BODY, timeout=30)
            assert response.status_code == 200 and response.headers["x-pagedserve-replica"] == "r1"
        assert faulty[0].seen["503"] >= 2
        assert router.replica_states() == {"r0": True, "r1": True}
        assert router.metric("pagedserve_router_ejections_total") == 0
        assert router.metric("pagedserve_router_confirm_probes_total") == 0  # not even suspected
        faulty[0].fault = None
        served = {httpx.post(router.url + "/v1/completions", json=BODY, timeout=30).headers["x-pagedserve-replica"]
                  for _ in range(2)}
        assert served == {"r0", "r1"}  # still in the rotation


def test_refused_connection_ejects_at_once(cluster, tmp_path):
    gone = StandInReplica(cluster.replicas[0].url)  # closed below: its port then refuses connections
    live = cluster.replicas[1].url
    with RouterProcess(tmp_path, **config([gone.url, live], health_interval_s=30)) as router:
        router.wait_healthy(["r0", "r1"])
        gone.close()
        for _ in range(2):  # round robin: one of the two tries r0 first
            response = httpx.post(router.url + "/v1/completions", json=BODY, timeout=30)
            assert response.status_code == 200 and response.headers["x-pagedserve-replica"] == "r1"
        assert router.replica_states() == {"r0": False, "r1": True}
        assert router.metric("pagedserve_router_ejections_total", replica="r0", source="passive") == 1
        assert router.metric("pagedserve_router_failovers_total", replica="r0") == 1  # one refusal was enough


def test_consecutive_timeouts_eject_passively(faulty, tmp_path):
    with RouterProcess(tmp_path, **config([s.url for s in faulty], health_interval_s=30,
                                          request_timeout_s=0.5)) as router:
        router.wait_healthy(["r0", "r1"])
        faulty[0].fault = "stall"
        for _ in range(8):
            response = httpx.post(router.url + "/v1/completions", json=BODY, timeout=30)
            assert response.status_code == 200 and response.headers["x-pagedserve-replica"] == "r1"
            if not router.replica_states()["r0"]:
                break
        assert faulty[0].seen == {"stall": 3}  # passive_failures timeouts in a row, no fewer and no more
        assert router.replica_states() == {"r0": False, "r1": True}
        assert router.metric("pagedserve_router_ejections_total", replica="r0", source="passive") == 1


# --- disconnects and bodies ----------------------------------------------------------------------

def test_client_disconnect_aborts_the_replica_request(cluster, tmp_path):
    url = cluster.replicas[0].url
    with RouterProcess(tmp_path, **config([url])) as router:
        router.wait_healthy(["r0"])
        wait_idle([url])
        tokens_before = metric_sum(url, "pagedserve_generation_tokens_total")
        body = b'{"model": "%s", "prompt": "Tell me a long story", "max_tokens": 400, "ignore_eos": true}' % \
            MODEL.encode()
        sock = socket.create_connection(("127.0.0.1", router.port), timeout=30)
        sock.sendall(completion_bytes(b"", body))
        wait_for(lambda: metric_sum(url, "pagedserve_num_requests_running") >= 1, 30, "the request to run")
        sock.close()
        wait_idle([url])
        generated = metric_sum(url, "pagedserve_generation_tokens_total") - tokens_before
        assert generated < 400, generated  # aborted, not run to its end
        assert router.metric("pagedserve_router_client_disconnects_total") == 1


def test_body_limit_holds_while_reading(cluster, tmp_path):
    setup = config(cluster.urls(), max_body_bytes=2**20)
    with RouterProcess(tmp_path, **setup) as router:
        router.wait_healthy(["r0", "r1"])
        rss_before = _rss_bytes(router.process.pid)

        def chunks(total: int):
            piece = b'{"prompt": "' + b"x" * 65536
            for _ in range(total // len(piece)):
                yield piece
        response = httpx.post(router.url + "/v1/completions", content=chunks(64 * 2**20), timeout=60)
        assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"
        assert _rss_bytes(router.process.pid) - rss_before < 16 * 2**20
        declared = httpx.post(router.url + "/v1/completions", content=b"x" * (2**20 + 1), timeout=30)
        assert declared.status_code == 413 and declared.json()["error"]["type"] == "invalid_request_error"
        small = httpx.post(router.url + "/v1/completions", content=iter([b'{"model": "%s", ' % MODEL.encode(),
                                                                          b'"prompt": "x", "max_tokens": 1}']))
        assert small.status_code == 200, small.text  # chunked and under the limit: served


def _rss_bytes(pid: int) -> int:
    line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) * 1024


def test_config_residency_tags_are_names(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text("replicas:\n  - {url: 'http://a', tags: EU}\n  - {url: 'http://b', tags: [gdpr]}\n")
    assert [s.tags for s in ClusterConfig.from_yaml(path).finalize().replicas] == [("eu",), ("gdpr",)]
    path.write_text("replicas:\n  - {url: 'http://a', tags: ['eu us']}\n")
    with pytest.raises(ValueError, match="residency tag"):
        ClusterConfig.from_yaml(path).finalize()
