"""Overload benchmark: offered load from 0.5x to 3x the server's capacity, mixed priorities, with
admission control on and off (one unbounded FCFS queue), one server at a time, in one run.

Capacity is measured first: the completion rate of a burst against the control-off server. Each load
point then sends the same Poisson arrivals for --duration seconds to each server in turn; requests unfinished --grace seconds after the
last arrival count as failed. Per class (critical / standard / sheddable): goodput (requests finished
with TTFT <= --ttft-slo, per second), p99 TTFT of the finished, and how many were refused (429/503 with
Retry-After). Results go to docs/benchmarks.md (section "Overload control") and a PNG plot in docs/.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np

from pagedserve.bench.report import REPO, command_line, machine_line, replace_section
from pagedserve.bench.servers import ServerProcess, free_port

logger = logging.getLogger(__name__)

SECTION = "## Overload control (benchmarks/overload.py)"
CLASSES = ("critical", "standard", "sheddable")


@dataclass(slots=True)
class Job:
    prompt: list[int]
    priority: str


@dataclass(slots=True)
class Outcome:
    priority: str
    status: int  # HTTP status; 0 for a transport failure or a request cut off at the deadline
    ttft: float = float("nan")
    finished: bool = False
    retry_after: bool = False  # a refusal that carried Retry-After


@dataclass(slots=True)
class LoadPoint:
    control: str
    factor: float
    rate: float
    duration_s: float
    goodput: dict[str, float]  # good requests per second of the offered window, per class and "all"
    good: dict[str, int]  # requests finished within the TTFT SLO
    p99_ttft: dict[str, float]
    refused: dict[str, int]
    failed: dict[str, int]  # neither finished nor refused honestly (timeouts, errors)
    offered: dict[str, int]


def make_jobs(tokens: list[int], num: int, mix: dict[str, float], seed: int) -> list[Job]:
    rng = random.Random(seed)
    classes, weights = list(mix), list(mix.values())
    jobs = []
    for _ in range(num):
        n = rng.randint(64, 128)
        start = rng.randrange(0, len(tokens) - n)
        jobs.append(Job(tokens[start:start + n], rng.choices(classes, weights)[0]))
    return jobs


async def run_one(client: httpx.AsyncClient, url: str, model: str, job: Job, max_tokens: int) -> Outcome:
    body = {"model": model, "prompt": job.prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "priority": job.priority}
    start = time.perf_counter()
    out = Outcome(job.priority, 0)
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                out.retry_after = "retry-after" in resp.headers
                await resp.aread()
                return out
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return out
                if out.ttft != out.ttft and any(c.get("text") for c in chunk.get("choices", [])):
                    out.ttft = time.perf_counter() - start
                if any(c.get("finish_reason") for c in chunk.get("choices", [])):
                    out.finished = True
    except httpx.HTTPError:
        out.status = 0
    return out


async def offer(url: str, model: str, jobs: list[Job], rate: float, seed: int, max_tokens: int,
                grace: float) -> tuple[list[Outcome], float, float]:
    """Open loop: job i is sent at its Poisson arrival time whatever the server is doing. Returns the
    outcomes, the makespan and the offered window (last arrival + grace), which is the same for every
    server offered these jobs, however early it ran out of work (refusals end a run sooner)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, len(jobs))) if rate > 0 else np.zeros(len(jobs))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()

        async def fire(at: float, job: Job) -> Outcome:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            return await run_one(client, url, model, job, max_tokens)

        tasks = [asyncio.ensure_future(fire(a, j)) for a, j in zip(arrivals, jobs, strict=True)]
        window = float(arrivals[-1]) + grace
        await asyncio.wait(tasks, timeout=window)
        duration = time.perf_counter() - start
        for task in tasks:
            task.cancel()
        return [t.result() if t.done() and not t.cancelled() else Outcome(j.priority, 0)
                for t, j in zip(tasks, jobs, strict=True)], duration, window


def summarize(control: str, factor: float, rate: float, outcomes: list[Outcome], window: float,
              slo: float) -> LoadPoint:
    point = LoadPoint(control, factor, rate, window, {}, {}, {}, {}, {}, {})
    for cls in (*CLASSES, "all"):
        mine = [o for o in outcomes if cls in ("all", o.priority)]
        done = [o for o in mine if o.finished]
        point.good[cls] = sum(1 for o in done if o.ttft <= slo)
        point.goodput[cls] = point.good[cls] / window
        point.p99_ttft[cls] = float(np.percentile([o.ttft for o in done], 99)) if done else float("nan")
        point.refused[cls] = sum(1 for o in mine if o.status in (429, 503) and o.retry_after)
        point.failed[cls] = len(mine) - len(done) - point.refused[cls]
        point.offered[cls] = len(mine)
    return point


