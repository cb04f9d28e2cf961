"""Hostile and careless clients against real gateway processes: no 500 from any input, admin input
validated, a cache key that cannot be poisoned, a tpm that holds, providers that misbehave (a stand-in,
gateway_stub_provider.py, where a real pagedserve cannot misbehave that way), and Redis restarts."""
from __future__ import annotations

import contextlib
import json
import socket

import httpx
import pytest
from gateway_support import (
    cli,
    free_port,
    gateway,
    pagedserve_server,
    redis_server,
    set_stub_mode,
    start_all,
    stub_provider,
    wait_for,
)

pytestmark = pytest.mark.slow

ADMIN = "admin-secret"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hardening")
    engine, engine_url = pagedserve_server("hard-engine", tmp)
    stub, stub_url = stub_provider("hard-stub", tmp)
    with contextlib.ExitStack() as stack:
        start_all(stack, engine, stub)
        model = httpx.get(engine_url + "/v1/models", timeout=10).json()["data"][0]["id"]
        warm = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        # The first prefill and decode build the engine's kernels (a minute on busy cores): not the gateway's time.
        httpx.post(engine_url + "/v1/chat/completions", json=warm, timeout=600).raise_for_status()
        config = {"max_body_bytes": 65536, "timezone": "UTC", "retry": {"request_deadline_s": 120},
                  "providers": {"engine": {"base_url": engine_url + "/v1", "timeout_s": 120,
                                           "models": {"small": {"name": model}}},
                                "stub": {"base_url": stub_url + "/v1", "models": {"small": {"name": "stub"}}}},
                  "routes": {"real": {"small": ["engine/small"]}, "stub": {"small": ["stub/small"]}}}
        process, url = gateway("hard-gw", config, tmp, ADMIN)
        stack.enter_context(process)
        path = str(tmp / "hard-gw.yaml")
        keys = {name: json.loads(cli("gateway", "keys", "create", "--config", path, *args)) for name, args in {
            "alice": ["--user", "alice", "--team", "hr"], "bob": ["--user", "bob", "--team", "hr"],
            "carl": ["--user", "carl"], "dana": ["--user", "dana"],
            "tight": ["--user", "tom", "--tpm", "200"]}.items()}
        yield {"url": url, "stub": stub_url, "keys": keys, "process": process}


def post(stack, path: str, body, key: str = "alice", **kwargs) -> httpx.Response:
    headers = {"authorization": f"Bearer {stack['keys'][key]['key']}", **kwargs.pop("headers", {})}
    if isinstance(body, (bytes, str)) or hasattr(body, "__iter__") and not isinstance(body, dict):
        return httpx.post(stack["url"] + path, content=body, headers=headers, timeout=60, **kwargs)
    return httpx.post(stack["url"] + path, json=body, headers=headers, timeout=60, **kwargs)


def chat(messages: list, **extra) -> dict:
    return {"model": "real", "messages": messages, "max_tokens": 4, "temperature": 0, **extra}


def assert_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def cached(stack, body: dict, key: str = "alice", path: str = "/v1/chat/completions") -> str:
    response = post(stack, path, body, key)
    assert response.status_code == 200, response.text
    return response.headers["x-gateway-cache"]


