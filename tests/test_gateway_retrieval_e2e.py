"""Retrieval through the gateway end to end, all real processes: `pagedserve serve`, `pagedserve gateway`, the
`pagedserve gateway index` CLI and the official openai client.

The seed's flow: the HR policy documents are indexed; "What's our parental leave policy in Germany?" is routed
by the classifier to the small model, which answers from 3 retrieved chunks; a paraphrase is a cache hit. The
parental-leave document is edited and re-indexed: the same question is served fresh (the stale reason names
the changed chunk) while a cached answer built only from an untouched document stays a hit.
"""
from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import httpx
import openai
import pytest
from gateway_support import cli, gateway, pagedserve_server, start_all, wait_for

pytestmark = pytest.mark.slow

ADMIN = "admin-secret"
HR = Path(__file__).parent / "data" / "hr_policy"
SEED = "What's our parental leave policy in Germany?"
PARAPHRASE = "What is our parental leave policy in Germany?"
HOTEL = "How much does the company pay for a hotel night?"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("retrieval")
    docs = tmp / "hr"
    shutil.copytree(HR, docs)
    with contextlib.ExitStack() as stack:
        server, server_url = pagedserve_server("server", tmp)
        start_all(stack, server)
        model = httpx.get(server_url + "/v1/models", timeout=10).json()["data"][0]["id"]
        httpx.post(server_url + "/v1/chat/completions", timeout=600, json={
            "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).raise_for_status()
        prices = {"small": {"name": model, "input": 0.1, "output": 0.4}, "large": {"name": model, "input": 1, "output": 4}}
        config = {
            "providers": {"local": {"base_url": server_url + "/v1", "timeout_s": 60, "models": prices}},
            "routes": {
                "hr-rag": {"small": ["local/small"], "large": ["local/large"], "speculate": True,
                           "retrieval": {"source": "hr-policy", "k": 3, "min_score": 0.4}},
                "plain": {"small": ["local/small"]},
            },
        }
        process, url = gateway("gw", config, tmp, ADMIN)
        stack.enter_context(process)
        config_path = str(tmp / "gw.yaml")
        key = json.loads(cli("gateway", "keys", "create", "--config", config_path, "--user", "alice", "--team", "hr"))
        client = openai.OpenAI(base_url=url + "/v1", api_key=key["key"], max_retries=0)
        yield {"url": url, "config": config_path, "docs": docs, "client": client, "process": process}


def admin(url: str, method: str, path: str, **kwargs) -> httpx.Response:
    return httpx.request(method, url + path, headers={"authorization": f"Bearer {ADMIN}"}, timeout=60, **kwargs)


def trace_of(url: str, trace_id: str) -> dict:
    rows = admin(url, "GET", "/admin/traces?limit=50").json()["data"]
    return next(t for t in rows if t["trace_id"] == trace_id)


def ask(client: openai.OpenAI, question: str, model: str = "hr-rag", **kwargs) -> tuple[dict, dict]:
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": question}], max_tokens=12, temperature=0, **kwargs)
    return json.loads(raw.text), raw.headers


def cache_entries(url: str) -> int:
    return admin(url, "GET", "/admin/status").json()["cache_entries"]


def test_seed_flow_answers_from_three_chunks_and_freshness_follows_each_chunk(stack):
    url, config, client = stack["url"], stack["config"], stack["client"]
    report = json.loads(cli("gateway", "index", "add", "hr-policy", str(stack["docs"]), "--config", config))
    assert report["version"] == "1" and len(report["added"]) == 4

    body, headers = ask(client, SEED)
    trace = trace_of(url, headers["x-gateway-trace-id"])
    assert headers["x-gateway-cache"] == "miss" and headers["x-gateway-tier"] == "small"
    assert trace["tier"] == "small" and trace["classifier_score"] < 0.5
    assert trace["speculative"] is None  # a retrieval route never speculates: the early call lacks the chunks
    sources = body["sources"]
    assert len(sources) == 3 and all(s["document"] == "hr/leave/germany.md" for s in sources)
    assert [s["chunk"] for s in sources] == [c["chunk"] for c in trace["retrieval"]]
    assert headers["x-gateway-sources"].count("hr/leave/germany.md#") == 3
    assert body["choices"][0]["message"]["content"]
    # The chunks reached the model: the same question without retrieval is a much shorter prompt.
    _, plain_headers = ask(client, SEED, model="plain", extra_body={"cache": False})
    plain = trace_of(url, plain_headers["x-gateway-trace-id"])
    assert trace["prompt_tokens"] > plain["prompt_tokens"] + 100

    wait_for(lambda: cache_entries(url) >= 1, 30, "the answer to be cached")
    again, headers = ask(client, PARAPHRASE)
    hit = trace_of(url, headers["x-gateway-trace-id"])
    assert headers["x-gateway-cache"] == "hit" and hit["cache_similarity"] >= 0.95 and hit["attempts"] == []
    assert again["choices"] == body["choices"] and again["sources"] == sources
    assert headers["x-gateway-sources"].count("hr/leave/germany.md#") == 3

    hotel, _ = ask(client, HOTEL)
    assert [s["document"] for s in hotel["sources"]] == ["hr/expenses.md"]  # min_score keeps the rest out
    wait_for(lambda: cache_entries(url) >= 2, 30, "the hotel answer to be cached")

    # The parental-leave document changes: one of the three chunks the cached answer was built from.
    page = stack["docs"] / "leave" / "germany.md"
    page.write_text(page.read_text().replace("80 percent of your net salary", "90 percent of your net salary"))
    report = json.loads(cli("gateway", "index", "add", "hr-policy", str(stack["docs"]), "--config", config))
    assert report["version"] == "2" and report["updated"] == ["hr/leave/germany.md"] and report["chunks_embedded"] == 1

    fresh, headers = ask(client, SEED)
    trace = trace_of(url, headers["x-gateway-trace-id"])
    assert headers["x-gateway-cache"] == "stale" and "germany.md" in trace["stale_reason"]
    assert len(fresh["sources"]) == 3 and fresh["sources"] != sources  # the edited chunk has a new hash
    assert "Pay during parental leave" in trace["stale_reason"] and trace["attempts"][0]["status"] == "200"
    assert any("90 percent" in admin(url, "POST", "/admin/index/hr-policy/search", json={"query": SEED, "k": 3})
               .json()["data"][i]["text"] for i in range(3))
    _, headers = ask(client, HOTEL)  # built only from expenses.md, which did not change
    assert headers["x-gateway-cache"] == "hit"

    # A streamed answer names its chunks in the first event, relayed or replayed from the cache.
    for question, expected in (("Can I work from another country for a few weeks?", "miss"), (HOTEL, "hit")):
        with client.chat.completions.with_streaming_response.create(
                model="hr-rag", messages=[{"role": "user", "content": question}], max_tokens=12, temperature=0,
                stream=True) as response:
            assert response.headers["x-gateway-cache"] == expected and response.headers["x-gateway-sources"]
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        assert events[0]["sources"] and all("sources" not in e for e in events[1:])


def test_index_admin_api_and_bad_input_leave_the_index_unharmed(stack):
    url = stack["url"]
    if admin(url, "GET", "/admin/index").json()["data"].get("hr-policy") is None:
        cli("gateway", "index", "add", "hr-policy", str(stack["docs"]), "--config", stack["config"])
    before = admin(url, "GET", "/admin/index").json()["data"]["hr-policy"]
    documents = admin(url, "GET", "/admin/index/hr-policy").json()["documents"]

    bad = [
        ({"documents": [{"name": "empty.md", "content": ""}]}, "empty"),
        ({"documents": [{"name": "bin.txt", "content_base64": "AAECAwQFBgcICQ=="}]}, "binary"),
        ({"documents": [{"name": "latin1.md", "content_base64": "R3L832UgYXVzIEv2bG4="}]}, "UTF-8"),
        ({"documents": [{"name": "x.md", "content_base64": "not base64!"}]}, "documents[0]"),
        ({"documents": [{"name": "x.pdf", "content": "text"}]}, "x.pdf"),
        ({"documents": [{"name": "x.md"}]}, "exactly one"),
        ({"documents": []}, "documents"),
        ({"documents": [{"name": "ok.md", "content": "# Fine\n\ntext"}, {"name": "e.md", "content": " "}]}, "e.md"),
    ]
    for body, words in bad:
        response = admin(url, "POST", "/admin/index/hr-policy/documents", json=body)
        assert response.status_code == 400, (body, response.text)
        assert words in response.json()["error"]["message"]
    long_query = admin(url, "POST", "/admin/index/hr-policy/search", json={"query": "leave " * 400})
    assert long_query.status_code == 400 and "encoder" in long_query.json()["error"]["message"]
    for method, path, body in (("POST", "/admin/index/nope/search", {"query": "x"}), ("GET", "/admin/index/nope", None),
                               ("DELETE", "/admin/index/nope", None),
                               ("DELETE", "/admin/index/hr-policy/documents/not-there.md", None)):
        response = admin(url, method, path, json=body)
        assert response.status_code == 404 and response.json()["error"]["code"] == "source_not_found", path
    assert httpx.get(url + "/admin/index", timeout=10).status_code == 401
    assert admin(url, "GET", "/admin/index").json()["data"]["hr-policy"] == before
    assert admin(url, "GET", "/admin/index/hr-policy").json()["documents"] == documents

    added = admin(url, "POST", "/admin/index/hr-policy/documents", json={"documents": [
        {"name": "api/bike.md", "content": "# Bike leasing\n\nAcme leases one bicycle per employee, up to 4000 EUR."}]})
    assert added.status_code == 200 and added.json()["added"] == ["api/bike.md"]
    found = admin(url, "POST", "/admin/index/hr-policy/search", json={"query": "Can I lease an e-bike?", "k": 1}).json()
    assert found["data"][0]["document"] == "api/bike.md" and found["version"] == added.json()["version"]
    gone = admin(url, "DELETE", "/admin/index/hr-policy/documents/api/bike.md")
    assert gone.status_code == 200 and gone.json()["removed"] == ["api/bike.md"]
    listed = json.loads(cli("gateway", "index", "list", "hr-policy", "--config", stack["config"]))
    assert sorted(listed) == sorted(documents)
