"""Speculative decoding: `pagedserve bench spec` (or benchmarks/spec.py).

One stream, greedy, --output tokens (EOS ignored) per workload, in one engine without speculation and one
with each --methods config, alternating --repeats rounds:
  retrieval  the gateway's context template with 3 corpus chunks, asked to quote one (quotes its context)
  code-edit  a small Python file, asked back whole with one function renamed (copies its context)
  open-chat  a story: nothing to look up (proposals rarely match; the cost of trying)
as ms per output token after the first, the speedup, the acceptance rate (accepted / proposed), the mean
tokens a verified draft yields (accepted + the target's own) and whether the output equals the one without;
then --batch streams at once over the workloads in turn, as output tok/s (what speculation costs a batch).
"""
from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from pagedserve.bench.measure import log, spread
from pagedserve.bench.report import REPO, command_line, machine_line, publish
from pagedserve.config import EngineConfig
from pagedserve.sampling_params import SamplingParams

QUICK = ["--output", "24", "--repeats", "1", "--workloads", "retrieval,open-chat", "--batch", "4"]
NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
CODE = '''import json
from pathlib import Path


def load_settings(path):
    """Reads the settings file, or the defaults when there is none."""
    file = Path(path)
    if not file.exists():
        return {"theme": "light", "font_size": 12, "autosave": True}
    return json.loads(file.read_text())


def save_settings(path, settings):
    Path(path).write_text(json.dumps(settings, indent=2))


def font_size(settings):
    size = settings.get("font_size", 12)
    return max(8, min(size, 72))
'''


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--output", type=int, default=128, help="output tokens per request (EOS ignored)")
    p.add_argument("--repeats", type=int, default=3, help="rounds, each timing every engine once per workload")
    p.add_argument("--workloads", default="retrieval,code-edit,open-chat", help="comma-separated subset")
    p.add_argument("--methods", action="append", default=None, metavar="JSON",
                   help=f"a --speculative-config to compare (repeatable; default: {NGRAM})")
    p.add_argument("--batch", type=int, default=16,
                   help="also a batch of this many streams at once over every workload (output tok/s); 0: none")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--docs", type=Path, default=REPO / "docs", help="where benchmarks.md is")
    p.add_argument("--no-write", action="store_true", help="print the table only")


def prompts(tokenizer) -> dict[str, str]:
    from pagedserve.bench.workloads import corpus_text
    from pagedserve.gateway.gateway_config import DEFAULT_CHUNK_TEMPLATE, DEFAULT_CONTEXT_TEMPLATE

    paragraphs = [p for p in corpus_text().split("\n\n") if 300 < len(p) < 700][:3]
    chunks = "\n\n".join(DEFAULT_CHUNK_TEMPLATE.format(n=i + 1, document="python-docs", heading=f"part {i + 1}",
                                                       text=text) for i, text in enumerate(paragraphs))
    context = DEFAULT_CONTEXT_TEMPLATE.format(delimiter="context", source="python-docs", chunks=chunks)
    chat = {"retrieval": f"{context}\n\nQuestion: what does excerpt [2] say? Quote it word for word.",
            "code-edit": f"{CODE}\nReturn this whole file with the function font_size renamed to clamp_font_size.",
            "open-chat": "Write a short story about a robot who learns to paint."}
    return {name: tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
            for name, text in chat.items()}


def one_stream(engine, prompt: str, output: int) -> tuple[float, list[int]]:
    """ms per output token after the first, and the output's tokens."""
    engine.add_request("bench", prompt, SamplingParams(temperature=0, max_tokens=output, ignore_eos=True))
    first = end = None
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            if first is None:
                first = now
            end, tokens = now, out.outputs[0].token_ids
    return (end - first) * 1e3 / max(1, len(tokens) - 1), tokens


def batch_tps(engine, texts: list[str], output: int) -> float:
    """Output tokens per second of len(texts) streams run together."""
    params = SamplingParams(temperature=0, max_tokens=output, ignore_eos=True)
    for i, text in enumerate(texts):
        engine.add_request(f"batch-{i}", text, params)
    start, total = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        total += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    return total / (time.perf_counter() - start)