def test_cache_key_covers_the_whole_conversation_every_part_and_the_endpoint(stack):
    user = {"role": "user", "content": QUESTION}
    assert cached(stack, chat([user])) == "miss"
    wait_for(lambda: cached(stack, chat([user])) == "hit", 30, "the answer to be cached")
    # Messages after the last user turn shape the answer: a prefill or a trailing system message is another key.
    assert cached(stack, chat([user, {"role": "assistant", "content": "Berlin is"}])) != "hit"
    assert cached(stack, chat([user, {"role": "system", "content": "Answer in German."}])) != "hit"
    # The same text with an image part: the key cannot see the image, so it is not cached at all.
    parts = [{"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]
    assert cached(stack, chat([{"role": "user", "content": parts}], model="stub")) == "bypass"
    # Completions never get the chat entry (nor its chat-shaped object).
    response = post(stack, "/v1/completions", {"model": "real", "prompt": QUESTION, "max_tokens": 4, "temperature": 0})
    assert response.headers["x-gateway-cache"] != "hit" and response.json()["object"] == "text_completion"
    # One team shares; keys without a team share nothing with other users.
    assert cached(stack, chat([user]), "bob") == "hit"
    assert cached(stack, chat([user]), "carl") == "miss"
    wait_for(lambda: cached(stack, chat([user]), "carl") == "hit", 30, "carl's own entry")
    assert cached(stack, chat([user]), "dana") == "miss"


def test_admin_input_is_validated(stack):
    admin = {"authorization": f"Bearer {ADMIN}"}
    bad = [{"user": "x", "models": "real"}, {"user": "x", "rpm": "10"}, {"user": "x", "daily_budget_usd": "1"},
           {"user": "x", "rpm": -5}, {"user": "x", "rpm": 0}, {"user": "x", "tpm": 1.5}, {"user": "x", "rpm": True},
           {"user": "x", "residency": "eu\r\nx-evil: 1"}, {"user": "a\nb"}, {"user": ""}, {"user": 5},
           {"user": "x", "team": ["hr"]}, {"user": "x", "daily_budget_usd": -1}, {"user": "x", "models": [1]},
           {"user": "x", "surprise": 1}, {}, [1], "[[[[", {"user": "x", "daily_budget_usd": 1e308}]
    for body in bad:
        kwargs = {"content": body} if isinstance(body, str) else {"json": body}
        assert_error(httpx.post(stack["url"] + "/admin/keys", headers=admin, timeout=10, **kwargs), 400)
    for path, params in [("/admin/traces", {"limit": "ten"}), ("/admin/usage", {"day": "yesterday\r\n"})]:
        assert_error(httpx.get(stack["url"] + path, params=params, headers=admin, timeout=10), 400)
    assert_error(httpx.post(stack["url"] + "/admin/sources/hr/bump", json={"version": {"a": 1}}, headers=admin), 400)
    created = httpx.post(stack["url"] + "/admin/keys", headers=admin, timeout=10,
                         json={"user": "erin", "models": ["stub"], "rpm": 10, "daily_budget_usd": 1, "residency": "eu"})
    assert created.status_code == 200 and created.json()["models"] == ["stub"]
    ok = httpx.post(stack["url"] + "/v1/chat/completions", headers={"authorization": f"Bearer {created.json()['key']}"},
                    json=chat([{"role": "user", "content": "hi"}], model="stub"), timeout=30)
    assert ok.status_code == 200 and ok.headers["x-ratelimit-limit-requests"] == "10"
    assert_error(httpx.post(stack["url"] + "/v1/chat/completions", json=chat([], model="stubby"),
                            headers={"authorization": f"Bearer {created.json()['key']}"}), 400)


def raw_request(url: str, head: bytes) -> int:
    """The status of a request written byte for byte (header values httpx would refuse to send)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head)
        return int(s.recv(4096).split(b" ")[1])


def test_hostile_input_gets_4xx_never_500(stack):
    url, ok = stack["url"], chat([{"role": "user", "content": "hi"}], model="stub")
    deep = ("[" * 30_000 + "]" * 30_000).encode()  # as deep as the 64 KiB limit allows (100,000 with 1 MiB)
    assert_error(post(stack, "/v1/chat/completions", b'{"model": "stub", "messages": ' + deep + b"}"), 400)
    admin = {"authorization": f"Bearer {ADMIN}"}
    assert_error(httpx.post(url + "/admin/keys", content=b'{"user": ' + deep + b"}", headers=admin), 400)
    for field, value in [("max_tokens", 10**17), ("max_completion_tokens", 10**17), ("max_tokens", "10"),
                         ("n", 10**17), ("stream_options", "yes"), ("stream", "true"), ("temperature", "0"),
                         ("sources", ["a\r\nb"]), ("sources", "hr"), ("route", "huge")]:
        assert_error(post(stack, "/v1/chat/completions", {**ok, field: value}), 400)
    assert_error(post(stack, "/v1/completions", {"model": "stub", "prompt": "x", "best_of": 10**17}), 400)
    # Tokens with non-ASCII bytes, as admin key and as API key: 401, not a 500.
    for path in (b"/admin/keys", b"/v1/models"):
        head = b"GET " + path + b" HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xc3\xa9t\xe9\xff\r\nConnection: close\r\n\r\n"
        assert raw_request(url, head) == 401
    # A chunked body over the limit is refused while it is read.
    chunks = (b'{"model": "stub", "messages": [], "pad": "' + b"x" * 8192 for _ in range(100))
    assert_error(post(stack, "/v1/chat/completions", chunks), 413)
    assert_error(httpx.post(url + "/admin/keys", content=(b"x" * 8192 for _ in range(100)), headers=admin), 413)


def test_tpm_is_a_bound_on_real_tokens(stack):
    body = chat([{"role": "user", "content": "Say hello."}], max_tokens=16, cache=False)
    statuses = [post(stack, "/v1/chat/completions", body, "tight").status_code for _ in range(4)]
    # Each request holds its worst case (~120 tokens) and hands back what it did not use: two fit in 200.
    assert statuses[0] == 200 and 429 in statuses, statuses
    admin = {"authorization": f"Bearer {ADMIN}"}
    traces = httpx.get(stack["url"] + "/admin/traces", params={"key_id": stack["keys"]["tight"]["key_id"]},
                       headers=admin).json()["data"]
    assert sum(t["prompt_tokens"] + t["completion_tokens"] for t in traces) <= 200
    huge = chat([{"role": "user", "content": "hi"}])
    huge.pop("max_tokens")  # the route's cap (256) is reserved and sent: more than the key's 200
    assert "tokens per minute" in assert_error(post(stack, "/v1/chat/completions", huge, "tight"), 429)["message"]


def events(response: httpx.Response) -> list:
    return [json.loads(line[5:]) for line in response.text.splitlines()
            if line.startswith("data:") and line[5:].strip() != "[DONE]"]


def test_misbehaving_provider_answers_become_errors_not_500s(stack):
    body = chat([{"role": "user", "content": "hi"}], model="stub", cache=False)
    try:
        set_stub_mode(stack["stub"], "binary-4xx")
        for stream in (False, True):
            error = assert_error(post(stack, "/v1/chat/completions", {**body, "stream": stream}), 400)
            assert "bad request" in error["message"]
        for mode in ("bad-event", "bad-first"):
            set_stub_mode(stack["stub"], mode)
            response = post(stack, "/v1/chat/completions", {**body, "stream": True})
            assert response.status_code == 200  # committed at the first event; it ends with an error event
            assert events(response)[-1]["error"]["code"] == "upstream_stream_error"
        set_stub_mode(stack["stub"], "no-usage")
        response = post(stack, "/v1/chat/completions", body)
        assert response.status_code == 200
        trace = httpx.get(stack["url"] + "/admin/traces", params={"limit": 1},
                          headers={"authorization": f"Bearer {ADMIN}"}).json()["data"][0]
        assert "no usable usage" in trace["budget_note"] and trace["prompt_tokens"] > 0  # charged the bound
    finally:
        set_stub_mode(stack["stub"], "ok")


def test_redis_restart_is_ridden_over_and_missing_persistence_is_warned(stack, tmp_path):
    config = {"cache": {"enabled": False},
              "providers": {"stub": {"base_url": stack["stub"] + "/v1", "models": {"small": {"name": "stub"}}}},
              "routes": {"stub": {"small": ["stub/small"]}}}
    volatile, volatile_url = redis_server(tmp_path)
    port = free_port()
    durable, durable_url = redis_server(tmp_path, port, aof_dir=tmp_path)
    with contextlib.ExitStack() as es:
        start_all(es, volatile, durable)
        warned, _ = gateway("gw-volatile", {**config, "store": volatile_url}, tmp_path, ADMIN)
        quiet, url = gateway("gw-durable", {**config, "store": durable_url}, tmp_path, ADMIN)
        start_all(es, warned, quiet)
        assert "no persistence" in warned.log() and "persistence" not in quiet.log()
        key = json.loads(cli("gateway", "keys", "create", "--config", str(tmp_path / "gw-durable.yaml"), "--user", "r"))
        ask = {"model": "stub", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

        def status() -> int:
            return httpx.post(url + "/v1/chat/completions", json=ask, timeout=30,
                              headers={"authorization": f"Bearer {key['key']}"}).status_code
        assert status() == 200
        durable.__exit__()
        durable.start().wait_ready()  # same port, same append-only file: the key survives
        assert status() == 200  # the stale pooled connection is retried once on a fresh one
