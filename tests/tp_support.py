"""Helpers for the tensor-parallel tests: ranks run in spawned processes, each reporting back over a pipe."""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch
import torch.distributed as dist

from pagedserve.distributed.communicator import gloo_store, init_gloo
from pagedserve.distributed.shm_communicator import ShmCommunicator, create_shm

TIMEOUT_S = 120.0


def collective_rank(rank: int, world: int, port: int, shm: Path, conn: Connection) -> None:
    """All-reduce and all-gather of seeded per-rank tensors, through shared memory and through gloo."""
    try:
        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=TIMEOUT_S))
        gloo = init_gloo(store, rank, world, TIMEOUT_S)
        shm_comm = ShmCommunicator(shm, rank, world, lambda: True, TIMEOUT_S, slot_bytes=4096)  # small: chunking
        results = []
        for dtype in (torch.float32, torch.bfloat16):
            for numel in (1, 7, 1000, 3000, 70_000):
                x = torch.randn(numel, generator=torch.Generator().manual_seed(rank * 1000 + numel)).to(dtype)
                results.append(("all_reduce", dtype, numel, shm_comm.all_reduce(x.clone()), gloo.all_reduce(x.clone())))
            sizes = [5 + r for r in range(world)]  # uneven, as a vocabulary that does not divide
            for rows in (1, 3, 200):
                x = torch.randn(rows, sizes[rank], generator=torch.Generator().manual_seed(rank)).to(dtype)
                results.append(("all_gather", dtype, rows, shm_comm.all_gather(x, sizes), gloo.all_gather(x, sizes)))
        report = ("ok", results)
    except BaseException:  # noqa: BLE001 -- reported to the test
        report = ("error", traceback.format_exc())
    conn.send_bytes(pickle.dumps(report))  # plain pickle: torch's would lend tensors through this process's memory


def run_ranks(target: Callable, world: int) -> list:
    """Runs target(rank, world, port, shm, conn) in world spawned processes; returns each rank's report. Every
    process is ended before this returns, whatever happens."""
    store = gloo_store(0, world, 0, TIMEOUT_S)  # this process hosts the ranks' store
    port = store.port
    shm = create_shm(f"pagedserve-tp-test-{os.getpid()}-{port}", world, slot_bytes=4096)
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    try:
        for rank in range(world):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=target, args=(rank, world, port, shm, theirs), daemon=True)
            proc.start()
            procs.append(proc)
            conns.append(ours)
        reports = []
        for conn, proc in zip(conns, procs):
            if conn not in wait([conn, proc.sentinel], TIMEOUT_S):
                raise AssertionError(f"a rank exited or timed out (exit code {proc.exitcode})")
            kind, payload = pickle.loads(conn.recv_bytes())
            assert kind == "ok", payload
            reports.append(payload)
        return reports
    finally:
        shm.unlink(missing_ok=True)
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
