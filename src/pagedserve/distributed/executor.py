"""The driver's side of tensor parallelism: it starts the worker ranks, is rank 0 itself, and sends every step's
inputs to the workers before running its own part (vLLM's multiprocess executor with the driver as a worker).

Only rank 0's logits are read; the workers' come from the same all-gather and are dropped. A worker that dies
fails the step at once (its sockets close mid-collective, its pipe breaks, its process sentinel fires), and a
hung one within the collectives' timeout; the replica then stops its other ranks and its engine reports dead.
"""
from __future__ import annotations

import io
import logging
import multiprocessing as mp
import pickle
import weakref
from collections import OrderedDict
from dataclasses import replace
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch

from pagedserve.config import EngineConfig
from pagedserve.distributed.communicator import RankFailure, gloo_store
from pagedserve.distributed.cpu_binding import bind, rank_cores
from pagedserve.distributed.lora_shard import LoRAPlan, shard_adapter
from pagedserve.distributed.parallel_layers import shard_llama
from pagedserve.distributed.parallel_state import open_communicator, shm_for
from pagedserve.distributed.split import plan_shard
from pagedserve.distributed.worker import worker_main
from pagedserve.engine.kv_cache import held
from pagedserve.engine.model_runner import BatchInputs, ModelRunner, stored
from pagedserve.model.lora import LoRAAdapter
from pagedserve.model.model_config import ModelConfig

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # a worker's start: spawn, imports, the model's transfer and split
COLLECTIVE_TIMEOUT_S = 300.0  # the longest one collective may wait for a rank that is alive but stuck


def check_parallel(config: EngineConfig) -> None:
    """Refuses, naming it, what tensor parallelism cannot run."""
    if config.tensor_parallel_size < 1:
        raise ValueError("--tensor-parallel-size must be at least 1")


