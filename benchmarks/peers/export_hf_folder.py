"""Writes a GGUF we serve (default: the packaged SmolLM2) as a Hugging Face folder (config.json, safetensors,
tokenizer) with transformers' own GGUF loader, for the peers that read HF folders (vLLM CPU, `transformers serve`).
Usage: python benchmarks/peers/export_hf_folder.py [OUT_DIR] [--model NAME]
  (defaults: build/peers/smollm2-hf for the default model, build/peers/<NAME>-hf otherwise; NAME as `serve --model`
  takes it, e.g. gemma-3-270m, whose tokenizer conversion takes minutes)"""
import argparse
from pathlib import Path

from transformers import AutoTokenizer

from pagedserve.bench.hf_peer import load
from pagedserve.bench.servers import default_gguf
from pagedserve.model.loader import resolve_model_path


def export(out: Path, model_name: str | None = None) -> Path:
    if (out / "config.json").is_file():
        return out
    gguf = resolve_model_path(model_name) if model_name else default_gguf()
    model = load("float32", gguf)
    # transformers dequantizes GGUF weights at load time; drop the marker that forbids saving them.
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":
    root = Path(__file__).resolve().parents[2]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", type=Path)
    p.add_argument("--model", default=None, help="a model name or GGUF path (default: the packaged SmolLM2)")
    args = p.parse_args()
    print(export(args.out or root / "build/peers" / (f"{args.model}-hf" if args.model else "smollm2-hf"), args.model))
