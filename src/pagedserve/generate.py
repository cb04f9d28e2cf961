"""`pagedserve generate`: the offline API (llm.py) from the shell, one prompt or chat turn."""
from __future__ import annotations

import argparse
import sys

from pagedserve.config import add_engine_args


def register(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="generate text offline with the engine",
                         description="Generate a completion for one prompt (or a chat turn) and print it.")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    add_sampling_args(gen)
    add_engine_args(gen)
    gen.set_defaults(func=generate)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1, help="-1 = disabled")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--n", type=int, default=1, help="number of samples")
    g.add_argument("--ignore-eos", action="store_true")


def generate(args: argparse.Namespace) -> int:
    from pagedserve.config import EngineConfig
    from pagedserve.llm import LLM
    from pagedserve.sampling_params import SamplingParams

    llm = LLM(config=EngineConfig.from_args(args))
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                            presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                            seed=args.sample_seed, stop=args.stop, max_tokens=args.max_tokens,
                            ignore_eos=args.ignore_eos)
    try:
        if args.chat:
            outs = llm.chat([{"role": "user", "content": args.prompt}], params)
        else:
            outs = llm.generate(args.prompt, params)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for c in outs[0].outputs:
        print(c.text if args.n == 1 else f"[{c.index}] {c.text}")
    return 0
