"""The gateway end to end, all real processes: two `pagedserve serve` replicas (primary behind a
fault-injecting proxy, and a fallback), `pagedserve gateway` instances, redis-server, the official
openai client, and an OTLP receiver.

The seed scenario: "What's our parental leave policy in Germany?" passes auth, rate limit and budget
(spent $0.40 of $2), meets a 0.97-similar cached answer that is stale because the HR policy index
changed, is routed to the small model by the classifier, answered by the primary with a 20 s timeout and
a fallback configured, recorded to the trace, and cached against today's version. Then its failing
variant: the primary returns 529; the gateway retries once, falls back, the breaker opens, and it
recovers when the primary does.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from zoneinfo import ZoneInfo

import httpx
import openai
import pytest
from gateway_support import (
    cli,
    fault_proxy,
    free_port,
    gateway,
    pagedserve_server,
    redis_server,
    set_fault,
    start_all,
    wait_for,
)

from pagedserve.gateway.budget import BudgetKeeper
from pagedserve.gateway.gateway_config import BudgetConfig
from pagedserve.gateway.store import NANO, SQLiteStore

pytestmark = pytest.mark.slow

ADMIN = "admin-secret"
SEED = "What's our parental leave policy in Germany?"
PRICES = {"small": {"input": 100.0, "output": 400.0, "cached_input": 50.0},
          "large": {"input": 300.0, "output": 1500.0, "cached_input": 150.0}}


class OTLPReceiver:
    """A real HTTP endpoint that accepts OTLP/HTTP protobuf trace exports."""

    def __init__(self):
        self.bodies: list[bytes] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                receiver.bodies.append(self.rfile.read(int(self.headers["content-length"])))
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args):
                pass
        self.server = HTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self) -> list:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        out = []
        for body in self.bodies:
            request = ExportTraceServiceRequest.FromString(body)
            for rs in request.resource_spans:
                for ss in rs.scope_spans:
                    out.extend(ss.spans)
        return out


@pytest.fixture(scope="module")
def upstreams(tmp_path_factory):
    """Primary (behind the fault proxy) and fallback pagedserve servers, and the served model's name."""
    tmp = tmp_path_factory.mktemp("upstreams")
    primary, primary_url = pagedserve_server("primary", tmp)
    fallback, fallback_url = pagedserve_server("fallback", tmp)
    with contextlib.ExitStack() as stack:
        start_all(stack, primary, fallback)
        proxy, proxy_url = fault_proxy("proxy", primary_url, tmp)
        stack.enter_context(proxy)
        model = httpx.get(fallback_url + "/v1/models", timeout=10).json()["data"][0]["id"]
        warm = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        for url in (primary_url, fallback_url):  # the first decode builds kernels: over a 20 s timeout on busy cores
            httpx.post(url + "/v1/chat/completions", json=warm, timeout=600).raise_for_status()
        yield {"proxy": proxy_url, "fallback": fallback_url, "model": model}


def gateway_config(upstreams: dict, **extra) -> dict:
    def models() -> dict:
        return {alias: {"name": upstreams["model"], **price} for alias, price in PRICES.items()}
    config = {
        "timezone": "Europe/Berlin",
        "budgets": {"user_daily_usd": 2.0},
        "max_body_bytes": 65536,
        "key_defaults": {"rpm": 300},
        "retry": {"attempts_per_provider": 2, "backoff_s": 0.05},
        "breaker": {"failure_threshold": 3, "reset_s": 6.0},  # long enough for two calls on loaded cores
        "providers": {
            "primary": {"base_url": upstreams["proxy"] + "/v1", "timeout_s": 20, "models": models()},
            "fallback": {"base_url": upstreams["fallback"] + "/v1", "timeout_s": 20, "models": models()},
        },
        "routes": {
            "hr-assistant": {"small": ["primary/small", "fallback/small"], "large": ["primary/large", "fallback/large"],
                             "sources": ["hr-policy"]},
            "hr-fast": {"small": ["primary/small", "fallback/small"], "large": ["primary/large", "fallback/large"],
                        "sources": ["hr-policy"], "speculate": True},
            "legal-assistant": {"small": ["primary/small"]},
        },
    }
    config.update(extra)
    return config


