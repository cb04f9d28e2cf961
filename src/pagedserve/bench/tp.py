"""Tensor parallelism on one host: what a collective costs, and what splitting the model buys.

Collectives: two ranks, one core each, all-reduce a tensor of each size (fp32) through shared memory and through
gloo over loopback TCP: the median latency of --iters calls and the bandwidth it amounts to (bytes / latency).

Scaling: W1 (--requests prompts of 128 tokens, --output tokens each, all at once) and one stream (one request
of 128 prompt tokens) at TP=1 on one core against TP=2 on two cores (one each): output tokens/s, and the scaling
efficiency TP=2 / (2 x TP=1). Targets on a 2-core machine: >= 85% on W1, >= 70% on one stream.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import statistics
import time
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path

from pagedserve.bench.report import REPO, command_line, machine_line, publish

QUICK = ["--sizes", "4096,1048576", "--iters", "20", "--requests", "4", "--output", "8"]
TIMEOUT_S = 300.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="4096,65536,1048576,4194304,16777216", help="all-reduce sizes in bytes")
    p.add_argument("--iters", type=int, default=200, help="all-reduces timed per size and path")
    p.add_argument("--requests", type=int, default=64, help="W1 requests")
    p.add_argument("--output", type=int, default=128, help="output tokens per request (W1 and one stream)")
    p.add_argument("--dtype", default="auto", help="model dtype of the scaling rows")
    p.add_argument("--docs", type=Path, default=REPO / "docs", help="where benchmarks.md is")
    p.add_argument("--no-write", action="store_true", help="print the tables only")


def collective_rank(rank: int, port: int, shm: Path, sizes: list[int], iters: int, conn: Connection) -> None:
    """One of two ranks: the median seconds per all-reduce of each size, by path."""
    import torch
    import torch.distributed as dist

    from pagedserve.distributed.communicator import init_gloo
    from pagedserve.distributed.shm_communicator import ShmCommunicator

    os.sched_setaffinity(0, [rank % os.cpu_count()])
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
    comms = {"shm": ShmCommunicator(shm, rank, 2, lambda: True, TIMEOUT_S), "gloo": init_gloo(store, rank, 2, TIMEOUT_S)}
    rows = []
    for size in sizes:
        x = torch.ones(size // 4)
        for name, comm in comms.items():
            for _ in range(3):
                comm.all_reduce(x)
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                comm.all_reduce(x)
                times.append(time.perf_counter() - t0)
            rows.append((size, name, statistics.median(times)))
    conn.send_bytes(pickle.dumps(rows))


def collectives(sizes: list[int], iters: int) -> list[tuple[int, str, float]]:
    from pagedserve.distributed.communicator import gloo_store
    from pagedserve.distributed.shm_communicator import create_shm

    store = gloo_store(0, 2, 0, TIMEOUT_S)
    shm = create_shm(f"pagedserve-bench-tp-{os.getpid()}", 2)
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    try:
        for rank in range(2):
            ours, theirs = ctx.Pipe()
            procs.append(ctx.Process(target=collective_rank, args=(rank, store.port, shm, sizes, iters, theirs),
                                     daemon=True))
            procs[-1].start()
            conns.append(ours)
        if conns[0] not in wait([conns[0], procs[0].sentinel], TIMEOUT_S):
            raise RuntimeError("the collective ranks did not finish")
        return pickle.loads(conns[0].recv_bytes())
    finally:
        shm.unlink(missing_ok=True)
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()


def scaling(tp: int, requests: int, output: int, dtype: str) -> tuple[float, float]:
    """(W1 output tokens/s, one stream's decode tokens/s) at tp ranks, one core each."""
    from pagedserve import LLM, SamplingParams
    from pagedserve.bench.workloads import corpus_tokens, w1
    from pagedserve.distributed.cpu_binding import bind

    bind([0], 1)  # TP=1 on one core; at TP=2 the driver rebinds itself to rank 0's core
    llm = LLM(dtype=dtype, tensor_parallel_size=tp, cpu_binding=";".join(str(r) for r in range(tp)),
              num_threads=1, kv_cache_memory="1GiB")
    try:
        jobs = w1(corpus_tokens(llm.tokenizer), requests, 128, output)
        params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
        llm.generate([{"prompt_token_ids": jobs[0].prompt_token_ids}], SamplingParams(max_tokens=2))  # warm up
        t0 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": j.prompt_token_ids} for j in jobs], params)
        w1_tps = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
        engine = llm.engine
        engine.add_request("stream", jobs[0].prompt_token_ids, params)
        engine.step()  # the prefill and the first token
        t0, steps = time.perf_counter(), 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        return w1_tps, steps / (time.perf_counter() - t0)
    finally:
        if llm.engine.workers is not None:
            llm.engine.workers.close()


def run_args(args: argparse.Namespace) -> int:
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = collectives(sizes, args.iters)
    lines = ["| bytes | shm latency (us) | shm GB/s | gloo latency (us) | gloo GB/s |", "|---:|---:|---:|---:|---:|"]
    by = {(size, name): t for size, name, t in rows}
    for size in sizes:
        shm, gloo = by[(size, "shm")], by[(size, "gloo")]
        lines.append(f"| {size:,} | {shm * 1e6:.1f} | {size / shm / 1e9:.2f} | {gloo * 1e6:.1f} | {size / gloo / 1e9:.2f} |")
    tp1 = scaling(1, args.requests, args.output, args.dtype)
    tp2 = scaling(2, args.requests, args.output, args.dtype)
    eff = [b / (2 * a) for a, b in zip(tp1, tp2)]
    body = "\n".join([
        f"`{command_line()}`. {machine_line()}", "",
        "All-reduce between two ranks (one core each), fp32, median of the timed calls:", "", *lines, "",
        f"SmolLM2-135M ({args.dtype}), output tokens/s: TP=1 on one core vs TP=2 on two (one each):", "",
        "| workload | TP=1, 1 core | TP=2, 2 cores | scaling efficiency | target |", "|---|---:|---:|---:|---:|",
        f"| W1 ({args.requests} x 128 prompt, {args.output} out) | {tp1[0]:.1f} | {tp2[0]:.1f} | {eff[0]:.0%} | 85% |",
        f"| one stream (decode) | {tp1[1]:.1f} | {tp2[1]:.1f} | {eff[1]:.0%} | 70% |",
    ])
    return publish("Tensor parallelism", body, [], args.docs, not args.no_write)
