"""Calibration tokens: a .jsonl file ({"text": ...} per line), a text file, a literal text, or by default the
repo's built-in corpus (the standard library's documentation, which ships with Python: no download). The
perplexity before and after is scored on the first tokens; the calibration samples are the last ones, so that
they do not overlap when the text is long enough (the report says when they do)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

BUILT_IN = "built-in: the standard library's documentation (pagedserve/corpus.py)"


@dataclass(slots=True)
class Calibration:
    source: str
    samples: torch.Tensor  # [num_samples, seq_len] token ids
    scored: list[int]  # the tokens whose perplexity is reported
    overlaps: bool  # the scored tokens are among the calibration samples


def read_text(calibration: str | None) -> tuple[str, str]:
    """(text, what it is)."""
    if calibration is None:
        from pagedserve.corpus import corpus_text

        return corpus_text(), BUILT_IN
    path = Path(calibration)
    if not path.is_file():
        return calibration, f"literal text ({len(calibration)} characters)"
    if path.suffix == ".jsonl":
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        if not all(isinstance(r, dict) and isinstance(r.get("text"), str) for r in rows):
            raise ValueError(f"{path}: every line of a .jsonl calibration file must be an object with a \"text\"")
        return "\n\n".join(r["text"] for r in rows), f"{path} ({len(rows)} texts)"
    return path.read_text(), str(path)


def calibration_set(tokens: list[int], source: str, num_samples: int, seq_len: int, ppl_tokens: int) -> Calibration:
    if len(tokens) < seq_len:
        raise ValueError(f"the calibration text has {len(tokens)} tokens, fewer than one sample of --seq-len {seq_len}")
    num_samples = min(num_samples, len(tokens) // seq_len)  # a short text gives fewer samples, not an error
    tail = tokens[len(tokens) - num_samples * seq_len:]
    samples = torch.tensor(tail, dtype=torch.long).view(num_samples, seq_len)
    scored = tokens[:ppl_tokens]
    return Calibration(source, samples, scored, len(tokens) < len(scored) + samples.numel())
