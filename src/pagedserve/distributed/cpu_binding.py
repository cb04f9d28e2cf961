"""Which cores each rank's threads run on (--cpu-binding): disjoint sets, so ranks never share a core's caches
or preempt each other between two collectives."""
from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def parse_cores(text: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8]."""
    cores: list[int] = []
    for part in filter(None, text.strip().split(",")):
        first, _, last = part.partition("-")
        cores += range(int(first), int(last or first) + 1)
    return cores


def numa_ordered(cores: list[int]) -> list[int]:
    """cores grouped by NUMA node (node 0's first), so that contiguous shares stay within a node where they can."""
    node_of = {}
    for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
        for core in parse_cores((node / "cpulist").read_text()):
            node_of[core] = int(node.name.removeprefix("node"))
    return sorted(cores, key=lambda c: (node_of.get(c, 0), c))


def rank_cores(spec: str, world: int) -> list[list[int]] | None:
    """Per rank, its cores; None: no binding. spec: `auto` (this process's cores in world equal contiguous shares,
    NUMA node by node; none if there are fewer cores than ranks), `none`, or one core list per rank separated by
    ';' (e.g. '0-7;8-15')."""
    if spec == "none":
        return None
    if spec == "auto":
        cores = numa_ordered(sorted(os.sched_getaffinity(0)))
        if len(cores) < world:
            logger.warning("%d cores for %d ranks: ranks are not bound to cores", len(cores), world)
            return None
        per = len(cores) // world
        return [cores[r * per:(r + 1) * per] for r in range(world)]
    shares = [parse_cores(s) for s in spec.split(";")]
    if len(shares) != world or not all(shares):
        raise ValueError(f"--cpu-binding {spec!r} names {len(shares)} core lists; expected one per rank ({world}), "
                         "separated by ';'")
    flat = [c for s in shares for c in s]
    if len(set(flat)) != len(flat):
        raise ValueError(f"--cpu-binding {spec!r}: ranks share cores")
    return shares


def bind(cores: list[int] | None, threads: int | None = None) -> None:
    """Binds every thread of this process (torch's pool included) to cores and sizes torch's pool to them."""
    if cores is not None:
        for task in Path("/proc/self/task").iterdir():
            try:
                os.sched_setaffinity(int(task.name), cores)
            except (ProcessLookupError, PermissionError):  # a thread that just ended
                continue
    n = len(cores) if cores is not None else threads
    if n:
        torch.set_num_threads(n)
