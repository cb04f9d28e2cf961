"""Prefill, kernel by kernel (issue #38): where one prefill step spends its time, each linear's rate against the
machine's peak, the attention kernel's rate, prompt tok/s at 256 and 1,024-token prompts, and decode ITL beside a
long prefill. Pure measurement; nothing imports it.

  python benchmarks/prefill_kernels.py profile    [--tokens 1024] [--quantization auto] [--repeats 5]
  python benchmarks/prefill_kernels.py peak       (AVX-512 BF16 / FP32 FMA rate of this machine, per core and all)
  python benchmarks/prefill_kernels.py gemm       [--rows 256,512,1024,2048] [--quantization none,gguf,int8]
  python benchmarks/prefill_kernels.py attention  [--tokens 256,1024,2048] [--kv-cache-dtypes bfloat16,int8,...]
  python benchmarks/prefill_kernels.py throughput [--workloads 1024x32,256x128] [--quantization auto]
  python benchmarks/prefill_kernels.py itl        [--chunks 256,512,1024,2048 | --caps 0,128,256,512] [--decodes 16]

Timings on a shared machine are noisy: every figure is a median over repeats, with its min-max.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from functools import partial

import torch


def spread(xs: list[float], fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


# -- a profiler of exclusive times by region ---------------------------------------------------------------------

class Regions:
    """Time per named region, exclusive of the regions nested inside it (CPU ops are synchronous): wall time, or this
    thread's CPU time (`clock`), which a single-threaded run on a shared machine measures without the time others
    held the core."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.exclusive: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list] = []  # [name, start, child time]
        self.on = False

    @contextmanager
    def region(self, name: str):
        if not self.on:
            yield
            return
        frame = [name, self.clock(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            self._stack.pop()
            total = self.clock() - frame[1]
            self.exclusive[name] += total - frame[2]
            self.calls[name] += 1
            if self._stack:
                self._stack[-1][2] += total

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            with self.region(name):
                return fn(*args, **kwargs)
        return timed


class TimedKernels:
    """The C++ extension with every function timed under its own name."""

    def __init__(self, kernels, regions: Regions) -> None:
        self._k, self._r = kernels, regions

    def __getattr__(self, name: str):
        fn = getattr(self._k, name)
        if not callable(fn) or name.endswith("available") or name in ("quant_paths",):
            return fn
        return self._r.wrap(name, fn)


def make_engine(args: argparse.Namespace, **over):
    from pagedserve.config import EngineConfig
    from pagedserve.engine.llm_engine import LLMEngine

    cfg = {"dtype": args.dtype, "quantization": args.quantization, "kv_cache_memory": args.kv_cache_memory,
           "kv_cache_dtype": args.kv_cache_dtype, "max_num_batched_tokens": args.max_num_batched_tokens,
           "enable_prefix_caching": False, "num_threads": args.threads}
    cfg.update(over)
    return LLMEngine(EngineConfig(**cfg))


def corpus(engine) -> list[int]:
    from pagedserve.bench.workloads import corpus_tokens

    return corpus_tokens(engine.tokenizer)


def instrument(engine, regions: Regions) -> None:
    """Times the step's parts: scheduler, input preparation, each linear by its projection, the fused ops and
    attention kernels, the LM head, the sampler."""
    import importlib

    from pagedserve.engine import llm_engine
    from pagedserve.model import quant_linear
    from pagedserve.model.linear import Linear
    from pagedserve.model.quant_linear import QuantEmbedding, QuantLinear

    model = engine.runner.model
    for name, module in model.named_modules():
        if isinstance(module, Linear | QuantLinear):
            label = "lm_head" if name == "lm_head" else name.rsplit(".", 1)[-1]
            module.forward = regions.wrap(label, module.forward)
        elif isinstance(module, QuantEmbedding | torch.nn.Embedding):
            module.forward = regions.wrap("embedding", module.forward)
    if model.kernels is not None:
        model.kernels = TimedKernels(model.kernels, regions)
    kernels = quant_linear.cpu_kernels()
    if kernels is not None:
        timed = TimedKernels(kernels, regions)
        quant_linear.cpu_kernels = lambda: timed
    for name in ("pagedserve.model.models.llama", "pagedserve.model.llama"):  # where the Llama family lives
        try:
            llama = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        llama.paged_attention = regions.wrap("attention (other)", llama.paged_attention)
        break
    llm_engine.sample = regions.wrap("sampler", llm_engine.sample)
    engine.scheduler.schedule = regions.wrap("scheduler", engine.scheduler.schedule)
    engine.runner.prepare = regions.wrap("prepare inputs", engine.runner.prepare)
    engine.runner.compute_logits = regions.wrap("lm_head", engine.runner.compute_logits)
    step = engine.step
    engine.step = regions.wrap("step", step)


def attention_path() -> str:
    from pagedserve.model import attention

    fn = getattr(attention, "prefill_attention_path", None)
    return fn() if fn is not None else "avx512 (before #38)"


def run_prompts(engine, prompts: list[list[int]], max_tokens: int = 1) -> float:
    """Adds the prompts, steps until all finish; returns the wall time."""
    from pagedserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{time.monotonic_ns()}-{i}", p, params)
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


ORDER = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head", "quant_dequantize", "prefill_attention",
         "paged_decode_attention", "attention (other)", "rope_and_cache", "rope_and_cache_int4", "rms_norm",
         "silu_and_mul", "embedding", "sampler", "scheduler", "prepare inputs"]


def cmd_profile(args: argparse.Namespace) -> None:
    engine = make_engine(args)
    cpu = args.clock == "cpu"
    if cpu and torch.get_num_threads() != 1:
        raise SystemExit("--clock cpu measures one thread: add --threads 1")
    regions = Regions(time.thread_time if cpu else time.perf_counter)
    instrument(engine, regions)
    tokens = corpus(engine)
    n = args.tokens
    run_prompts(engine, [tokens[:n]])  # warm-up (kernels loaded, oneDNN primitives made)
    per_run = []
    for r in range(args.repeats):
        regions.exclusive.clear()
        regions.calls.clear()
        regions.on = True
        start = 1000 + 97 * r
        run_prompts(engine, [tokens[start:start + n]])
        regions.on = False
        per_run.append(dict(regions.exclusive))
    names = [k for k in ORDER if any(k in run for run in per_run)]
    names += sorted({k for run in per_run for k in run} - set(names) - {"step"})
    total = [run["step"] + sum(v for k, v in run.items() if k != "step") for run in per_run]
    print(f"# one prefill step of {n} tokens: dtype {engine.dtype}, quantization {engine.quantization} "
          f"({engine.weights_info['quant_kernel']}), KV {engine.kv_format.name}, {torch.get_num_threads()} threads, "
          f"{args.repeats} runs")
    print("| part | ms | share |")
    print("|---|---|---|")
    med_total = statistics.median(total)
    for k in names:
        ms = [run.get(k, 0.0) * 1e3 for run in per_run]
        print(f"| {k} | {spread(ms)} | {100 * statistics.median(ms) / (med_total * 1e3):.1f}% |")
    other = [run["step"] * 1e3 for run in per_run]
    print(f"| Python and the rest of the step | {spread(other)} | {100 * statistics.median(other) / (med_total * 1e3):.1f}% |")
    print(f"| **step** | {spread([t * 1e3 for t in total])} | {n / med_total:.0f} prompt tok/s |")


# -- the machine's peak --------------------------------------------------------------------------------------------

PEAK_SRC = r"""
#include <torch/extension.h>
#include <immintrin.h>
#include <ATen/Parallel.h>
#include <chrono>
// Independent accumulator chains of one instruction: its throughput in instructions per second per thread.
template <int KIND>
static inline __m512 op(__m512 a, __m512 x, __m512 y) {
  if constexpr (KIND == 0) return _mm512_dpbf16_ps(a, (__m512bh)x, (__m512bh)y);
  else return _mm512_fmadd_ps(a, x, y);
}
template <int KIND>
static double run(int64_t iters) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0, a8 = a0, a9 = a0,
         a10 = a0, a11 = a0;
  const __m512 x = _mm512_set1_ps(1e-3f), y = _mm512_set1_ps(1e-3f);
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iters; ++it) {
    a0 = op<KIND>(a0, x, y); a1 = op<KIND>(a1, x, y); a2 = op<KIND>(a2, x, y); a3 = op<KIND>(a3, x, y);
    a4 = op<KIND>(a4, x, y); a5 = op<KIND>(a5, x, y); a6 = op<KIND>(a6, x, y); a7 = op<KIND>(a7, x, y);
    a8 = op<KIND>(a8, x, y); a9 = op<KIND>(a9, x, y); a10 = op<KIND>(a10, x, y); a11 = op<KIND>(a11, x, y);
    asm volatile("" : "+v"(a0), "+v"(a1), "+v"(a2), "+v"(a3), "+v"(a4), "+v"(a5), "+v"(a6), "+v"(a7), "+v"(a8),
                 "+v"(a9), "+v"(a10), "+v"(a11));
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const float sink = _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a5), a11));
  if (sink == 12345.f) return 0;
  return 12.0 * iters / s;
}
// kind 0: vdpbf16ps zmm (32 multiply-adds each), 1: vfmadd231ps zmm (16). Returns instructions/s per thread,
// summed over `threads` threads running at once.
double peak(int64_t kind, int64_t iters, int64_t threads) {
  std::vector<double> rate(threads);
  at::parallel_for(0, threads, 1, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) rate[t] = kind == 0 ? run<0>(iters) : run<1>(iters);
  });
  double s = 0; for (double r : rate) s += r; return s;
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("peak", &peak); }
"""


def cmd_peak(args: argparse.Namespace) -> None:
    from torch.utils.cpp_extension import load_inline

    mod = load_inline("prefill_peak", cpp_sources=[PEAK_SRC], extra_cflags=["-O3", "-march=native", "-fopenmp"],
                      extra_ldflags=["-fopenmp"], build_directory=_scratch("peak"))
    threads = torch.get_num_threads()
    for kind, name, flops in ((0, "vdpbf16ps zmm (bf16 dot, fp32 accumulate)", 64), (1, "vfmadd231ps zmm (fp32)", 32)):
        one = [mod.peak(kind, 20_000_000, 1) for _ in range(args.repeats)]
        allc = [mod.peak(kind, 20_000_000, threads) for _ in range(args.repeats)]
        print(f"{name}: 1 thread {spread([r * flops / 1e9 for r in one])} GFLOP/s "
              f"({spread([r / 1e9 for r in one], '{:.2f}')} G instr/s); {threads} threads "
              f"{spread([r * flops / 1e9 for r in allc])} GFLOP/s")


def _scratch(name: str) -> str:
    path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"prefill_kernels_{name}")
    os.makedirs(path, exist_ok=True)
    return path


