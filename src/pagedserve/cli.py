"""The one `pagedserve` command. Each tier registers its own subcommands from its own cli module; the
benchmarks register theirs from bench/cli.py."""
from __future__ import annotations

import argparse
import importlib
import logging
import sys
from pathlib import Path

import yaml

# Each module defines register(subparsers); handlers are set with set_defaults(func=...).
SUBCOMMANDS = [
    "pagedserve.generate",
    "pagedserve.server.cli",
    "pagedserve.cluster.cli",
    "pagedserve.gateway.cli",
    "pagedserve.bench.cli",
    "pagedserve.quantize.cli",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedserve",
        description="An LLM serving stack: paged-KV engine, OpenAI-compatible server, router and gateway.",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def merge_config_file(args: argparse.Namespace, argv: list[str]) -> None:
    """Values from --config fill every option not given on the command line."""
    data = yaml.safe_load(Path(args.config).read_text()) or {}
    given = {a.split("=")[0].lstrip("-").replace("-", "_") for a in argv if a.startswith("--")}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in given:
            setattr(args, name, value)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    if getattr(args, "merge_config_file", False) and args.config:
        merge_config_file(args, argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for chatty in ("faiss.loader", "bm25s"):  # which SIMD build loaded; index-building steps
        logging.getLogger(chatty).setLevel(max(logging.WARNING, logging.getLogger().level))
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