def admin_get(url: str, path: str) -> dict:
    response = httpx.get(url + path, headers={"authorization": f"Bearer {ADMIN}"}, timeout=10)
    response.raise_for_status()
    return response.json()


def trace_of(url: str, trace_id: str) -> dict:
    return next(t for t in admin_get(url, "/admin/traces?limit=50")["data"] if t["trace_id"] == trace_id)


def ask(client: openai.OpenAI, question: str, **kwargs):
    """One chat call through the gateway; returns (answer text, headers)."""
    raw = client.chat.completions.with_raw_response.create(
        model=kwargs.pop("model", "hr-assistant"), messages=[{"role": "user", "content": question}],
        max_tokens=kwargs.pop("max_tokens", 8), temperature=kwargs.pop("temperature", 0), **kwargs)
    return raw.parse().choices[0].message.content, raw.headers


def wait_cache_entries(url: str, n: int) -> None:
    wait_for(lambda: admin_get(url, "/admin/status")["cache_entries"] >= n, 30, f"{n} cache entries")


def expected_cost(trace: dict, tier: str) -> float:
    p = PRICES[tier]
    fresh = trace["prompt_tokens"] - trace["cached_tokens"]
    return (fresh * p["input"] + trace["cached_tokens"] * p["cached_input"] + trace["completion_tokens"] * p["output"]) / 1e6


