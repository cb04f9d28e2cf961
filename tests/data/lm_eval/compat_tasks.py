"""Loaders of the compatibility suite's lm-eval tasks: each YAML names one with `custom_dataset`, so the
JSONL beside this file is read from the repository (no download, no dependence on the working directory)."""
from __future__ import annotations

import json
import re
from pathlib import Path

import datasets

HERE = Path(__file__).parent


def _split(name: str) -> dict:
    rows = [json.loads(line) for line in (HERE / name).read_text().splitlines() if line.strip()]
    return {"test": datasets.Dataset.from_list(rows)}


def multiple_choice(**_metadata) -> dict:
    return _split("compat_mc.jsonl")


def paragraphs(**_metadata) -> dict:
    return _split("compat_ppl.jsonl")


def questions(**_metadata) -> dict:
    return _split("compat_gen.jsonl")


def perplexity_results(doc: dict, results: list[float]) -> dict:
    """As lm-eval's wikitext task: the document's log-likelihood with its word and byte counts."""
    (loglikelihood,) = results
    words = len(re.split(r"\s+", doc["text"]))
    size = len(doc["text"].encode("utf-8"))
    return {"word_perplexity": (loglikelihood, words), "byte_perplexity": (loglikelihood, size),
            "bits_per_byte": (loglikelihood, size)}
