"""Gateway benchmark (benchmarks/gateway.py, `pagedserve bench gateway`).

1. Added latency on a cache miss: the same requests sent alternately straight to a `pagedserve serve`
   engine and through a `pagedserve gateway` in front of it (p50 / p99 of the difference), for the full
   pipeline (semantic cache + classifier) with speculative calls on simple and on hard questions (the
   best case: the lexical guess is always right) and on a mixed stream (labelled questions, some with a
   wordy suffix that fools the guess, some repeated so that cache hits waste the speculative call), serially,
   and for the plumbing alone (cache off, one tier). Engine and gateway are pinned to separate cores
   (--engine-cpus).
2. Semantic-cache lookup time at 100k entries (faiss HNSW + SQLite fetch), against exact flat search.
3. Hit rate, false hits and staleness on a replayed question stream with source-version bumps and near-miss
   questions (negated, another country, another year: other answers), with the near-miss guard on and off,
   against an exact-match cache.
Results replace the "## Gateway" section of docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import contextlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import numpy as np

from pagedserve.bench.gateway_replay import VARIANTS, replay
from pagedserve.bench.report import REPO, command_line, replace_section
from pagedserve.bench.servers import free_port

SECTION = "## Gateway"

SERVER_ARGS = ["--kv-cache-memory", "64MiB", "--max-num-seqs", "8", "--max-model-len", "1024",
               "--embedding-model", "none", "--disable-access-log"]
EMBED_NOTES = ["the gateway's: paid once per request (cache miss), shared with the classifier",
               "peer: the same encoder in fp32"]
SIMPLE = "What is {i} {op} {j}?"  # the classifier sends it to the small tier
HARD = "Why is {i} {op} {j} what it is? Explain your reasoning step by step."  # ... and this to the large one
# A wordy ending that makes the lexical guess say "hard" for many questions the classifier calls simple.
WORDY = " Please answer in detail and compare the alternatives."
MIXED = "mixed"  # labelled questions, a third with WORDY, a quarter repeats of earlier ones
# (name, cache + classifier on, speculative call, question template or MIXED)
CONFIGURATIONS = [("full pipeline, speculative, simple question (best case)", True, True, SIMPLE),
                  ("full pipeline, speculative, hard question (best case)", True, True, HARD),
                  ("full pipeline, speculative, mixed stream", True, True, MIXED),
                  ("full pipeline, serial, simple question", True, False, SIMPLE),
                  ("full pipeline, serial, mixed stream", True, False, MIXED),
                  ("full pipeline + retrieval (k=3 over Python's documentation topics), mixed stream", True, False, MIXED),
                  ("plumbing only (cache off, one tier)", False, False, SIMPLE)]
RETRIEVAL_ROW = 5  # its route retrieves from Python's documentation topics (bench/retrieval.py's corpus)
def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


@contextlib.contextmanager
def process(command: list[str], url: str, log: Path, cpus: set[int] | None = None, timeout: float = 300):
    import httpx

    if cpus and shutil.which("taskset"):
        command = ["taskset", "-c", ",".join(map(str, sorted(cpus))), *command]
    with open(log, "ab") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{' '.join(command)} exited:\n{log.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{' '.join(command)} did not start")
            time.sleep(0.2)
        yield proc
    finally:
        proc.terminate()
        proc.wait(30)


def split_cpus(engine_cpus: int) -> tuple[set[int], set[int]]:
    """The engine on its own cores and the gateway on the rest, as on separate hosts: an engine's OpenMP
    threads sharing a core with the gateway's embedding stall at every barrier."""
    cpus = sorted(os.sched_getaffinity(0))
    if engine_cpus <= 0 or engine_cpus >= len(cpus):
        return set(cpus), set(cpus)
    return set(cpus[:engine_cpus]), set(cpus[engine_cpus:])


def question_pairs(template: str, count: int, seed: int) -> list[tuple[str, str]]:
    """(question sent straight to the engine, question sent through the gateway) per call pair. Different
    texts of the same shape, so that neither side gets the other's prefix-cache blocks."""
    if template != MIXED:
        return [(template.format(i=i, j=i + 7, op="plus"), template.format(i=i, j=i + 7, op="minus"))
                for i in range(count)]
    from pagedserve.gateway.classify import load_examples

    rng = np.random.default_rng(seed)
    pool = [text for text, _ in load_examples()]
    rng.shuffle(pool)
    asked: list[str] = []
    pairs = []
    for _ in range(count):
        if asked and rng.random() < 0.25:  # a repeat: a cache hit that makes the speculative call wasted work
            question = asked[rng.integers(len(asked))]
        else:
            question = pool[len(asked) % len(pool)] + (WORDY if rng.random() < 1 / 3 else "")
            asked.append(question)
        pairs.append(("Hi! " + question, question))
    return pairs


