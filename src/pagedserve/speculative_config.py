"""Speculative decoding's settings, vLLM's `--speculative-config` JSON: which proposer and how many tokens.

Torch-free (the CLI's --help imports it). The engine's spec_decode/ package reads it.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from typing import Any

METHODS = ("ngram", "suffix", "draft_model")


@dataclass(slots=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: proposals verified per step (at most k + 1 tokens accepted)
    prompt_lookup_min: int | None = None  # ngram: shortest suffix matched (vLLM: 5 when neither bound is given)
    prompt_lookup_max: int | None = None  # ngram: longest suffix matched, tried first
    # draft_model: the draft (a GGUF file, HF folder or packaged name sharing the target's tokenizer) and its KV pool
    model: str | None = None
    draft_kv_cache_memory: str = "256MiB"
    # suffix: the tries' depth (longest pattern matched + proposal), finished outputs kept in the shared trie,
    # and the least probability a proposal's path may have (it stops growing below)
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 64
    suffix_decoding_min_token_prob: float = 0.1
    # no proposals in a step with more running requests than this (vLLM's key); None: a step proposes while
    # measured step times say verification saves more than it costs (engine/spec_decode/proposer.py)
    disable_by_batch_size: int | None = None
    # a request whose recent proposals were accepted less often than this stops proposing (probing again later)
    min_acceptance_rate: float = 0.2

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported; choose one of {', '.join(METHODS)}")
        _check_int("num_speculative_tokens", self.num_speculative_tokens, 1, 16)
        if self.disable_by_batch_size is not None:
            _check_int("disable_by_batch_size", self.disable_by_batch_size, 1, 1 << 20)
        _check_fraction("min_acceptance_rate", self.min_acceptance_rate)
        if self.method == "draft_model" and not isinstance(self.model, str):
            raise ValueError('the draft_model method needs "model": the draft model (GGUF file, HF folder or packaged '
                             "name) sharing the target's tokenizer")
        if self.method == "suffix":
            _check_int("suffix_decoding_max_tree_depth", self.suffix_decoding_max_tree_depth,
                       self.num_speculative_tokens + 1, 64)
            _check_int("suffix_decoding_max_cached_requests", self.suffix_decoding_max_cached_requests, 0, 100_000)
            _check_fraction("suffix_decoding_min_token_prob", self.suffix_decoding_min_token_prob)
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            self.prompt_lookup_min = lo if lo is not None else (hi if hi is not None else 5)
            self.prompt_lookup_max = hi if hi is not None else self.prompt_lookup_min
            _check_int("prompt_lookup_min", self.prompt_lookup_min, 1, 64)
            _check_int("prompt_lookup_max", self.prompt_lookup_max, 1, 64)
            if self.prompt_lookup_min > self.prompt_lookup_max:
                raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed prompt_lookup_max "
                                 f"({self.prompt_lookup_max})")

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From the JSON text of --speculative-config, a dict (a YAML config file, LLM(speculative_config=...))
        or a SpeculativeConfig; None stays None."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise TypeError("the speculative config is a JSON object, e.g. "
                            '{"method": "ngram", "num_speculative_tokens": 4}')
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative config key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        for key in ("method", "num_speculative_tokens"):
            if key not in value:
                raise ValueError(f"the speculative config needs {key!r}")
        return cls(**value)

    def __str__(self) -> str:
        """The JSON that --speculative-config takes back (cluster launchers pass the flag on)."""
        return json.dumps({k: v for k, v in asdict(self).items() if v is not None})


def _check_int(name: str, value: Any, lo: int, hi: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")


def _check_fraction(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise ValueError(f"{name} must be a number in [0, 1], got {value!r}")


def parse_arg(text: str) -> SpeculativeConfig:
    """argparse type of --speculative-config: a bad value is a usage error naming what is wrong."""
    import argparse

    try:
        spec = SpeculativeConfig.parse(text)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    assert spec is not None
    return spec
