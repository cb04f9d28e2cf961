"""vLLM's CPU build as a peer: its environment at its own recommended setting, its OpenAI server for the
serving benchmark, and its offline `LLM` (in its own virtualenv, benchmarks/peers/setup_vllm_cpu.sh) for
the throughput benchmark. Same weights as ours: the packaged GGUF exported to a HF folder by
benchmarks/peers/export_hf_folder.py (vLLM computes in bf16 from it)."""
from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from pagedserve.bench.measure import Job, Run, log
from pagedserve.bench.report import REPO

DEFAULT_VENV = REPO / "build/peers/vllm-cpu-venv"
DEFAULT_FOLDER = REPO / "build/peers/smollm2-hf"
WORKER = Path(__file__).with_name("vllm_worker.py")
SERVED_NAME = "SmolLM2-135M-Instruct"


def python(venv: Path | str = DEFAULT_VENV) -> Path | None:
    """The venv's python when vllm is installed there, else None."""
    exe = Path(venv) / "bin/python"
    return exe if exe.is_file() and any((Path(venv) / "lib").glob("python3*/site-packages/vllm/__init__.py")) else None


def missing_reason(venv: Path | str = DEFAULT_VENV, folder: Path | str = DEFAULT_FOLDER) -> str | None:
    if python(venv) is None:
        return f"no vLLM CPU in {venv} (install it: benchmarks/peers/setup_vllm_cpu.sh)"
    if not (Path(folder) / "config.json").is_file():
        return f"no HF folder at {folder} (export it: benchmarks/peers/export_hf_folder.py)"
    return None


def tcmalloc() -> str | None:
    for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"):
        for name in ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4"):
            if (Path(d) / name).is_file():
                return str(Path(d) / name)
    return None


def environment(venv: Path | str = DEFAULT_VENV, threads: int = 2, kv_gib: int = 4) -> dict[str, str]:
    """vLLM CPU's recommended setting (its CPU installation guide): tcmalloc and the libiomp5 its intel-openmp
    dependency ships in LD_PRELOAD, its OpenMP threads bound one per core (VLLM_CPU_OMP_THREADS_BIND), a KV
    space of its own in GiB (VLLM_CPU_KVCACHE_SPACE), and nothing fetched from a hub."""
    preload = [p for p in (tcmalloc(), str(Path(venv) / "lib/libiomp5.so")) if p and Path(p).is_file()]
    env = {"VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
           "VLLM_CPU_KVCACHE_SPACE": str(kv_gib), "OMP_NUM_THREADS": str(threads),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env


def describe(env: dict[str, str]) -> str:
    return ", ".join(f"{k}={env[k]}" for k in ("LD_PRELOAD", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_KVCACHE_SPACE")
                     if k in env)


def server_command(venv: Path | str, folder: Path | str, port: int, max_num_seqs: int, max_model_len: int,
                   dtype: str = "bfloat16") -> list[str]:
    """Its OpenAI server, started as a module: the `vllm serve` entry point looks for a distribution named
    `vllm`, and this one is `vllm-cpu`."""
    return [str(python(venv)), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
            "--served-model-name", SERVED_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
            "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len), "--enable-prefix-caching",
            "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]


class OfflinePeer:
    """One `vllm.LLM` in its own process for the whole benchmark (its start-up compiles for minutes)."""

    name = "vLLM CPU"

    def __init__(self, venv: Path | str = DEFAULT_VENV, folder: Path | str = DEFAULT_FOLDER, threads: int = 2,
                 dtype: str = "bfloat16", max_num_seqs: int = 64, max_model_len: int = 2048, kv_gib: int = 4,
                 max_num_batched_tokens: int = 0):
        self.env = environment(venv, threads, kv_gib)
        self.setting = (f"LLM.generate, all requests at once, {dtype}, max_num_seqs {max_num_seqs}, "
                        f"max_num_batched_tokens {max_num_batched_tokens or 'its default'}, prefix caching on "
                        f"(reset before every run); {describe(self.env)}")
        log(f"starting vLLM CPU ({self.setting})")
        self.stderr = open(REPO / "build/peers/vllm-offline.log", "w")  # noqa: SIM115 -- lives with the process
        self.proc = subprocess.Popen(
            [str(python(venv)), str(WORKER), str(folder), dtype, str(max_num_seqs), str(max_model_len),
             str(max_num_batched_tokens)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
            env={**os.environ, **self.env})
        ready = self.proc.stdout.readline()
        while ready and not ready.startswith("{"):
            ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError(f"vLLM CPU did not start (exit {self.proc.wait()}); see build/peers/vllm-offline.log")

    def _ask(self, msg: dict) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        while line and not line.startswith("{"):  # not the protocol's (the worker keeps its stdout clean)
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"vLLM CPU exited ({self.proc.poll()}); see build/peers/vllm-offline.log")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return reply

    def run(self, jobs: list[Job]) -> Run:
        reply = self._ask({"cmd": "run", "jobs": [[j.prompt_token_ids, j.max_tokens] for j in jobs]})
        time.sleep(0.5)  # its OpenMP threads spin a while after the work: keep that out of the next timing
        return Run(reply["elapsed"], reply["outputs"], sum(len(j.prompt_token_ids) for j in jobs))

    def single(self, job: Job) -> tuple[float, float]:
        """(TTFT seconds, ms per output token after the first)."""
        reply = self._ask({"cmd": "single", "prompt": job.prompt_token_ids, "max_tokens": job.max_tokens})
        time.sleep(0.5)
        return reply["ttft"], reply["ms_per_token"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self._ask({"cmd": "quit"})
            except (RuntimeError, BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.stderr.close()