def overhead(args: argparse.Namespace, tmp: Path) -> list[dict]:
    """Alternating direct / gateway calls, each configuration on its own fresh gateway."""
    import asyncio

    import httpx
    import yaml

    from pagedserve.gateway.auth import mint_key
    from pagedserve.gateway.store import SQLiteStore

    server_port = free_port()
    server = f"http://127.0.0.1:{server_port}"
    rows = []
    engine_cpus, gateway_cpus = split_cpus(args.engine_cpus)
    serve = [sys.executable, "-m", "pagedserve.cli", "serve", "--port", str(server_port), *SERVER_ARGS,
             "--num-threads", str(len(engine_cpus))]
    with process(serve, server, tmp / "server.log", engine_cpus):
        model = httpx.get(server + "/v1/models").json()["data"][0]["id"]
        for i, (name, full, speculate, template) in enumerate(CONFIGURATIONS):
            port, data = free_port(), tmp / f"gw-{i}"
            token, key = mint_key("bench")
            asyncio.run(SQLiteStore(data / "gateway.db").put_key(key))
            models = {"small": {"name": model, "input": 0.1, "output": 0.4}, "large": {"name": model, "input": 1.0}}
            route = {"small": ["engine/small"], **({"large": ["engine/large"]} if full else {}), "speculate": speculate}
            if i == RETRIEVAL_ROW:
                asyncio.run(index_corpus(data / "gateway.db"))
                route["retrieval"] = {"source": "pydoc", "k": 3}
            config = {"data_dir": str(data), "admin_key": "bench", "cache": {"enabled": full},
                      "budgets": {"user_daily_usd": 1000.0},
                      "providers": {"engine": {"base_url": server + "/v1", "models": models}},
                      "routes": {"bench": route}}
            (tmp / f"gw-{i}.yaml").write_text(yaml.safe_dump(config))
            command = [sys.executable, "-m", "pagedserve.cli", "gateway", "--config", str(tmp / f"gw-{i}.yaml"),
                       "--port", str(port)]
            gateway = f"http://127.0.0.1:{port}"
            pairs = question_pairs(template, args.requests + WARMUP, seed=i)
            with process(command, gateway, tmp / f"gw-{i}.log", gateway_cpus):
                rows.append({"name": name, **paired_calls(server, gateway, token, model, pairs)})
    return rows


WARMUP = 5  # call pairs that warm connections and caches, not counted


async def index_corpus(db: Path) -> None:
    from pagedserve.bench.retrieval import corpus
    from pagedserve.embedding import Embedder
    from pagedserve.gateway.retrieval.library import Library
    from pagedserve.gateway.store import SQLiteStore

    store = SQLiteStore(db)
    await Library(store, Embedder.load()).add("pydoc", corpus())
    await store.close()


def paired_calls(server: str, gateway: str, token: str, model: str, pairs: list[tuple[str, str]]) -> dict:
    import httpx

    direct, through, hits = [], [], []
    headers = {"authorization": f"Bearer {token}"}
    with httpx.Client(timeout=60) as c:
        def timed(url: str, name: str, text: str, auth: dict) -> tuple[float, str]:
            body = {"model": name, "messages": [{"role": "user", "content": text}], "max_tokens": 1, "temperature": 0}
            t = time.perf_counter()
            r = c.post(url + "/v1/chat/completions", json=body, headers=auth)
            elapsed = (time.perf_counter() - t) * 1000
            r.raise_for_status()
            return elapsed, r.headers.get("x-gateway-cache", "miss")
        for i, (direct_text, gateway_text) in enumerate(pairs):
            to_engine = (server, model, direct_text, {})
            to_gateway = (gateway, "bench", gateway_text, headers)
            if i % 2 == 0:  # alternating order: neither side always runs second
                (d, _), (t, cached) = timed(*to_engine), timed(*to_gateway)
            else:
                (t, cached), (d, _) = timed(*to_gateway), timed(*to_engine)
            if i < WARMUP:
                continue
            if cached == "hit":
                hits.append(t)
            else:
                direct.append(d)
                through.append(t)
        n = len(pairs) - WARMUP
        rows = written_traces(c, gateway, len(pairs))[:n]  # newest first: the timed calls
    assert all(t["status"] == 200 for t in rows), "a timed call failed"
    diffs = [t - d for d, t in zip(direct, through)]  # per pair: the engine's own variance mostly cancels
    misses = [t for t in rows if t["cache"] != "hit"]
    inside = [t["latency_ms"] - sum(a["latency_ms"] for a in t["attempts"]) for t in misses]
    return {"n": n, "route": describe_routes(rows, hits), "direct_p50": percentile(direct, 50),
            "gateway_p50": percentile(through, 50), "added_p50": percentile(diffs, 50),
            "added_p99": percentile(diffs, 99), "inside_p50": percentile(inside, 50),
            "inside_p99": percentile(inside, 99)}


