"""English prose that ships with every Python: the standard library's module documentation, the text the
perplexity benchmarks score and `pagedserve quantize` calibrates on by default (no download). Standard library
only: benchmarks/peers/make_quantized_checkpoints.py loads this file by path in another venv."""
from __future__ import annotations

import inspect

CORPUS_MODULES = ["argparse", "asyncio", "collections", "csv", "datetime", "decimal", "email", "functools",
                  "http.client", "inspect", "itertools", "json", "logging", "os", "pathlib", "pickle", "random",
                  "re", "sqlite3", "statistics", "string", "subprocess", "threading", "typing", "unittest",
                  "urllib.request", "zipfile"]


def corpus_text() -> str:
    """The same text in every process: submodules are left out, since a package gains them as attributes
    as soon as anything imports them (`email.utils`, `json.decoder`), which would shift the text."""
    import importlib

    parts = []
    for name in CORPUS_MODULES:
        mod = importlib.import_module(name)
        public = [a for a in sorted(dir(mod)) if not a.startswith("_") and not inspect.ismodule(getattr(mod, a))]
        parts.append(inspect.getdoc(mod) or "")
        parts += [inspect.getdoc(getattr(mod, a)) or "" for a in public[:40]]
    return "\n\n".join(p for p in parts if p)