@pytest.fixture(scope="module")
def seed_gateway(upstreams, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("seed")
    receiver = OTLPReceiver()
    config = gateway_config(upstreams, otlp_endpoint=receiver.url)
    probe = disagreement()  # hr-fast's threshold sits between its guess and its score
    config["routes"]["hr-fast"]["hard_threshold"] = probe[1]
    process, url = gateway("seed-gw", config, tmp, ADMIN)
    config_path = tmp / "seed-gw.yaml"
    with process:
        key = json.loads(cli("gateway", "keys", "create", "--config", str(config_path), "--user", "alice",
                             "--team", "hr", "--models", "hr-assistant", "--rpm", "600"))
        yield {"url": url, "key": key, "config": config_path, "tmp": tmp, "process": process, "otlp": receiver,
               "disagreement": probe}


def test_seed_scenario_end_to_end(seed_gateway):
    url, config = seed_gateway["url"], str(seed_gateway["config"])
    client = openai.OpenAI(base_url=url + "/v1", api_key=seed_gateway["key"]["key"], max_retries=0)
    key_id = seed_gateway["key"]["key_id"]

    # Last week: the HR policy index is at version 1 and a paraphrase of the question was answered and cached.
    assert "version 1" in cli("gateway", "sources", "bump", "hr-policy", "--config", config)
    _, headers = ask(client, "What is our parental leave policy in Germany?")
    assert headers["x-gateway-cache"] == "miss"
    wait_cache_entries(url, 1)
    # Earlier today the user spent money: top the day's spend up to exactly $0.40.
    store = SQLiteStore(seed_gateway["tmp"] / "seed-gw-data" / "gateway.db")
    keeper = BudgetKeeper(store, ZoneInfo("Europe/Berlin"), BudgetConfig())
    spent = {r["scope"]: r["spend_usd"] for r in asyncio.run(keeper.usage(keeper.day()))}
    asyncio.run(store.add_spend(keeper.day(), ["user:alice"], round((0.40 - spent["user:alice"]) * NANO)))
    # Yesterday the HR policy index changed.
    assert "version 2" in cli("gateway", "sources", "bump", "hr-policy", "--config", config)

    answer, headers = ask(client, SEED)
    assert answer and headers["x-gateway-cache"] == "stale" and headers["x-gateway-tier"] == "small"
    assert headers["x-gateway-provider"] == "primary/small"
    assert int(headers["x-ratelimit-remaining-requests"]) < 600
    trace = trace_of(url, headers["x-gateway-trace-id"])
    # Gateway: auth, per-user rate limit, daily budget.
    assert (trace["key_id"], trace["user"], trace["team"]) == (key_id, "alice", "hr")
    assert trace["budget_spent_usd"] == pytest.approx(0.40) and trace["budget_limit_usd"] == 2.0
    # Cache: a semantic match above the 0.95 threshold ...
    assert 0.95 <= trace["cache_similarity"] < 1.0
    # ... Freshness: stale, because the HR policy changed since it was cached.
    assert trace["cache"] == "stale" and trace["stale_reason"] == "source hr-policy changed: cached against 1, now 2"
    # Route: the classifier says simple, so the small model.
    assert trace["tier"] == "small" and trace["classifier_score"] < 0.5 and not trace["pinned"]
    # Call: the primary answered on its first attempt (20 s timeout and a fallback configured).
    assert [(a["provider"], a["status"]) for a in trace["attempts"]] == [("primary", "200")]
    # Record: tokens, cost, latency, route and cache result.
    assert trace["prompt_tokens"] > 10 and 1 <= trace["completion_tokens"] <= 8
    assert trace["cost_usd"] == pytest.approx(expected_cost(trace, "small"), rel=1e-6)
    assert trace["latency_ms"] > 0 and trace["status"] == 200 and trace["sources"] == {"hr-policy": "2"}
    usage = {r["scope"]: r["spend_usd"] for r in admin_get(url, "/admin/usage")["data"]}
    assert usage["user:alice"] == pytest.approx(0.40 + trace["cost_usd"])

    # The answer was cached against today's version: the next asker gets it, fresh, for free.
    wait_cache_entries(url, 1)
    again, headers = ask(client, SEED)
    hit = trace_of(url, headers["x-gateway-trace-id"])
    assert again == answer and hit["cache"] == "hit" and hit["cost_usd"] == 0 and hit["attempts"] == []
    assert hit["sources"] == {"hr-policy": "2"}

    # A hard question goes to the large model.
    _, headers = ask(client, "Compare the tax treatment of employee stock options in Germany and the US, and "
                             "design an equity policy that is fair to both groups.", extra_body={"cache": False})
    hard = trace_of(url, headers["x-gateway-trace-id"])
    assert hard["tier"] == "large" and hard["classifier_score"] >= 0.5 and hard["cache"] == "bypass"
    assert hard["cost_usd"] == pytest.approx(expected_cost(hard, "large"), rel=1e-6)
    # A request may pin its tier.
    _, headers = ask(client, SEED, extra_body={"route": "large", "cache": False})
    pinned = trace_of(url, headers["x-gateway-trace-id"])
    assert pinned["tier"] == "large" and pinned["pinned"] and pinned["classifier_score"] is None

    rows = [json.loads(line) for line in cli("gateway", "traces", "--config", config, "--json", "--limit", "3").splitlines()]
    assert rows[0]["trace_id"] == pinned["trace_id"] and len(rows) == 3
    assert "stale" in cli("gateway", "traces", "--config", config, "--limit", "10")


def test_primary_529_retry_once_then_fallback_breaker_opens_and_recovers(seed_gateway, upstreams):
    url, proxy = seed_gateway["url"], upstreams["proxy"]
    client = openai.OpenAI(base_url=url + "/v1", api_key=seed_gateway["key"]["key"], max_retries=0)

    def attempts(question: str) -> list[tuple[str, str]]:
        answer, headers = ask(client, question, max_tokens=2, extra_body={"cache": False, "route": "small"})
        assert answer is not None
        return [(a["provider"], a["status"]) for a in trace_of(url, headers["x-gateway-trace-id"])["attempts"]]

    set_fault(proxy, "529")
    try:
        faulted = httpx.get(proxy + "/_fault").json()["faulted"]
        assert attempts("How many vacation days do I get?") == [("primary", "529"), ("primary", "529"),
                                                                ("fallback", "200")]
        # Third consecutive failure opens the breaker: the retry is not even sent.
        assert attempts("When are salaries paid?") == [("primary", "529"), ("primary", "circuit_open"),
                                                       ("fallback", "200")]
        assert admin_get(url, "/admin/status")["providers"]["primary"]["state"] == "open"
        assert attempts("Who approves overtime?") == [("primary", "circuit_open"), ("fallback", "200")]
        assert httpx.get(proxy + "/_fault").json()["faulted"] == faulted + 3  # no traffic while open
    finally:
        set_fault(proxy, "ok")
    # The primary recovers: after reset_s one probe goes through, succeeds, and closes the breaker.
    wait_for(lambda: attempts("What is the notice period?")[0] == ("primary", "200"), 30, "the half-open probe")
    assert admin_get(url, "/admin/status")["providers"]["primary"] == {"state": "closed", "failures": 0}


def test_streaming_passes_through_and_a_mid_stream_failure_is_an_error_not_a_splice(seed_gateway, upstreams):
    url, proxy = seed_gateway["url"], upstreams["proxy"]
    client = openai.OpenAI(base_url=url + "/v1", api_key=seed_gateway["key"]["key"], max_retries=0)
    messages = [{"role": "user", "content": "Name a colour."}]
    whole = client.chat.completions.create(model="hr-assistant", messages=messages, max_tokens=8, temperature=0,
                                           extra_body={"cache": False})
    chunks = list(client.chat.completions.create(model="hr-assistant", messages=messages, max_tokens=8,
                                                 temperature=0, stream=True, extra_body={"cache": False},
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    wait_for(lambda: admin_get(url, "/admin/traces?limit=1")["data"][0]["stream"], 10, "the stream's trace")
    traces = admin_get(url, "/admin/traces?limit=1")["data"]
    assert traces[0]["completion_tokens"] == whole.usage.completion_tokens and traces[0]["cost_usd"] > 0

    set_fault(proxy, "cut")
    try:
        stream = iter(client.chat.completions.create(model="hr-assistant", messages=messages, max_tokens=8,
                                                     temperature=0, stream=True, extra_body={"cache": False}))
        assert next(stream).choices  # the first event reached the client ...
        with pytest.raises(openai.APIError, match="failed after the stream started"):
            next(stream)  # ... and the next thing it sees is the error, not another provider's text
    finally:
        set_fault(proxy, "ok")
    wait_for(lambda: admin_get(url, "/admin/traces?limit=1")["data"][0]["status"] == 502, 10, "the failed trace")
    failed = admin_get(url, "/admin/traces?limit=1")["data"][0]
    assert [(a["provider"], a["status"]) for a in failed["attempts"]] == [("primary", "200")]


def disagreement() -> tuple[str, float, str]:
    """A request on which the lexical guess and the embedding classifier are far apart (the gateway trains
    the same classifier from the same labelled set, deterministically), a hard_threshold between the two
    scores, and the tier the classifier then picks."""
    import torch

    from pagedserve.embedding import Embedder
    from pagedserve.gateway import classify
    from pagedserve.gateway.semantic_cache import normalise

    torch.set_num_threads(1)
    embedder = Embedder.load().fast()
    model = classify.train(embedder, classify.load_examples())
    candidates = ["Summary of my leave balance?", "I need the HR email.", "My manager's manager?",
                  "Thoughts on the new office?", "Overtime rules.", "Anything new about the bonus?"]
    gaps = []
    for text in candidates:
        query = normalise(text)
        score, guess = model.score(query, embedder.embed([query])[0]), model.guess(query)
        gaps.append((abs(score - guess), text, score, guess))
    gap, text, score, guess = max(gaps)
    threshold = round((score + guess) / 2, 4)
    assert gap >= 0.1 and 0.15 <= threshold <= 0.85, gaps
    return text, threshold, "large" if score >= threshold else "small"


def test_speculative_call_is_used_on_a_miss_and_aborted_on_a_hit_or_a_different_verdict(seed_gateway, upstreams):
    url, proxy = seed_gateway["url"], upstreams["proxy"]
    key = json.loads(cli("gateway", "keys", "create", "--config", str(seed_gateway["config"]), "--user", "carol",
                         "--team", "ops", "--models", "hr-fast"))
    client = openai.OpenAI(base_url=url + "/v1", api_key=key["key"], max_retries=0)
    question = "How many days of sick leave do I get in France?"
    entries = admin_get(url, "/admin/status")["cache_entries"]

    # A miss: the small tier's call was already in flight while the query was embedded and looked up.
    answer, headers = ask(client, question, model="hr-fast")
    miss = trace_of(url, headers["x-gateway-trace-id"])
    assert (miss["cache"], miss["tier"], miss["speculative"]) == ("miss", "small", "used")
    assert [(a["provider"], a["status"]) for a in miss["attempts"]] == [("primary", "200")]
    assert miss["cost_usd"] == pytest.approx(expected_cost(miss, "small"), rel=1e-6)
    wait_cache_entries(url, entries + 1)

    # Hits on paraphrases, plain and streamed, while the primary hangs: the answer comes from the cache at once,
    # and both speculative calls, which reached the provider before the lookup began, are dropped (the provider
    # sees its caller go away) without counting against the breaker.
    set_fault(proxy, "hang")
    try:
        before = httpx.get(proxy + "/_fault").json()
        again, headers = ask(client, "how many days of sick leave do i get in france", model="hr-fast")
        assert again == answer and headers["x-gateway-cache"] == "hit"
        chunks = list(client.chat.completions.create(
            model="hr-fast", messages=[{"role": "user", "content": "How many days of sick leave do I get in France?!"}],
            max_tokens=8, temperature=0, stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer

        def all_abandoned() -> bool:
            now = httpx.get(proxy + "/_fault").json()
            return now["requests"] - before["requests"] == now["abandoned"] - before["abandoned"] == 2
        wait_for(all_abandoned, 20, "the proxy to see the speculative calls abandoned")
    finally:
        set_fault(proxy, "ok")
    hits = admin_get(url, "/admin/traces?limit=2")["data"]
    assert [(t["cache"], t["speculative"], t["cost_usd"], t["attempts"]) for t in hits] == \
        [("hit", "cancelled (cache hit)", 0, [])] * 2
    assert admin_get(url, "/admin/status")["providers"]["primary"]["state"] == "closed"

    # A hard question: the lexical guess already says large, so the early call was the right one.
    _, headers = ask(client, "Compare the parental leave rules of Germany and France and design a policy that "
                             "treats both offices fairly.", model="hr-fast")
    hard = trace_of(url, headers["x-gateway-trace-id"])
    assert (hard["tier"], hard["speculative"]) == ("large", "used")
    assert hard["cost_usd"] == pytest.approx(expected_cost(hard, "large"), rel=1e-6)
    # Where the guess and the classifier disagree, the early call is cancelled and only the chosen tier is charged.
    text, _, tier = seed_gateway["disagreement"]
    _, headers = ask(client, text, model="hr-fast")
    wrong = trace_of(url, headers["x-gateway-trace-id"])
    assert (wrong["tier"], wrong["speculative"]) == (tier, f"cancelled ({tier} tier)")
    assert wrong["cost_usd"] == pytest.approx(expected_cost(wrong, tier), rel=1e-6)

    # The provider's own 4xx on a speculative call passes through as it would on a serial one.
    rejected = httpx.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {key['key']}"}, timeout=30,
                          json={"model": "hr-fast", "messages": [{"role": "user", "content": "What time is lunch?"}],
                                "max_tokens": 2, "top_p": 5, "cache": False})
    assert rejected.status_code == 400 and rejected.json()["error"]["message"]
    trace = admin_get(url, "/admin/traces?limit=1")["data"][0]
    assert trace["speculative"] == "used" and [(a["provider"], a["status"]) for a in trace["attempts"]] == [
        ("primary", "400")]

    # Streamed miss: the early stream is the one relayed.
    chunks = list(client.chat.completions.create(model="hr-fast", messages=[{"role": "user", "content": "Name a fruit."}],
                                                 max_tokens=6, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    wait_for(lambda: admin_get(url, "/admin/traces?limit=1")["data"][0]["stream"], 10, "the stream's trace")
    assert admin_get(url, "/admin/traces?limit=1")["data"][0]["speculative"] == "used"


def test_bad_input_gets_4xx_in_openai_error_shape(seed_gateway):
    url, token = seed_gateway["url"], seed_gateway["key"]["key"]
    auth = {"authorization": f"Bearer {token}"}
    chat = url + "/v1/chat/completions"
    ok_body = {"model": "hr-assistant", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [
        (httpx.post(chat, content=b'{"model": "hr-assistant", "messages": [', headers=auth), 400, "invalid_json"),
        (httpx.post(chat, json=[1, 2], headers=auth), 400, "invalid_json"),
        (httpx.post(chat, json={"model": "hr-assistant"}, headers=auth), 400, "invalid_value"),
        (httpx.post(chat, json={**ok_body, "messages": []}, headers=auth), 400, "invalid_value"),
        (httpx.post(chat, json={**ok_body, "temperature": 7}, headers=auth), 400, "invalid_value"),
        (httpx.post(chat, json={**ok_body, "model": "gpt-9"}, headers=auth), 404, "model_not_found"),
        (httpx.post(chat, json={**ok_body, "model": "legal-assistant"}, headers=auth), 403, "model_not_allowed"),
        (httpx.post(chat, json={**ok_body, "padding": "x" * 70000}, headers=auth), 413, "request_too_large"),
        (httpx.post(chat, json=ok_body), 401, "missing_api_key"),
        (httpx.post(chat, json=ok_body, headers={"authorization": "Bearer sk-ps-wrong"}), 401, "invalid_api_key"),
        (httpx.get(url + "/admin/keys", headers=auth), 401, "invalid_admin_key"),
        (httpx.get(url + "/v1/nothing-here", headers=auth), 404, None),
    ]
    for response, status, code in cases:
        error = response.json()["error"]
        assert response.status_code == status, (status, response.text)
        assert set(error) == {"message", "type", "param", "code"} and error["message"] and error["code"] == code
    # The provider's own 4xx passes through in the same shape, and is not a reason to fall back.
    response = httpx.post(chat, json={**ok_body, "top_p": 5, "cache": False}, headers=auth, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["message"]
    trace = trace_of(url, admin_get(url, "/admin/traces?limit=1")["data"][0]["trace_id"])
    assert [(a["provider"], a["status"]) for a in trace["attempts"]] == [("primary", "400")]
    # Revoked keys stop working at once.
    created = httpx.post(url + "/admin/keys", json={"user": "mallory"}, headers={"authorization": f"Bearer {ADMIN}"})
    new = created.json()
    assert httpx.post(chat, json=ok_body, headers={"authorization": f"Bearer {new['key']}"}, timeout=30).status_code == 200
    httpx.delete(url + f"/admin/keys/{new['key_id']}", headers={"authorization": f"Bearer {ADMIN}"}).raise_for_status()
    revoked = httpx.post(chat, json=ok_body, headers={"authorization": f"Bearer {new['key']}"})
    assert revoked.status_code == 401 and "revoked" in revoked.json()["error"]["message"]
    models = httpx.get(url + "/v1/models", headers=auth).json()
    assert [m["id"] for m in models["data"]] == ["hr-assistant"]


def test_completions_residency_and_key_cli(seed_gateway, upstreams):
    url, config = seed_gateway["url"], str(seed_gateway["config"])
    created = json.loads(cli("gateway", "keys", "create", "--config", config, "--user", "eve", "--team", "legal",
                             "--residency", "eu"))
    listed = {k["key_id"]: k for k in json.loads(cli("gateway", "keys", "list", "--config", config))}
    assert listed[created["key_id"]]["residency"] == "eu" and listed[created["key_id"]]["revoked_at"] is None
    assert all("key_hash" not in k and "key" not in k for k in listed.values())
    client = openai.OpenAI(base_url=url + "/v1", api_key=created["key"], max_retries=0)
    raw = client.completions.with_raw_response.create(model="hr-assistant", prompt="The capital of France is",
                                                      max_tokens=4, temperature=0)
    assert raw.parse().choices[0].text and raw.headers["x-ratelimit-limit-requests"] == "300"  # key_defaults
    seen = httpx.get(upstreams["proxy"] + "/_fault").json()["last_headers"]
    assert seen["x-residency"] == "eu" and seen["x-request-id"] == raw.headers["x-gateway-trace-id"]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="hr-assistant", prompt="The capital of France is", max_tokens=4, temperature=0, stream=True) if c.choices)
    assert streamed == raw.parse().choices[0].text  # greedy: the same text, whether cached or generated
    assert f"revoked {created['key_id']}" in cli("gateway", "keys", "revoke", created["key_id"], "--config", config)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model="hr-assistant", prompt="hi", max_tokens=1)


def test_structured_outputs_and_tools_pass_through_and_scope_the_cache(seed_gateway):
    url, config = seed_gateway["url"], str(seed_gateway["config"])
    created = json.loads(cli("gateway", "keys", "create", "--config", config, "--user", "sam", "--team", "hr"))
    client = openai.OpenAI(base_url=url + "/v1", api_key=created["key"], max_retries=0)
    schema = {"type": "object", "additionalProperties": False, "required": ["weeks"],
              "properties": {"weeks": {"type": "integer", "minimum": 0, "maximum": 52}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "leave", "schema": schema, "strict": True}}
    question = "How many weeks of parental leave do employees in Spain get?"
    entries = admin_get(url, "/admin/status")["cache_entries"]
    answer, headers = ask(client, question, response_format=fmt, max_tokens=24)
    assert headers["x-gateway-cache"] == "miss" and json.loads(answer)["weeks"] in range(53)
    wait_cache_entries(url, entries + 1)
    free, headers = ask(client, question, max_tokens=24)  # the same words without JSON mode: another scope
    assert headers["x-gateway-cache"] == "miss" and free != answer
    again, headers = ask(client, question, response_format=fmt, max_tokens=24)
    assert headers["x-gateway-cache"] == "hit" and again == answer
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "required": ["city"], "properties": {"city": {"type": "string", "maxLength": 20}}}}}
    entries = admin_get(url, "/admin/status")["cache_entries"]
    for stream in (False, True, False):  # a call is never cached: each one reaches the model
        raw = client.chat.completions.with_raw_response.create(
            model="hr-assistant", messages=[{"role": "user", "content": "Weather in Berlin?"}], tools=[weather],
            tool_choice="required", parallel_tool_calls=False, max_tokens=40, temperature=0, stream=stream)
        assert raw.headers["x-gateway-cache"] == "miss"
        if stream:
            deltas = [d for c in raw.parse() if c.choices for d in c.choices[0].delta.tool_calls or []]
            name, arguments = deltas[0].function.name, "".join(d.function.arguments or "" for d in deltas)
        else:
            call = raw.parse().choices[0].message.tool_calls[0]
            name, arguments = call.function.name, call.function.arguments
        assert name == "get_weather" and isinstance(json.loads(arguments)["city"], str)
    ask(client, "How many vacation days do employees in Spain get?", max_tokens=8)
    wait_cache_entries(url, entries + 1)  # remembered after the calls' answers were (or were not)
    assert admin_get(url, "/admin/status")["cache_entries"] == entries + 1


def test_restart_keeps_spend_and_spans_were_exported(seed_gateway):
    url, process = seed_gateway["url"], seed_gateway["process"]
    before = {r["scope"]: r["spend_usd"] for r in admin_get(url, "/admin/usage")["data"]}
    assert before["user:alice"] > 0.40
    process.__exit__()  # SIGTERM: the gateway shuts down and flushes its spans
    spans = seed_gateway["otlp"].spans()
    names = {s.name for s in spans}
    assert {"gateway.request", "gateway.provider_call"} <= names
    stale = [s for s in spans if s.name == "gateway.request"
             and any(a.key == "gateway.cache" and a.value.string_value == "stale" for a in s.attributes)]
    assert stale, "the seed request's span carries its cache verdict"
    process.start().wait_ready()  # the module fixture stops it
    after = {r["scope"]: r["spend_usd"] for r in admin_get(url, "/admin/usage")["data"]}
    assert after == before
    client = openai.OpenAI(base_url=url + "/v1", api_key=seed_gateway["key"]["key"], max_retries=0)
    _, headers = ask(client, SEED)
    trace = trace_of(url, headers["x-gateway-trace-id"])
    assert trace["cache"] == "hit"  # the cache survived too
    assert trace["budget_spent_usd"] == pytest.approx(before["user:alice"])


def test_two_gateways_sharing_redis_enforce_one_limit_and_one_budget(upstreams, tmp_path):
    redis_process, redis_url = redis_server(tmp_path)
    # Provider timeout 1.5 s: used below to check a hung primary is abandoned and the fallback answers.
    config = gateway_config(upstreams, store=redis_url)
    config["providers"]["primary"]["timeout_s"] = 1.5
    with contextlib.ExitStack() as stack:
        stack.enter_context(redis_process)
        a, url_a = gateway("gw-a", config, tmp_path, ADMIN)
        b, url_b = gateway("gw-b", config, tmp_path, ADMIN)
        start_all(stack, a, b)
        config_path = str(tmp_path / "gw-a.yaml")
        limited = json.loads(cli("gateway", "keys", "create", "--config", config_path, "--user", "rita", "--rpm", "4"))
        statuses, retry_after = [], []
        for i in range(8):
            response = httpx.post((url_a, url_b)[i % 2] + "/v1/chat/completions", timeout=30,
                                  headers={"authorization": f"Bearer {limited['key']}"},
                                  json={"model": "hr-assistant", "messages": [{"role": "user", "content": f"Say {i}"}],
                                        "max_tokens": 1, "cache": False, "route": "small"})
            statuses.append(response.status_code)
            if response.status_code == 429:
                assert response.json()["error"]["code"] == "rate_limit_exceeded"
                assert response.headers["x-ratelimit-remaining-requests"] == "0"
                retry_after.append(int(response.headers["retry-after"]))
        assert statuses.count(200) == 4 and statuses.count(429) == 4  # one limit of 4, not 4 per instance
        assert all(1 <= r <= 15 for r in retry_after)

        # One daily budget: ~$0.03 a request (each holds its ~$0.1 worst case) against $0.2, spent alternately
        # through both instances.
        cheap = json.loads(cli("gateway", "keys", "create", "--config", config_path, "--user", "bo", "--daily-budget",
                               "0.2", "--store", redis_url))
        codes = []
        for i in range(8):
            response = httpx.post((url_a, url_b)[i % 2] + "/v1/chat/completions", timeout=30,
                                  headers={"authorization": f"Bearer {cheap['key']}"},
                                  json={"model": "hr-assistant", "cache": False, "route": "large", "max_tokens": 1,
                                        "messages": [{"role": "user", "content": "Reply with the word yes " * 10}]})
            codes.append(response.status_code)
        assert codes[:2] == [200, 200] and codes[-1] == 429
        assert "daily budget of key" in response.json()["error"]["message"]
        assert response.json()["error"]["type"] == "insufficient_quota"
        spend = {r["scope"]: r["spend_usd"] for r in admin_get(url_b, "/admin/usage")["data"]}
        costs = [t["cost_usd"] for u in (url_a, url_b) for t in admin_get(u, "/admin/traces?user=bo")["data"]]
        # Real cost is settled against a worst-case hold: the limit is never passed.
        assert spend["user:bo"] == pytest.approx(sum(costs)) and 0.04 < spend["user:bo"] <= 0.2

        # A hung primary: each attempt is cut at its 1.5 s deadline, then the fallback answers.
        free = json.loads(cli("gateway", "keys", "create", "--config", config_path, "--user", "tim"))
        set_fault(upstreams["proxy"], "hang")
        try:
            start = time.monotonic()
            response = httpx.post(url_a + "/v1/chat/completions", timeout=30,
                                  headers={"authorization": f"Bearer {free['key']}"},
                                  json={"model": "hr-assistant", "messages": [{"role": "user", "content": "hello"}],
                                        "max_tokens": 1, "cache": False, "route": "small"})
        finally:
            set_fault(upstreams["proxy"], "ok")
        assert response.status_code == 200 and time.monotonic() - start < 10
        trace = trace_of(url_a, response.headers["x-gateway-trace-id"])
        assert [(x["provider"], x["status"]) for x in trace["attempts"]] == [
            ("primary", "timeout"), ("primary", "timeout"), ("fallback", "200")]
        assert all(1.4 <= x["latency_ms"] / 1000 <= 3.0 for x in trace["attempts"][:2])

        # Without its shared store the gateway cannot check limits: it refuses (fails closed), clearly.
        redis_process.__exit__()
        response = httpx.post(url_b + "/v1/chat/completions", timeout=30, headers={"authorization": f"Bearer {free['key']}"},
                              json={"model": "hr-assistant", "messages": [{"role": "user", "content": "hi"}]})
        assert response.status_code == 503 and response.json()["error"]["code"] == "store_unavailable"
