"""Disaggregated prefill/decode benchmark: what moving KV blocks costs, and what separating prefill from decode
buys under a mixed load, in one run.

Transfer: a prefill worker computes prompts of several lengths; the KV blocks of each are pulled over HTTP as a
decode worker pulls them (GB/s, ms), and the decode worker's own pull (transfer + import into its pool, from its
/metrics) is timed; beside them the machine's limits: a memory copy and a loopback TCP socket of the same bytes.

Interference: long prompts (2-4k tokens, 16 output tokens) and chats (short prompts, 256 output tokens),
open-loop Poisson arrivals at rising rates, against 1 prefill + 1 decode worker (one core each) and against
two co-located replicas (one core each), each behind the router. TTFT p50/p99 over all requests, the chats'
inter-token latency p50/p99, goodput under TTFT <= --ttft-slo and TPOT <= --tpot-slo, and a plot.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import yaml

from pagedserve.bench.gateway import process
from pagedserve.bench.report import REPO, command_line, machine_line, publish
from pagedserve.bench.serve import BenchRequest, RateResult, run_rate, summarize
from pagedserve.bench.servers import ServerProcess, free_port
from pagedserve.bench.workloads import corpus_tokens
from pagedserve.server.kv_transfer import lease_target
from pagedserve.server.peer_auth import PEER_PREFIX, SECRET_ENV, PeerKey

QUICK = ["--lengths", "512", "--rates", "0.3", "--duration", "10", "--long", "256,512", "--chat-output", "16"]
# Admission control off on every worker of both deployments: its TTFT-based refusals of long prompts would
# otherwise turn load into 429s, and this compares where the time goes, not who refuses more.
SERVE = [sys.executable, "-m", "pagedserve.cli", "serve", "--num-threads", "1", "--embedding-model", "none",
         "--disable-access-log", "--max-model-len", "8192", "--admission-control", "off"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--lengths", default="1024,4096,8000", help="prompt tokens for the transfer rows (the "
                   "default model's context is 8192, so 16k prompts cannot be made)")
    p.add_argument("--rates", default="0.1,0.2,0.4,0.8",
                   help="request rates (req/s) for the interference rows: up to where one prefill worker saturates")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of arrivals per rate")
    p.add_argument("--long", default="2048,4096", help="min,max prompt tokens of the long requests")
    p.add_argument("--chat-output", type=int, default=256, help="output tokens of a chat")
    p.add_argument("--ttft-slo", type=float, default=2.0, help="goodput: TTFT at most this (s)")
    p.add_argument("--tpot-slo", type=float, default=0.1, help="goodput: time per output token at most this (s)")
    p.add_argument("--kv-cache-memory", default="512MiB", help="each worker's KV pool")
    p.add_argument("--docs", type=Path, default=REPO / "docs", help="where benchmarks.md is")
    p.add_argument("--no-write", action="store_true", help="print the tables only")


# ---- transfer -------------------------------------------------------------------------------------------

def memcpy_s(nbytes: int) -> float:
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(1)
    dst = torch.empty_like(src)
    return min(_timed(lambda: dst.copy_(src)) for _ in range(3))


def loopback_s(nbytes: int) -> float:
    """One process sends nbytes over a loopback TCP connection; the other reads all of them."""
    payload = b"\x01" * nbytes
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    done = threading.Event()

    def read() -> None:
        conn, _ = server.accept()
        left = nbytes
        while left:
            left -= len(conn.recv(min(left, 1 << 20)))
        conn.close()
        done.set()
    threading.Thread(target=read, daemon=True).start()
    client = socket.create_connection(("127.0.0.1", port))
    start = time.perf_counter()
    client.sendall(payload)
    done.wait()
    elapsed = time.perf_counter() - start
    client.close()
    server.close()
    return elapsed


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def pull_seconds(url: str) -> tuple[float, float]:
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url + "/metrics", timeout=10).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name in ("pagedserve_kv_transfer_seconds_sum", "pagedserve_kv_transfer_seconds_count")}
    return values.get("pagedserve_kv_transfer_seconds_sum", 0.0), values.get("pagedserve_kv_transfer_seconds_count", 0)


TRANSPORTS = ("tcp", "shm", "ray")


@contextlib.contextmanager
def local_ray():
    """A one-machine Ray cluster on loopback for the object-store transport (its GCS address), or None without
    Ray installed."""
    try:
        from pagedserve.cluster.ray_launcher import use_loopback

        use_loopback()
        import ray
    except ImportError:
        yield None
        return
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


# The benchmark's workers and router are one cluster: they share this secret (in the environment they inherit),
# and this process signs its own calls to the workers' peer routes with it, as a router would.
PEER_KEY = PeerKey.generate()


def peer_post(url: str, body: dict) -> dict:
    path = PEER_PREFIX + "/v1/completions"
    content, headers = PEER_KEY.signed_json("POST", path, body)
    return httpx.post(url + path, content=content, headers=headers, timeout=1200).json()


def lease(prefill: str, body: dict) -> dict:
    """A prefill half: the prompt computed (or found cached) and its blocks leased; the handle."""
    return peer_post(prefill, {**body, "kv_transfer_params": {"do_remote_decode": True}})["kv_transfer_params"]


def transfer_rows(args, tmp: Path, tokens: list[int]) -> list[dict]:
    """Per prompt length: the blocks pulled over HTTP by this process, and by a decode worker per transport (each
    a fresh lease of the same prompt, which the prefill worker then has cached)."""
    common = [*SERVE, "--kv-cache-memory", args.kv_cache_memory]
    rows = []
    with local_ray() as cluster, contextlib.ExitStack() as stack:
        join = ["--ray-address", cluster] if cluster else []
        port = free_port()
        prefill = f"http://127.0.0.1:{port}"
        stack.enter_context(process([*common, "--port", str(port), "--kv-role", "prefill", "--kv-lease-s", "600",
                                     *join], prefill, tmp / "transfer-prefill.log", {0}))
        decoders = {}
        for transport in TRANSPORTS if cluster else TRANSPORTS[:2]:
            port = free_port()
            decoders[transport] = f"http://127.0.0.1:{port}"
            stack.enter_context(process([*common, "--port", str(port), "--kv-role", "decode", "--kv-transport",
                                         transport, *join], decoders[transport], tmp / f"transfer-{transport}.log",
                                        {1}))
        for n, length in enumerate(int(x) for x in args.lengths.split(",")):
            prompt = tokens[n * 97:n * 97 + length]
            body = {"prompt": prompt, "max_tokens": 1, "temperature": 0}

            start = time.perf_counter()
            handle = lease(prefill, body)
            prefill_s = time.perf_counter() - start
            gets = []
            for _ in range(3):
                start = time.perf_counter()
                target = lease_target(handle["lease_id"])
                data = httpx.get(prefill + target, headers=PEER_KEY.sign("GET", target), timeout=600).content
                gets.append(time.perf_counter() - start)
            pulls, cached = {}, []
            for transport, decode in decoders.items():
                handle = lease(prefill, body)
                before = pull_seconds(decode)
                # two tokens: the first is the prefill worker's, so with one the decode half would need no blocks
                decoded = peer_post(decode, {**body, "max_tokens": 2, "kv_transfer_params": {
                    **handle, "do_remote_prefill": True, "remote_url": prefill}})
                after = pull_seconds(decode)
                pulls[transport] = after[0] - before[0] if after[1] > before[1] else float("nan")
                cached.append(decoded["usage"]["prompt_tokens_details"]["cached_tokens"])
            rows.append({"tokens": length, "blocks": handle["num_blocks"], "bytes": len(data),
                         "kv_format": handle["kv_format"], "prefill_s": prefill_s, "get_s": statistics.median(gets),
                         "pulls": pulls, "cached": min(cached), "memcpy_s": memcpy_s(len(data)),
                         "loopback_s": loopback_s(len(data))})
            print(f"transfer {length} tokens: {len(data) / 1e6:.1f} MB, GET {statistics.median(gets) * 1e3:.0f} ms, "
                  "pull+import " + ", ".join(f"{t} {v * 1e3:.0f} ms" for t, v in pulls.items()) +
                  f"; {min(cached)} tokens cached", flush=True)
    return rows


# ---- interference ---------------------------------------------------------------------------------------

def workload(args, tokens: list[int], rate: float, seed: int) -> tuple[list[BenchRequest], list[bool]]:
    """The requests, and which of them are chats (the rest are long prompts)."""
    rng = np.random.default_rng(seed)
    lo, hi = (int(x) for x in args.long.split(","))
    out, chats = [], []
    for i in range(max(4, round(rate * args.duration))):
        chat = i % 2 == 1
        length = int(rng.integers(32, 128)) if chat else int(rng.integers(lo, hi + 1))
        start = int(rng.integers(0, len(tokens) - length))
        out.append(BenchRequest(tokens[start:start + length], "", args.chat_output if chat else 16))
        chats.append(chat)
    return out, chats


@contextlib.contextmanager
def deployment(name: str, args, tmp: Path):
    """Two workers on one core each behind a router: 1 prefill + 1 decode, or 2 co-located replicas."""
    ports = [free_port(), free_port()]
    roles = ["prefill", "decode"] if name == "disaggregated" else ["both", "both"]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    config = tmp / f"router-{name}.yaml"
    config.write_text(yaml.safe_dump({"replicas": [{"url": u, "name": f"{r}-{i}", "kv_role": r}
                                                   for i, (u, r) in enumerate(zip(urls, roles))]}))
    router_port = free_port()
    router = f"http://127.0.0.1:{router_port}"
    with contextlib.ExitStack() as stack:
        for i, (port, role) in enumerate(zip(ports, roles)):
            kv_role = ["--kv-role", role] if name == "disaggregated" else []
            stack.enter_context(process([*SERVE, "--port", str(port), *kv_role, "--kv-cache-memory",
                                         args.kv_cache_memory], urls[i], tmp / f"{name}-{i}.log", {i}))
        stack.enter_context(process([sys.executable, "-m", "pagedserve.cli", "router", "--config", str(config),
                                     "--port", str(router_port)], router, tmp / f"{name}-router.log"))
        with contextlib.suppress(httpx.HTTPError):
            for _ in range(100):  # until both replicas are in rotation
                if all(r["healthy"] for r in httpx.get(router + "/health", timeout=2).json()["replicas"]):
                    break
                time.sleep(0.1)
        server = ServerProcess(name, [], port=router_port, url=router,
                               model=httpx.get(urls[0] + "/v1/models", timeout=10).json()["data"][0]["id"])
        yield server


def interference(args, tmp: Path, tokens: list[int]) -> list[tuple[RateResult, list[float], list[float]]]:
    out = []
    rates = [float(x) for x in args.rates.split(",")]
    for name in ("disaggregated", "co-located"):
        with deployment(name, args, tmp) as server:
            asyncio.run(run_rate(server, workload(args, tokens, 1.0, 99)[0][:2], 0, 0, 600))  # warm both workers
            for rate in rates:
                requests, is_chat = workload(args, tokens, rate, seed=int(rate * 1000))
                results, duration = asyncio.run(run_rate(server, requests, rate, seed=7, timeout=args.duration * 6))
                row = summarize(name, rate, results, duration, args.ttft_slo, args.tpot_slo)
                chats = [r for chat, r in zip(is_chat, results) if r.ok and chat]
                chat_itl = [x for r in chats for x in r.itls]
                ttfts = [r.ttft for r in results if r.ok]
                out.append((row, chat_itl, ttfts))
                print(f"{name} at {rate} req/s: {row.num_ok}/{row.num_requests} ok, TTFT p99 "
                      f"{_p(ttfts, 99):.2f} s, chat ITL p99 {_p(chat_itl, 99) * 1e3:.0f} ms, goodput "
                      f"{row.goodput:.3f} req/s", flush=True)
    return out


def _p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


# ---- report ---------------------------------------------------------------------------------------------

def plot(rows, path: Path) -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for name, marker in (("disaggregated", "o"), ("co-located", "s")):
        mine = [(row.rate, itl, ttft, row.goodput) for row, itl, ttft in rows if row.server == name]
        rates = [m[0] for m in mine]
        axes[0].plot(rates, [_p(m[1], 99) * 1e3 for m in mine], marker=marker, label=name)
        axes[1].plot(rates, [_p(m[2], 99) for m in mine], marker=marker, label=name)
        axes[2].plot(rates, [m[3] for m in mine], marker=marker, label=name)
    for ax, title in zip(axes, ("chats' ITL p99 (ms)", "TTFT p99 (s)", "goodput (req/s)")):
        if ax is not axes[2]:
            ax.set_yscale("log")  # an interfered ITL is seconds where a clean one is milliseconds
        ax.set_xlabel("offered load (req/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def render(args, transfer: list[dict], rows, figure: Path | None) -> str:
    lines = [f"Command: `{command_line()}`", "", machine_line(), "",
             ("Transfer of one prompt's KV blocks (bytes as stored). HTTP GET: this process reads the lease's "
              "blocks; pull + import: a decode worker's whole pull (asking for the blocks, moving them over the "
              "transport, importing them into its pool 32 blocks per engine call) per transport: TCP (HTTP), "
              "shared memory (/dev/shm) and the Ray object store (a one-machine Ray cluster, both workers joined "
              "as drivers):"), "",
             ("| prompt tokens | blocks | KV MB | format | HTTP GET ms (GB/s) | pull + import ms: tcp / shm / ray | "
              "memcpy ms (GB/s) | loopback TCP ms (GB/s) | prefill s | tokens cached after the pull |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in transfer:
        gb = r["bytes"] / 1e9
        pulls = " / ".join(f"{r['pulls'][t] * 1e3:.0f}" if t in r["pulls"] else "-" for t in TRANSPORTS)
        lines.append(f"| {r['tokens']} | {r['blocks']} | {r['bytes'] / 1e6:.1f} | {r['kv_format']} | "
                     f"{r['get_s'] * 1e3:.0f} ({gb / r['get_s']:.2f}) | {pulls} | {r['memcpy_s'] * 1e3:.1f} "
                     f"({gb / r['memcpy_s']:.1f}) | {r['loopback_s'] * 1e3:.1f} ({gb / r['loopback_s']:.2f}) | "
                     f"{r['prefill_s']:.1f} | {r['cached']} |")
    lo, hi = args.long.split(",")
    lines += ["", (f"Interference: half long prompts ({lo}-{hi} tokens, 16 output tokens), half chats (32-127-token "
                   f"prompts, {args.chat_output} output tokens, EOS ignored), Poisson arrivals for {args.duration:.0f} s "
                   f"per rate; two workers on one core each behind the router, admission control off on both "
                   f"deployments; goodput: TTFT <= {args.ttft_slo} s and TPOT <= {args.tpot_slo * 1e3:.0f} ms."), "",
              ("| deployment | rate req/s | ok | TTFT p50 / p99 s | chats' ITL p50 / p99 / p99.9 ms | goodput req/s | "
               "output tok/s |"), "|---|---|---|---|---|---|---|"]
    for row, itl, ttft in rows:
        lines.append(f"| {row.server} | {row.rate} | {row.num_ok}/{row.num_requests} | {_p(ttft, 50):.2f} / "
                     f"{_p(ttft, 99):.2f} | {_p(itl, 50) * 1e3:.0f} / {_p(itl, 99) * 1e3:.0f} / "
                     f"{_p(itl, 99.9) * 1e3:.0f} | {row.goodput:.3f} | {row.output_tok_s:.1f} |")
    if figure is not None:
        lines += ["", f"![disaggregation]({figure.name})"]
    lines += ["", verdict(rows), NOTES]
    return "\n".join(lines)


def verdict(rows) -> str:
    """The target per rate: chats' ITL p99 at least 2x lower disaggregated, goodput no lower."""
    by = {(row.server, row.rate): (row, itl) for row, itl, _ in rows}
    parts, met = [], []
    for rate in sorted({row.rate for row, *_ in rows}):
        if ("disaggregated", rate) not in by or ("co-located", rate) not in by:
            continue
        (d, d_itl), (c, c_itl) = by["disaggregated", rate], by["co-located", rate]
        gain = _p(c_itl, 99) / _p(d_itl, 99)
        parts.append(f"{rate}: {gain:.2f}x (goodput {d.goodput:.3f} vs {c.goodput:.3f})")
        if gain >= 2 and d.goodput >= c.goodput:
            met.append(str(rate))
    return (f"- Chats' ITL p99, co-located over disaggregated, per rate (req/s): {'; '.join(parts)}. Target (at "
            f"least 2x, goodput no lower) met at: {', '.join(met) or 'no rate'}.")


