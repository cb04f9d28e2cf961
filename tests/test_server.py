"""The OpenAI-compatible server, run for real (`pagedserve serve` in a subprocess on a free loopback port),
driven by the official `openai` client and raw httpx where the client would hide the HTTP details."""
import asyncio
import base64
import ctypes
import errno
import os
import socket
import time

import httpx
import numpy as np
import openai
import pytest

from pagedserve import LLM
from pagedserve.sampling_params import SamplingParams
from tests.server_support import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
EMBED_MODEL = "all-MiniLM-L6-v2"
API_KEY = "test-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_MODEL_LEN = 1024
SYS_PIDFD_GETFD = 438  # the same number on every Linux architecture
PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def add(a, b):", "1, 2, 3, 4,"]


@pytest.fixture(scope="module")
def server_process() -> ServerProcess:
    srv = ServerProcess(["--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", str(MAX_MODEL_LEN),
                         "--api-key", API_KEY, "--max-request-size", "1MiB",
                         "--shed-after", ""])  # shedding by queue age is test_overload's; here it'd be the machine's speed
    assert "curl" in srv.banner
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def server(server_process) -> str:
    return server_process.url


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM(dtype="float32", kv_cache_memory="32MiB", max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def greedy(reference: LLM, prompt, max_tokens: int = 16, **kw):
    return reference.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **kw))[0]


def greedy_chat(reference: LLM, messages: list[dict], max_tokens: int = 16):
    return reference.chat(messages, SamplingParams(temperature=0, max_tokens=max_tokens))[0]


