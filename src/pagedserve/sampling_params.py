"""Per-request sampling parameters, vLLM/OpenAI vocabulary."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class GuidedDecodingParams:
    """One output constraint (vLLM's names): a JSON schema, any JSON object, a regex, one of fixed strings,
    or a grammar (Lark, or GBNF/EBNF when it uses `::=`)."""
    json: str | dict[str, Any] | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    key: tuple[str, str] = field(init=False, repr=False, compare=False)  # (kind, canonical text), set at init

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise ValueError(f"a guided decoding request sets exactly one of json, json_object, regex, choice and "
                             f"grammar; got {', '.join(kinds) or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("guided choice must be a non-empty list of non-empty strings")
        object.__setattr__(self, "key", self._canonical())

    def _canonical(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints share one compiled grammar."""
        if self.json is not None:
            try:
                schema = json.loads(self.json) if isinstance(self.json, str) else self.json
                text = json.dumps(schema, separators=(",", ":"))  # key order kept: it is the output order
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
            except (RecursionError, TypeError, ValueError) as exc:
                raise ValueError(f"the JSON schema cannot be read: {type(exc).__name__}: {exc}") from None
            if not isinstance(schema, dict):
                raise ValueError("the JSON schema must be an object")
            return "json", text
        if self.json_object:
            return "json_object", ""
        if self.choice is not None:
            return "choice", json.dumps(list(self.choice))
        return ("regex", self.regex) if self.regex is not None else ("grammar", self.grammar or "")


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = 16  # None: up to the context length
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives besides the sampled token
    prompt_logprobs: int | None = None  # per prompt token: its logprob plus this many top alternatives
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    guided_decoding: GuidedDecodingParams | None = None  # constrain the output to a schema, regex or grammar
    # token id -> bias in [-100, 100] added to its logit before sampling (OpenAI's logit_bias; string ids taken)
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        if self.logit_bias is not None:
            self.logit_bias = _token_biases(self.logit_bias)
        self.verify()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5 or self.top_k == 1

    def verify(self) -> None:
        checks = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0, f"temperature must be non-negative, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be -1 (disabled) or positive, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be positive, got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.max_tokens is None or self.max_tokens >= 1,
             f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}"),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
             f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


def _token_biases(bias: dict) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} (or int keys) as {id: bias}; an empty map is no bias."""
    result = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        if isinstance(value, bool) or not isinstance(value, int | float) or not -100 <= value <= 100:
            raise ValueError(f"logit_bias values must be numbers in [-100, 100], got {value!r} for token {key}")
        if token < 0:
            raise ValueError(f"logit_bias token ids must be non-negative, got {key!r}")
        result[token] = float(value)
    return result or None
