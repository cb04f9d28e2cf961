"""The router against two real replicas (one pair of processes for the whole module, to spare 2 cores).

Each replica's own /metrics counters say who served what. Order matters: the failover test, last,
kills and restarts a replica.
"""
import asyncio
import json
import threading
from dataclasses import dataclass

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from router_support import (
    REPLICA_ARGS,
    FaultProxy,
    RouterProcess,
    completions_served,
    metric_sum,
    replica_snapshot,
    served_by,
    wait_for,
)

from pagedserve.cluster.launcher import LocalCluster

# Clusters of several replica processes: behind make test-all.
pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"

TENANTS = {
    "acme": "You are the assistant of ACME Rockets. Answer questions about rocket skates, anvils, "
            "giant magnets and portable holes. Be brief, polite and precise. " * 4,
    "globex": "You are the helpdesk of Globex Corporation. You know the Cypress Creek campus, its "
              "hammock district and the monorail schedule. Answer in one short sentence. " * 4,
}


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(2, REPLICA_ARGS) as cluster:
        yield cluster


@pytest.fixture
def replicas(cluster):
    return cluster.urls()


def router_config(urls, policy):
    return {"policy": policy, "health_interval_s": 0.5,
            "replicas": [{"url": u, "name": f"r{i}"} for i, u in enumerate(urls)]}


def test_round_robin_rotates(replicas, tmp_path):
    with RouterProcess(tmp_path, **router_config(replicas, "round_robin")) as router:
        router.wait_healthy(["r0", "r1"])
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="none")
        order = [served_by(replicas, lambda: client.completions.create(
            model="SmolLM2-135M-Instruct", prompt="Count: one two", max_tokens=2))[0] for _ in range(4)]
        assert order in ([0, 1, 0, 1], [1, 0, 1, 0])


def test_least_load_spreads_concurrent_streams(replicas, tmp_path):
    with RouterProcess(tmp_path, **router_config(replicas, "least_load")) as router:
        router.wait_healthy(["r0", "r1"])
        before = [completions_served(u) for u in replicas]
        body = {"model": "SmolLM2-135M-Instruct", "prompt": "Tell me a story", "max_tokens": 24,
                "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=router.url, timeout=60) as client:
            streams = [client.stream("POST", "/v1/completions", json=body) for _ in range(4)]
            readers = []
            for stream in streams:  # all four are in flight before any is read to the end
                response = stream.__enter__()
                assert response.status_code == 200
                lines = response.iter_lines()
                next(lines)
                readers.append(lines)
            for stream, lines in zip(streams, readers, strict=True):
                assert "data: [DONE]" in list(lines)
                stream.__exit__(None, None, None)
        after = [completions_served(u) for u in replicas]
        assert [a - b for a, b in zip(after, before, strict=True)] == [2, 2]


def test_prefix_affinity_keeps_each_tenant_on_one_replica(replicas, tmp_path):
    with RouterProcess(tmp_path, **router_config(replicas, "prefix_affinity")) as router:
        router.wait_healthy(["r0", "r1"])
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="none")
        hits_before = [metric_sum(u, "pagedserve_prefix_cache_hit_tokens_total") for u in replicas]
        placement = {name: set() for name in TENANTS}
        for turn in range(3):
            for name, system in TENANTS.items():
                index, answer = served_by(replicas, lambda s=system, t=turn: client.chat.completions.create(
                    model="SmolLM2-135M-Instruct", max_tokens=2,
                    messages=[{"role": "system", "content": s}, {"role": "user", "content": f"Question {t}?"}]))
                assert answer.choices[0].message.content is not None
                placement[name].add(index)
        assert all(len(p) == 1 for p in placement.values()), placement
        assert placement["acme"] != placement["globex"]  # a new prefix goes to the emptier replica
        hits_after = [metric_sum(u, "pagedserve_prefix_cache_hit_tokens_total") for u in replicas]
        # turns 2 and 3 of each tenant reuse its system prompt (tens of tokens) on its own replica
        assert all(after - before >= 2 * 40 for before, after in zip(hits_before, hits_after, strict=True))
        assert router.metric("pagedserve_router_decisions_total", reason="prefix_match") == 4