def written_traces(client, gateway: str, count: int, patience_s: float = 30) -> list[dict]:
    """The newest count traces, once all are written (a trace is written after its response is sent)."""
    deadline = time.monotonic() + patience_s
    while True:
        rows = client.get(gateway + "/admin/traces", params={"limit": count},
                          headers={"authorization": "Bearer bench"}).json()["data"]
        if len(rows) == count or time.monotonic() > deadline:
            assert len(rows) == count, f"{len(rows)} traces written for {count} calls"
            return rows
        time.sleep(0.05)


def describe_routes(rows: list[dict], hit_ms: list[float]) -> str:
    """Tiers of the misses, the cache hits, and what became of the speculative calls, from the traces."""
    misses = [t for t in rows if t["cache"] != "hit"]
    small = sum(t["tier"] == "small" for t in misses) / len(misses)
    text = f"{small:.0%} small, {1 - small:.0%} large"
    if hit_ms:
        text += f"; cache hits {len(hit_ms) / len(rows):.0%} (through the gateway p50 {percentile(hit_ms, 50):.1f} ms)"
    searched = [t["retrieval_ms"] for t in misses if t.get("retrieval_ms") is not None]
    if searched:
        text += (f"; retrieval search p50 {percentile(searched, 50):.2f} ms, p99 {percentile(searched, 99):.2f} ms, "
                 f"{np.mean([len(t['retrieval']) for t in misses]):.1f} chunks per request")
    speculative = [t["speculative"] or "" for t in rows]
    if any(speculative):
        used = sum(s == "used" for s in speculative)
        on_hit = sum(s.endswith("(cache hit)") for s in speculative)
        other_tier = sum(s.endswith("tier)") for s in speculative)
        text += (f"; speculative call used {used / len(rows):.0%}, wasted on a cache hit {on_hit / len(rows):.0%}, "
                 f"on the other tier {other_tier / len(rows):.0%}")
    return text


def lookup_at_scale(args: argparse.Namespace, tmp: Path, embedder, questions: list[str]) -> dict:
    """100k entries clustered around real question embeddings; lookups of perturbed real questions."""
    import faiss

    from pagedserve.gateway.semantic_cache import SemanticCache

    rng = np.random.default_rng(0)
    centres = embedder.embed(questions)
    picks = rng.integers(0, len(centres), args.entries)
    noise = rng.standard_normal((args.entries, embedder.dim)).astype(np.float32) * 0.04
    vectors = centres[picks] + noise
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    cache = SemanticCache(tmp / "scale.db", embedder.dim)
    body = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "x" * 200}, "finish_reason": "stop"}]}
    t0 = time.perf_counter()
    for start in range(0, args.entries, 10_000):
        cache.put_many("scope", [f"q{i}" for i in range(start, start + 10_000)], vectors[start:start + 10_000],
                       body, {"hr-policy": "1"}, 86400)
    build_s = time.perf_counter() - t0
    # Each query is a stored entry plus a little noise (a paraphrase): the index must find that entry.
    planted = rng.integers(0, args.entries, args.queries)
    queries = vectors[planted] + rng.standard_normal((args.queries, embedder.dim)).astype(np.float32) * 0.005
    queries /= np.linalg.norm(queries, axis=1, keepdims=True)
    lookup_ms, found = [], []
    for q in queries:
        t = time.perf_counter()
        result = cache.lookup("scope", q, 0.95, {"hr-policy": "1"}, None)
        lookup_ms.append((time.perf_counter() - t) * 1000)
        found.append(result.entry.entry_id if result.result == "hit" else None)
    flat = faiss.IndexFlatIP(embedder.dim)
    flat.add(vectors)
    flat_ms, exact = [], []
    for q in queries:
        t = time.perf_counter()
        _, ids = flat.search(q.reshape(1, -1), 1)
        flat_ms.append((time.perf_counter() - t) * 1000)
        exact.append(int(ids[0][0]) + 1)  # entry ids start at 1 in insertion order
    recall = float(np.mean([f == e for f, e in zip(found, exact)]))
    return {"entries": args.entries, "build_s": build_s, "lookup_p50": percentile(lookup_ms, 50),
            "lookup_p99": percentile(lookup_ms, 99), "flat_p50": percentile(flat_ms, 50),
            "flat_p99": percentile(flat_ms, 99), "recall": recall}


