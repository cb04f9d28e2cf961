"""Writes the packaged SmolLM2 GGUF as a Hugging Face folder (config.json, safetensors, tokenizer) with
transformers' own GGUF loader, so `transformers serve` can load it as a peer in benchmarks/serve.py.
Usage: python benchmarks/peers/export_hf_folder.py [OUT_DIR]  (default: build/peers/smollm2-hf)"""
import sys
from pathlib import Path

from transformers import AutoTokenizer

from pagedserve.bench.hf_peer import load
from pagedserve.bench.servers import default_gguf


def export(out: Path) -> Path:
    if (out / "config.json").is_file():
        return out
    gguf = default_gguf()
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
    print(export(Path(sys.argv[1]) if len(sys.argv) > 1 else root / "build/peers/smollm2-hf"))
