"""The adapters an engine holds in memory: loaded off the step thread, kept least-recently-used up to
max_cpu_loras (pinned ones never evicted). An adapter's identity for the prefix cache is its weights' digest, so a
reload with other weights under the same name never meets the old KV. One loader thread reads every adapter in
turn, and a load already under way for a request is shared, not queued again (a burst of requests for an
evicted adapter reads it once)."""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections import OrderedDict

import torch

from pagedserve.lora_request import LoRARequest
from pagedserve.model.lora import LoRAAdapter, load_adapter
from pagedserve.model.model_config import ModelConfig

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, config: ModelConfig, dtype: torch.dtype, max_lora_rank: int, max_cpu_loras: int) -> None:
        self.config, self.dtype = config, dtype
        self.max_lora_rank, self.max_cpu_loras = max_lora_rank, max_cpu_loras
        self.adapters: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self.pinned: set[str] = set()
        self.loads = self.evictions = 0  # since start, for /metrics
        self._loading: dict[LoRARequest, concurrent.futures.Future] = {}  # loads queued or under way
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="lora-load")

    def get(self, request: LoRARequest) -> LoRAAdapter | None:
        """The loaded adapter for request (same name, id and path), marked recently used; else None."""
        with self._lock:
            adapter = self.adapters.get(request.lora_name)
            if adapter is None or (adapter.int_id, adapter.path) != (request.lora_int_id, request.lora_path):
                return None
            self.adapters.move_to_end(request.lora_name)
            return adapter

    def submit(self, request: LoRARequest) -> concurrent.futures.Future:
        """Loads off the calling thread (a loaded adapter comes back as a finished future, one being loaded as
        that load's future)."""
        adapter = self.get(request)
        if adapter is not None:
            done: concurrent.futures.Future = concurrent.futures.Future()
            done.set_result(adapter)
            return done
        with self._lock:
            future = self._loading.get(request)
            if future is None:
                future = self._loading[request] = self._pool.submit(self.load, request)
            return future

    def load(self, request: LoRARequest, pin: bool = False) -> LoRAAdapter:
        """Reads and prepares the adapter; ValueError when it cannot serve this model."""
        start = time.perf_counter()
        adapter = None
        try:
            adapter = load_adapter(request.lora_path, self.config, request.lora_name, request.lora_int_id,
                                   self.max_lora_rank, self.dtype)
        finally:
            with self._lock:  # no longer loading and now loaded at once: a submit between would load it again
                self._loading.pop(request, None)
                if adapter is not None:
                    self.loads += 1
                    self.adapters.pop(request.lora_name, None)
                    self.adapters[request.lora_name] = adapter
                    if pin:
                        self.pinned.add(request.lora_name)
                    self._evict()
        logger.info("loaded LoRA adapter %s (rank %d, %.1f MB) from %s in %.0f ms", adapter.name, adapter.rank,
                    adapter.nbytes / 1e6, adapter.path, (time.perf_counter() - start) * 1e3)
        return adapter

    def resident(self) -> tuple[int, int]:
        """(adapters in memory, their bytes)."""
        with self._lock:
            return len(self.adapters), sum(a.nbytes for a in self.adapters.values())

    def unload(self, name: str) -> bool:
        """Forgets an adapter (requests already holding it finish with it); False if it was not loaded."""
        with self._lock:
            self.pinned.discard(name)
            return self.adapters.pop(name, None) is not None

    def _evict(self) -> None:
        for name in list(self.adapters):
            if len(self.adapters) <= self.max_cpu_loras:
                return
            if name not in self.pinned:
                del self.adapters[name]
                self.evictions += 1
                logger.info("evicted LoRA adapter %s (least recently used; --max-cpu-loras %d)", name,
                            self.max_cpu_loras)
