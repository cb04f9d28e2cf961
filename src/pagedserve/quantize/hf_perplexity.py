"""Perplexity of a compressed-tensors folder as transformers + compressed-tensors run it, for `pagedserve
quantize --transformers-python` and the tests. Standalone (torch and transformers only): it runs as a file in
another venv (llm-compressor's, build/llmc-venv), never imported by pagedserve.

Usage: python hf_perplexity.py FOLDER WINDOW < tokens.json   prints {"perplexity": ..., "scored": ...}
Windows as pagedserve's bench.perplexity.windows: consecutive, every position but each window's first scored."""
import json
import math
import sys

import torch
from transformers import AutoModelForCausalLM


def main() -> None:
    folder, size = sys.argv[1], int(sys.argv[2])
    tokens = json.load(sys.stdin)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    # Decompressed to fp32 weights: the same numbers as the packed ones, on transformers' own fp32 forward.
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.eval()
    total, scored = 0.0, 0
    with torch.inference_mode():
        for i in range(0, len(tokens) - 1, size):
            chunk = tokens[i:i + size]
            if len(chunk) < 2:
                continue
            ids = torch.tensor([chunk])
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            total += float(logprobs.gather(1, ids[0, 1:, None]).sum())
            scored += len(chunk) - 1
    print(json.dumps({"perplexity": math.exp(-total / scored), "scored": scored}))


if __name__ == "__main__":
    main()