def embed_latency(embedders: dict, questions: list[str]) -> dict[str, tuple[float, float]]:
    """p50 / p99 ms of one query embedding, per embedder, interleaved so both see the same load."""
    times: dict[str, list[float]] = {name: [] for name in embedders}
    for text in questions[:100]:
        for name, embedder in embedders.items():
            t = time.perf_counter()
            embedder.embed([text])
            times[name].append((time.perf_counter() - t) * 1000)
    return {name: (percentile(v, 50), percentile(v, 99)) for name, v in times.items()}


def render(args, lines_overhead, scale, replay_rows, load: tuple[float, float]) -> str:
    out = [SECTION, "",
           f"Command: `{command_line()}`",
           (f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores shared with other work "
           f"(load average {load[0]:.1f} before, {load[1]:.1f} after); CPU only. Date: {datetime.now():%Y-%m-%d %H:%M}."),
           "", "### Latency added on a cache miss (SmolLM2-135M engine, max_tokens=1; added = paired difference)", "",
           ("| gateway | n | routed | direct p50 ms | through gateway p50 ms | added p50 ms | added p99 ms | "
           "in-gateway p50 ms | in-gateway p99 ms |"), "|---|---|---|---|---|---|---|---|---|"]
    for r in lines_overhead:
        out.append(f"| {r['name']} | {r['n']} | {r['route']} | {r['direct_p50']:.1f} | {r['gateway_p50']:.1f} | "
                   f"{r['added_p50']:.1f} | {r['added_p99']:.1f} | {r['inside_p50']:.2f} | {r['inside_p99']:.2f} |")
    pinning = (f"The engine runs on {args.engine_cpus} core(s) (`--engine-cpus {args.engine_cpus}`, as many threads) "
               "and the gateway on the rest, as on separate hosts" if args.engine_cpus > 0 else
               "Engine and gateway share every core (`--engine-cpus 0`)")
    out += ["", (f"{pinning}: an engine's OpenMP threads sharing a core with the gateway's query embedding stall at "
            "every barrier (tens of ms). \"In-gateway\" is each trace's total latency minus its provider attempts: "
            "the gateway's own work (auth, limits, budget, embedding, cache lookup, classifier, trace) outside the "
            "provider call. Serially, almost all of it is the one query embedding (table below); with "
            "`speculate: true` the call starts on the lexical guess's tier before the embedding, which then runs "
            "while the provider works (\"speculative call used\": the final classifier agreed). The best-case rows "
            "ask questions whose lexical guess is always right and never repeat; the mixed stream asks the labelled "
            "questions of the classifier's training set, a third of them with a wordy ending that fools the "
            "guess, a quarter repeats of earlier ones (\"wasted on a cache hit\": the cache answered and the "
            "speculative call was cancelled, or discarded if it had finished; \"on the other tier\": the "
            "classifier overruled the guess). Added latency is over the misses; hits are timed apart. The paired "
            "end-to-end difference also holds the engine's call-to-call variation; run to run its p50 moves by "
            "about 1 ms. The retrieval row's route also searches its source (and puts what passes min_score 0.2 into "
            "the prompt): its in-gateway figure holds the search, its end-to-end one also the engine's longer "
            "prefill of the context, which is the model's work, not the gateway's."), "",
            f"### Semantic-cache lookup at {scale['entries']:,} entries", "",
            "| index | lookup p50 ms | lookup p99 ms | notes |", "|---|---|---|---|",
            (f"| faiss HNSW (M=32, efSearch=128) + SQLite fetch (ours) | {scale['lookup_p50']:.3f} | "
            f"{scale['lookup_p99']:.3f} | build {scale['build_s']:.0f} s; hit on the planted near-duplicate "
            f"(= exact top-1) for {scale['recall']:.1%} of queries |"),
            f"| faiss exact flat inner product (peer) | {scale['flat_p50']:.3f} | {scale['flat_p99']:.3f} | search only |",
            *(f"| query embedding, MiniLM-L6, 1 thread, {name} | {p50:.2f} | {p99:.2f} | {note} |"
              for name, (p50, p99), note in zip(scale["embed"], scale["embed"].values(), EMBED_NOTES)),
            "", (f"### Replayed question stream ({args.stream} requests, Zipf over {args.questions} questions, "
            f"{len(VARIANTS)} phrasings each, {replay_rows[0]['near_miss']:.0%} near misses: negated, another "
            f"country or year; source bumped every {args.bump_every})"), "",
            "| cache | threshold | near-miss guard | hit rate | false hits | correct hits | stale skipped | stale served |",
            "|---|---|---|---|---|---|---|---|"]
    for r in replay_rows:
        out.append(f"| semantic (ours) | {r['threshold']} | {'on' if r['guard'] else 'off'} | {r['hit']:.1%} | "
                   f"{r['false_hit']:.1%} | {r['hit'] - r['false_hit']:.1%} | {r['stale']:.1%} | {r['served_stale']:.1%} |")
    r = replay_rows[0]
    out.append(f"| exact match on normalised text (peer) | - | - | {r['exact_hit']:.1%} | {r['exact_false_hit']:.1%} | "
               f"{r['exact_hit'] - r['exact_false_hit']:.1%} | {r['exact_stale']:.1%} | - (keyed by version) |")
    return "\n".join(out) + "\n"