# -- GEMMs at prefill shapes ---------------------------------------------------------------------------------------

def timeit(fn, repeats: int, inner: int = 3) -> list[float]:
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        out.append((time.perf_counter() - t0) / inner)
    return out


def cmd_gemm(args: argparse.Namespace) -> None:
    """Each distinct linear of the default model at prefill M, per weight format: achieved GFLOP/s."""
    from pagedserve.model.linear import Linear
    from pagedserve.model.quant_linear import QuantLinear, quant_kernel

    rows = [int(x) for x in args.rows.split(",")]
    print(f"threads {torch.get_num_threads()}; GFLOP/s = 2 M N K / time; median (min-max) of {args.repeats}")
    print("| format | linear | N x K | " + " | ".join(f"M={m}" for m in rows) + " |")
    print("|---|---|---|" + "---|" * len(rows))
    for q in args.quantization.split(","):
        a = argparse.Namespace(**{**vars(args), "quantization": q})
        engine = make_engine(a)
        model = engine.runner.model
        seen = {}
        for name, module in model.named_modules():
            if isinstance(module, Linear | QuantLinear):
                label = "lm_head" if name == "lm_head" else name.rsplit(".", 1)[-1]
                seen.setdefault(label, module)
        kind = quant_kernel(engine.quantization, engine.dtype)
        for label, module in seen.items():
            n, k = (module.out_features, module.in_features)
            cells = []
            for m in rows:
                if label == "lm_head" and m > 256:
                    cells.append("-")
                    continue
                x = torch.randn(m, k).to(engine.dtype)
                with torch.inference_mode():
                    ts = timeit(partial(module, x), args.repeats)
                cells.append(spread([2 * m * n * k / t / 1e9 for t in ts], "{:.0f}"))
            print(f"| {engine.quantization} ({kind}) | {label} | {n} x {k} | " + " | ".join(cells) + " |")
        del engine


