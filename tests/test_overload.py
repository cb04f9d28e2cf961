"""Overload control on a real server: a burst of mixed priorities against a small KV pool and a small
queue bound, degradation, deadlines, and a SIGTERM drain under load. Driven by the official client."""
from __future__ import annotations

import asyncio
import random
import signal

import httpx
import openai
import pytest

from tests.polling import wait_for
from tests.server_support import ServerProcess

# Load and drain runs against real servers: minutes, so behind make test-all.
pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Write a haiku about the sea.", "def add(a, b):", "1, 2, 3, 4,",
           "Once upon a time", "The best way to learn a language is"]
MAX_TOKENS = 32
SHED_CAP = 8  # the burst server's degradation cap for sheddable work


@pytest.fixture(scope="module")
def burst_server():
    # 12 MiB of fp32 KV holds about 5 of these requests at once; 8 may run; 400 queued tokens is ~9 more.
    # A 30 s TTFT target keeps the age rules and shedding out of this burst: the token bound is under test.
    srv = ServerProcess(["--dtype", "float32", "--kv-cache-memory", "12MiB", "--max-num-seqs", "8",
                         "--max-model-len", "512", "--embedding-model", "none", "--max-queued-tokens", "400",
                         "--ttft-slo", "30",
                         "--degrade-at", "0", "--degrade", f"sheddable:max_tokens={SHED_CAP},n=1"])
    yield srv.url
    srv.stop()


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


async def complete(c: openai.AsyncOpenAI, prompt: str, priority: str, **kw):
    kw.setdefault("temperature", 0)
    return await c.completions.create(model="SmolLM2-135M-Instruct", prompt=prompt,
                                      max_tokens=kw.pop("max_tokens", MAX_TOKENS),
                                      extra_body={"priority": priority, "ignore_eos": True, **kw.pop("extra", {})},
                                      **kw)


def test_burst_of_mixed_priorities_sheds_honestly_and_serves_critical(burst_server):
    async def run():
        c = client(burst_server)
        reference = {p: (await complete(c, p, "critical")).choices[0].text for p in PROMPTS}
        rng = random.Random(0)
        jobs = [(rng.choice(PROMPTS), cls) for cls, n in (("critical", 6), ("standard", 12), ("sheddable", 12))
                for _ in range(n)]
        rng.shuffle(jobs)
        results = await asyncio.wait_for(
            asyncio.gather(*(complete(c, p, cls) for p, cls in jobs), return_exceptions=True), 300)
        return reference, jobs, results

    reference, jobs, results = asyncio.run(run())
    served = {"critical": 0, "standard": 0, "sheddable": 0}
    refused = {"critical": 0, "standard": 0, "sheddable": 0}
    for (prompt, cls), result in zip(jobs, results):
        if isinstance(result, openai.APIStatusError):
            assert result.status_code in (429, 503), result
            assert int(result.response.headers["retry-after"]) >= 1
            assert result.body["code"] in ("overloaded", "queue_full", "shed"), result.body
            refused[cls] += 1
            continue
        assert not isinstance(result, BaseException), repr(result)
        choice = result.choices[0]
        assert choice.finish_reason == "length"
        if cls == "sheddable":  # degraded, and says so
            assert result.usage.completion_tokens == SHED_CAP
            assert result.model_extra["degraded"] == [f"max_tokens={SHED_CAP}"]
            assert reference[prompt].startswith(choice.text)
        else:
            assert result.usage.completion_tokens == MAX_TOKENS
            assert result.model_extra["degraded"] is None
            assert choice.text == reference[prompt]
        served[cls] += 1
    assert served["critical"] == 6, (served, refused)
    assert refused["sheddable"] > 0, (served, refused)  # 3x the queue bound was offered
    # No count of standard against sheddable refusals here: which class a burst turns away more of depends
    # on arrival order (degraded sheddable requests are cheaper, standard ones hold the queue longer), and
    # a CI run once refused 7 standard to 6 sheddable. The door's class order at one queue state is what
    # the design promises; test_admission.py pins it with a fake clock.

    text = httpx.get(f"{burst_server}/metrics").text
    assert 'pagedserve_admission_rejected_total{priority_class="sheddable",reason="overloaded"}' in text
    assert 'pagedserve_admission_admitted_total{priority_class="critical"} 12.0' in text  # 6 + 6 references
    assert "pagedserve_preemptions_by_reason_total" in text
    assert 'pagedserve_admission_in_flight 0.0' in text  # every ticket came back