class Workers:
    """Ranks 1..N-1, each a spawned process bound to its own cores; this process is rank 0."""

    def __init__(self, config: EngineConfig, model: torch.nn.Module) -> None:
        world = config.tensor_parallel_size
        self.shard = plan_shard(model.config, 0, world)  # refuses a shape that does not split before any spawn
        self.kv_heads = [plan_shard(model.config, r, world).kv_heads for r in range(world)]
        # the rank whose share of each block holds each KV head first (where fewer heads than ranks repeat them)
        self.head_owners = [r for r, heads in enumerate(self.kv_heads)
                            if r == 0 or heads.start >= self.kv_heads[r - 1].stop]
        cores = rank_cores(config.cpu_binding, world)
        threads = None if cores else max(1, (config.num_threads or torch.get_num_threads()) // world)
        store = gloo_store(0, world, 0, COLLECTIVE_TIMEOUT_S)
        shm = shm_for(store, world)
        ctx = mp.get_context("spawn")
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        self._finalizer = weakref.finalize(self, stop_workers, self.procs, self.conns, shm)
        for rank in range(1, world):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(target=worker_main, name=f"pagedserve-tp-rank{rank}", daemon=True,
                               args=(rank, world, store.port, shm, cores[rank] if cores else None, threads,
                                     theirs, COLLECTIVE_TIMEOUT_S))
            proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(ours)
        try:
            for rank in range(1, world):
                self._expect(rank, "hello")
            bind(cores[0] if cores else None, threads)
            procs = self.procs
            self.comm = open_communicator(store, 0, world, shm, lambda: all(p.is_alive() for p in procs),
                                          COLLECTIVE_TIMEOUT_S)
            buffer = io.BytesIO()
            torch.save(model, buffer)  # whatever loaded it, every rank splits the same model
            for conn in self.conns:
                conn.send_bytes(buffer.getbuffer())
            del buffer
            shard_llama(model, self.shard, self.comm)
            for rank in range(1, world):
                self._expect(rank, "ready")
            if shm is not None:  # every rank has it mapped: nothing is left behind, however this process ends
                shm.unlink()
        except OSError as exc:  # a pipe to a worker broke: it is gone
            raise self.failed(exc) from exc
        except BaseException:
            self.close()
            raise
        logger.info("tensor parallel: %d ranks (rank 0 here), %s collectives, %s, cores %s", world, self.comm.name,
                    self.describe_split(), cores if cores else "unbound")

    def describe_split(self) -> str:
        s = self.shard
        return (f"rank 0 holds query heads {s.q_heads.start}-{s.q_heads.stop - 1}, KV heads "
                f"{s.kv_heads.start}-{s.kv_heads.stop - 1}, {len(s.intermediate)} MLP columns, {len(s.vocab)} "
                "vocabulary rows")

    def _expect(self, rank: int, kind: str) -> Any:
        conn, proc = self.conns[rank - 1], self.procs[rank - 1]
        ready = wait([conn, proc.sentinel], START_TIMEOUT_S)
        if conn in ready:
            try:
                got, payload = conn.recv()
            except EOFError:
                got, payload = "error", f"it exited (code {proc.join(5) or proc.exitcode})"
            if got == kind:
                return payload
            raise RankFailure(f"rank {rank} failed to start: {payload}")
        if proc.sentinel in ready:
            raise RankFailure(f"rank {rank} exited during start-up (exit code {proc.exitcode})")
        raise RankFailure(f"rank {rank} did not start within {START_TIMEOUT_S:.0f}s")

    def send_each(self, kind: str, payloads: list[Any]) -> None:
        """payloads[r - 1] to rank r."""
        try:
            for conn, payload in zip(self.conns, payloads, strict=True):
                conn.send_bytes(pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL))
        except OSError as exc:
            raise self.failed(exc) from exc

    def collect(self, kind: str) -> list[Any]:
        """Each worker's answer to the message just sent, in rank order."""
        answers = []
        for rank, conn in enumerate(self.conns, start=1):
            try:
                got, payload = pickle.loads(conn.recv_bytes())
            except (EOFError, OSError) as exc:
                raise self.failed(exc) from exc
            if got != kind:
                raise self.failed(RankFailure(f"rank {rank} answered {got!r}: {payload}"))
            answers.append(payload)
        return answers

    def send(self, kind: str, payload: Any) -> None:
        data = pickle.dumps((kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for conn in self.conns:
                conn.send_bytes(data)
        except OSError as exc:  # BrokenPipeError: a worker is gone
            raise self.failed(exc) from exc

    def failed(self, cause: BaseException) -> RankFailure:
        """The failure to raise (what the workers said or how they ended), after stopping every worker."""
        notes = []
        for rank, (conn, proc) in enumerate(zip(self.conns, self.procs), start=1):
            try:
                while conn.poll(0):
                    kind, payload = conn.recv()
                    notes.append(f"rank {rank}: {payload}" if kind == "error" else "")
            except (EOFError, OSError):
                pass
            if not proc.is_alive():
                notes.append(f"rank {rank} exited (code {proc.exitcode})")
        self.close()
        return RankFailure("; ".join(filter(None, [str(cause), *notes])))

    def close(self) -> None:
        self._finalizer()


def stop_workers(procs: list[BaseProcess], conns: list[Connection], shm: Path | None) -> None:
    """Asks each worker to stop, then ends any that does not within a few seconds."""
    if shm is not None:
        shm.unlink(missing_ok=True)
    stop = pickle.dumps(("stop", None))
    for conn in conns:
        try:
            conn.send_bytes(stop)
        except OSError:
            pass
    for proc in procs:
        proc.join(timeout=5)
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=5)
    for conn in conns:
        conn.close()


class ParallelModelRunner(ModelRunner):
    """Rank 0's runner: each call that runs the model is sent to the workers first, so that every rank makes the
    same collectives in the same order."""

    def __init__(self, workers: Workers, model: torch.nn.Module, config: ModelConfig, *args: Any, **kwargs: Any) -> None:
        self.workers = workers
        self.full_config = config
        # rank 0's parts of the adapters the workers hold, least recently used first; twice the slots, so that
        # a step's adapters (at most max_loras) are never the ones forgotten
        self.adapter_parts: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.max_adapter_parts = 2 * kwargs.get("max_loras", 0)
        names = ["kv_format", "num_blocks", "block_size"]
        workers.send("runner", {**dict(zip(names, args)), **kwargs})
        self._guarded(super().__init__, model, workers.shard.local_config(config), *args, **kwargs)
        if self.tails is not None:
            self.tails.journal = {}

    def _guarded(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except RankFailure as exc:
            raise self.workers.failed(exc) from exc

    def adapter_part(self, adapter: LoRAAdapter) -> LoRAAdapter:
        """Rank 0's part of adapter; the first time, the workers get the whole (however it was loaded: a
        request's lora_request or the server's load route) and keep their parts, before the step that uses it."""
        key = adapter.cache_key
        part = self.adapter_parts.get(key)
        if part is not None:
            self.adapter_parts.move_to_end(key)
            return part
        self.workers.send("lora", adapter)
        part = self.adapter_parts[key] = shard_adapter(adapter, self.workers.shard, self.full_config)
        if len(self.adapter_parts) > self.max_adapter_parts:
            self.workers.send("lora_drop", self.adapter_parts.popitem(last=False)[0])
        return part

    def execute(self, batch: BatchInputs) -> torch.Tensor:
        if self.tails is not None:  # int4 KV: the workers' key tails follow the ones rank 0 planned
            self.workers.send("tails", self.tails.drain())
        lora = None if batch.lora is None else LoRAPlan.of(batch.lora)
        self.workers.send("execute", replace(batch, sample_rows=[], sample_reqs=[], prompt_rows=[], lora=lora))
        return self._guarded(super().execute, batch)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        self.workers.send("logits", hidden.clone())  # a view would pickle its whole base
        return self._guarded(super().compute_logits, hidden, upcast)

    def copy_blocks(self, copies: list[tuple[int, int]], tails: list[tuple[int, int] | None] | None = None) -> None:
        tails = self.fork_tails(copies) if tails is None else tails
        self.workers.send("copy_blocks", (copies, tails))
        super().copy_blocks(copies, tails)

    # KV transfer: a payload holds every KV head, as a TP=1 worker's does (either end may be tensor-parallel or
    # not); each rank gathers or writes only its own heads' share of it.
    def wire_shape(self, t: torch.Tensor) -> tuple[int, ...]:
        return (self.full_config.num_key_value_heads, *t.shape[2:])

    @torch.inference_mode()
    def export_blocks(self, positions: list[tuple[int, ...]], out: torch.Tensor | None = None) -> memoryview:
        self.workers.send("gather", positions)
        ranks = [self._guarded(self.gather_blocks, positions), *self.workers.collect("pieces")]
        out = self._payload(len(positions), out)
        offset = 0
        for shares in zip(*ranks, strict=True):  # one layer's block tensor, every rank's heads of it
            whole = torch.cat([shares[r].view(stored(shares[r].dtype)) for r in self.workers.head_owners], dim=1)
            size = whole.numel() * whole.element_size()
            out[offset:offset + size].view(whole.dtype).view(whole.shape).copy_(whole)
            offset += size
        return memoryview(out.numpy())

    @torch.inference_mode()
    def import_blocks(self, positions: list[tuple[int, ...]], data: bytes | memoryview, num_blocks: int,
                      first: int = 0) -> None:
        if self.tails is not None:  # journaled: the workers' tails follow with the next step
            self.tails.release(held(positions))
        pieces = [p.view(num_blocks, -1, *p.shape[1:])[first:first + len(positions)].flatten(0, 1)
                  for p in self._pieces(data, num_blocks)]  # only the positions placed now travel to the workers
        shares = [[p[:, heads.start:heads.stop].contiguous() for p in pieces] for heads in self.workers.kv_heads]
        self.workers.send_each("scatter", [(positions, share) for share in shares[1:]])
        self._guarded(self.scatter_blocks, positions, shares[0])
