"""What the offline benchmark measures and checks: one timed run's tokens, the checks that the run did
what it claims (every job got exactly its tokens, EOS really ignored), agreement between two systems'
greedy outputs, and the spread of repeated figures."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

from pagedserve.bench.workloads import Job

__all__ = ["Job", "Run", "agreement", "length_problems", "log", "spread"]


@dataclass
class Run:
    elapsed: float
    outputs: list[list[int]]  # the tokens each job got, in job order
    prompt_tokens: int
    ttfts: list[float] = field(default_factory=list)
    kv_waste: float | None = None
    peak_running: int = 0  # most requests in one step
    preemptions: int = 0
    decode_step_s: list[float] = field(default_factory=list)  # steps after every job had its first token

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.elapsed

    @property
    def prompt_tps(self) -> float:
        return self.prompt_tokens / self.elapsed

    @property
    def total_tps(self) -> float:
        return (self.output_tokens + self.prompt_tokens) / self.elapsed


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def length_problems(who: str, run: Run, jobs: list[Job], eos_id: int | None = None) -> list[str]:
    """Jobs that did not get exactly max_tokens tokens, or (eos_id given) whose output holds EOS, which a
    system that really ignored EOS until max_tokens could not have produced or padded with."""
    bad = [i for i, (job, out) in enumerate(zip(jobs, run.outputs, strict=True)) if len(out) != job.max_tokens]
    problems = [(f"{who}: {len(bad)} of {len(jobs)} jobs got a different number of tokens than asked "
                f"(first: job {bad[0]})")] if bad else []
    if eos_id is not None:
        with_eos = sum(eos_id in out for out in run.outputs)
        if with_eos:
            problems.append(f"{who}: EOS in {with_eos} outputs: ignore_eos did not hold")
    return problems


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> tuple[int, int, float]:
    """(identical sequences, sequences compared, median index of the first differing token)."""
    firsts = []
    for a, b in zip(ours, theirs, strict=True):
        n = min(len(a), len(b))
        firsts.append(next((i for i in range(n) if a[i] != b[i]), n))
    identical = sum(a == b for a, b in zip(ours, theirs, strict=True))
    return identical, len(ours), statistics.median(firsts)


def spread(values: list[float], fmt: str = "{:.1f}") -> str:
    """'median (min-max over N)' or the single value."""
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))} over {len(values)})"
