"""AsyncLLM: drives the synchronous LLMEngine from its own thread and streams outputs to asyncio callers.

The engine is single-threaded, so every call into it (add, abort, step, stats) happens on the engine
thread. Callers hand it commands through a queue and get results back through futures and per-request
asyncio queues filled with loop.call_soon_threadsafe, so a model step never blocks the event loop.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Self

from pagedserve.lora_request import LoRARequest
from pagedserve.outputs import RequestOutput
from pagedserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

STATS_INTERVAL_S = 0.05  # how stale the engine stats shown to /metrics may get while the engine is busy


class EngineDeadError(RuntimeError):
    """The engine loop crashed or was shut down; no request can be served any more."""


class RequestFailedError(RuntimeError):
    """The engine failed one request (RequestOutput.error) while the engine itself is healthy."""


@dataclass(slots=True)
class RequestStream:
    """Outputs of one request as they come. Closing it before the last output aborts the request."""

    owner: AsyncLLM
    request_id: str
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput snapshots, then possibly an exception
    finished: bool = False
    first: RequestOutput | None = None  # the output of tokens given at add_request (already in the queue)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self.queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        self.finished = item.finished
        return item

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)
        self.owner._streams.pop(self.request_id, None)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


@dataclass(slots=True)
class _Command:
    fn: Callable[[], Any]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class AsyncLLM:
    """Async front of one LLMEngine. Start with start(), stop with shutdown()."""

    def __init__(self, engine: Any):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.grammars = engine.grammars  # thread-safe: the server compiles constraints before adding requests
        self.model_name: str = engine.model_name
        self.max_model_len: int = engine.max_model_len
        self.max_num_seqs: int = engine.config.max_num_seqs
        self.stats = engine.stats()
        self.error: BaseException | None = None
        self._streams: dict[str, RequestStream] = {}
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._stats_time = 0.0

    @classmethod
    def from_config(cls, config: Any) -> AsyncLLM:
        from pagedserve.engine.llm_engine import LLMEngine

        return cls(LLMEngine(config))

    def start(self) -> AsyncLLM:
        self._thread.start()
        return self

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.error is None

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # ---- caller side (event loop) ----

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          priority: int = 0, lora_request: LoRARequest | None = None,
                          output_token_ids: list[int] | None = None, hold: bool = False) -> RequestStream:
        """Adds a request; bad input raises here (ValueError), before any output. Close the stream when done.
        output_token_ids and hold: see LLMEngine.add_request; the output of the given tokens is the stream's
        first item."""
        stream = RequestStream(self, request_id, asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        try:
            first = await self.call(lambda: self.engine.add_request(
                request_id, prompt, params, priority, lora_request=lora_request, output_token_ids=output_token_ids,
                hold=hold))
        except BaseException:
            self.abort(request_id)  # a cancelled caller may have queued the add already
            raise
        if first is not None:
            stream.first = _snapshot(first)
            stream.queue.put_nowait(stream.first)
            if first.finished:
                self._streams.pop(request_id, None)
        return stream

    async def release_held(self, request_id: str) -> None:
        await self.call(lambda: self.engine.release_held(request_id))

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Yields cumulative RequestOutputs until the finished one. Leaving early aborts the request."""
        async with await self.add_request(request_id, prompt, params, priority) as stream:
            async for out in stream:
                yield out

    def abort(self, request_id: str) -> None:
        """Aborts a request (its KV blocks are freed before the next step). Never blocks."""
        self._streams.pop(request_id, None)
        if self.is_running:
            self._submit(lambda: self.engine.abort_request(request_id))

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Runs fn on the engine thread between two steps and returns its result (or raises its error)."""
        if not self.is_running:
            raise EngineDeadError(f"engine is not running: {self.error!r}")
        return await asyncio.wrap_future(self._submit(fn))

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stops the loop; requests still streaming get EngineDeadError."""
        self._stopped = True
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._fail_all(EngineDeadError("engine shut down"))

    # ---- engine side (engine thread) ----

    def _submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        command = _Command(fn)
        self._commands.put(command)
        self._wakeup.set()
        return command.future

    def _run(self) -> None:
        logger.info("engine loop started")
        try:
            while not self._stopped:
                self._run_commands()
                if self.engine.has_unfinished_requests():
                    self._dispatch(self.engine.step())
                    self._refresh_stats(force=False)
                else:
                    self._refresh_stats(force=True)
                    self._wakeup.wait(timeout=1.0)
                    self._wakeup.clear()
        except BaseException as exc:  # surfaced to every caller; the server reports unhealthy
            logger.exception("engine loop crashed")
            self.error = exc
            self._fail_all(EngineDeadError(f"engine loop crashed: {exc!r}"))
        finally:
            self._fail_commands()
            logger.info("engine loop stopped")

    def _run_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if not command.future.set_running_or_notify_cancel():
                continue
            try:
                command.future.set_result(command.fn())
            except Exception as exc:  # noqa: BLE001 -- any failure (e.g. ValueError for a bad prompt) goes to the caller
                command.future.set_exception(exc)

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, Any]]] = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished or out.error is not None:
                self._streams.pop(out.request_id, None)
            item: Any = _snapshot(out) if out.error is None else RequestFailedError(out.error)
            by_loop.setdefault(stream.loop, []).append((stream.queue, item))
        for loop, items in by_loop.items():
            _call_soon(loop, _deliver, items)

    def _refresh_stats(self, force: bool) -> None:
        now = time.monotonic()
        if force or now - self._stats_time > STATS_INTERVAL_S:
            self.stats = self.engine.stats()
            self._stats_time = now

    def _fail_all(self, exc: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for stream in streams.values():
            _call_soon(stream.loop, stream.queue.put_nowait, exc)

    def _fail_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command.future.set_running_or_notify_cancel():
                command.future.set_exception(EngineDeadError("engine is not running"))


def _deliver(items: list[tuple[asyncio.Queue, Any]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def _call_soon(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the caller's loop is closed: nobody is listening any more
        pass


def _snapshot(out: RequestOutput) -> RequestOutput:
    """A copy the engine can't mutate under the reader (outputs are cumulative and may be reused)."""
    return dataclasses.replace(out, outputs=[
        dataclasses.replace(
            c, token_ids=list(c.token_ids), logprobs=None if c.logprobs is None else list(c.logprobs))
        for c in out.outputs
    ])


