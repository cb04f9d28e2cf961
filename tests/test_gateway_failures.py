"""What the gateway promises when providers fail, about what it caches, and about its SQLite state after a
crash, checked against real `pagedserve gateway` processes. The providers are gateway_stub_provider.py
stand-ins (NOT pagedserve: a real server cannot be told to answer 500 or to hang on demand)."""
from __future__ import annotations

import contextlib
import threading
import time

import httpx
import pytest
from gateway_support import gateway, set_stub_mode, start_all, stub_provider, wait_for

ADMIN = "admin-secret"
ADMIN_AUTH = {"authorization": f"Bearer {ADMIN}"}
DEADLINE_S = 1.0  # retry.request_deadline_s: over every attempt of one request
PROVIDER_TIMEOUT_S = 30.0  # each provider's own deadline, far longer


def stub_model(base_url: str, **extra) -> dict:
    return {"base_url": base_url + "/v1", "models": {"small": {"name": "stub", **extra}}}


@pytest.fixture(scope="module")
def stubs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("stubs")
    a, a_url = stub_provider("stub-a", tmp)
    b, b_url = stub_provider("stub-b", tmp)
    with contextlib.ExitStack() as stack:
        start_all(stack, a, b)
        yield {"a": a_url, "b": b_url}


@pytest.fixture
def ok_stubs(stubs):
    """The stubs answer at once, before and after each test."""
    for url in stubs.values():
        set_stub_mode(url, "ok")
    yield stubs
    for url in stubs.values():
        set_stub_mode(url, "ok")


@pytest.fixture(scope="module")
def gw(stubs, tmp_path_factory):
    """One gateway; each test has routes over providers of its own, so breakers do not carry over."""
    tmp = tmp_path_factory.mktemp("failures")
    a, b = stubs["a"], stubs["b"]
    config = {
        "timezone": "UTC",
        "retry": {"attempts_per_provider": 2, "backoff_s": 0.01, "request_deadline_s": DEADLINE_S},
        "breaker": {"failure_threshold": 2, "reset_s": 600},
        "providers": {"a_down": stub_model(a), "b_down": stub_model(b),
                      "a_slow": {**stub_model(a), "timeout_s": PROVIDER_TIMEOUT_S},
                      "b_slow": {**stub_model(b), "timeout_s": PROVIDER_TIMEOUT_S},
                      "a_cached": stub_model(a)},
        "routes": {"down": {"small": ["a_down/small", "b_down/small"]},
                   "slow": {"small": ["a_slow/small", "b_slow/small"]},
                   "cached": {"small": ["a_cached/small"]}},
    }
    process, url = gateway("fail-gw", config, tmp, ADMIN)
    with process:
        created = httpx.post(url + "/admin/keys", json={"user": "pat"}, headers=ADMIN_AUTH, timeout=10)
        created.raise_for_status()
        yield {"url": url, "auth": {"authorization": f"Bearer {created.json()['key']}"}}