def test_degradation_caps_sheddable_and_refuses_n_but_spares_standard(burst_server):
    async def run():
        c = client(burst_server)
        shed = await c.completions.with_raw_response.create(
            model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=20, n=2, temperature=0.7, seed=1,
            extra_body={"priority": "sheddable", "ignore_eos": True})
        std = await complete(c, "Hello", "standard", max_tokens=20, n=2, temperature=0.7, seed=1)
        stream = await c.chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=[{"role": "user", "content": "Hi"}], max_tokens=20,
            stream=True, stream_options={"include_usage": True}, extra_headers={"x-priority": "sheddable"},
            extra_body={"ignore_eos": True})
        chunks = [chunk async for chunk in stream]
        return shed, std, chunks

    shed, std, chunks = asyncio.run(run())
    assert shed.headers["x-pagedserve-degraded"] == f"max_tokens={SHED_CAP},n=1"
    body = shed.parse()
    assert len(body.choices) == 1 and body.usage.completion_tokens == SHED_CAP
    assert body.model_extra["degraded"] == [f"max_tokens={SHED_CAP}", "n=1"]
    assert len(std.choices) == 2 and std.usage.completion_tokens == 40
    assert chunks[0].model_extra["degraded"] == [f"max_tokens={SHED_CAP}"]
    assert chunks[-1].usage.completion_tokens == SHED_CAP  # tokens, as the engine counted them: not chunks
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["length"]


def test_deadlines_and_bad_priorities(burst_server):
    async def run():
        c = client(burst_server)
        out = []
        for kw in ({"extra": {"timeout": 0.05}}, {"extra_headers": {"x-request-timeout": "0.05"}}):
            try:
                await complete(c, "Tell me a long story.", "standard", max_tokens=200, **kw)
            except openai.APIStatusError as exc:
                out.append(exc)
        for priority, headers in (("urgent", None), (None, {"x-priority": "vip"})):
            try:
                await complete(c, "Hi", priority, extra_headers=headers)
            except openai.APIStatusError as exc:
                out.append(exc)
        return out

    late, late_header, bad_body, bad_header = asyncio.run(run())
    for exc in (late, late_header):
        assert exc.status_code == 504 and exc.body["code"] == "deadline_exceeded"
    for exc in (bad_body, bad_header):
        assert exc.status_code == 400 and exc.body["param"] == "priority"
    assert httpx.get(f"{burst_server}/health").json() == {"status": "ok"}


def test_sheddable_work_that_cannot_start_in_time_is_shed_with_retry_after():
    # A 50 ms TTFT target: a 400-token prefill cannot make it, so sheddable work is shed, standard is not.
    srv = ServerProcess(["--dtype", "float32", "--kv-cache-memory", "32MiB", "--embedding-model", "none",
                         "--ttft-slo", "0.05", "--shed-after", "sheddable=1"])
    prompt = " ".join(["The history of computing is a story of ideas that took decades to mature."] * 26)

    async def run():
        c = client(srv.url)
        outcomes = []
        for priority, stream in (("sheddable", False), ("sheddable", True), ("standard", True)):
            try:
                result = await complete(c, prompt, priority, max_tokens=4, stream=stream)
                outcomes.append([chunk async for chunk in result] if stream else result)
            except openai.APIStatusError as exc:
                outcomes.append(exc)
        return outcomes

    try:
        shed, shed_stream, standard = asyncio.run(run())
        for exc in (shed, shed_stream):  # a stream is shed before its headers: a plain 429
            assert isinstance(exc, openai.APIStatusError) and exc.status_code == 429, exc
            assert exc.body["code"] == "shed" and int(exc.response.headers["retry-after"]) >= 1
        assert isinstance(standard, list) and standard[-1].choices[0].finish_reason == "length"
        text = httpx.get(f"{srv.url}/metrics").text
        assert 'pagedserve_admission_rejected_total{priority_class="sheddable",reason="shed"} 2.0' in text
    finally:
        srv.stop()


