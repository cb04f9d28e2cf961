"""How a rank joins its group and which collectives it uses: shared memory on one host (the default), gloo where
PAGEDSERVE_TP_COLLECTIVES=gloo (the reference the shared-memory path is tested against, and the path across hosts)."""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from pagedserve.distributed.communicator import GlooCommunicator, init_gloo
from pagedserve.distributed.shm_communicator import ShmCommunicator, create_shm


def collectives() -> str:
    wanted = os.environ.get("PAGEDSERVE_TP_COLLECTIVES", "shm")
    if wanted not in ("shm", "gloo"):
        raise ValueError(f"PAGEDSERVE_TP_COLLECTIVES={wanted!r}; choose shm or gloo")
    return wanted


def shm_for(store: dist.TCPStore, world: int) -> Path | None:
    """The shared-memory file of a new group (rank 0 makes it), or None where the group uses gloo."""
    return create_shm(f"pagedserve-tp-{os.getpid()}-{store.port}", world) if collectives() == "shm" else None


def open_communicator(store: dist.TCPStore, rank: int, world: int, shm: Path | None, alive: Callable[[], bool],
                      timeout_s: float) -> GlooCommunicator | ShmCommunicator:
    """Joins the gloo group (every rank, whichever collectives run), then maps the shared memory where there is."""
    gloo = init_gloo(store, rank, world, timeout_s)
    return gloo if shm is None else ShmCommunicator(shm, rank, world, alive, timeout_s)
