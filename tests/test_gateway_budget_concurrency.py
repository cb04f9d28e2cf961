"""Daily budgets under concurrent bursts, with real token counts: a real `pagedserve serve` answers, and the
gateway (one on SQLite, or two sharing one redis-server) must never let a key's spend pass its budget by
more than one request's actual cost, whatever the text (English, Chinese: ~1 token per character) and n.

The figures printed here are the reliability table's (docs/gateway.md): requests, budget, spent, overspend.
"""
from __future__ import annotations

import asyncio
import contextlib
import json

import httpx
import pytest
from gateway_support import cli, gateway, pagedserve_server, redis_server, start_all

pytestmark = pytest.mark.slow

ADMIN = "admin-secret"
BUDGET = 0.15  # dollars: about a dozen of the requests below
WAVES, PER_WAVE = 3, 20
ENGLISH = "Summarise the travel expense policy for a trip to Berlin in one sentence."
CHINESE = "请用一句话总结去柏林出差的差旅费用报销政策，并列出需要提交的所有文件和审批步骤。"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    # KV room for a whole burst: the engine's own overload shedding (429) is not what is measured here.
    process, url = pagedserve_server("budget-engine", tmp_path_factory.mktemp("engine"), ["--kv-cache-memory", "256MiB"])
    with process:
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        warm = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        # The first prefill and decode build the engine's kernels (a minute on busy cores): not the gateway's time.
        httpx.post(url + "/v1/chat/completions", json=warm, timeout=600).raise_for_status()
        yield url, model


def config(engine, **extra) -> dict:
    url, model = engine
    return {"cache": {"enabled": False}, "timezone": "UTC", "retry": {"request_deadline_s": 300},
            "providers": {"engine": {"base_url": url + "/v1", "timeout_s": 300,
                                     "models": {"small": {"name": model, "input": 100.0, "output": 400.0}}}},
            "routes": {"chat": {"small": ["engine/small"]}}, **extra}


def body(i: int) -> dict:
    """English, Chinese, and English with n=4: the mixes that overspent with a characters/4 estimate."""
    text, n = [(ENGLISH, 1), (CHINESE, 1), (ENGLISH, 4)][i % 3]
    return {"model": "chat", "messages": [{"role": "user", "content": f"{i}. {text}"}], "max_tokens": 8, "n": n,
            "temperature": 0.7 if n > 1 else 0}


async def bursts(urls: list[str], token: str) -> list[int]:
    """WAVES waves of PER_WAVE requests sent at once, spread over the gateways; the statuses."""
    statuses = []
    async with httpx.AsyncClient(timeout=300, headers={"authorization": f"Bearer {token}"}) as client:
        for wave in range(WAVES):
            calls = [client.post(urls[i % len(urls)] + "/v1/chat/completions", json=body(wave * PER_WAVE + i))
                     for i in range(PER_WAVE)]
            statuses += [r.status_code for r in await asyncio.gather(*calls)]
    return statuses


def measure(urls: list[str], key: dict, statuses: list[int]) -> dict:
    admin = {"authorization": f"Bearer {ADMIN}"}
    usage = httpx.get(urls[0] + "/admin/usage", headers=admin, timeout=10).json()["data"]
    spent = next(r["spend_usd"] for r in usage if r["scope"] == f"key:{key['key_id']}")
    traces = [t for u in urls for t in httpx.get(u + "/admin/traces", params={"limit": 1000, "key_id": key["key_id"]},
                                                  headers=admin, timeout=10).json()["data"]]
    costs = [t["cost_usd"] for t in traces if t["status"] == 200]
    figures = {"requests": len(statuses), "ok": statuses.count(200), "refused": statuses.count(429),
               "budget": BUDGET, "spent": round(spent, 6), "overspend": round(max(spent - BUDGET, 0.0), 6),
               "max_cost": max(costs), "notes": [t["budget_note"] for t in traces if t["budget_note"]]}
    print(json.dumps(figures))
    assert set(statuses) <= {200, 429}, statuses
    assert figures["ok"] >= 3 and figures["refused"] >= 10  # the budget was reached, and it bound
    assert spent == pytest.approx(sum(costs), abs=1e-9)  # spend is real usage: every hold was released
    assert spent <= BUDGET + max(costs)  # the goal; with a worst-case hold it does not pass the budget at all
    assert spent <= BUDGET and figures["notes"] == []  # no request used more than it had reserved
    return figures


def test_budget_holds_under_bursts_on_sqlite(engine, tmp_path):
    process, url = gateway("budget-sqlite", config(engine), tmp_path, ADMIN)
    with process:
        key = json.loads(cli("gateway", "keys", "create", "--config", str(tmp_path / "budget-sqlite.yaml"),
                             "--user", "una", "--daily-budget", str(BUDGET)))
        measure([url], key, asyncio.run(bursts([url], key["key"])))


def test_budget_holds_under_bursts_on_two_gateways_sharing_redis(engine, tmp_path):
    redis_process, redis_url = redis_server(tmp_path)
    with contextlib.ExitStack() as stack:
        stack.enter_context(redis_process)
        a, url_a = gateway("budget-a", config(engine, store=redis_url), tmp_path, ADMIN)
        b, url_b = gateway("budget-b", config(engine, store=redis_url), tmp_path, ADMIN)
        start_all(stack, a, b)
        key = json.loads(cli("gateway", "keys", "create", "--config", str(tmp_path / "budget-a.yaml"),
                             "--user", "vic", "--daily-budget", str(BUDGET)))
        measure([url_a, url_b], key, asyncio.run(bursts([url_a, url_b], key["key"])))
