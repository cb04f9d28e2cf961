"""Issue #36, finding 12, against a real gateway process: the answer that fills (or refills) a cache entry is
stored before the client has it, so the same question asked right after is a hit; identical requests that
arrive while one is on its way to the provider wait for it (one provider call), streamed ones following its
events live; a failed call releases them to try on their own.

Deterministic: the stand-in provider (gateway_stub_provider.py) holds its answers at a gate until the test
opens it, counts the completions it is asked for, and numbers each answer, so a test knows which call an
answer came from. The test opens the gate only once the gateway's /admin/status shows every request waiting.

Each test prints its totals (requests sent, statuses, provider calls) for docs/reliability.md.
"""
from __future__ import annotations

import contextlib
import json
import threading
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest
from gateway_support import (
    gateway,
    set_stub_gate,
    set_stub_mode,
    start_all,
    stub_provider,
    stub_state,
    wait_for,
)

pytestmark = pytest.mark.slow

ADMIN = {"authorization": "Bearer admin-secret"}


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("flight")
    stub, stub_url = stub_provider("flight-stub", tmp)
    config = {"timezone": "UTC", "key_defaults": {"rpm": 10**6},
              "retry": {"attempts_per_provider": 1, "request_deadline_s": 120},
              "providers": {"stub": {"base_url": stub_url + "/v1", "timeout_s": 120,
                                     "models": {"small": {"name": "stub", "input": 1.0, "output": 1.0}}}},
              "routes": {"chat": {"small": ["stub/small"], "sources": ["wiki"]}}}
    process, url = gateway("flight-gw", config, tmp, "admin-secret")
    with contextlib.ExitStack() as stack:
        start_all(stack, stub, process)
        key = httpx.post(url + "/admin/keys", json={"user": "fay"}, headers=ADMIN, timeout=10).json()["key"]
        yield {"url": url, "stub": stub_url, "auth": {"authorization": f"Bearer {key}"}}


@pytest.fixture
def stub(gw):
    """The stand-in answers at once before and after each test, whatever the test left it doing."""
    set_stub_mode(gw["stub"], "ok")
    set_stub_gate(gw["stub"], True)
    yield gw["stub"]
    set_stub_mode(gw["stub"], "ok")
    set_stub_gate(gw["stub"], True)


@dataclass
class Answer:
    status: int
    cache: str | None
    text: str | None
    trace_id: str


