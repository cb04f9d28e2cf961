"""AsyncLLM over a real LLMEngine: concurrency, abort on early exit, errors, shutdown."""
import asyncio
import threading
import time

import pytest

from pagedserve.config import EngineConfig
from pagedserve.engine.async_engine import AsyncLLM, EngineDeadError
from pagedserve.engine.llm_engine import LLMEngine
from pagedserve.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(kv_cache_memory="16MiB", dtype="float32"))


@pytest.fixture
def llm(engine: LLMEngine):
    async_llm = AsyncLLM(engine).start()
    yield async_llm
    async_llm.shutdown()


def offline(engine: LLMEngine, prompt: str, params: SamplingParams) -> str:
    engine.add_request("offline", prompt, params)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out.outputs[0].text
    raise AssertionError("no output")


async def collect(llm: AsyncLLM, rid: str, prompt: str, params: SamplingParams):
    outs = [out async for out in llm.generate(rid, prompt, params)]
    return outs


async def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_concurrent_requests_match_offline_and_step_off_loop(engine: LLMEngine):
    prompts = ["The capital of France is", "List three colors:", "def fibonacci(n):"]
    expected = [offline(engine, p, GREEDY) for p in prompts]
    step_threads: set[int] = set()
    original_step = engine.step

    def recording_step():
        step_threads.add(threading.get_ident())
        return original_step()

    engine.step = recording_step
    llm = AsyncLLM(engine).start()
    try:
        async def main():
            loop_thread = threading.get_ident()
            results = await asyncio.gather(*(collect(llm, f"r{i}", p, GREEDY) for i, p in enumerate(prompts)))
            return loop_thread, results

        loop_thread, results = asyncio.run(main())
    finally:
        llm.shutdown()
        del engine.step
    assert [r[-1].outputs[0].text for r in results] == expected
    for outs in results:
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        lengths = [len(o.outputs[0].token_ids) for o in outs]
        assert lengths == sorted(lengths)  # cumulative snapshots, never mutated afterwards
    assert step_threads and loop_thread not in step_threads


def test_leaving_early_aborts_and_frees_blocks(llm: AsyncLLM):
    async def main():
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        async for out in llm.generate("long", "Tell me a story about a dragon.", params):
            if len(out.outputs[0].token_ids) >= 3:
                break
        await wait_for(lambda: llm.stats.blocks_used == 0 and llm.stats.num_running == 0)
        return out

    out = asyncio.run(main())
    assert not out.finished
    assert not llm.engine.has_unfinished_requests()


def test_cancelled_task_aborts(llm: AsyncLLM):
    async def main():
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        task = asyncio.ensure_future(collect(llm, "cancel-me", "Once upon a time", params))
        await wait_for(lambda: llm.stats.blocks_used > 0)
        task.cancel()
        await wait_for(lambda: llm.stats.blocks_used == 0 and llm.num_streams == 0)

    asyncio.run(main())


def test_bad_input_raises_before_any_output(llm: AsyncLLM):
    async def main():
        with pytest.raises(ValueError, match="empty"):
            await llm.add_request("empty", "", GREEDY)
        with pytest.raises(ValueError, match="context length"):
            await llm.add_request("long", [1] * (llm.max_model_len + 5), GREEDY)
        # The engine keeps serving afterwards.
        outs = await collect(llm, "ok", "Hello", GREEDY)
        assert outs[-1].finished

    asyncio.run(main())
    assert llm.num_streams == 0


def test_engine_crash_reaches_callers(engine: LLMEngine):
    def broken_step():
        raise RuntimeError("simulated kernel failure")

    engine.step = broken_step
    llm = AsyncLLM(engine).start()
    try:
        async def main():
            with pytest.raises(EngineDeadError, match="simulated kernel failure"):
                await collect(llm, "doomed", "Hello", GREEDY)
            with pytest.raises(EngineDeadError):
                await llm.add_request("after", "Hello", GREEDY)

        asyncio.run(main())
        assert not llm.is_running
    finally:
        del engine.step
        llm.shutdown()
        engine.abort_request("doomed")


def test_shutdown_ends_open_streams(engine: LLMEngine):
    llm = AsyncLLM(engine).start()

    async def main():
        params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
        stream = await llm.add_request("open", "Count to a thousand:", params)
        await anext(stream)
        llm.shutdown()
        with pytest.raises(EngineDeadError):
            async for _ in stream:
                pass

    asyncio.run(main())
    engine.abort_request("open")
    assert not engine.has_unfinished_requests()