NOTES = ("- Where the time goes, by construction of this setup: the disaggregated pair has one core for every "
         "prefill of a long prompt where the co-located pair has two, so its long prompts' TTFT grows first as the "
         "rate rises; chats' short prompts skip the prefill pool (disagg_min_prompt_tokens 256) and are computed on "
         "the decode worker, which decodes every chat (twice the batch of each co-located replica), computes each "
         "long prompt's last partial block and imports its blocks 32 at a time between steps. A co-located "
         "replica runs a long prompt's prefill in token-budgeted chunks (2048 tokens, seconds on one core) in the "
         "same steps as its chats' decodes: those pauses are what disaggregation removes. TTFT of 2-4k-token "
         "prompts on one core is seconds either way, so goodput counts mostly chats.")


def run_args(args: argparse.Namespace) -> int:
    from pagedserve.model.loader import load_model

    tokens = corpus_tokens(load_model(None).tokenizer)
    os.environ[SECRET_ENV] = PEER_KEY.hex()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        transfer = transfer_rows(args, tmp, tokens)
        rows = interference(args, tmp, tokens)
    figure = None if args.no_write else plot(rows, args.docs / "disagg.png")
    body = render(args, transfer, rows, figure)
    # A request always computes its last prompt token: a prompt of whole blocks hits one block fewer.
    problems = [f"{r['tokens']} tokens: the decode worker found {r['cached']} tokens cached of the "
                f"{r['blocks'] * 16} transferred" for r in transfer
                if r["cached"] < min(r["blocks"], (r["tokens"] - 1) // 16) * 16]
    problems += [f"{row.server} at {row.rate}: {row.num_requests - row.num_ok} requests failed"
                 for row, *_ in rows if row.num_ok < row.num_requests]
    return publish("Disaggregated prefill/decode", body, problems, args.docs, not args.no_write)
