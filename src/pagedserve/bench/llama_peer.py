"""llama.cpp as a peer of the offline benchmark: its llama-server (benchmarks/peers/build_llama_server.sh, a
native build) on the same GGUF, every job sent at once to its parallel slots, as a user batches with it.
Its native /completion endpoint takes token-id prompts and returns the generated token ids, so the run is
checked like the others (counts, EOS ignored, agreement)."""
from __future__ import annotations

import asyncio
import subprocess
import time
from pathlib import Path

import httpx

from pagedserve.bench.measure import Job, Run, log
from pagedserve.bench.report import REPO

DEFAULT_BINARY = REPO / "build/peers/llama.cpp/build/bin/llama-server"


class OfflinePeer:
    name = "llama.cpp"

    def __init__(self, gguf: Path, binary: Path = DEFAULT_BINARY, threads: int = 2, slots: int = 64,
                 slot_tokens: int = 1664):
        from pagedserve.bench.servers import free_port

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port), "-np", str(slots),
               "-c", str(slots * slot_tokens), "-t", str(threads), "-tb", str(threads), "--cont-batching",
               "--no-webui", "-b", "2048", "-ub", "512"]
        self.setting = (f"llama-server, {slots} parallel slots, continuous batching, {threads} threads, "
                        f"the GGUF's own types (Q4_1 / Q8_0)")
        log(f"starting {self.setting}")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode} while starting")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.close()
                raise TimeoutError("llama-server not healthy after 300 s")
            time.sleep(0.5)

    async def _all(self, jobs: list[Job]) -> list[dict]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        async with httpx.AsyncClient(timeout=None, limits=limits) as client:
            async def one(job: Job) -> dict:
                body = {"prompt": job.prompt_token_ids, "n_predict": job.max_tokens, "temperature": 0,
                        "ignore_eos": True, "cache_prompt": False, "return_tokens": True, "stream": False}
                resp = await client.post(f"{self.url}/completion", json=body)
                resp.raise_for_status()
                return resp.json()
            return await asyncio.gather(*(one(j) for j in jobs))

    def run(self, jobs: list[Job]) -> Run:
        start = time.perf_counter()
        replies = asyncio.run(self._all(jobs))
        elapsed = time.perf_counter() - start
        return Run(elapsed, [list(r.get("tokens") or []) for r in replies], sum(len(j.prompt_token_ids) for j in jobs))

    def single(self, job: Job) -> tuple[float, float]:
        """(TTFT seconds, ms per output token after the first), from the server's own timings."""
        timings = asyncio.run(self._all([job]))[0]["timings"]
        return timings["prompt_ms"] / 1e3, timings["predicted_per_token_ms"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
