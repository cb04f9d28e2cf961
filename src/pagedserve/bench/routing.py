"""Routing benchmark (`pagedserve bench routing`, benchmarks/routing.py).

Real mode: N local replicas, a multi-tenant chat workload (T tenants, each with its own long system
prompt; several users per tenant; multi-turn conversations), run once through a router per policy.
Each policy gets its own tenant prompts (a per-run salt), so no policy inherits another's warm cache.
Prefix hit rate comes from the replicas' own counters; TTFT and throughput from the client side.
It also calibrates the simulator: prefill cost per uncached token and decode cost per token on one
otherwise idle replica.

Simulation mode (--simulate): see routing_sim.py; clearly a model, not a measurement.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.bench.measure import spread
from pagedserve.bench.report import REPO, commit, replace_section
from pagedserve.cluster.launcher import LocalCluster, free_port, wait_healthy

SECTION = "## Routing policies (benchmarks/routing.py)"
WORDS = ("account", "invoice", "refund", "shipping", "warranty", "policy", "customer", "order", "delivery", "return", "support", "agent", "product", "manual", "battery", "screen", "charger", "network", "router", "modem", "password", "login", "security", "privacy", "contract", "renewal", "discount", "premium", "basic", "plan", "upgrade", "downgrade", "billing", "cycle", "payment", "card", "bank", "transfer", "receipt", "tax", "region", "store", "opening", "hours", "holiday", "weekend", "schedule", "manager", "escalate", "ticket", "priority", "urgent", "normal", "low", "response", "time", "apology", "thanks", "greeting", "closing")


@dataclass(slots=True)
class PolicyResult:
    policy: str
    requests: int
    seconds: float
    output_tokens: int
    hit_rate: float
    ttft: list[float] = field(default_factory=list)
    per_replica: list[int] = field(default_factory=list)

    def row(self) -> dict:
        q = statistics.quantiles(self.ttft, n=100) if len(self.ttft) > 1 else self.ttft * 99
        return {"policy": self.policy, "requests": self.requests, "req_s": self.requests / self.seconds,
                "tok_s": self.output_tokens / self.seconds, "hit_rate": self.hit_rate,
                "ttft_p50": q[49], "ttft_p99": q[98], "per_replica": self.per_replica}


def counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in ("pagedserve_prefix_cache_hit_tokens_total", "pagedserve_prefix_cache_query_tokens_total"):
                out[s.name] = out.get(s.name, 0.0) + s.value
            if s.name == "pagedserve_requests_total" and "chat" in s.labels.get("endpoint", ""):
                out["chat"] = out.get("chat", 0.0) + s.value
    return out


def system_prompt(url: str, tenant: int, salt: str, tokens: int, rng: random.Random) -> str:
    """A tenant's own system prompt of about `tokens` tokens (measured with the replica's /tokenize)."""
    head = f"You are the support assistant of tenant {tenant} (run {salt}). Follow these notes:\n"
    words = [rng.choice(WORDS) for _ in range(tokens)]
    text = head + " ".join(words)
    count = len(httpx.post(url + "/tokenize", json={"prompt": text}, timeout=30).json()["tokens"])
    keep = max(1, int(len(words) * tokens / count))
    return head + " ".join(words[:keep])


async def chat_turn(client: httpx.AsyncClient, model: str, messages: list[dict], max_tokens: int,
                    ttfts: list[float]) -> tuple[str, int]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start, first, text, tokens = time.perf_counter(), None, [], 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            for choice in chunk.get("choices", []):
                if choice.get("delta", {}).get("content") and first is None:
                    first = time.perf_counter()
                text.append(choice.get("delta", {}).get("content") or "")
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    ttfts.append((first or time.perf_counter()) - start)
    return "".join(text), tokens


async def run_workload(router_url: str, model: str, prompts: list[str], args: argparse.Namespace,
                       ttfts: list[float]) -> int:
    conversations = asyncio.Queue()
    for user in range(args.users):
        for tenant, prompt in enumerate(prompts):
            conversations.put_nowait((tenant, user, prompt))
    output_tokens = 0

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal output_tokens
        while not conversations.empty():
            tenant, user, prompt = conversations.get_nowait()
            messages = [{"role": "system", "content": prompt}]
            for turn in range(args.turns):
                messages.append({"role": "user", "content": f"User {user} asks question {turn}: where is my "
                                                            f"order {tenant * 100 + user}?"})
                text, tokens = await chat_turn(client, model, messages, args.max_tokens, ttfts)
                output_tokens += tokens
                messages.append({"role": "assistant", "content": text})

    async with httpx.AsyncClient(base_url=router_url, timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
    return output_tokens


def run_policy(policy: str, urls: list[str], model: str, args: argparse.Namespace, salt: str) -> PolicyResult:
    port = free_port()
    router_url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "pagedserve.cli", "--log-level", "WARNING", "router", "--policy", policy,
               "--port", str(port), *[a for u in urls for a in ("--replica", u)]]
    router = subprocess.Popen(command)
    try:
        wait_healthy(router_url, time.monotonic() + 60)
        rng = random.Random(args.seed)
        prompts = [system_prompt(urls[0], t, salt, args.system_tokens, rng) for t in range(args.tenants)]
        before = [counters(u) for u in urls]
        ttfts: list[float] = []
        start = time.perf_counter()
        tokens = asyncio.run(run_workload(router_url, model, prompts, args, ttfts))
        seconds = time.perf_counter() - start
        after = [counters(u) for u in urls]
    finally:
        router.terminate()
        router.wait(30)
    hit = sum(a.get("pagedserve_prefix_cache_hit_tokens_total", 0) - b.get("pagedserve_prefix_cache_hit_tokens_total", 0)
              for a, b in zip(after, before, strict=True))
    query = sum(a.get("pagedserve_prefix_cache_query_tokens_total", 0)
                - b.get("pagedserve_prefix_cache_query_tokens_total", 0) for a, b in zip(after, before, strict=True))
    per_replica = [int(a.get("chat", 0) - b.get("chat", 0)) for a, b in zip(after, before, strict=True)]
    return PolicyResult(policy, len(ttfts), seconds, tokens, hit / query if query else 0.0, ttfts, per_replica)


def calibrate(url: str, model: str, tokens: int) -> dict:
    """Cost model inputs, on one replica with the others idle: warm (cached) and cold prefill, decode."""
    rng = random.Random(12345)
    prompt = system_prompt(url, 999, f"calibration-{time.time()}", tokens, rng)

    def ttft(max_tokens: int) -> tuple[float, float]:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
        start = time.perf_counter()
        usage = httpx.post(url + "/v1/completions", json=body, timeout=600).json()["usage"]
        return time.perf_counter() - start, usage["prompt_tokens"]

    cold, prompt_tokens = ttft(1)
    warm, _ = ttft(1)
    long, _ = ttft(33)
    return {"prompt_tokens": prompt_tokens, "cold_s": cold, "warm_s": warm,
            "prefill_s_per_token": max(cold - warm, 1e-6) / prompt_tokens,
            "decode_s_per_token": max(long - warm, 1e-6) / 32, "measured": datetime.now(UTC).isoformat()}


def report(results: dict[str, list[PolicyResult]], args: argparse.Namespace, calibration: dict, sim: str) -> str:
    lines = [SECTION, "",
             f"Command: `pagedserve bench routing {command_line(args)}`  ",
             (f"Machine: {platform.machine()}, {os.cpu_count()} CPU cores shared with other work, no GPU; "
              f"{args.replicas} replicas of SmolLM2-135M-Instruct (1 thread each, admission control off); "
              f"date {datetime.now(UTC):%Y-%m-%d %H:%M}; commit {commit()}.  "),
             (f"Workload: {args.tenants} tenants x {args.users} users x {args.turns} turns, "
              f"~{args.system_tokens}-token system prompt per tenant, {args.max_tokens} output tokens per turn, "
              f"{args.concurrency} concurrent conversations (closed loop). Every replica is warmed before the first "
              f"policy; each policy gets tenant prompts of its own per round (no policy inherits another's cache); "
              f"{args.repeats} rounds, the policy order reversed every round. Figures: median (min-max over "
              f"the rounds)."), ""]
    for pool, runs in results.items():
        lines += [f"KV pool {pool} per replica:", "",
                  ("| policy | requests | req/s | output tok/s | prefix hit rate | TTFT p50 (s) | TTFT p99 (s) | "
                   "requests per replica (first round) | req/s vs RR | hit rate vs RR |"),
                  "|---|---|---|---|---|---|---|---|---|---|"]
        by_policy: dict[str, list[dict]] = {}
        for run in runs:
            by_policy.setdefault(run.policy, []).append(run.row())
        med = {p: {k: statistics.median(r[k] for r in rows) for k in ("req_s", "hit_rate")} for p, rows in by_policy.items()}
        base = med.get("round_robin", next(iter(med.values())))
        for policy, rows in by_policy.items():
            def col(key: str, fmt: str = "{:.2f}", rows: list[dict] = rows) -> str:
                return spread([r[key] for r in rows], fmt)
            hit_ratio = med[policy]["hit_rate"] / base["hit_rate"] if base["hit_rate"] else float("inf")
            lines.append(f"| {policy} | {rows[0]['requests']} | {col('req_s')} | {col('tok_s', '{:.1f}')} | "
                         f"{col('hit_rate', '{:.1%}')} | {col('ttft_p50')} | {col('ttft_p99')} | "
                         f"{rows[0]['per_replica']} | {med[policy]['req_s'] / base['req_s']:.2f}x | {hit_ratio:.1f}x |")
        lines.append("")
    lines += [("Hit rate: prompt tokens served from the replicas' prefix caches / prompt tokens looked up, "
               "from the replicas' own /metrics. TTFT is client-side, through the router."), "",
              (f"Calibration (one replica, others idle): prefill {calibration['prefill_s_per_token'] * 1e3:.2f} ms "
               f"per uncached token, decode {calibration['decode_s_per_token'] * 1e3:.1f} ms per token, "
               f"cached-prompt overhead {calibration['warm_s']:.2f} s."), "", sim]
    return "\n".join(lines) + "\n"


def command_line(args: argparse.Namespace) -> str:
    flags = ("replicas", "tenants", "users", "turns", "system_tokens", "max_tokens", "concurrency", "kv_cache_memory",
             "repeats")
    return " ".join(f"--{f.replace('_', '-')} {getattr(args, f)}" for f in flags)



# `pagedserve bench all --quick`: every part of this benchmark, at a scale of seconds.
QUICK = ["--replicas", "2", "--kv-cache-memory", "64MiB", "--repeats", "1", "--tenants", "2", "--users", "1", "--turns", "2", "--system-tokens", "200", "--max-tokens", "4", "--concurrency", "2"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--replicas", type=int, default=4, help="local replicas (1 thread each)")
    p.add_argument("--policies", default="round_robin,least_load,prefix_affinity", help="comma-separated")
    p.add_argument("--tenants", type=int, default=16, help="tenants, each with its own system prompt")
    p.add_argument("--users", type=int, default=2, help="conversations per tenant")
    p.add_argument("--turns", type=int, default=3, help="turns per conversation")
    p.add_argument("--system-tokens", type=int, default=1000, help="system prompt length per tenant")
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens per turn")
    p.add_argument("--concurrency", type=int, default=8, help="conversations in flight (closed loop)")
    p.add_argument("--kv-cache-memory", default="128MiB,512MiB",
                   help="KV pool per replica, comma-separated, one run each. 128MiB holds a few tenants' prompts, "
                        "not all: the regime where the choice of replica decides the hits. 512MiB is the server's "
                        "default, where most of the working set fits whatever the policy")
    p.add_argument("--repeats", type=int, default=2,
                   help="rounds over the policies per pool size; the order reverses every round")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--simulate", action="store_true",
                   help="only the simulation, printed (uses the calibration the last real run saved in --docs)")
    p.add_argument("--docs", type=Path, default=REPO / "docs",
                   help="where benchmarks.md and routing_calibration.json go")


def run_args(args: argparse.Namespace) -> int:
    from pagedserve.bench.routing_sim import DEFAULT_CALIBRATION, simulation_report

    logging.getLogger("httpx").setLevel(logging.WARNING)
    if args.simulate:
        saved = args.docs / "routing_calibration.json"
        calibration = json.loads(saved.read_text()) if saved.is_file() else DEFAULT_CALIBRATION
        print(simulation_report(calibration, args.seed))
        return 0
    results: dict[str, list[PolicyResult]] = {}
    calibration = None
    for pool in args.kv_cache_memory.split(","):
        # Admission control off: a shed request would be retried elsewhere by the router, or fail, and the
        # policies would be compared on what the replicas refused rather than on where the cache was.
        serve_args = ["--kv-cache-memory", pool, "--num-threads", "1", "--max-num-seqs", "16",
                      "--max-model-len", "4096", "--embedding-model", "none", "--disable-access-log",
                      "--admission-control", "off"]
        with LocalCluster(args.replicas, serve_args) as cluster:
            urls = cluster.urls()
            model = httpx.get(urls[0] + "/v1/models", timeout=10).json()["data"][0]["id"]
            for url in urls:  # every replica warm before the first policy, so none runs cold
                calibrate(url, model, 64)
            if calibration is None:
                calibration = calibrate(urls[0], model, args.system_tokens)
                print("calibration:", calibration, flush=True)
            policies = args.policies.split(",")
            for r in range(args.repeats):
                for policy in policies if r % 2 == 0 else policies[::-1]:
                    result = run_policy(policy, urls, model, args, salt=f"{policy}-{pool}-{r}")
                    results.setdefault(pool, []).append(result)
                    print(pool, json.dumps(result.row()), flush=True)
    (args.docs / "routing_calibration.json").write_text(json.dumps(calibration, indent=1) + "\n")
    sim = simulation_report(calibration, args.seed)
    section = report(results, args, calibration, sim)
    print(section)
    replace_section(section, args.docs / "benchmarks.md")
    return 0
