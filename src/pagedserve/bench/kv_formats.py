"""KV cache formats in one run: the `kv` workload of `pagedserve bench throughput`.

Per --kv-cache-dtype, the same engine settings otherwise:
  capacity  tokens per GiB of pool, and W1 (128 + 128 tokens per request) in a deliberately small pool: the
            most requests running at once, the preemptions it took, output tok/s
  LONG      32 requests x 2,048-token prompts, 128 greedy output tokens, in a pool that holds them all in every
            format: output tok/s and ms per decode step (steps after every request had its first token)
  W1, MIX   the throughput workloads, to show they keep their speed; MIX also reports its KV waste
Every run's token counts are checked, and each format's greedy outputs are compared with the first format's
(reported: the median first differing token).
"""
from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from pagedserve.bench.measure import Run, agreement, length_problems, log, spread
from pagedserve.bench.report import machine_line
from pagedserve.bench.workloads import Job, mix, w1
from pagedserve.config import parse_size

LONG_PROMPT, LONG_OUTPUT, LONG_REQUESTS = 2048, 128, 32


@dataclass
class FormatRuns:
    stored_as: str = ""  # the format the engine resolved (auto: the model dtype)
    tokens_per_gib: float = 0.0
    runs: dict[str, list[Run]] = field(default_factory=dict)  # workload -> repeats

    def add(self, workload: str, run: Run) -> None:
        self.runs.setdefault(workload, []).append(run)


def long_jobs(tokens: list[int], num: int, prompt_len: int, output_len: int) -> list[Job]:
    """Distinct 2,048-token stretches of the corpus, so no prefix is shared."""
    return [Job(tokens[(i * prompt_len) % (len(tokens) - prompt_len):][:prompt_len], output_len) for i in range(num)]


def measure(formats: list[str], tokens: list[int], make_engine: Callable, run_engine: Callable, args) -> tuple[str, list[str]]:
    """make_engine(**config) builds an engine; run_engine(engine, jobs, track_waste) runs jobs to completion."""
    n = lambda k: max(1, int(k * args.scale))
    ln = lambda k: max(4, int(k * args.length_scale))
    workloads = {
        "small pool W1": (w1(tokens, n(64), ln(128), ln(128)), {"kv_cache_memory": args.kv_small_pool}),
        "LONG": (long_jobs(tokens, n(LONG_REQUESTS), ln(LONG_PROMPT), ln(LONG_OUTPUT)),
                 {"kv_cache_memory": args.kv_long_pool}),
        "W1": (w1(tokens, n(64), ln(128), ln(128)), {}),
        "MIX": (mix(tokens, n(128)), {}),
    }
    if args.length_scale != 1:
        workloads["MIX"] = ([Job(j.prompt_token_ids[:ln(len(j.prompt_token_ids))], ln(j.max_tokens))
                             for j in workloads["MIX"][0]], {})
    results = {f: FormatRuns() for f in formats}
    problems: list[str] = []
    for repeat in range(args.repeats):
        order = formats if repeat % 2 == 0 else formats[::-1]  # alternate which format runs first
        for name, (jobs, over) in workloads.items():
            for fmt in order:
                engine = make_engine(kv_cache_dtype=fmt, **over)
                pool = parse_size(over.get("kv_cache_memory", args.kv_cache_memory))
                results[fmt].tokens_per_gib = engine.weights_info["kv_cache_tokens"] / pool * 2**30
                results[fmt].stored_as = engine.kv_format.name
                run_engine(engine, jobs[:2], False)  # warm-up
                engine.kv.reset_prefix_cache()
                run = run_engine(engine, jobs, name == "MIX")
                log(f"  kv {fmt} {name}: {run.output_tps:.0f} output tok/s, peak running {run.peak_running}, "
                    f"{run.preemptions} preemptions")
                problems += length_problems(f"kv {fmt} {name}", run, jobs)
                results[fmt].add(name, run)
    return render(formats, results, args), problems


def render(formats: list[str], results: dict[str, FormatRuns], args) -> str:
    base = formats[0]
    flags = f"--workloads kv --kv-cache-dtypes {','.join(formats)} --repeats {args.repeats}"
    flags += ("" if args.scale == 1 else f" --scale {args.scale}") + (
        "" if args.length_scale == 1 else f" --length-scale {args.length_scale}")
    lines = [f"Command: `pagedserve bench throughput {flags}`", "", machine_line(), "",
             (f"Pools: W1 capacity in --kv-small-pool {args.kv_small_pool}; LONG in {args.kv_long_pool} (every "
              f"LONG request fits in every format); W1 and MIX in {args.kv_cache_memory}. Figures: median (min-max) "
              "over the repeats, formats in alternating order."), "",
             "| KV cache | tokens per GiB | small pool W1: peak running | preemptions | output tok/s | "
             "LONG output tok/s | LONG ms per decode step | W1 output tok/s | MIX output tok/s | MIX KV waste | "
             "greedy vs " + base + " (LONG, median first differing token) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for fmt in formats:
        r = results[fmt].runs
        small = r["small pool W1"]
        step_ms = [statistics.median(x.decode_step_s) * 1e3 for x in r["LONG"] if x.decode_step_s]
        _, _, first = agreement(r["LONG"][0].outputs, results[base].runs["LONG"][0].outputs)
        lines.append(
            f"| {fmt} ({results[fmt].stored_as}) | {results[fmt].tokens_per_gib:,.0f} | {max(x.peak_running for x in small)} | "
            f"{spread([x.preemptions for x in small], '{:.0f}')} | {spread([x.output_tps for x in small])} | "
            f"{spread([x.output_tps for x in r['LONG']])} | {spread(step_ms) if step_ms else '-'} | "
            f"{spread([x.output_tps for x in r['W1']])} | {spread([x.output_tps for x in r['MIX']])} | "
            f"{statistics.median(x.kv_waste for x in r['MIX']):.2%} | {first:.0f} |")
    return "\n".join(lines)
