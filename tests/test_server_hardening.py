"""The server against hostile or careless clients, run for real: text that is not Unicode, clients that
leave, requests too big for the server, a KV pool smaller than the model's context, misleading
validation, a schema that disagrees with the server, and bodies too large to buffer."""
from __future__ import annotations

import concurrent.futures
import json
import socket
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.polling import wait_for
from tests.server_support import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
POOL_TOKENS = 352  # 16 MiB of fp32 KV for this model: far below its 8,192-token context
SEATS = 16
MAX_BODY = 2**20


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("hardening") / "server.log"
    srv = ServerProcess(["--dtype", "float32", "--kv-cache-memory", "16MiB", "--max-num-seqs", str(SEATS),
                         "--max-request-size", "1MiB", "--num-threads", "1", "--attention-backend", "torch",
                         # No shedding by queue age: these tests are about size and input, not a busy machine's speed.
                         "--shed-after", "", "--ttft-slo", "120"], log_path=log)
    srv.log_path = log
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def post(url: str, path: str, body: bytes | dict) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{url}{path}", content=content, headers={"Content-Type": "application/json"}, timeout=60)


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the samples of one metric whose labels include the given ones ('5' matches any 5xx status)."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def server_errors(url: str) -> float:
    return metric(url, "pagedserve_requests_total", status="5")


# ---- text that JSON carries but Unicode does not ----

LONE = "a\\ud800b"  # a JSON escape: the parser gives a str with a lone surrogate, which no encoder takes
USER = {"role": "user", "content": "hi"}
SURROGATE_CASES = [
    ("/v1/completions", f'{{"prompt": "{LONE}"}}', "prompt"),
    ("/v1/completions", f'{{"prompt": ["ok", "{LONE}"]}}', "prompt"),
    ("/v1/completions", f'{{"prompt": "x", "stop": "{LONE}"}}', "stop"),
    ("/v1/completions", f'{{"prompt": "x", "stop": ["{LONE}"]}}', "stop"),
    ("/v1/completions", f'{{"prompt": "x", "model": "{LONE}"}}', "model"),
    ("/v1/completions", f'{{"prompt": "x", "user": "{LONE}"}}', "user"),
    ("/v1/completions", f'{{"prompt": "x", "priority": "{LONE}"}}', "priority"),
    ("/v1/completions", f'{{"prompt": "x", "{LONE}": 1}}', None),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "{LONE}"}}]}}', "messages.0.content"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "{LONE}"}}]}}]}}',
     "messages.0.content"),
    ("/v1/chat/completions", f'{{"messages": [{{"role": "user", "content": "x", "name": "{LONE}"}}]}}',
     "messages.0.name"),
    ("/v1/chat/completions", f'{{"messages": [{json.dumps(USER)}], "response_format": {{"type": "{LONE}"}}}}',
     "response_format.type"),
    ("/v1/chat/completions", f'{{"messages": [{json.dumps(USER)}], "{LONE}": true}}', None),
    ("/v1/embeddings", f'{{"input": "{LONE}"}}', "input"),
    ("/v1/embeddings", f'{{"input": ["ok", "{LONE}"]}}', "input"),
    ("/v1/embeddings", f'{{"input": "x", "model": "{LONE}"}}', "model"),
    ("/tokenize", f'{{"prompt": "{LONE}"}}', "prompt"),
    ("/tokenize", f'{{"messages": [{{"role": "user", "content": "{LONE}"}}]}}', "messages.0.content"),
    ("/detokenize", f'{{"tokens": [1], "model": "{LONE}"}}', "model"),
]


@pytest.mark.parametrize(("path", "body", "param"), SURROGATE_CASES,
                         ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(SURROGATE_CASES)])
def test_lone_surrogates_are_clear_400s(server, path, body, param):
    before = server_errors(server.url)
    r = post(server.url, path, body.encode())
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    if param not in (None, "priority"):
        assert "surrogate" in error["message"]
    assert server_errors(server.url) == before


def test_surrogate_pair_is_one_character_and_served(server):
    """The official client cannot even encode a lone surrogate; a pair as two escapes is one emoji."""
    with pytest.raises(UnicodeEncodeError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="none").completions.create(model=MODEL, prompt="\ud800")
    r = post(server.url, "/v1/completions", b'{"prompt": "I like \\ud83d\\ude00", "max_tokens": 2}')
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 2


# ---- clients that leave ----