def test_session_affinity_pins_sessions(replicas, tmp_path):
    with RouterProcess(tmp_path, **router_config(replicas, "session_affinity")) as router:
        router.wait_healthy(["r0", "r1"])
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="none")
        seen = {}
        for session in ("alice", "bob", "carol", "dave", "erin", "frank"):
            for _ in range(2):
                index, _ = served_by(replicas, lambda s=session: client.completions.create(
                    model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=1,
                    extra_headers={"x-session-id": s}))
                seen.setdefault(session, set()).add(index)
        assert all(len(v) == 1 for v in seen.values())
        assert {i for v in seen.values() for i in v} == {0, 1}


def test_router_endpoints_and_errors(replicas, tmp_path):
    config = router_config(replicas, "prefix_affinity")
    config["replicas"][0]["tags"] = ["eu"]
    with RouterProcess(tmp_path, **config) as router:
        router.wait_healthy(["r0", "r1"])
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="none")
        assert [m.id for m in client.models.list().data] == ["SmolLM2-135M-Instruct"]
        health = httpx.get(router.url + "/health").json()
        assert health["status"] == "ok" and len(health["replicas"]) == 2
        blocks = metric_sum(replicas[0], "pagedserve_kv_blocks_total")
        assert health["replicas"][0]["kv_tokens"] == blocks * 16  # sizes its prefix-index budget
        bad = httpx.post(router.url + "/v1/completions", content=b"{not json")
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
        nowhere = httpx.post(router.url + "/v1/completions", headers={"x-residency": "ap"},
                             json={"model": "SmolLM2-135M-Instruct", "prompt": "x", "max_tokens": 1})
        assert nowhere.status_code == 503 and "residency" in nowhere.json()["error"]["message"]
        eu = httpx.post(router.url + "/v1/completions", headers={"x-residency": "eu"},
                        json={"model": "SmolLM2-135M-Instruct", "prompt": "x", "max_tokens": 1})
        assert eu.status_code == 200 and eu.headers["x-pagedserve-replica"] == "r0"
        # a replica's own 4xx passes through untouched (no retry, no ejection)
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="SmolLM2-135M-Instruct", prompt="x", max_tokens=-3)
        assert router.replica_states() == {"r0": True, "r1": True}
        # streaming passes through chunk by chunk. One request at a time: greedy text is the same on every
        # replica only for the same batch (bf16 sums in another order part at near-ties, as in any engine).
        texts = ["".join(c.choices[0].text for c in client.completions.create(
            model="SmolLM2-135M-Instruct", prompt="The sky is", max_tokens=8, temperature=0, stream=True))
            for _ in range(4)]
        assert len(set(texts)) == 1 and texts[0]
        metrics = httpx.get(router.url + "/metrics").text
        assert "pagedserve_router_decisions_total" in metrics and "pagedserve_router_replica_healthy" in metrics


# --- data residency under failures ---------------------------------------------------------------
# Replica 0 stands for an EU jurisdiction, replica 1 for a US one. The router sees six entries, three
# per jurisdiction, each through its own cuttable TCP link, so one example can take any subset down,
# before or during a request, in microseconds. Which process answered is read from its own counters.

ENTRIES = [f"{j}-{i}" for j in ("eu", "us") for i in range(3)]
REGIONS = {"eu-0": "eu-west", "eu-1": "eu-central", "eu-2": "eu-west",
           "us-0": "us-east", "us-1": "us-west", "us-2": "us-east"}


@dataclass
class ResidencySetup:
    router: RouterProcess
    proxies: dict[str, FaultProxy]
    processes: dict[str, str]
    last_counts: dict[str, float] | None = None