# -- attention -----------------------------------------------------------------------------------------------------

def cmd_attention(args: argparse.Namespace) -> None:
    """The prefill attention kernel alone on the default model's shapes (9 heads, 3 KV heads, d 64), one fresh
    prompt of n tokens, against SDPA; causal FLOPs = 4 n^2 d H / 2."""
    from pagedserve.model.attention import AttentionMetadata, PrefillSpan, paged_attention
    from pagedserve.model.kernels import cpu_kernels
    from pagedserve.model.kv_cache_dtype import LayerKVCache, resolve_kv_format

    kernels = cpu_kernels()
    heads, kv_heads, d, bs = args.heads, args.kv_heads, args.head_dim, 16
    print(f"threads {torch.get_num_threads()}; {heads} heads, {kv_heads} KV heads, d {d}; GFLOP/s of the causal "
          f"half (2 n^2 d H); median (min-max) of {args.repeats}")
    print("| KV cache | path | " + " | ".join(f"n={n}" for n in args.tokens) + " |")
    print("|---|---|" + "---|" * len(args.tokens))
    for kvd in args.kv_cache_dtypes.split(","):
        fmt = resolve_kv_format(kvd, torch.bfloat16)
        for path in args.paths.split(","):
            cells = []
            for n in args.tokens:
                torch.manual_seed(0)
                blocks = -(-n // bs)
                cache = LayerKVCache(fmt, blocks * bs, kv_heads, d, bs)
                qkv = (torch.randn(n, (heads + 2 * kv_heads) * d) * 2).to(torch.bfloat16)
                q = qkv[:, :heads * d].view(n, heads, d)
                k = qkv[:, heads * d:(heads + kv_heads) * d].reshape(n, kv_heads, d)
                v = qkv[:, (heads + kv_heads) * d:].reshape(n, kv_heads, d)
                table = torch.arange(blocks)
                meta = AttentionMetadata(torch.arange(n), 0, torch.zeros(0, 1, dtype=torch.long),
                                         torch.zeros(0, dtype=torch.long), [PrefillSpan(0, n, 0, table)],
                                         prefill_spans=torch.tensor([[0, n, 0]]), prefill_tables=table.unsqueeze(0))
                if fmt.int4:
                    from pagedserve.model.kv_int4 import KeyTails
                    cache = LayerKVCache(fmt, blocks * bs, kv_heads, d, bs, KeyTails(blocks, bs, 4))
                    meta.key_plan = cache.tails.plan(list(range(n)))
                cache.write(k, v, meta.slot_mapping, meta.key_plan)
                fused = kernels if path != "sdpa" else None
                if path not in ("sdpa", "auto"):
                    os.environ["PAGEDSERVE_PREFILL_ATTENTION"] = path
                else:
                    os.environ.pop("PAGEDSERVE_PREFILL_ATTENTION", None)
                _reset_attention_path()
                try:
                    with torch.inference_mode():
                        ts = timeit(partial(paged_attention, q, k, v, cache, meta, bs, d ** -0.5, fused), args.repeats)
                except RuntimeError as e:
                    cells.append(f"n/a ({str(e)[:30]})")
                    continue
                cells.append(spread([2 * n * n * d * heads / t / 1e9 for t in ts], "{:.0f}"))
            print(f"| {fmt.name} | {path} | " + " | ".join(cells) + " |")
    os.environ.pop("PAGEDSERVE_PREFILL_ATTENTION", None)
    _reset_attention_path()


def _reset_attention_path() -> None:
    from pagedserve.model import attention

    fn = getattr(attention, "prefill_attention_path", None)
    if fn is not None and hasattr(fn, "cache_clear"):
        fn.cache_clear()


# -- prompt throughput ---------------------------------------------------------------------------------------------

def cmd_throughput(args: argparse.Namespace) -> None:
    """Prompt tok/s of n prompts of L tokens, one output token each, no prompt repeated (prefix caching on, as
    the issue ran it), per quantization; runs alternate between settings."""
    engines = {q: make_engine(argparse.Namespace(**{**vars(args), "quantization": q}), enable_prefix_caching=True)
               for q in args.quantization.split(",")}
    tokens = corpus(next(iter(engines.values())))
    results: dict[tuple[str, str], list[float]] = defaultdict(list)
    offset = 0
    for rep in range(args.repeats):
        for wl in args.workloads.split(","):
            length, num = (int(x) for x in wl.split("x"))
            for q, engine in (engines.items() if rep % 2 == 0 else reversed(list(engines.items()))):
                prompts = []
                for i in range(num):  # distinct slices; the corpus wraps around
                    s = (offset + i * 131) % (len(tokens) - length)
                    prompts.append(tokens[s:s + length])
                offset += 7919
                if rep == 0 and not results:
                    run_prompts(engine, prompts[:2])  # warm-up
                t = run_prompts(engine, prompts)
                results[(wl, q)].append(num * length / t)
    print(f"threads {torch.get_num_threads()}; max_num_batched_tokens {args.max_num_batched_tokens}; prompt tok/s, "
          f"median (min-max) of {args.repeats}, settings alternating")
    print("| workload | " + " | ".join(f"{q} ({engines[q].quantization})" for q in engines) + " |")
    print("|---|" + "---|" * len(engines))
    for wl in args.workloads.split(","):
        length, num = wl.split("x")
        print(f"| {num} x {length} tokens | " + " | ".join(spread(results[(wl, q)], "{:.0f}") for q in engines) + " |")


# -- decode ITL beside a long prefill ------------------------------------------------------------------------------

def cmd_itl(args: argparse.Namespace) -> None:
    """`decodes` requests decoding, then one prompt of `prompt` tokens arrives; per token budget
    (max_num_batched_tokens), or with --caps per cap on prefill beside decodes at the given budget
    (max_prefill_tokens_beside_decodes, 0 = off): the decodes' inter-token latency while the prompt is prefilled
    (max and mean step time of the steps carrying a prefill chunk), the steps without one, and the prompt's TTFT."""
    from pagedserve.sampling_params import SamplingParams

    print(f"threads {torch.get_num_threads()}; {args.decodes} decoding requests (128-token prompts) + one "
          f"{args.prompt}-token prompt; ms, median (min-max) of {args.repeats}")
    rows = [(int(c), {"max_prefill_tokens_beside_decodes": int(c) or None}) for c in args.caps.split(",")] \
        if args.caps else [(int(c), {"max_num_batched_tokens": int(c)}) for c in args.chunks.split(",")]
    print(f"| {'prefill cap beside decodes' if args.caps else 'token budget'} | steps with prefill | ITL during "
          "prefill: max | mean | ITL decode only | TTFT of the long prompt |")
    print("|---|---|---|---|---|---|")
    for budget, over in rows:
        engine = make_engine(args, **over)
        tokens = corpus(engine)
        worst, mean, plain, ttft, nsteps = [], [], [], [], []
        for rep in range(args.repeats + 1):
            base = 500 + rep * 3001
            for i in range(args.decodes):
                s = base + i * 151
                engine.add_request(f"d{rep}-{i}", tokens[s:s + 128],
                                   SamplingParams(max_tokens=4096, temperature=0.0, ignore_eos=True))
            while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or \
                    engine.scheduler.waiting:
                engine.step()
            decode_only = []
            for _ in range(5):
                t0 = time.perf_counter()
                engine.step()
                decode_only.append(time.perf_counter() - t0)
            s = base + 20000
            engine.add_request(f"p{rep}", tokens[s:s + args.prompt], SamplingParams(max_tokens=1, temperature=0.0))
            steps = []
            t_arrive = time.perf_counter()
            done = False
            while not done:
                t0 = time.perf_counter()
                outs = engine.step()
                steps.append(time.perf_counter() - t0)
                done = any(o.request_id == f"p{rep}" and o.finished for o in outs)
            first = time.perf_counter() - t_arrive
            for i in range(args.decodes):
                engine.abort_request(f"d{rep}-{i}")
            if rep == 0:
                continue  # warm-up
            worst.append(max(steps) * 1e3)
            mean.append(statistics.mean(steps) * 1e3)
            plain.append(statistics.median(decode_only) * 1e3)
            ttft.append(first * 1e3)
            nsteps.append(len(steps))
        print(f"| {budget} | {statistics.median(nsteps):.0f} | {spread(worst, '{:.0f}')} | {spread(mean, '{:.0f}')} | "
              f"{spread(plain, '{:.0f}')} | {spread(ttft, '{:.0f}')} |")
        del engine


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("command", choices=["profile", "peak", "gemm", "attention", "throughput", "itl"])
    p.add_argument("--tokens", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--kv-cache-dtypes", default="bfloat16,int8,fp8,int4")
    p.add_argument("--kv-cache-memory", default="1GiB")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="profile: wall time, or the thread's CPU time (with --threads 1; robust to a shared machine)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rows", default="256,512,1024,2048")
    p.add_argument("--paths", default="auto,sdpa")
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--workloads", default="1024x32,256x128")
    p.add_argument("--chunks", default="256,512,1024,2048")
    p.add_argument("--caps", default="", help="itl: caps on prefill beside decodes to compare (0 = off), at "
                   "--max-num-batched-tokens; replaces --chunks")
    p.add_argument("--decodes", type=int, default=16)
    p.add_argument("--prompt", type=int, default=1024)
    args = p.parse_args()
    if args.command == "profile":
        args.tokens = int(args.tokens or 1024)
        args.quantization = args.quantization or "auto"
    elif args.command == "attention":
        args.tokens = [int(x) for x in (args.tokens or "256,1024,2048").split(",")]
    elif args.command == "gemm":
        args.quantization = args.quantization or "none,gguf,int8"
    else:
        args.quantization = args.quantization or "auto"
    {"profile": cmd_profile, "peak": cmd_peak, "gemm": cmd_gemm, "attention": cmd_attention,
     "throughput": cmd_throughput, "itl": cmd_itl}[args.command](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