def test_non_streamed_disconnect_is_499_and_aborts(server):
    """The client goes away while its answer is being generated: the engine stops at once, /metrics counts
    a 499 (not a 500), and the log holds no traceback."""
    errors = server_errors(server.url)
    generated = metric(server.url, "pagedserve_generation_tokens_total")
    body = json.dumps({"prompt": "Tell me a long story.", "max_tokens": 300, "ignore_eos": True}).encode()
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: metric(server.url, "pagedserve_num_requests_running") > 0, 30, "the request to run")
    wait_for(lambda: metric(server.url, "pagedserve_requests_total", endpoint="/v1/completions", status="499"),
             10, "the disconnect to be counted")
    wait_for(lambda: metric(server.url, "pagedserve_num_requests_running") == 0
             and metric(server.url, "pagedserve_kv_blocks_used") == 0, 5, "the request to be aborted")
    assert metric(server.url, "pagedserve_generation_tokens_total") - generated < 300
    assert metric(server.url, "pagedserve_admission_in_flight") == 0
    assert server_errors(server.url) == errors
    log = server.log_path.read_text()
    assert "InvalidStateError" not in log and "Traceback" not in log


# ---- one request cannot hold the server ----

def test_a_request_bigger_than_the_server_is_refused_at_once(server, client):
    started = time.monotonic()
    r = post(server.url, "/v1/completions", {"prompt": ["Hello there"] * 1000, "n": 64, "max_tokens": 16})
    assert r.status_code == 400 and r.json()["error"]["code"] == "request_too_large"
    assert "64000 sequences" in r.json()["error"]["message"] and r.json()["error"]["param"] == "prompt"
    r = post(server.url, "/v1/completions", {"prompt": "Hello", "n": SEATS + 1, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    # Within the seats but over the KV tokens the server admits: refused too, naming the bound.
    r = post(server.url, "/v1/completions", {"prompt": ["Hello there"] * 4, "n": 4, "max_tokens": 40})
    assert r.status_code == 400 and r.json()["error"]["code"] == "request_too_large"
    assert str(POOL_TOKENS) in r.json()["error"]["message"]
    assert time.monotonic() - started < 10
    assert client.completions.create(model=MODEL, prompt="Hi", max_tokens=2).choices[0].text is not None


def test_the_largest_request_allowed_leaves_room_for_others(server):
    """A request at the size limit runs while a small one sent after it is still served, not shed."""
    big = {"prompt": ["Count: 1, 2,"] * 4, "n": 4, "max_tokens": 12, "ignore_eos": True}
    with httpx.Client(base_url=server.url, timeout=120) as http, concurrent.futures.ThreadPoolExecutor(1) as pool:
        big_answer = pool.submit(http.post, "/v1/completions", json=big)
        wait_for(lambda: metric(server.url, "pagedserve_admission_in_flight") == 1
                 and metric(server.url, "pagedserve_admission_queued_tokens") == 0, 30, "the big request to start")
        small = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "ignore_eos": True})
        assert small.status_code == 200, small.text
        assert small.json()["usage"]["completion_tokens"] == 4
        assert big_answer.result().status_code == 200
        assert len(big_answer.result().json()["choices"]) == 16


# ---- a KV pool smaller than the model's context ----

def test_context_capped_to_the_pool(server, client):
    assert f"capping max_model_len to {POOL_TOKENS}" in server.log_path.read_text()
    assert client.models.retrieve(MODEL).model_extra["max_model_len"] == POOL_TOKENS
    # No max_tokens: the answer gets the room the prompt leaves (it used to be refused, naming messages).
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 280}],
                                       temperature=0, extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == POOL_TOKENS
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=MODEL, prompt="word " * 400, max_tokens=1)


# ---- validation that says what is wrong ----