@pytest.fixture
def residency_setup(cluster, tmp_path):
    """Replica 0 plays the EU jurisdiction, replica 1 the US one; six entries reach them via FaultProxy."""
    processes = {"eu": cluster.replicas[0].url, "us": cluster.replicas[1].url}
    proxies = {e: FaultProxy(cluster.replicas[0 if e.startswith("eu") else 1].port) for e in ENTRIES}
    config = {
        "policy": "prefix_affinity", "health_interval_s": 0.2, "health_timeout_s": 1.0,
        "unhealthy_threshold": 1, "healthy_threshold": 1, "connect_timeout_s": 1.0, "max_attempts": 3,
        "request_timeout_s": 10.0, "stream_idle_timeout_s": 10.0,
        "region": "us-east",
        "rtt_ms": {"us-east": {"eu-west": 80, "eu-central": 90, "us-west": 60},
                   "eu-west": {"eu-central": 15, "us-east": 80, "us-west": 140}},
        "replicas": [{"url": proxies[e].url, "name": e, "region": REGIONS[e], "tags": [e[:2]]} for e in ENTRIES],
    }
    try:
        with RouterProcess(tmp_path, **config) as router:
            router.wait_healthy(ENTRIES)
            yield ResidencySetup(router, proxies, processes)
    finally:
        for proxy in proxies.values():
            proxy.close()


def settled_counts(processes: dict[str, str]) -> dict[str, float]:
    """Per process, requests answered, read once both engines are idle and the counts stop moving (a
    request whose link was cut is counted when the replica notices the disconnect)."""
    previous = None

    def stable():
        nonlocal previous
        snapshots = {j: replica_snapshot(u) for j, u in processes.items()}
        counts = {j: served for j, (busy, served) in snapshots.items()}
        idle = not any(busy for busy, _ in snapshots.values())
        done, previous = idle and counts == previous, counts
        return counts if done else None
    return wait_for(stable, 10, "the replicas to settle", interval=0.05)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(down=st.lists(st.booleans(), min_size=6, max_size=6),
       residency=st.sampled_from(["eu", "us", None]),
       client_region=st.sampled_from(["eu-west", "us-east", "us-west", None]),
       settle=st.booleans(), cut_after=st.sampled_from([None, 0, 200]), stream=st.booleans())
def test_residency_holds_under_random_failures(residency_setup, down, residency, client_region, settle, cut_after,
                                               stream):
    setup = residency_setup
    router, proxies, processes = setup.router, setup.proxies, setup.processes
    for entry, is_down in zip(ENTRIES, down, strict=True):
        proxies[entry].set_up(not is_down)
    if settle:  # let the router's probes see the new pattern first
        wanted = {e: not d for e, d in zip(ENTRIES, down, strict=True)}
        wait_for(lambda: router.replica_states() == wanted, 10, "the router to see the failure pattern")
    allowed = [e for e in ENTRIES if residency is None or e.startswith(residency)]
    allowed_up = [e for e in allowed if not down[ENTRIES.index(e)]]
    before = setup.last_counts or settled_counts(processes)
    headers = {k: v for k, v in (("x-residency", residency), ("x-client-region", client_region)) if v}
    cut = cut_after is not None and allowed_up
    body = {"model": "SmolLM2-135M-Instruct", "prompt": "Where does my data live? " * 8,
            "max_tokens": 4 if cut else 1, "ignore_eos": True, "stream": stream}
    if cut:  # cut the whole jurisdiction but one link while the request runs: once it reached a replica and
        # `cut_after` bytes of the answer came back (0: before the replica answered; 200: mid-stream)
        once = threading.Lock()

        def cut_links() -> None:
            if once.acquire(blocking=False):
                for e in allowed_up[1:]:
                    proxies[e].set_up(False)
        for e in allowed_up:
            proxies[e].arm(b"Where does my data live?", cut_after, cut_links)
    try:
        response = httpx.post(router.url + "/v1/completions", json=body, headers=headers, timeout=30)
    except httpx.TimeoutException:
        pytest.fail(f"the router hung; its log ends:\n{router.log_path.read_text()[-3000:]}")
    finally:
        for proxy in proxies.values():
            proxy.disarm()
    if cut and response.status_code == 200:
        assert once.locked()  # it passed a link, so the cut happened, during this request
    after = setup.last_counts = settled_counts(processes)
    served = [j for j in processes if after[j] > before[j]]
    # the property: nothing ever reaches a replica outside the request's residency
    if residency is not None:
        assert set(served) <= {residency}, (served, residency)
        assert response.status_code != 200 or response.headers["x-pagedserve-replica"].startswith(residency)
    if not allowed_up:
        assert response.status_code == 503
        assert "residency" in response.json()["error"]["message"] or residency is None
    elif settle and not cut:
        assert response.status_code == 200, response.text
    else:
        assert response.status_code in (200, 503), response.text
        if stream and response.status_code == 200 and "error" in response.text:
            assert "failed mid-stream" in response.text  # an error event, not a hang


