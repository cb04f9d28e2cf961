"""Reference quantized checkpoints of the default model, made by llm-compressor itself (compressed-tensors format),
for the loader's tests and the checkpoint benchmarks. Runs in its own venv (make_quantized_checkpoints.sh builds it:
llm-compressor pins its own transformers and compressed-tensors); never imported by pagedserve.

Usage: python make_quantized_checkpoints.py SRC_HF_FOLDER OUT_DIR [SCHEME ...]
Writes OUT_DIR/<scheme>/ for each scheme (all by default); a scheme whose folder holds `done` is skipped.

Group size 64, not llm-compressor's usual 128: the default model's K is 576 (and 1536), which 128 does not divide
and llm-compressor refuses such groups; 64 divides both.
"""
from __future__ import annotations

import importlib.util
import shutil
import sys
import time
from pathlib import Path

import torch

GROUP = 64
SAMPLES, SEQ_LEN = 32, 256
REFERENCE_LAYERS = (0, 29)
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time")
GREEDY_TOKENS = 16
SCHEMES = ("w4a16-gptq", "w4a16-rtn", "w8a16", "w8a8-int", "fp8-channel", "fp8-tensor")


def corpus_text() -> str:
    """The repo's perplexity corpus (the stdlib's documentation, src/pagedserve/corpus.py), loaded by path so that
    this venv needs nothing of pagedserve's dependencies."""
    path = Path(__file__).resolve().parents[2] / "src/pagedserve/corpus.py"
    spec = importlib.util.spec_from_file_location("corpus", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.corpus_text()


def calibration(tokenizer):
    """SAMPLES windows of SEQ_LEN tokens from the back half of the corpus (the front is what perplexity scores)."""
    from datasets import Dataset

    ids = tokenizer(corpus_text())["input_ids"]
    start = len(ids) // 2
    rows = [ids[start + i * SEQ_LEN:start + (i + 1) * SEQ_LEN] for i in range(SAMPLES)]
    return Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * SEQ_LEN for _ in rows]})


def int_weights(bits: int, group: int | None) -> dict:
    return {"num_bits": bits, "type": "int", "symmetric": True,
            "strategy": "group" if group else "channel", "group_size": group}


def recipe(scheme: str):
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier

    w4 = {"group_0": {"targets": ["Linear"], "weights": int_weights(4, GROUP)}}
    if scheme == "w4a16-gptq":
        return GPTQModifier(config_groups=w4, ignore=["lm_head"])
    if scheme == "w4a16-rtn":
        return QuantizationModifier(config_groups=w4, ignore=["lm_head"])
    if scheme == "w8a16":  # per channel (the W8A16 preset's groups of 128 do not divide 576)
        w8 = {"group_0": {"targets": ["Linear"], "weights": int_weights(8, None)}}
        return QuantizationModifier(config_groups=w8, ignore=["lm_head"])
    presets = {"w8a8-int": "W8A8", "fp8-channel": "FP8_DYNAMIC", "fp8-tensor": "FP8"}
    return QuantizationModifier(targets="Linear", scheme=presets[scheme], ignore=["lm_head"])


def make(src: Path, out: Path, scheme: str) -> None:
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = out / scheme
    if (target / "done").exists():
        return
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    needs_data = scheme in ("w4a16-gptq", "fp8-tensor")  # GPTQ's Hessians; FP8's static activation scales
    oneshot(model=model, recipe=recipe(scheme), dataset=calibration(tokenizer) if needs_data else None,
            max_seq_length=SEQ_LEN, num_calibration_samples=SAMPLES)
    tmp = out / f".tmp-{scheme}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, save_compressed=True)
    tokenizer.save_pretrained(tmp)
    write_reference(tmp, tokenizer)
    (tmp / "done").touch()
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    print(f"{scheme}: {target} in {time.perf_counter() - t0:.0f}s", flush=True)


def write_reference(folder: Path, tokenizer) -> None:
    """What transformers + compressed-tensors make of the saved folder, for pagedserve's tests (which run without
    them): the weights as compressed-tensors decompresses them (REFERENCE_LAYERS' linears) and greedy tokens."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,  # decompressed into fp32 weights
                                                 quantization_config=CompressedTensorsConfig(dequantize=True))
    model.eval()
    tensors = {}
    for i in REFERENCE_LAYERS:
        for name, module in model.model.layers[i].named_modules():
            if isinstance(module, torch.nn.Linear):
                tensors[f"model.layers.{i}.{name}.weight"] = module.weight.detach().float().contiguous()
    with torch.inference_mode():
        for i, text in enumerate(PROMPTS):
            ids = tokenizer(text, return_tensors="pt")["input_ids"]
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=GREEDY_TOKENS,
                                 min_new_tokens=GREEDY_TOKENS, do_sample=False)
            tensors[f"prompt.{i}"], tensors[f"greedy.{i}"] = ids[0], out[0, ids.shape[1]:].contiguous()
    (folder / "reference").mkdir()  # a subfolder: loaders read every *.safetensors beside config.json
    save_file(tensors, str(folder / "reference" / "expected.safetensors"))


if __name__ == "__main__":
    torch.manual_seed(0)
    src, out = Path(sys.argv[1]), Path(sys.argv[2])
    for name in sys.argv[3:] or SCHEMES:
        if name not in SCHEMES:
            sys.exit(f"unknown scheme {name!r}; choose from {', '.join(SCHEMES)}")
        make(src, out, name)