def test_a_closed_loop_of_16_users_is_served_not_refused():
    """Issue #38: 16 users, each sending its next 512-token prompt (128-token answer, streamed) as soon as its
    last answer ends, against the server's defaults: well within its seats and KV pool, so every request is
    queued and served and none is refused, however long the first tokens take on this machine."""
    import gguf

    from pagedserve.bench.serve import closed_workload, run_closed
    from pagedserve.bench.servers import ServerProcess as BenchServer
    from pagedserve.model.loader import default_model_path, gguf_metadata
    from pagedserve.model.tokenizer import Tokenizer

    srv = ServerProcess(["--embedding-model", "none"])
    try:
        tokenizer = Tokenizer.from_gguf_metadata(gguf_metadata(gguf.GGUFReader(str(default_model_path()))))
        server = BenchServer("pagedserve", [], url=srv.url)
        server.model = "SmolLM2-135M-Instruct"
        requests = closed_workload(tokenizer, 64, 512, 128)
        # All 16 start together; for 15 s each user sends its next request when its answer ends (a refused
        # one at once, as guidellm does), so arrivals spread out as answers come: the loop's steady state.
        results, _ = asyncio.run(run_closed(server, requests, 16, 15.0, 600, refused="at-once"))
        refused = [r for r in results if not r.ok]
        assert not refused, (len(refused), [(r.status, r.error[:200]) for r in refused[:5]])
        assert len(results) >= 16 and all(r.output_tokens == 128 for r in results)
    finally:
        srv.stop()


def test_sigterm_drains_admitted_requests_and_refuses_new_ones():
    srv = ServerProcess(["--dtype", "float32", "--kv-cache-memory", "64MiB", "--embedding-model", "none",
                         "--shutdown-timeout", "120"])

    async def run():
        c = client(srv.url)
        # A streamed response has its headers once the request is admitted.
        streams = await asyncio.gather(*(c.completions.create(
            model="SmolLM2-135M-Instruct", prompt=p, max_tokens=120, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}) for p in PROMPTS))
        srv.proc.send_signal(signal.SIGTERM)
        health = await asyncio.to_thread(wait_for, lambda: _health(srv.url), 60, "/health to report draining")
        try:
            await complete(c, "Hi", "critical")
            refused = None
        except openai.APIStatusError as exc:
            refused = exc

        async def consume(stream) -> tuple[int, str | None]:
            tokens, reason = 0, None
            async for chunk in stream:
                if chunk.usage:
                    tokens = chunk.usage.completion_tokens
                if chunk.choices:
                    reason = chunk.choices[0].finish_reason or reason
            return tokens, reason

        return health, refused, await asyncio.gather(*(consume(s) for s in streams))

    try:
        health, refused, finished = asyncio.run(run())
        assert health == {"status": "draining"}, health
        assert refused is not None and refused.status_code == 503 and refused.body["code"] == "draining"
        assert int(refused.response.headers["retry-after"]) >= 1
        assert finished == [(120, "length")] * len(PROMPTS)
        assert srv.proc.wait(120) == 0
    finally:
        srv.stop()


def _health(url: str) -> dict | None:
    """/health's body once it is not 200 (None while it is, or while a loaded machine is slow to answer)."""
    try:
        response = httpx.get(f"{url}/health", timeout=30)
    except httpx.TransportError:
        return None
    return None if response.status_code == 200 else response.json()
