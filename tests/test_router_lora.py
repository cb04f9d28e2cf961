"""The router and LoRA adapters over two real replicas (`pagedserve serve --enable-lora`): a request for an
adapter goes to a replica that holds it; an adapter no replica holds is loaded on one on demand (once, however
many requests ask); when every holder is busy it is loaded on one more; unknown names get the replica's 404."""
from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest
from router_support import REPLICA_ARGS, RouterProcess, metric_sum, served_by, wait_for

from pagedserve.cluster.launcher import LocalCluster
from tests.lora_support import load_adapter, make_adapters

pytestmark = pytest.mark.slow  # router processes over replica processes: behind make test-all

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, hf_model):
    return make_adapters(hf_model, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(2, REPLICA_ARGS + ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "16"]) as cluster:
        yield cluster


def replica_models(router: RouterProcess) -> dict[str, list[str]]:
    return {r["name"]: r["models"] for r in httpx.get(router.url + "/health", timeout=5).json()["replicas"]}


def test_adapters_route_to_holders_and_load_on_demand(cluster, adapters, tmp_path):
    urls = cluster.urls()
    # attn8 on the first replica only, loaded behind the router's back (by another peer of the cluster, signed with
    # the session's secret): the router learns it from /v1/models.
    load_adapter(urls[0], "attn8", adapters["attn8"][0]).raise_for_status()
    config = {"policy": "least_load", "health_interval_s": 0.3, "lora_spill_inflight": 1,
              "lora_modules": {name: str(adapters[name][0]) for name in ("attn8", "mlp4", "all16")},
              "replicas": [{"url": u, "name": f"r{i}"} for i, u in enumerate(urls)]}
    with RouterProcess(tmp_path, **config) as router:
        router.wait_healthy(["r0", "r1"])
        wait_for(lambda: "attn8" in replica_models(router)["r0"], 10, "the router to see attn8 on r0")
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)
        assert {MODEL, "attn8", "mlp4", "all16"} <= {m.id for m in client.models.list()}

        def complete(model: str, max_tokens: int = 2):
            return lambda: client.completions.create(model=model, prompt="Hello", max_tokens=max_tokens)

        # least_load would alternate; an adapter stays with its holder.
        for _ in range(3):
            index, answer = served_by(urls, complete("attn8"))
            assert index == 0 and answer.model == "attn8"
        assert router.metric("pagedserve_router_lora_loads_total") == 0

        # mlp4 is nowhere: loaded once on one replica, which then serves every mlp4 request.
        holder, answer = served_by(urls, complete("mlp4"))
        assert answer.model == "mlp4"
        for _ in range(2):
            assert served_by(urls, complete("mlp4"))[0] == holder
        assert router.metric("pagedserve_router_lora_loads_total", adapter="mlp4", result="loaded") == 1
        assert "mlp4" in replica_models(router)[f"r{holder}"]
        # The replica's own /metrics count what it holds (attn8 loaded directly on r0, mlp4 by the router).
        held = {"attn8", "mlp4"} if holder == 0 else {"attn8"}
        assert metric_sum(urls[0], "pagedserve_lora_adapters_loaded") == len(held)
        assert metric_sum(urls[0], "pagedserve_lora_loads_total") == len(held)
        assert metric_sum(urls[0], "pagedserve_lora_adapter_bytes") > 0

        # Every attn8 holder busy (spill at 1 in flight): the next attn8 request loads it on r1 and runs there.
        stream = client.completions.create(model="attn8", prompt="Tell me a long story.", max_tokens=400,
                                           stream=True, extra_body={"ignore_eos": True})
        next(iter(stream))  # r0 has it in flight now
        index, answer = served_by(urls, complete("attn8"))
        stream.close()
        assert index == 1 and answer.model == "attn8"
        assert router.metric("pagedserve_router_lora_loads_total", replica="r1", adapter="attn8",
                             result="loaded") == 1

        # A burst for an adapter nobody holds loads it once (the replica being loaded counts as its holder).
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: complete("all16")(), range(4)))
        assert {a.model for a in answers} == {"all16"}
        assert router.metric("pagedserve_router_lora_loads_total", adapter="all16", result="loaded") == 1

        # A name neither replica nor router knows: the replica's own 404, in OpenAI's shape.
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-adapter", prompt="Hello", max_tokens=1)


def test_a_failed_load_is_a_clear_error(cluster, tmp_path):
    urls = cluster.urls()
    config = {"policy": "round_robin", "health_interval_s": 0.3, "lora_modules": {"ghost": str(tmp_path / "none")},
              "replicas": [{"url": u, "name": f"r{i}"} for i, u in enumerate(urls)]}
    with RouterProcess(tmp_path, **config) as router:
        router.wait_healthy(["r0", "r1"])
        response = httpx.post(router.url + "/v1/completions", timeout=60,
                              json={"model": "ghost", "prompt": "Hello", "max_tokens": 1})
        assert response.status_code == 503
        assert "loading adapter ghost" in response.json()["error"]["message"]
        assert router.metric("pagedserve_router_lora_loads_total", adapter="ghost", result="failed") >= 2
        ok = httpx.post(router.url + "/v1/completions", timeout=60, json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
        assert ok.status_code == 200  # the router and replicas keep serving


def test_gateway_routes_tenants_to_their_adapters_through_the_router(cluster, adapters, tmp_path):
    """Per-tenant fine-tunes behind one gateway route each: a tier names an adapter model on a provider (here
    the router, which loads the adapter where it is needed), and the answer is the adapter's own."""
    from tests.gateway_support import cli, gateway

    urls = cluster.urls()
    config = {"policy": "least_load", "health_interval_s": 0.3,
              "lora_modules": {"mlp4": str(adapters["mlp4"][0])},
              "replicas": [{"url": u, "name": f"r{i}"} for i, u in enumerate(urls)]}
    price = {"input": 0.1, "output": 0.4}
    with RouterProcess(tmp_path, **config) as router:
        router.wait_healthy(["r0", "r1"])
        gw_config = {"providers": {"cluster": {"base_url": router.url + "/v1", "timeout_s": 60, "models": {
                         "acme-tuned": {"name": "mlp4", **price}, "base": {"name": MODEL, **price}}}},
                     "routes": {"acme-support": {"small": ["cluster/acme-tuned"]},
                                "generic": {"small": ["cluster/base"]}}}
        process, url = gateway("lora-gw", gw_config, tmp_path, "admin-secret")
        with process:
            key = json.loads(cli("gateway", "keys", "create", "--config", str(tmp_path / "lora-gw.yaml"),
                                 "--user", "acme", "--models", "acme-support,generic"))["key"]
            via_gateway = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
            direct = openai.OpenAI(base_url=router.url + "/v1", api_key="none", max_retries=0)

            def answer(client: openai.OpenAI, model: str) -> str:
                return client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi!"}],
                                                      max_tokens=8, temperature=0).choices[0].message.content

            tuned, base = answer(via_gateway, "acme-support"), answer(via_gateway, "generic")
            assert tuned == answer(direct, "mlp4") and base == answer(direct, MODEL)
            assert tuned != base  # the adapter changes the answer: the tier really ran it
