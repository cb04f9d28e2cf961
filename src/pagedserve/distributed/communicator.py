"""The collectives a tensor-parallel forward pass needs: all_reduce and all_gather over a gloo process group.

The group is a standalone ProcessGroupGloo over its own TCPStore, not torch.distributed's global default group,
so that one process may hold several engines (tests do) and each engine's ranks find each other by their port.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


class RankFailure(RuntimeError):
    """Another rank died or stopped answering: this replica cannot compute any more steps."""


class GlooCommunicator:
    """Sum all-reduce in place, and all-gather concatenated along the last dim."""

    name = "gloo"

    def __init__(self, group: dist.ProcessGroupGloo, store: dist.TCPStore, rank: int, world_size: int) -> None:
        self.group, self.store = group, store
        self.rank, self.world_size = rank, world_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        try:
            self.group.allreduce([x]).wait()
        except RuntimeError as exc:  # a peer's socket closed, or the group's timeout passed
            raise RankFailure(f"all_reduce failed on rank {self.rank}: {exc}") from exc
        return x

    def all_gather(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """x: [..., sizes[rank]]; returns [..., sum(sizes)]. Uneven parts are padded to the widest for gloo."""
        width = max(sizes)
        padded = x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))
        parts = [torch.empty_like(padded) for _ in sizes]
        try:
            self.group.allgather([parts], [padded.contiguous()]).wait()
        except RuntimeError as exc:
            raise RankFailure(f"all_gather failed on rank {self.rank}: {exc}") from exc
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes)], dim=-1)

    def close(self) -> None:
        self.group = None


def gloo_store(rank: int, world_size: int, port: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0 hosts the store (port 0: any free port, read back from store.port); the others connect to it."""
    return dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def init_gloo(store: dist.TCPStore, rank: int, world_size: int, timeout_s: float) -> GlooCommunicator:
    """Joins the group (blocks until every rank has). timeout_s bounds every collective, so that a rank that hangs,
    rather than dies (which gloo sees at once, as its sockets close), still fails the step."""
    group = dist.ProcessGroupGloo(dist.PrefixStore("tp", store), rank, world_size, timedelta(seconds=timeout_s))
    return GlooCommunicator(group, store, rank, world_size)