def wait_idle(url: str, timeout: float = 120.0) -> None:
    """Until the server has no admitted request left (abandoned streams are aborted as they close)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(f"{url}/metrics", timeout=10).text
        busy = [line for line in text.splitlines() if line.startswith(("pagedserve_num_requests_running",
                                                                      "pagedserve_num_requests_waiting"))]
        if all(float(line.rsplit(" ", 1)[1]) == 0 for line in busy):
            return
        time.sleep(0.5)
    raise TimeoutError("server still busy between load points")


def measure_capacity(server: ServerProcess, jobs: list[Job], max_tokens: int) -> float:
    """Completed requests per second of a burst large enough to keep every engine slot busy."""
    outcomes, duration, _ = asyncio.run(offer(server.url, server.model, jobs, 0.0, 0, max_tokens, 600.0))
    wait_idle(server.url)
    return sum(o.finished for o in outcomes) / duration


def server_for(control: str, args: argparse.Namespace) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.cli", "--log-level", "WARNING", "serve", "--port", str(port),
           "--disable-access-log", "--embedding-model", "none", "--admission-control", control,
           "--ttft-slo", str(args.ttft_slo), *args.server_args]
    return ServerProcess(f"control {control}", cmd, port)


def run(args: argparse.Namespace) -> tuple[float, list[LoadPoint]]:
    """Both servers stay up; each load point runs against control off, then on, so drifts in machine
    load hit both alike."""
    from pagedserve.bench.workloads import corpus_tokens
    from pagedserve.model.loader import load_model

    tokens = corpus_tokens(load_model(None).tokenizer)
    mix = dict(zip(CLASSES, (float(x) for x in args.mix.split(",")), strict=True))
    servers = {control: server_for(control, args) for control in ("off", "on")}
    try:
        for server in servers.values():
            server.start()
            asyncio.run(offer(server.url, server.model, make_jobs(tokens, 4, mix, 99), 0.0, 0, 4, 120))  # warm-up
        capacity = args.capacity
        if capacity is None:
            capacity = measure_capacity(servers["off"], make_jobs(tokens, args.capacity_burst, mix, 1),
                                        args.max_tokens)
            logger.info("capacity: %.2f req/s", capacity)
        points = []
        for i, factor in enumerate(float(f) for f in args.loads.split(",")):
            rate = factor * capacity
            jobs = make_jobs(tokens, max(8, round(rate * args.duration)), mix, 10 + i)
            for control, server in servers.items():
                outcomes, _, window = asyncio.run(offer(server.url, server.model, jobs, rate, 10 + i,
                                                        args.max_tokens, args.grace))
                point = summarize(control, factor, rate, outcomes, window, args.ttft_slo)
                logger.info("control %s, %.1fx (%.2f req/s): goodput %s p99 TTFT %s refused %s failed %s",
                            control, factor, rate, _fmt(point.goodput), _fmt(point.p99_ttft), point.refused,
                            point.failed)
                points.append(point)
                wait_idle(server.url)
    finally:
        for server in servers.values():
            server.stop()
    return capacity, points


def _fmt(d: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:.2f}" for k, v in d.items()) + "}"


# ---- report ----

def report(capacity: float, points: list[LoadPoint], args: argparse.Namespace, plot: Path | None) -> str:
    lines = [
        SECTION, "",
        f"Command: `{command_line()}`",
        machine_line() + " The cores are shared with other work: compare within one run.",
        (f"Workload: prompts of 64-128 tokens, {args.max_tokens} output tokens (greedy, ignore_eos), class mix "
         f"critical/standard/sheddable {args.mix}, Poisson arrivals for {args.duration:g} s per point. "
         f"Capacity (control-off burst of {args.capacity_burst}): {capacity:.2f} req/s. Goodput: requests "
         f"finished with TTFT <= {args.ttft_slo:g} s (good), per second of the offered window (the arrivals' "
         f"span plus a {args.grace:g} s grace, the same for control on and off); the server's --ttft-slo is "
         f"the same."),
        "",
        ("| control | load | offered req/s | goodput all (good / offered) | critical | standard | sheddable | p99 TTFT critical / "
        "standard / sheddable (s) | refused (429/503 + Retry-After) | failed |"),
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        ttft = " / ".join(f"{p.p99_ttft[c]:.2f}" for c in CLASSES)
        lines.append(f"| {p.control} | {p.factor:g}x | {p.rate:.2f} | {p.goodput['all']:.2f} "
                     f"({p.good['all']} / {p.offered['all']}) | "
                     f"{p.goodput['critical']:.2f} | {p.goodput['standard']:.2f} | {p.goodput['sheddable']:.2f} | "
                     f"{ttft} | {p.refused['all']}/{p.offered['all']} | {p.failed['all']} |")
    lines += ["", *verdict(points, args)]
    if plot is not None:
        lines += ["", f"![goodput and p99 TTFT vs offered load, control on and off]({plot.name})"]
    return "\n".join(lines) + "\n"


def verdict(points: list[LoadPoint], args: argparse.Namespace) -> list[str]:
    out = []
    for control in ("on", "off"):
        mine = [p for p in points if p.control == control]
        peak = max((p.goodput["all"] for p in mine), default=0.0)
        at2 = next((p for p in mine if p.factor == 2.0), None)
        if at2 is None or peak == 0:
            continue
        out.append(f"Control {control}: at 2x load goodput {at2.goodput['all']:.2f} req/s "
                   f"({at2.good['all']} good of {at2.offered['all']} offered) = "
                   f"{at2.goodput['all'] / peak:.0%} of its peak {peak:.2f}; critical p99 TTFT "
                   f"{at2.p99_ttft['critical']:.2f} s (SLO {args.ttft_slo:g} s).")
    return out


def plot_points(points: list[LoadPoint], path: Path, slo: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for control, style in (("on", "-"), ("off", "--")):
        mine = [p for p in points if p.control == control]
        x = [p.factor for p in mine]
        axes[0].plot(x, [p.goodput["all"] for p in mine], "o" + style, label=f"all, control {control}")
        axes[0].plot(x, [p.goodput["critical"] for p in mine], "s" + style, label=f"critical, control {control}")
        for cls in CLASSES:
            axes[1].plot(x, [p.p99_ttft[cls] for p in mine], "o" + style, label=f"{cls}, control {control}")
    axes[1].axhline(slo, color="grey", lw=0.8, label="TTFT SLO")
    axes[0].set_title("goodput (req/s finished within the TTFT SLO)")
    axes[1].set_title("p99 TTFT of finished requests (s)")
    axes[1].set_yscale("log")
    for ax in axes:
        ax.set_xlabel("offered load (x capacity)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Overload control: mixed priorities, admission control on vs off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# `pagedserve bench all --quick`: every part of this benchmark, at a scale of seconds.
QUICK = ["--loads", "1.5", "--duration", "4", "--grace", "20", "--capacity-burst", "8", "--max-tokens", "8"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--loads", default="0.5,1,1.5,2,3", help="offered loads as multiples of the measured capacity")
    p.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per load point")
    p.add_argument("--grace", type=float, default=30.0, help="seconds after the last arrival before cut-off")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request")
    p.add_argument("--mix", default="0.2,0.4,0.4", help="shares of critical, standard, sheddable requests")
    p.add_argument("--ttft-slo", type=float, default=3.0, help="TTFT SLO of goodput and of the server (s)")
    p.add_argument("--capacity", type=float, default=None, help="skip measuring: capacity in req/s")
    p.add_argument("--capacity-burst", type=int, default=96, help="requests in the capacity-measuring burst")
    p.add_argument("--docs", type=Path, default=REPO / "docs", help="where benchmarks.md and the plot go")
    p.add_argument("--no-write", action="store_true", help="print the results only")
    p.add_argument("server_args", nargs="*", default=["--max-num-batched-tokens", "512"],
                   help="`pagedserve serve` flags for both servers, after -- (default: --max-num-batched-tokens "
                        "512, steps short enough for a TTFT target on this CPU)")


def run_args(args: argparse.Namespace) -> int:
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    capacity, points = run(args)
    plot = None if args.no_write else args.docs / "overload_benchmark.png"
    if plot is not None:
        plot_points(points, plot, args.ttft_slo)
    section = report(capacity, points, args, plot)
    print(section)
    if not args.no_write:
        replace_section(section, args.docs / "benchmarks.md")
    return 0