VALIDATION_CASES = [
    ("/v1/completions", {"prompt": "x", "stop": ["s"] * 1000}, "stop", "at most 16"),
    ("/v1/chat/completions", {"messages": [USER], "stop": ["s"] * 17}, "stop", "at most 16"),
    ("/v1/embeddings", {"input": ["x"] * 2049}, "input", "at most 2048"),
    ("/v1/completions", {"prompt": [-1]}, "prompt", "greater than or equal to 0"),
    ("/v1/completions", {"prompt": [[5, -1]]}, "prompt", "prompt[0][1]"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [-3]}, "stop_token_ids.0", "greater than or equal"),
    ("/v1/completions", {"prompt": [True]}, "prompt", "prompt[0]"),
    ("/v1/completions", {"prompt": "x", "n": True}, "n", "integer"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "16"}, "max_tokens", "integer"),
    ("/v1/completions", {"prompt": "x", "temperature": "0.5"}, "temperature", "number"),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream", "boolean"),
    ("/v1/completions", {"prompt": "x", "echo": 1}, "echo", "boolean"),
    ("/v1/completions", {"prompt": ""}, "prompt", "at least 1"),
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt", "at least 1"),
    ("/v1/completions", {"prompt": [[]]}, "prompt", "at least 1"),
    ("/v1/embeddings", {"input": ["a", ""]}, "input", "at least 1"),
    ("/detokenize", {"tokens": [False]}, "tokens.0", "integer"),
    ("/tokenize", {"prompt": None}, "prompt", "string"),
    ("/tokenize", {}, None, "exactly one of prompt or messages"),
]


@pytest.mark.parametrize(("path", "body", "param", "says"), VALIDATION_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(VALIDATION_CASES)])
def test_validation_messages_name_the_real_problem(server, path, body, param, says):
    r = post(server.url, path, body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and says in error["message"], error


def test_empty_body_says_so(server):
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/tokenize"):
        error = post(server.url, path, b"").json()["error"]
        assert "body is missing" in error["message"] and "None" not in error["message"]


# ---- the schema says what the server does ----

def test_openapi_agrees_with_the_server(server):
    doc = httpx.get(f"{server.url}/openapi.json").json()
    assert "securitySchemes" not in doc.get("components", {})  # no --api-key: no security to declare
    assert not any("security" in op for path in doc["paths"].values() for op in path.values())
    schemas = doc["components"]["schemas"]
    prompt = schemas["CompletionRequest"]["properties"]["prompt"]["anyOf"]
    assert prompt[0] == {"type": "string", "minLength": 1}
    assert all(branch.get("minItems") == 1 for branch in prompt[1:])
    assert schemas["ChatCompletionRequest"]["then"]["properties"]["logprobs"] == {"const": True}
    assert schemas["TokenizeRequest"]["oneOf"] == [{"required": ["prompt"]}, {"required": ["messages"]}]
    assert schemas["TokenizeRequest"]["properties"]["prompt"]["type"] == "string"  # not nullable


@pytest.mark.parametrize(("method", "path", "allow"), [
    ("GET", "/v1/completions", "POST"), ("PUT", "/v1/chat/completions", "POST"), ("POST", "/v1/models", "GET"),
    ("DELETE", "/health", "GET"), ("POST", "/metrics", "GET"), ("GET", "/tokenize", "POST"),
])
def test_405_says_what_is_allowed(server, method, path, allow):
    r = httpx.request(method, f"{server.url}{path}")
    assert r.status_code == 405 and r.headers["allow"] == allow
    assert r.json()["error"]["message"]


# ---- bodies too large to buffer ----

def test_chunked_body_over_the_limit_is_refused_while_reading(server):
    """A 400 MB chunked body: the server answers 413 after about its limit and closes the connection, so
    neither its memory nor the time spent reading grows with what the client would send."""
    pid = server.proc.pid
    rss_before = _rss_bytes(pid)
    host, port = server.url.removeprefix("http://").split(":")
    chunk = b"%x\r\n%s\r\n" % (2**16, b"a" * 2**16)
    sent = 0
    with socket.create_connection((host, int(port)), timeout=30) as sock, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        answer = pool.submit(_read_until_closed, sock)  # read while sending: a reset may follow the answer
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        try:
            while sent < 400 * 2**20:
                sock.sendall(chunk)
                sent += 2**16
        except (BrokenPipeError, ConnectionResetError):
            pass
        head = answer.result()
    assert sent < 64 * 2**20, f"the server read {sent} bytes of a body over its {MAX_BODY}-byte limit"
    assert head.startswith(b"HTTP/1.1 413") and b"connection: close" in head.lower(), head
    assert _rss_bytes(pid) - rss_before < 32 * 2**20
    assert httpx.get(f"{server.url}/health").status_code == 200


def _read_until_closed(sock: socket.socket) -> bytes:
    data = b""
    try:
        while part := sock.recv(65536):
            data += part
    except (ConnectionResetError, TimeoutError):
        pass
    return data


def _rss_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("VmRSS:")[1].split()[0]) * 1024
