"""CLI of the server tier: `pagedserve serve` and `pagedserve bench serve` (heavy imports inside handlers)."""
from __future__ import annotations

import argparse
import os


def register(sub: argparse._SubParsersAction, bench: argparse._SubParsersAction) -> None:
    """Adds this tier's subcommands."""
    from pagedserve.config import add_engine_args

    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve a model over an OpenAI-compatible HTTP API (completions, chat, "
                                   "embeddings, tokenize, health, Prometheus metrics).")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all interfaces)")
    p.add_argument("--port", type=int, default=8000, help="port to bind; 0 picks a free one (printed)")
    p.add_argument("--served-model-name", default=None,
                   help="model name clients send (default: the model's own name, e.g. SmolLM2-135M-Instruct)")
    p.add_argument("--api-key", default=os.environ.get("PAGEDSERVE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on API routes (default: $PAGEDSERVE_API_KEY, else open)")
    p.add_argument("--embedding-model", default="default",
                   help="sentence-embedding folder for /v1/embeddings; 'default' = packaged all-MiniLM-L6-v2, "
                        "'none' turns embeddings off")
    p.add_argument("--max-request-size", default="8MiB", help="largest request body accepted (413 beyond)")
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds to let in-flight requests finish on shutdown")
    p.add_argument("--disable-access-log", action="store_true", help="don't log one line per HTTP request")
    add_engine_args(p)
    p.set_defaults(func=_serve)

    b = bench.add_parser("serve", help="online serving benchmark: Poisson arrivals over MIX vs llama-server",
                         description="Open-loop Poisson load at several request rates over the MIX workload "
                                     "against pagedserve and llama.cpp's llama-server; writes "
                                     "docs/benchmarks.md and a PNG plot.")
    b.add_argument("bench_args", nargs=argparse.REMAINDER, help="arguments of benchmarks/serve.py (see --help)")
    b.set_defaults(func=_bench_serve)


def _serve(args: argparse.Namespace) -> int:
    from pagedserve.server.api_server import serve

    return serve(args)


def _bench_serve(args: argparse.Namespace) -> int:
    from pagedserve.server.bench_serve import main

    return main(args.bench_args)
