"""All-reduce and all-gather through shared memory between the ranks of one host (as vLLM's CPU backend does).

One file in /dev/shm, mapped by every rank: a flag per rank (its own cache line) and, twice over, a slot per rank.
A collective is: copy this rank's tensor into its slot, publish the collective's sequence number in its flag,
wait until every flag has reached it, then read all slots (the sum in rank order, so every rank gets the same bits;
bf16 summed in fp32). Two sets of slots alternate: a rank overwrites a slot of collective s only at s + 2, after
every rank has published s + 1, that is after all finished reading s; so one barrier per collective suffices.
x86 keeps stores in program order, so a flag seen published means its slot's bytes are there too.

A wait spins (yielding the core) and checks, every millisecond or so, that its peers are alive and the timeout has
not passed: a dead rank fails the step within about a millisecond, never a hang.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pagedserve.distributed.communicator import RankFailure

FLAG_WORDS = 16  # int64s per rank's flag: one 128-byte line each, so that ranks never write the same line
SLOT_BYTES = 8 << 20  # per rank and parity; a larger tensor goes through in pieces


def shm_bytes(world: int, slot_bytes: int = SLOT_BYTES) -> int:
    return world * FLAG_WORDS * 8 + 2 * world * slot_bytes


def create_shm(name: str, world: int, slot_bytes: int = SLOT_BYTES) -> Path:
    """The zero-filled file the ranks map (rank 0 creates it, and unlinks it once every rank has mapped it)."""
    path = Path("/dev/shm") / name
    with open(path, "xb") as f:
        f.truncate(shm_bytes(world, slot_bytes))
    return path


class ShmCommunicator:
    name = "shm"

    def __init__(self, path: Path, rank: int, world: int, alive: Callable[[], bool], timeout_s: float,
                 slot_bytes: int = SLOT_BYTES) -> None:
        self.rank, self.world_size = rank, world
        self.alive, self.timeout_s = alive, timeout_s
        self.slot_bytes = slot_bytes
        raw = torch.from_file(str(path), shared=True, size=shm_bytes(world, slot_bytes), dtype=torch.uint8)
        head = world * FLAG_WORDS * 8
        self.flags = raw[:head].view(torch.int64).view(world, FLAG_WORDS).numpy()
        self.slots = raw[head:].view(2, world, slot_bytes)
        self.seq = 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.view(-1)
        step = self.slot_bytes // x.element_size()
        for start in range(0, flat.numel(), step):
            part = flat[start:start + step]
            slots = self._exchange(part)
            views = [s[:part.numel() * x.element_size()].view(x.dtype) for s in slots]
            if x.dtype == torch.float32:
                part.copy_(views[0])
                for v in views[1:]:
                    part.add_(v)
            else:
                acc = views[0].float()
                for v in views[1:]:
                    acc.add_(v)
                part.copy_(acc)
        return x

    def all_gather(self, x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
        """x: [..., sizes[rank]] -> [..., sum(sizes)], in rows that fit a slot at a time."""
        lead = x.shape[:-1]
        rows = x.reshape(-1, x.shape[-1])
        per = max(1, self.slot_bytes // (max(sizes) * x.element_size()))
        out = torch.empty(rows.shape[0], sum(sizes), dtype=x.dtype)
        for start in range(0, rows.shape[0], per):
            part = rows[start:start + per]
            n = part.shape[0]
            slots = self._exchange(part.contiguous().view(-1))
            col = 0
            for r, (slot, width) in enumerate(zip(slots, sizes)):
                out[start:start + n, col:col + width] = slot[:n * width * x.element_size()].view(x.dtype).view(n, width)
                col += width
        return out.view(*lead, sum(sizes))

    def _exchange(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Publishes flat (at most one slot) and returns every rank's slot of this collective, once all are in."""
        self.seq += 1
        parity = self.seq % 2
        nbytes = flat.numel() * flat.element_size()
        if nbytes > self.slot_bytes:
            raise ValueError(f"{nbytes} bytes do not fit a {self.slot_bytes}-byte slot")
        self.slots[parity, self.rank, :nbytes].copy_(flat.view(torch.uint8))
        self.flags[self.rank, 0] = self.seq
        self._wait(self.seq)
        return list(self.slots[parity])

    def _wait(self, seq: int) -> None:
        flags = self.flags
        spins = 0
        deadline = None
        while int(flags[:, 0].min()) < seq:
            spins += 1
            if spins % 64:
                continue
            os.sched_yield()
            if spins % 4096 == 0:
                now = time.monotonic()
                deadline = deadline or now + self.timeout_s
                if not self.alive():
                    raise RankFailure(f"rank {self.rank}: a peer rank died during collective {seq}")
                if now > deadline:
                    raise RankFailure(f"rank {self.rank}: collective {seq} waited {self.timeout_s:.0f}s for a peer")

    def close(self) -> None:
        self.slots = None

