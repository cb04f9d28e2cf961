"""`pagedserve quantize MODEL --method gptq|awq|rtn|smoothquant --out DIR`: a compressed-tensors checkpoint from any
model we load (a GGUF included), quantized here over our own model code in fp32 (docs/quantized_checkpoints.md
says why not llm-compressor), with the perplexity before and after in DIR/quantize_report.json."""
from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from pagedserve.quantize.rtn import Grid
from pagedserve.quantize.sequential import METHODS, Settings

logger = logging.getLogger(__name__)
KERNEL_BLOCK = 32  # our int4 / int8 kernels' block: groups must be multiples of it


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("quantize", help="write a compressed-tensors checkpoint (GPTQ, AWQ, RTN, SmoothQuant)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="GGUF file, HF folder or packaged model name (default: the packaged SmolLM2-135M GGUF)")
    p.add_argument("--method", choices=METHODS, default="gptq",
                   help="gptq / awq / rtn: int4 or int8 weights (W4A16, W8A16); smoothquant: W8A8 (--bits 8)")
    p.add_argument("--bits", type=int, choices=(4, 8), default=4)
    p.add_argument("--group-size", type=int, default=None,
                   help="input columns per scale; must be a multiple of 32 dividing every linear's in_features "
                        "(128 does not divide SmolLM2's 576: use 64 or 32). 0: per output channel. Default: 64 "
                        "for 4 bits, per channel for 8 bits")
    p.add_argument("--asym", action="store_true", help="asymmetric int4 (zero points); default symmetric")
    p.add_argument("--act-order", action="store_true",
                   help="GPTQ: columns by decreasing Hessian diagonal, static groups (no g_idx written)")
    p.add_argument("--dampening", type=float, default=0.01, help="GPTQ: fraction of mean(diag H) added to it")
    p.add_argument("--calibration", default=None,
                   help="FILE.jsonl ({\"text\": ...} per line), a text file, or literal TEXT; default: the built-in "
                        "corpus (the standard library's documentation)")
    p.add_argument("--num-samples", type=int, default=32, help="calibration samples")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per calibration sample")
    p.add_argument("--ppl-tokens", type=int, default=4096,
                   help="tokens (the text's first) whose perplexity is scored before and after; 0: skip")
    p.add_argument("--ppl-window", type=int, default=1024, help="perplexity window in tokens")
    p.add_argument("--transformers-python", default=None,
                   help="a python with transformers + compressed-tensors (e.g. build/llmc-venv/bin/python): "
                        "also score the written folder there")
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.set_defaults(func=run)


def grid_for(args: argparse.Namespace) -> Grid:
    """The weights' grid, refusing by name what the format or our kernels cannot hold."""
    if args.method == "smoothquant":
        if args.bits != 8 or args.asym or args.group_size not in (None, 0):
            raise ValueError("--method smoothquant writes W8A8: --bits 8, symmetric per-channel weights "
                             "(no --asym, no --group-size)")
        return Grid(8, None, True)
    if args.act_order and args.method != "gptq":
        raise ValueError("--act-order is GPTQ's (--method gptq)")
    if args.bits == 8 and args.asym:
        raise ValueError("asymmetric int8 weights have no kernel here (they would run dequantized): drop --asym")
    group = args.group_size if args.group_size is not None else (64 if args.bits == 4 else 0)
    if group and group % KERNEL_BLOCK:
        raise ValueError(f"--group-size {group} is not a multiple of {KERNEL_BLOCK} (our kernels' block)")
    return Grid(args.bits, group or None, not args.asym)


def run(args: argparse.Namespace) -> int:
    try:
        report = quantize(args, grid_for(args))
    except ValueError as e:
        print(f"pagedserve quantize: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report["perplexity"], indent=2))
    return 0


def quantize(args: argparse.Namespace, grid: Grid) -> dict:
    from pagedserve.model.loader import is_gguf, load_model, resolve_model_path
    from pagedserve.quantize.calibration import calibration_set, read_text
    from pagedserve.quantize.perplexity import perplexity, windows
    from pagedserve.quantize.sequential import quantize_weights
    from pagedserve.quantize.writer import write_folder

    start = time.perf_counter()
    loaded = load_model(args.model)
    if loaded.checkpoint_scheme != "none":
        raise ValueError(f"{args.model} is already quantized ({loaded.checkpoint_scheme})")
    if "rope_freqs" in loaded.weights and is_gguf(args.model):
        raise ValueError("a GGUF with rope_freqs (Llama 3.1 RoPE factors) cannot be written as a config.json yet")
    text, source = read_text(args.calibration)
    cal = calibration_set(loaded.tokenizer.encode(text), source, args.num_samples, args.seq_len, args.ppl_tokens)
    settings = Settings(args.method, grid, args.act_order, args.dampening)
    logger.info("%s: %d samples of %d tokens from %s", args.method, *cal.samples.shape, source)
    weights, quantized = quantize_weights(loaded.weights, loaded.config, cal.samples, settings)
    source_dir = None if is_gguf(args.model) else resolve_model_path(args.model)
    write_folder(args.out, loaded, source_dir, weights, quantized, grid, settings.w8a8)
    seconds = time.perf_counter() - start
    chunks = windows(cal.scored, args.ppl_window)
    ppl: dict = {"tokens": len(cal.scored), "window": args.ppl_window, "overlaps_calibration": cal.overlaps}
    if chunks:
        ppl["before"] = perplexity(args.model, chunks)
        ppl["after"] = perplexity(str(args.out), chunks)
        ppl["change"] = ppl["after"] / ppl["before"] - 1
        if args.transformers_python:
            ppl["transformers"] = transformers_perplexity(args.transformers_python, args.out, cal.scored,
                                                          args.ppl_window)
    report = {"model": args.model or "default (SmolLM2-135M-Instruct GGUF)", "method": args.method,
              "grid": asdict(grid), "act_order": args.act_order, "dampening": args.dampening,
              "calibration": {"source": source, "samples": cal.samples.shape[0], "seq_len": cal.samples.shape[1]},
              "perplexity": ppl, "quantize_seconds": round(seconds, 1)}
    (args.out / "quantize_report.json").write_text(json.dumps(report, indent=2))
    return report


def transformers_perplexity(python: str, folder: Path, tokens: list[int], window: int) -> float:
    script = Path(__file__).with_name("hf_perplexity.py")
    out = subprocess.run([python, str(script), str(folder), str(window)], input=json.dumps(tokens),
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["perplexity"]