# `pagedserve bench all --quick`: every part of this benchmark, at a scale of seconds.
QUICK = ["--requests", "10", "--entries", "500", "--queries", "50", "--stream", "60", "--questions", "20", "--bump-every", "30"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--requests", type=int, default=200, help="measured call pairs per gateway configuration")
    p.add_argument("--entries", type=int, default=100_000, help="semantic-cache entries for the lookup benchmark")
    p.add_argument("--queries", type=int, default=1000, help="lookups timed at that size")
    p.add_argument("--stream", type=int, default=3000, help="requests in the replayed stream")
    p.add_argument("--questions", type=int, default=100, help="distinct questions in the stream")
    p.add_argument("--bump-every", type=int, default=500, help="source version bump interval (requests)")
    p.add_argument("--near-miss", type=float, default=0.15,
                   help="share of the stream asked as a near miss (negated, another country or year)")
    p.add_argument("--thresholds", type=float, nargs="+", default=[0.95, 0.9], help="similarity thresholds")
    p.add_argument("--engine-cpus", type=int, default=max((os.cpu_count() or 2) // 2, 1),
                   help="cores the engine is pinned to (and its thread count); the gateway gets the rest. "
                        "0: no pinning, both share every core")
    p.add_argument("--skip-overhead", action="store_true", help="skip the part that starts servers")
    p.add_argument("--docs", type=Path, default=REPO / "docs", help="where benchmarks.md is")


def run_args(args: argparse.Namespace) -> int:
    import torch

    from pagedserve.embedding import Embedder
    from pagedserve.gateway.classify import load_examples

    logging.getLogger("httpx").setLevel(logging.WARNING)
    load_before = os.getloadavg()[0]
    torch.set_num_threads(1)
    exact = Embedder.load()
    embedder = exact.fast()  # what the gateway embeds with
    examples = load_examples()
    simple = [t for t, label in examples if label == 0][: args.questions]
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        rows = [] if args.skip_overhead else overhead(args, tmp)
        for r in rows:
            print(f"{r['name']}: added p50 {r['added_p50']:.1f} ms, p99 {r['added_p99']:.1f} ms; in-gateway p50 "
                  f"{r['inside_p50']:.2f} ms ({r['route']})", flush=True)
        scale = lookup_at_scale(args, tmp, embedder, [t for t, _ in examples])
        scale["embed"] = embed_latency({"fp16-weight kernels": embedder, "fp32": exact}, [t for t, _ in examples])
        print(f"lookup at {scale['entries']}: p50 {scale['lookup_p50']:.3f} ms, p99 {scale['lookup_p99']:.3f} ms "
              f"(flat {scale['flat_p50']:.3f} ms); embed p50 {scale['embed']}", flush=True)
        replay_rows = replay(args, tmp, embedder, simple)
        for r in replay_rows:
            print(f"replay threshold {r['threshold']}, guard {'on' if r['guard'] else 'off'}: hit {r['hit']:.1%}, "
                  f"false {r['false_hit']:.1%}, stale {r['stale']:.1%}, exact-match hit {r['exact_hit']:.1%}",
                  flush=True)
    section = render(args, rows, scale, replay_rows, (load_before, os.getloadavg()[0]))
    replace_section(section, args.docs / "benchmarks.md")
    print(section)
    return 0
