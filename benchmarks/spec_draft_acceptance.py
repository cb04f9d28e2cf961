"""Acceptance of sampled draft-model proposals (speculative sampling) against greedy point-mass drafts of the same
draft, at one temperature: counts, not timings. The draft is the packaged SmolLM2 itself (--layers 0) or its first
--layers layers written as an HF folder (a smaller model sharing the tokenizer; no other is packaged).

python benchmarks/spec_draft_acceptance.py --layers 24 --temperature 1.0
"""
from __future__ import annotations

import argparse
import tempfile

PROMPTS = ["Once upon a time", "List three prime numbers:", "The capital of France is", "def fibonacci(n):",
           "Write a short poem about the sea.", "The best way to learn a language is"]


def truncated_draft(layers: int, folder: str) -> str:
    from transformers import AutoTokenizer

    from pagedserve.bench.hf_peer import load
    from pagedserve.model.loader import default_model_path

    model = load("float32")
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    model.save_pretrained(folder)
    path = default_model_path()
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(folder)
    return folder


def acceptance(draft: str, args: argparse.Namespace) -> str:
    from pagedserve import LLM
    from pagedserve.sampling_params import SamplingParams

    llm = LLM(dtype="float32", kv_cache_memory="64MiB", speculative_config={
        "method": "draft_model", "model": draft, "num_speculative_tokens": args.k, "draft_kv_cache_memory": "32MiB",
        "min_acceptance_rate": 0.0, "disable_by_batch_size": 64})  # every step proposes: counts, not a policy
    llm.generate(PROMPTS, [SamplingParams(temperature=args.temperature, seed=s, max_tokens=args.output,
                                          ignore_eos=True) for s in range(len(PROMPTS))])
    s = llm.engine.spec_stats
    return f"{s.acceptance_rate:.1%} ({s.num_accepted_tokens}/{s.num_draft_tokens}), histogram {s.acceptance_lengths}"


def main() -> None:
    from pagedserve.engine.spec_decode import draft_model
    from pagedserve.model.loader import default_model_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=24, help="the draft's layers (0: the whole target)")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--output", type=int, default=32)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        draft = truncated_draft(args.layers, folder) if args.layers else str(default_model_path())
        print(f"sampled drafts: {acceptance(draft, args)}")
        draft_model.draft_sample = lambda logits, batch: (logits.argmax(dim=-1), None)  # the point-mass drafts
        print(f"greedy drafts:  {acceptance(draft, args)}")


if __name__ == "__main__":
    main()