def run_args(args: argparse.Namespace) -> int:
    from pagedserve.engine.llm_engine import LLMEngine

    methods = args.methods or [NGRAM]
    common = {"dtype": args.dtype, "kv_cache_memory": "256MiB", "num_threads": args.threads}
    engines = {"off": LLMEngine(EngineConfig(**common))}
    for spec in methods:
        engines[spec] = LLMEngine(EngineConfig(**common, speculative_config=spec))
    texts = prompts(engines["off"].tokenizer)
    workloads = args.workloads.split(",")
    ms: dict[tuple[str, str], list[float]] = {}
    outputs: dict[tuple[str, str], list[int]] = {}
    accept: dict[tuple[str, str], tuple[int, int, int]] = {}
    for name, engine in engines.items():  # warm-up: kernels, allocator, prefix cache of each prompt
        one_stream(engine, texts[workloads[0]], 8)
    for r in range(args.repeats):
        for w in workloads:
            for name, engine in (engines.items() if r % 2 == 0 else reversed(engines.items())):
                before = engine.spec_stats.copy() if engine.spec_stats is not None else None
                t, outputs[name, w] = one_stream(engine, texts[w], args.output)
                ms.setdefault((name, w), []).append(t)
                if before is not None:
                    s = engine.spec_stats
                    accept[name, w] = (s.num_drafts - before.num_drafts, s.num_draft_tokens - before.num_draft_tokens,
                                       s.num_accepted_tokens - before.num_accepted_tokens)
                log(f"round {r + 1} {w} {name[:40]}: {t:.1f} ms/token")
        if args.batch:
            batch = [texts[workloads[i % len(workloads)]] for i in range(args.batch)]
            for name, engine in engines.items():
                ms.setdefault((name, "batch"), []).append(batch_tps(engine, batch, args.output))
                log(f"round {r + 1} batch of {args.batch} {name[:40]}: {ms[name, 'batch'][-1]:.0f} tok/s")
    body = render(args, engines, workloads, ms, outputs, accept, len(engines["off"].tokenizer.encode(texts["retrieval"]))
                  if "retrieval" in texts else 0)
    return publish("Speculative decoding", body, [], args.docs, not args.no_write)


def render(args, engines: dict, workloads: list[str], ms: dict, outputs: dict, accept: dict, rag_len: int) -> str:
    lines = [f"Command: `{command_line()}`", "", machine_line(), "",
             (f"One stream, greedy, {args.output} output tokens (EOS ignored), dtype {args.dtype}, {args.threads or 'all'} "
              f"torch threads; ms per output token "
              f"after the first: median (min-max) over {args.repeats} rounds. The retrieval prompt is {rag_len} "
              "tokens."), "",
             "| workload | speculation | ms/token | speedup | acceptance rate | tokens per draft | drafts | same output |",
             "|---|---|---|---|---|---|---|---|"]
    for w in workloads:
        base = statistics.median(ms["off", w])
        for name in engines:
            t = statistics.median(ms[name, w])
            drafts, proposed, accepted = accept.get((name, w), (0, 0, 0))
            rate = f"{accepted / proposed:.0%}" if proposed else "-"
            per_draft = f"{1 + accepted / drafts:.2f}" if drafts else "-"
            label = "off" if name == "off" else f"`{name}`"
            lines.append(f"| {w} | {label} | {spread(ms[name, w])} | {base / t:.2f}x | {rate} | {per_draft} | {drafts} | "
                         f"{'yes' if outputs[name, w] == outputs['off', w] else 'no'} |")
    if args.batch:
        lines += ["", f"A batch of {args.batch} streams over the workloads in turn, output tok/s:", "",
                  "| speculation | output tok/s | vs off |", "|---|---|---|"]
        base = statistics.median(ms["off", "batch"])
        for name in engines:
            label = "off" if name == "off" else f"`{name}`"
            lines.append(f"| {label} | {spread(ms[name, 'batch'], '{:.0f}')} | "
                         f"{statistics.median(ms[name, 'batch']) / base:.2f}x |")
    lines += ["", ("- Speculation verifies a request's proposals as a chunked-prefill chunk of 1 + k rows in the "
                   "step's one forward pass; a step with proposals runs the Python layers rather than the C++ decode "
                   "stack. Timings come from a shared machine (see its load average above)."),
              ("- same output: greedy output equal to the one without speculation; in bfloat16 a verification "
               "chunk's logits may differ from a decode step's in the last bits, which can flip a near-tie (fp32 "
               "outputs are identical: tests/test_spec_decode.py).")]
    return "\n".join(lines)