def chat(gw: dict, route: str, **extra) -> httpx.Response:
    body = {"model": route, "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 8, "temperature": 0, **extra}
    return httpx.post(gw["url"] + "/v1/chat/completions", json=body, headers=gw["auth"], timeout=60)


def asked(stub_url: str) -> int:
    return httpx.get(stub_url + "/_mode", timeout=5).json()["requests"]


def attempts(gw: dict, response: httpx.Response) -> list[tuple[str, str]]:
    trace_id = response.headers["x-gateway-trace-id"]
    traces = httpx.get(gw["url"] + "/admin/traces?limit=20", headers=ADMIN_AUTH, timeout=10).json()["data"]
    return [(a["provider"], a["status"]) for t in traces if t["trace_id"] == trace_id for a in t["attempts"]]


def spent(url: str, scope: str) -> float:
    rows = httpx.get(url + "/admin/usage", headers=ADMIN_AUTH, timeout=10).json()["data"]
    return sum(r["spend_usd"] for r in rows if r["scope"] == scope)


def test_every_provider_failing_is_502_and_every_breaker_open_is_503(gw, ok_stubs):
    for url in ok_stubs.values():
        set_stub_mode(url, "fail")
    before = {name: asked(url) for name, url in ok_stubs.items()}
    failed = chat(gw, "down")
    assert failed.status_code == 502, failed.text
    assert failed.json()["error"]["code"] == "providers_failed" and failed.json()["error"]["message"]
    # One retry per provider, then the fallback; two failures in a row open each breaker.
    assert attempts(gw, failed) == [("a_down", "500"), ("a_down", "500"), ("b_down", "500"), ("b_down", "500")]
    assert {name: asked(url) - before[name] for name, url in ok_stubs.items()} == {"a": 2, "b": 2}

    unavailable = chat(gw, "down")
    assert unavailable.status_code == 503, unavailable.text
    assert unavailable.json()["error"]["code"] == "providers_unavailable"
    assert attempts(gw, unavailable) == [("a_down", "circuit_open"), ("b_down", "circuit_open")]
    assert {name: asked(url) - before[name] for name, url in ok_stubs.items()} == {"a": 2, "b": 2}  # none sent
    status = httpx.get(gw["url"] + "/admin/status", headers=ADMIN_AUTH, timeout=10).json()["providers"]
    assert status["a_down"]["state"] == status["b_down"]["state"] == "open"
    assert spent(gw["url"], "user:pat") == 0  # nothing answered, nothing charged


def test_request_deadline_bounds_all_attempts_together(gw, ok_stubs):
    set_stub_mode(ok_stubs["a"], "hang")
    before_b = asked(ok_stubs["b"])
    start = time.monotonic()
    response = chat(gw, "slow")
    elapsed = time.monotonic() - start
    assert response.status_code == 502 and response.json()["error"]["code"] == "providers_failed", response.text
    # The one attempt is cut at the request's deadline, not the provider's 30 s; no time is left for the retry
    # or for the fallback provider, which is never asked.
    assert attempts(gw, response) == [("a_slow", "timeout")]
    assert asked(ok_stubs["b"]) == before_b
    assert DEADLINE_S <= elapsed < PROVIDER_TIMEOUT_S / 3, elapsed
    wait_for(lambda: httpx.get(ok_stubs["a"] + "/_mode", timeout=5).json()["abandoned"] >= 1, 10,
             "the hung provider to see its caller leave")


def test_only_deterministic_requests_are_cached(gw, ok_stubs):
    def cache_entries() -> int:
        return httpx.get(gw["url"] + "/admin/status", headers=ADMIN_AUTH, timeout=10).json()["cache_entries"]

    entries, calls = cache_entries(), asked(ok_stubs["a"])
    first = chat(gw, "cached")
    assert first.status_code == 200 and first.headers["x-gateway-cache"] == "miss"
    wait_for(lambda: cache_entries() == entries + 1, 10, "the greedy answer to be cached")
    assert chat(gw, "cached").headers["x-gateway-cache"] == "hit"
    assert asked(ok_stubs["a"]) == calls + 1
    # The same question sampled (however it is sampled) neither reads nor writes the cache: each is asked anew.
    sampled = [{"temperature": 0.7}, {"temperature": 0.7}, {"temperature": 0.7, "seed": 1},
               {"temperature": None}, {"n": 2}]
    for extra in sampled:
        response = chat(gw, "cached", **extra)
        assert response.status_code == 200 and response.headers["x-gateway-cache"] == "bypass", (extra, response.text)
    assert asked(ok_stubs["a"]) == calls + 1 + len(sampled)
    assert cache_entries() == entries + 1


def test_sqlite_keys_spend_and_holds_survive_kill_9(stubs, tmp_path):
    # $1,000 per million tokens: a 5-token answer costs $0.005; a request's worst-case hold is about $0.08, so a
    # $0.12 budget fits one hold beside the spend, not two.
    config = {"timezone": "UTC", "cache": {"enabled": False},
              "providers": {"stub": stub_model(stubs["a"], input=1000.0, output=1000.0)},
              "routes": {"priced": {"small": ["stub/small"]}}}
    process, url = gateway("crash-gw", config, tmp_path, ADMIN)
    with process, contextlib.ExitStack() as cleanup:
        cleanup.callback(set_stub_mode, stubs["a"], "ok")
        set_stub_mode(stubs["a"], "ok")
        keys = {}
        for user, budget in (("kim", 0.12), ("lee", None), ("max", None)):
            body = {"user": user} | ({"daily_budget_usd": budget} if budget else {})
            keys[user] = httpx.post(url + "/admin/keys", json=body, headers=ADMIN_AUTH, timeout=10).json()

        def ask(user: str) -> httpx.Response:
            return httpx.post(url + "/v1/chat/completions", headers={"authorization": f"Bearer {keys[user]['key']}"},
                              json={"model": "priced", "messages": [{"role": "user", "content": "hi"}],
                                    "max_tokens": 8}, timeout=60)
        assert ask("kim").status_code == 200
        wait_for(lambda: spent(url, "user:kim") == pytest.approx(0.005), 10, "the answer to be charged")
        httpx.delete(url + f"/admin/keys/{keys['max']['key_id']}", headers=ADMIN_AUTH, timeout=10).raise_for_status()
        # A request in flight when the gateway dies: its hold was written before the provider was asked.
        set_stub_mode(stubs["a"], "hang")
        asked_before = asked(stubs["a"])
        ended: list[Exception] = []

        def doomed() -> None:
            try:
                ask("kim")
            except httpx.HTTPError as e:
                ended.append(e)
        in_flight = threading.Thread(target=doomed, daemon=True)
        in_flight.start()
        wait_for(lambda: asked(stubs["a"]) > asked_before, 10, "the provider to be asked")

        process.process.kill()  # SIGKILL: no shutdown, no flush
        process.process.wait(10)
        in_flight.join(10)
        assert len(ended) == 1 and isinstance(ended[0], httpx.RemoteProtocolError)  # it died with the gateway
        set_stub_mode(stubs["a"], "ok")
        process.start().wait_ready()

        assert spent(url, "user:kim") == pytest.approx(0.005) and spent(url, f"key:{keys['kim']['key_id']}") > 0
        listed = {k["key_id"]: k for k in httpx.get(url + "/admin/keys", headers=ADMIN_AUTH, timeout=10).json()["data"]}
        assert {k["key_id"] for k in keys.values()} <= set(listed)
        assert listed[keys["max"]["key_id"]]["revoked_at"] is not None
        assert ask("lee").status_code == 200
        assert ask("max").status_code == 401
        # The dead request's hold still counts today (refusing a little early, never overspending).
        refused = ask("kim")
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["type"] == "insufficient_quota"
        assert "held by requests in flight" in refused.json()["error"]["message"]
        assert spent(url, "user:kim") == pytest.approx(0.005)  # refused: nothing charged