# --- failover ------------------------------------------------------------------------------------
# A replica killed (SIGKILL) under load: no non-streamed request is lost, its streams end with an error
# event, the router ejects it and takes it back once restarted.


async def plain(client: httpx.AsyncClient, i: int) -> httpx.Response:
    return await client.post("/v1/completions", json={"model": MODEL, "prompt": f"Request {i}: tell me",
                                                      "max_tokens": 24, "ignore_eos": True})


async def stream(client: httpx.AsyncClient, started: asyncio.Event, counter: list) -> tuple[str, list[str]]:
    body = {"model": MODEL, "prompt": "Write a long story", "max_tokens": 100, "ignore_eos": True,
            "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        events = []
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == 1:
                    counter.append(1)
                    if len(counter) == 4:
                        started.set()
        return response.headers["x-pagedserve-replica"], events


def test_kill_replica_under_load(cluster, tmp_path):
    urls = cluster.urls()
    config = {"policy": "least_load", "health_interval_s": 0.3, "unhealthy_threshold": 1,
              "replicas": [{"url": u, "name": f"r{i}"} for i, u in enumerate(urls)]}
    with RouterProcess(tmp_path, **config) as router:
        router.wait_healthy(["r0", "r1"])

        async def scenario():
            async with httpx.AsyncClient(base_url=router.url, timeout=120) as client:
                started, counter = asyncio.Event(), []
                streams = [asyncio.create_task(stream(client, started, counter)) for _ in range(4)]
                await asyncio.wait_for(started.wait(), 60)  # every stream has its first token
                plains = [asyncio.create_task(plain(client, i)) for i in range(6)]
                await asyncio.sleep(0)
                wait_busy = asyncio.to_thread(wait_for, lambda: _running(urls[1]) >= 4, 30, "r1 busy")
                await wait_busy
                cluster.replicas[1].kill()
                return await asyncio.gather(*streams), await asyncio.gather(*plains)

        stream_results, plain_results = asyncio.run(scenario())
        for response in plain_results:  # none lost: each retried on r0 and complete
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 24
        by_replica = {"r0": [], "r1": []}
        for name, events in stream_results:
            by_replica[name].append(events)
        assert len(by_replica["r1"]) == 2 and len(by_replica["r0"]) == 2
        for events in by_replica["r1"]:
            assert "error" in json.loads(events[-1]) and "r1" in json.loads(events[-1])["error"]["message"]
        for events in by_replica["r0"]:
            assert events[-1] == "[DONE]"
        assert router.replica_states() == {"r0": True, "r1": False}
        assert router.metric("pagedserve_router_stream_errors_total") == 2
        assert router.metric("pagedserve_router_failovers_total") >= 1

        # a fresh request right away is served by r0 only
        before = completions_served(urls[0])
        response = httpx.post(router.url + "/v1/completions", json={"model": MODEL, "prompt": "x",
                                                                    "max_tokens": 1})
        assert response.status_code == 200 and completions_served(urls[0]) == before + 1

        cluster.restart(cluster.replicas[1])  # same port: the router re-admits it by its probes
        router.wait_healthy(["r0", "r1"])
        assert router.metric("pagedserve_router_readmissions_total", replica="r1") >= 1


def _running(url: str) -> float:
    return metric_sum(url, "pagedserve_num_requests_running") + metric_sum(url, "pagedserve_num_requests_waiting")
