"""A worker rank's process: joins the group, takes the driver's model, keeps its part, then runs every step the
driver sends it (the same calls as the driver's own runner, so the collectives meet) until told to stop."""
from __future__ import annotations

import io
import logging
import os
import pickle
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from pagedserve.distributed.communicator import RankFailure, gloo_store
from pagedserve.distributed.cpu_binding import bind
from pagedserve.distributed.lora_shard import shard_adapter
from pagedserve.distributed.parallel_layers import shard_llama
from pagedserve.distributed.parallel_state import open_communicator
from pagedserve.distributed.split import RankShard, plan_shard
from pagedserve.engine.model_runner import ModelRunner
from pagedserve.model.lora import LoRAAdapter

logger = logging.getLogger(__name__)


def worker_main(rank: int, world: int, port: int, shm: Path | None, cores: list[int] | None, threads: int | None,
                conn: Connection, timeout_s: float) -> None:
    bind(cores, threads)
    driver = os.getppid()
    try:
        store = gloo_store(rank, world, port, timeout_s)
        conn.send(("hello", os.getpid()))
        comm = open_communicator(store, rank, world, shm, lambda: os.getppid() == driver, timeout_s)
        model = torch.load(io.BytesIO(conn.recv_bytes()), weights_only=False)
        shard = plan_shard(model.config, rank, world)
        shard_llama(model, shard, comm)
        conn.send(("ready", None))
        serve(conn, model, shard)
    except (EOFError, BrokenPipeError, RankFailure):  # the driver or another rank is gone: nothing left to serve
        os._exit(1)
    except BaseException:  # reported to the driver, which fails the replica with it
        logger.exception("tensor-parallel rank %d failed", rank)
        try:
            conn.send(("error", traceback.format_exc()))
        finally:
            os._exit(1)


@torch.inference_mode()
def serve(conn: Connection, model: torch.nn.Module, shard: RankShard) -> None:
    runner: ModelRunner | None = None
    adapters: dict[str, LoRAAdapter] = {}  # this rank's parts of the adapters rank 0 sent, by cache_key
    while True:
        kind, payload = pickle.loads(conn.recv_bytes())
        if kind == "stop":
            return
        if kind == "runner":
            runner = ModelRunner(model, shard.local_config(model.config), **payload)
        elif kind == "execute":
            if payload.lora is not None:
                payload.lora = payload.lora.batch(runner.lora_slots, adapters)
            runner.execute(payload)
        elif kind == "lora":
            adapters[payload.cache_key] = shard_adapter(payload, shard, model.config)
        elif kind == "lora_drop":
            adapters.pop(payload, None)
        elif kind == "logits":
            runner.compute_logits(payload)
        elif kind == "copy_blocks":
            runner.copy_blocks(*payload)
        elif kind == "tails":
            runner.tails.follow(*payload)
        elif kind == "gather":  # KV transfer: this rank's heads of the blocks, to rank 0
            conn.send_bytes(pickle.dumps(("pieces", runner.gather_blocks(payload)), protocol=pickle.HIGHEST_PROTOCOL))
        elif kind == "scatter":
            runner.scatter_blocks(*payload)
        else:
            raise ValueError(f"unknown step message {kind!r}")