def ask(gw: dict, question: str, stream: bool = False, first_event: threading.Event | None = None, **extra) -> Answer:
    """One chat request; a streamed one is read to its end ([DONE]), first_event set at its first text."""
    body = {"model": "chat", "messages": [{"role": "user", "content": question}], "max_tokens": 8,
            "temperature": 0, "stream": stream, **extra}
    if not stream:
        r = httpx.post(gw["url"] + "/v1/chat/completions", json=body, headers=gw["auth"], timeout=120)
        text = r.json()["choices"][0]["message"]["content"] if r.status_code == 200 else None
        return Answer(r.status_code, r.headers.get("x-gateway-cache"), text, r.headers["x-gateway-trace-id"])
    parts = []
    with httpx.stream("POST", gw["url"] + "/v1/chat/completions", json=body, headers=gw["auth"], timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                parts += [c["delta"].get("content") or "" for c in event["choices"]]
                if first_event is not None and parts:
                    first_event.set()
        return Answer(r.status_code, r.headers.get("x-gateway-cache"), "".join(parts), r.headers["x-gateway-trace-id"])


def waiting(gw: dict) -> int:
    return httpx.get(gw["url"] + "/admin/status", headers=ADMIN, timeout=10).json()["flights"]["waiting"]


def traces(gw: dict, ids: list[str]) -> list[dict]:
    rows = {t["trace_id"]: t for t in httpx.get(gw["url"] + "/admin/traces?limit=200", headers=ADMIN,
                                                 timeout=10).json()["data"]}
    return [rows[i] for i in ids]


def report(name: str, answers: list[Answer], provider_calls: int) -> None:
    print(json.dumps({"test": name, "requests": len(answers), "statuses": dict(Counter(a.status for a in answers)),
                      "cache": dict(Counter(a.cache for a in answers)), "provider_calls": provider_calls}))


LANDMARKS = ["the Eiffel Tower", "the Golden Gate Bridge", "the Sydney Opera House", "Big Ben", "the Colosseum",
             "the Taj Mahal", "the Statue of Liberty", "the Great Wall of China"]


def test_an_answer_is_in_the_cache_before_its_client_has_it(gw, stub):
    """Miss, then at once a hit; the source moves, stale, then at once a hit again: no wait between asking."""
    before, answers = stub_state(stub)["requests"], []
    for stream, ask_about in ((False, "When was {} built?"), (True, "Who designed {}?")):
        for landmark in LANDMARKS:
            question = ask_about.format(landmark)
            first, again = ask(gw, question, stream), ask(gw, question, stream)
            httpx.post(gw["url"] + "/admin/sources/wiki/bump", headers=ADMIN, timeout=10).raise_for_status()
            fresh, refilled = ask(gw, question, stream), ask(gw, question, stream)
            answers += [first, again, fresh, refilled]
            assert [a.cache for a in (first, again, fresh, refilled)] == ["miss", "hit", "stale", "hit"], question
            assert again.text == first.text and refilled.text == fresh.text != first.text
    calls = stub_state(stub)["requests"] - before
    report("fill", answers, calls)
    assert calls == 32 and all(a.status == 200 for a in answers)  # one call per miss or stale, none per hit


def test_identical_concurrent_misses_share_one_provider_call(gw, stub):
    question, before = "Which river flows through the city of Lyon?", stub_state(stub)["requests"]
    set_stub_gate(stub, False)
    with ThreadPoolExecutor(8) as pool:
        leader = pool.submit(ask, gw, question)
        wait_for(lambda: stub_state(stub)["waiting"] == 1, 30, "the leader's call at the provider")
        waiters = [pool.submit(ask, gw, question, n % 2 == 1) for n in range(7)]  # whole and streamed
        wait_for(lambda: waiting(gw) == 7, 30, "seven identical requests waiting for the leader")
        set_stub_gate(stub, True)
        answers = [leader.result()] + [w.result() for w in waiters]
    calls = stub_state(stub)["requests"] - before
    report("coalesce", answers, calls)
    assert calls == 1 and [a.status for a in answers] == [200] * 8
    assert {a.text for a in answers} == {f"stub answer {before + 1}"}  # the one call's answer, for everyone
    assert [a.cache for a in answers] == ["miss"] + ["coalesced"] * 7
    rows = traces(gw, [a.trace_id for a in answers])
    assert rows[0]["cost_usd"] > 0 and all(t["cost_usd"] == 0 and t["attempts"] == [] for t in rows[1:])
    assert {t["coalesced_with"] for t in rows[1:]} == {answers[0].trace_id}
    assert ask(gw, question).cache == "hit"


def test_requests_offering_tools_are_not_coalesced(gw, stub):
    """Their answer is often a tool call, which is never handed to another request: each calls on its own."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    set_stub_gate(stub, False)
    with ThreadPoolExecutor(2) as pool:
        answers = [pool.submit(ask, gw, "What is the weather in Lyon?", tools=tools) for _ in range(2)]
        wait_for(lambda: stub_state(stub)["waiting"] == 2, 30, "both requests at the provider")
        set_stub_gate(stub, True)
        assert [a.result().cache for a in answers] == ["miss", "miss"]


def test_streamed_waiters_follow_the_leaders_stream_live(gw, stub):
    """The provider holds the stream after its first event: waiters that stream already have that event (they
    follow the one upstream stream), a whole-answer waiter waits for the end; then all get the same answer."""
    question, before = "Name the longest bridge over the Rhine.", stub_state(stub)["requests"]
    set_stub_gate(stub, False)
    seen = [threading.Event() for _ in range(4)]
    with ThreadPoolExecutor(5) as pool:
        leader = pool.submit(ask, gw, question, True, seen[0])
        wait_for(lambda: stub_state(stub)["waiting"] == 1 and seen[0].is_set(), 30, "the leader's first event")
        followers = [pool.submit(ask, gw, question, True, event) for event in seen[1:]]
        whole = pool.submit(ask, gw, question)
        wait_for(lambda: all(e.is_set() for e in seen) and waiting(gw) == 1, 30,
                 "three followers with the first event, one whole-answer waiter")
        assert stub_state(stub)["waiting"] == 1  # still held: the followers' first event came from the leader's stream
        set_stub_gate(stub, True)
        answers = [leader.result()] + [f.result() for f in followers] + [whole.result()]
    calls = stub_state(stub)["requests"] - before
    report("stream", answers, calls)
    assert calls == 1 and {a.text for a in answers} == {f"stub answer {before + 1}"}
    assert [a.cache for a in answers] == ["miss"] + ["coalesced"] * 4
    assert all(t["cost_usd"] == 0 for t in traces(gw, [a.trace_id for a in answers[1:]]))


def test_a_failed_call_releases_its_waiters_to_try_on_their_own(gw, stub):
    question, before = "What is the tallest tower in Marseille?", stub_state(stub)["requests"]
    set_stub_mode(stub, "fail")  # the leader's call will fail; the calls after it will not
    set_stub_gate(stub, False)
    with ThreadPoolExecutor(4) as pool:
        leader = pool.submit(ask, gw, question)
        wait_for(lambda: stub_state(stub)["waiting"] == 1, 30, "the leader's call at the provider")
        waiters = [pool.submit(ask, gw, question, n == 0) for n in range(3)]
        wait_for(lambda: waiting(gw) == 3, 30, "three identical requests waiting for the leader")
        set_stub_mode(stub, "ok")
        set_stub_gate(stub, True)
        answers = [leader.result()] + [w.result() for w in waiters]
    calls = stub_state(stub)["requests"] - before
    report("release", answers, calls)
    assert [a.status for a in answers] == [502, 200, 200, 200] and calls == 4
    assert len({a.text for a in answers[1:]}) == 3  # each released waiter got an answer of its own call
    assert all(t["coalesced_with"] == answers[0].trace_id for t in traces(gw, [a.trace_id for a in answers[1:]]))


def test_the_upstream_stream_is_dropped_only_when_every_reader_left(gw, stub):
    question = "Which mountain pass links Grenoble and Turin?"
    set_stub_gate(stub, False)
    body = {"model": "chat", "messages": [{"role": "user", "content": question}], "max_tokens": 8,
            "temperature": 0, "stream": True}
    abandoned = stub_state(stub)["abandoned"]
    with ThreadPoolExecutor(1) as pool:
        with httpx.stream("POST", gw["url"] + "/v1/chat/completions", json=body, headers=gw["auth"], timeout=60) as r:
            lines = r.iter_lines()  # held: a line iterator dropped closes the response
            assert next(lines).startswith("data: {")
            leader = r.headers["x-gateway-trace-id"]
            follower = pool.submit(ask, gw, question, True, first := threading.Event())
            wait_for(first.is_set, 30, "the follower's first event")
        # The leader's client left (its trace says so); the follower still reads: the provider's stream goes on.
        wait_for(lambda: any(t["trace_id"] == leader and t["status"] == 499 for t in httpx.get(
            gw["url"] + "/admin/traces?limit=20", headers=ADMIN, timeout=10).json()["data"]), 30, "the leader's 499")
        set_stub_gate(stub, True)
        assert follower.result().text.startswith("stub answer") and stub_state(stub)["abandoned"] == abandoned
    # A lone reader that leaves takes the upstream stream with it (a pagedserve provider would stop generating).
    set_stub_gate(stub, False)
    lone = {**body, "messages": [{"role": "user", "content": "Which mountain pass links Nice and Cuneo?"}]}
    with httpx.stream("POST", gw["url"] + "/v1/chat/completions", json=lone, headers=gw["auth"], timeout=60) as r:
        next(line for line in r.iter_lines() if line.startswith("data: {"))
    wait_for(lambda: stub_state(stub)["abandoned"] == abandoned + 1, 30, "the lone reader's upstream to be dropped")