def metric(url: str, name: str, **labels) -> float:
    """Sum of the samples of one metric whose labels include the given ones."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith((name + "{", name + " ")) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wait_until(predicate, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


# ---- completions ----

def test_completion_matches_offline_greedy(client, reference):
    for prompt in PROMPTS[:2]:
        ref = greedy(reference, prompt)
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        assert r.choices[0].text == ref.outputs[0].text
        assert r.choices[0].finish_reason == ref.outputs[0].finish_reason
        assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.model == MODEL and r.object == "text_completion"


def test_completion_stream_matches_offline_greedy(client, reference):
    ref = greedy(reference, PROMPTS[2])
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.outputs[0].finish_reason
    assert len([c for c in chunks if c.choices]) > 2  # really streamed, not one blob
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)


def test_completion_prompt_forms(client, reference):
    refs = [greedy(reference, p, 8) for p in PROMPTS[:3]]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [x.outputs[0].text for x in refs]
    assert r.usage.prompt_tokens == sum(len(x.prompt_token_ids) for x in refs)
    ids = refs[0].prompt_token_ids
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == refs[0].outputs[0].text
    echoed = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0, echo=True)
    assert echoed.choices[0].text == reference.tokenizer.decode(ids) + refs[0].outputs[0].text


def test_n_and_seeds(client):
    def sample(seed, n=3):
        return client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=12,
                                         temperature=1.0, n=n, seed=seed)

    a, b, c = sample(7), sample(7), sample(8)
    assert [x.index for x in a.choices] == [0, 1, 2]
    assert [x.text for x in a.choices] == [x.text for x in b.choices]
    assert [x.text for x in a.choices] != [x.text for x in c.choices]
    assert len({x.text for x in a.choices}) > 1  # the n samples differ from each other
    assert 3 <= a.usage.completion_tokens <= 3 * 12
    assert a.usage.prompt_tokens == b.usage.prompt_tokens
    streamed = client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=12,
                                         temperature=1.0, n=3, seed=7, stream=True)
    texts = ["", "", ""]
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [x.text for x in a.choices]


def test_stop_string(client, reference):
    ref = greedy(reference, PROMPTS[1], 24).outputs[0].text
    words = ref.split()
    stop = words[len(words) // 2]
    expected = ref[: ref.find(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == expected
    assert r.choices[0].finish_reason == "stop"
    messages = [{"role": "user", "content": "Name three colors."}]
    ref_chat = greedy_chat(reference, messages, 24).outputs[0].text
    stop = ref_chat.split()[len(ref_chat.split()) // 2]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0, stop=stop)
    assert chat.choices[0].message.content == ref_chat[: ref_chat.find(stop)]
    assert chat.choices[0].finish_reason == "stop"


def test_completion_logprobs(client, reference):
    ref = greedy(reference, PROMPTS[0], 8)
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert "".join(lp.tokens) == r.choices[0].text == ref.outputs[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()), abs=1e-4)  # greedy picks the most likely token
    assert lp.text_offset == sorted(lp.text_offset)


# ---- chat ----

def test_chat_matches_offline_greedy(client, reference):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."}]
    ref = greedy_chat(reference, messages)
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.outputs[0].finish_reason
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_chat_logprobs_and_content_parts(client):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Say hello"}]}]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert "".join(t.token for t in content) == r.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob, abs=1e-4)
               for t in content)
    assert all(bytes(t.bytes).decode() == t.token for t in content)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=2, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]


def test_prefix_cache_hits_reported(client):
    prompt = "Paged attention splits the KV cache into fixed-size blocks. " * 6
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert second.usage.prompt_tokens == first.usage.prompt_tokens > 48
    assert second.usage.prompt_tokens_details.cached_tokens >= 32
    assert second.usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens_details.cached_tokens


# ---- embeddings, models, tokenizer ----

def test_embeddings(client, server):
    texts = ["How do I reset my password?", "What are the steps to change my password?",
             "The weather in Lisbon is warm in July."]
    r = client.embeddings.create(model=EMBED_MODEL, input=texts)  # the client asks for base64
    vecs = np.array([d.embedding for d in r.data])
    assert vecs.shape == (3, 384) and [d.index for d in r.data] == [0, 1, 2]
    np.testing.assert_allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    assert vecs[0] @ vecs[1] > vecs[0] @ vecs[2] + 0.2
    assert r.usage.prompt_tokens == r.usage.total_tokens > 10
    raw = httpx.post(f"{server}/v1/embeddings", headers=AUTH,
                     json={"input": texts[0], "encoding_format": "float"}).json()
    np.testing.assert_allclose(raw["data"][0]["embedding"], vecs[0], atol=1e-6)
    b64 = httpx.post(f"{server}/v1/embeddings", headers=AUTH,
                     json={"input": texts[0], "encoding_format": "base64"}).json()
    decoded = np.frombuffer(base64.b64decode(b64["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_allclose(decoded, vecs[0], atol=1e-6)


def test_models_tokenize_health(client, server, reference):
    ids = {m.id for m in client.models.list().data}
    assert ids == {MODEL, EMBED_MODEL}
    assert client.models.retrieve(MODEL).id == MODEL
    tok = httpx.post(f"{server}/tokenize", headers=AUTH, json={"prompt": "Hello world"}).json()
    assert tok["tokens"] == reference.tokenizer.encode("Hello world") and tok["count"] == len(tok["tokens"])
    assert tok["max_model_len"] == MAX_MODEL_LEN
    chat_tok = httpx.post(f"{server}/tokenize", headers=AUTH,
                          json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat_tok["count"] > tok["count"]
    detok = httpx.post(f"{server}/detokenize", headers=AUTH, json={"tokens": tok["tokens"]}).json()
    assert detok["prompt"] == "Hello world"
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}


# ---- concurrency and disconnects ----

@pytest.mark.slow  # a load run
def test_fifty_concurrent_streams(server, reference):
    prompts = [f"Fact number {i} about the ocean:" for i in range(10)]
    expected = {p: greedy(reference, p, 12).outputs[0].text for p in prompts}

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                                 stream=True)
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0,
                                      timeout=300) as client:
            return await asyncio.gather(*(one(client, prompts[i % 10]) for i in range(50)))

    texts = asyncio.run(main())
    assert texts == [expected[prompts[i % 10]] for i in range(50)]


def test_disconnect_frees_blocks(server):
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 600, "ignore_eos": True,
            "temperature": 0, "stream": True}
    generated_before = metric(server, "pagedserve_generation_tokens_total")
    with httpx.stream("POST", f"{server}/v1/completions", headers=AUTH, json=body, timeout=60) as resp:
        assert resp.status_code == 200
        lines = resp.iter_lines()
        for _ in range(6):
            next(lines)
        wait_until(lambda: metric(server, "pagedserve_kv_blocks_used") > 0)
    # 600 tokens take many seconds; the blocks come back at once because the request was aborted.
    wait_until(lambda: metric(server, "pagedserve_kv_blocks_used") == 0
               and metric(server, "pagedserve_num_requests_running") == 0, timeout=5)
    assert metric(server, "pagedserve_generation_tokens_total") - generated_before < 300

    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        httpx.post(f"{server}/v1/completions", headers=AUTH, json={**body, "stream": False}, timeout=1.5)
    wait_until(lambda: metric(server, "pagedserve_kv_blocks_used") == 0
               and metric(server, "pagedserve_num_requests_running") == 0, timeout=5)


# ---- errors ----

def raw(url: str, path: str, body: bytes, content_type: str | None = "application/json") -> httpx.Response:
    headers = {**AUTH, "Content-Type": content_type} if content_type else AUTH
    return httpx.post(f"{url}{path}", content=body, headers=headers, timeout=30)


ERROR_CASES = [
    ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "best_of": 2, "n": 3}, 400, "best_of"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}}, 400, None),
    ("/v1/completions", {"prompt": "word " * 1500, "max_tokens": 4}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": MAX_MODEL_LEN}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [10**7], "min_tokens": 2}, 400, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {"prompt": "x", "model": "gpt-17"}, 404, "model"),
    ("/v1/completions", {"prompt": "x", "model": EMBED_MODEL}, 400, "model"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "critic", "content": "x"}]}, 400, "messages.0.role"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "x"}]}, 400, "messages.0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": []}, 400, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, None),
    ("/v1/embeddings", {"input": ""}, 400, "input"),
    ("/v1/embeddings", {"input": "x", "dimensions": 12}, 400, "dimensions"),
    ("/v1/embeddings", {"input": "x", "model": MODEL}, 400, "model"),
    ("/v1/embeddings", {"input": [1, 2, 3]}, 400, "input"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/tokenize", {}, 400, None),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), ERROR_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(ERROR_CASES)])
def test_invalid_requests(server, path, body, status, param):
    import json

    r = raw(server, path, json.dumps(body).encode())
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param


@pytest.mark.parametrize(("body", "content_type", "status"), [
    (b'{"prompt": "x",', "application/json", 400),  # malformed JSON
    (b'{"prompt": "\xff\xfe"}', "application/json", 400),  # invalid UTF-8
    (b'["prompt"]', "application/json", 400),  # not an object
    (b"", "application/json", 400),  # empty body
    (b'{"prompt": "x", "temperature": NaN}', "application/json", 400),  # Python's json would take NaN
    (b'{"prompt": "x", "repetition_penalty": Infinity}', "application/json", 400),
    (b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", "application/json", 400),  # deep nesting
    (b'{"prompt": "x"}', "text/plain", 400),  # not declared as JSON
    (b'{"prompt": "x", "max_tokens": 1}', None, 200),  # no Content-Type at all: read as JSON
])
def test_malformed_bodies(server, body, content_type, status):
    r = raw(server, "/v1/completions", body, content_type)
    assert r.status_code == status, r.text
    if status != 200:
        assert r.json()["error"]["message"]


def test_auth_size_and_routes(server, client):
    ok = {"prompt": "x", "max_tokens": 1}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic abc"}):
        r = httpx.post(f"{server}/v1/completions", json=ok, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server}/v1", api_key="nope", max_retries=0).models.list()
    big = b'{"prompt": "' + b"a" * (2 * 2**20) + b'"}'
    r = raw(server, "/v1/completions", big)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit holds for chunked bodies too
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"a" * 65536
        yield b'"}'

    r = httpx.post(f"{server}/v1/completions", content=chunks(), headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == 413
    assert httpx.get(f"{server}/v1/nope", headers=AUTH).status_code == 404
    assert httpx.get(f"{server}/v1/nope", headers=AUTH).json()["error"]["message"]
    r = httpx.get(f"{server}/v1/completions", headers=AUTH)
    assert r.status_code == 405 and r.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, temperature=5)
    assert httpx.get(f"{server}/health").status_code == 200


# ---- metrics and OpenAPI ----

METRIC_SERIES = {  # name, labels -> how much one 4-token completion plus one 400 moves it
    ("pagedserve_requests_total", (("endpoint", "/v1/completions"), ("status", "200"))): 1,
    ("pagedserve_requests_total", (("endpoint", "/v1/completions"), ("status", "400"))): 1,
    ("pagedserve_time_to_first_token_seconds_count", ()): 1,
    ("pagedserve_time_per_output_token_seconds_count", ()): 1,
    ("pagedserve_e2e_request_latency_seconds_count", ()): 1,
    ("pagedserve_generation_tokens_total", ()): 4,
}


def test_metrics(server, client):
    def snapshot() -> dict:
        series = {(name, labels): metric(server, name, **dict(labels)) for name, labels in METRIC_SERIES}
        return {**series, "prompt_tokens": metric(server, "pagedserve_prompt_tokens_total")}

    before = snapshot()
    ok = client.completions.create(model=MODEL, prompt="Hi there", max_tokens=4, temperature=0,
                                   extra_body={"ignore_eos": True})
    with pytest.raises(openai.BadRequestError):  # refused before the engine: no tokens, no latency samples
        client.completions.create(model=MODEL, prompt="Hi there", max_tokens=4, temperature=5)
    expected = {**METRIC_SERIES, "prompt_tokens": ok.usage.prompt_tokens}
    assert ok.usage.completion_tokens == 4 and ok.usage.prompt_tokens > 0

    def deltas() -> dict:
        now = snapshot()
        return {k: now[k] - before[k] for k in now}
    # Each series is recorded as its response ends: wait until all have moved, then they must be exact.
    wait_until(lambda: all(v >= expected[k] for k, v in deltas().items()))
    assert deltas() == expected
    text = httpx.get(f"{server}/metrics").text
    assert metric(server, "pagedserve_kv_blocks_total") > 0
    for name in ("pagedserve_num_requests_waiting", "pagedserve_prefix_cache_hit_rate",
                 "pagedserve_num_preemptions_total"):
        assert name in text


def test_openapi_matches_server(server):
    doc = httpx.get(f"{server}/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/embeddings", "/v1/models", "/tokenize",
            "/detokenize", "/health", "/metrics"} <= set(doc["paths"])
    assert '"422"' not in httpx.get(f"{server}/openapi.json").text
    assert "400" in doc["paths"]["/v1/completions"]["post"]["responses"]
    schemas = doc["components"]["schemas"]
    # Every documented request field is accepted with its documented default.
    for path, name, base in [("/v1/completions", "CompletionRequest", {"prompt": "Hi"}),
                             ("/v1/chat/completions", "ChatCompletionRequest",
                              {"messages": [{"role": "user", "content": "Hi"}]})]:
        props = schemas[name]["properties"]
        assert {"top_k", "min_p", "repetition_penalty", "ignore_eos", "min_tokens", "seed", "stop"} <= set(props)
        defaults = {k: v["default"] for k, v in props.items() if v.get("default") is not None}
        body = {**defaults, **base, "max_tokens": 2}
        r = httpx.post(f"{server}{path}", json=body, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
    assert "HTTPBearer" in str(doc["components"].get("securitySchemes", {}))


def test_accepted_connections_have_nagle_off(server_process):
    """With Nagle on, each response body waited ~40 ms behind its headers for the client's delayed ACK.
    Read off the running server's own accepted socket (uvicorn on uvloop, whose sockets asyncio never sees)."""
    port = int(server_process.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")  # accepted and served; the connection stays open
        nodelay = socket_option_of_peer(server_process.proc.pid, sock.getsockname(), socket.TCP_NODELAY)
    assert nodelay != 0


def socket_option_of_peer(pid: int, peer: tuple, option: int) -> int:
    """A TCP option of process `pid`'s socket connected to `peer`, read on a duplicate of that socket
    (pidfd_getfd(2): allowed on our own child process)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        for entry in os.scandir(f"/proc/{pid}/fd"):
            try:
                if not os.readlink(entry.path).startswith("socket:"):
                    continue
            except FileNotFoundError:  # closed while we looked
                continue
            fd = libc.syscall(SYS_PIDFD_GETFD, pidfd, int(entry.name), 0)
            if fd < 0:
                err = ctypes.get_errno()
                if err in (errno.ENOSYS, errno.EPERM):
                    pytest.skip(f"pidfd_getfd is not allowed here: {os.strerror(err)}")
                continue
            with socket.socket(fileno=fd) as dup:
                try:
                    if dup.getpeername() == peer:
                        return dup.getsockopt(socket.IPPROTO_TCP, option)
                except OSError:  # listening, or not an IP socket
                    continue
    finally:
        os.close(pidfd)
    raise AssertionError(f"no socket of process {pid} is connected to {peer}")
