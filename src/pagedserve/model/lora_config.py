"""A PEFT adapter's adapter_config.json, checked field by field before anything is computed from it: a config
is as hostile as a client's request (a folder may hold what a tenant uploaded), so each field the loader reads
must have its JSON type and a sane range, and the LoRA variants this server does not compute are refused
rather than served wrong.

rank_pattern and alpha_pattern keys are regular expressions that PEFT matches against module names. They are
compiled with RE2, which matches in time linear in the name and compiles within a memory bound: Python's re
backtracks (one 30-character pattern held the GIL, and with it the whole server, for seconds), and the regex
package's timeout covers matching but not compiling, where `a{4294967294}` took 4 GB. RE2 has no
backreferences or lookaround, which module patterns have no use for.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import re2
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError
from pydantic_core import from_json

MAX_CONFIG_BYTES = 64 * 1024  # PEFT writes ~1.5 KB; a rank_pattern for every module of an 80-layer model ~25 KB
MAX_PATTERNS = 1024  # per rank_pattern / alpha_pattern
MAX_PATTERN_CHARS = 256
MAX_ALPHA = 4096.0  # lora_alpha / r past this is no fine-tune: PEFT's recipes use alpha up to 2 r
PATTERN_MAX_MEM = 256 * 1024  # RE2's compile budget per pattern: ~5 ms at worst, ample for module names

# PEFT fields that change what an adapter computes, which this server's plain LoRA does not do: refused when set.
UNSUPPORTED = {
    "use_dora": "DoRA", "lora_bias": "a trained bias on lora_B", "fan_in_fan_out": "fan_in_fan_out (Conv1D weights)",
    "modules_to_save": "modules_to_save (full copies of modules)", "layer_replication": "layer_replication",
    "trainable_token_indices": "trainable tokens", "target_parameters": "LoRA on parameters (target_parameters: peft's adapters on a mixture of experts' experts)",
    "alora_invocation_tokens": "activated LoRA", "use_qalora": "QA-LoRA", "use_bdlora": "BD-LoRA",
    "kasa_config": "KaSA", "monteclora_config": "MonteCLoRA", "arrow_config": "Arrow routing",
}

PatternKey = Annotated[str, StringConstraints(min_length=1, max_length=MAX_PATTERN_CHARS)]
Rank = Annotated[int, Field(gt=0)]
Alpha = Annotated[float, Field(gt=0, le=MAX_ALPHA, allow_inf_nan=False)]
Names = Annotated[str, StringConstraints(max_length=MAX_PATTERN_CHARS)]


class _Schema(BaseModel):
    """The fields the loader reads or that must hold for its reading to be right (others are ignored:
    PEFT adds fields over its versions)."""
    model_config = ConfigDict(strict=True, extra="ignore")
    peft_type: Literal["LORA"] = "LORA"
    r: Rank = 8  # PEFT's defaults, for a config that leaves them out
    lora_alpha: Alpha = 8
    use_rslora: bool = False
    rank_pattern: Annotated[dict[PatternKey, Rank], Field(max_length=MAX_PATTERNS)] | None = None
    alpha_pattern: Annotated[dict[PatternKey, Alpha], Field(max_length=MAX_PATTERNS)] | None = None
    target_modules: Names | Annotated[list[Names], Field(max_length=MAX_PATTERNS)] | None = None
    bias: Literal["none", "all", "lora_only"] = "none"
    base_model_name_or_path: Names | None = None


@dataclass(frozen=True, slots=True)
class Patterns:
    """PEFT's per-module overrides: the first key that matches a module's name gives its value."""
    entries: tuple[tuple[Any, float], ...]  # (compiled RE2 pattern, value)

    @classmethod
    def compile(cls, field: str, patterns: dict[str, float] | None) -> Patterns:
        options = re2.Options()
        # never_capture: a yes or no is all a lookup needs, and RE2's DFA gives it in ~2 us (5 with groups)
        options.max_mem, options.log_errors, options.never_capture = PATTERN_MAX_MEM, False, True
        entries = []
        for key, value in (patterns or {}).items():
            try:  # PEFT's own matching: re.match(rf"(.*\.)?({key})$", module_name)
                entries.append((re2.compile(rf"(.*\.)?({key})$", options), value))
            except re2.error as exc:
                reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else exc
                raise ValueError(f"adapter_config.json: {field} key {key!r} is not a pattern this server takes "
                                 f"(RE2 syntax, no backreferences or lookaround): {reason}") from None
        return cls(tuple(entries))

    def get(self, module: bytes, default: float) -> float:
        return next((value for pattern, value in self.entries if pattern.match(module)), default)


@dataclass(frozen=True, slots=True)
class AdapterConfig:
    r: int
    lora_alpha: float
    use_rslora: bool
    ranks: Patterns
    alphas: Patterns

    @property
    def max_rank(self) -> int:
        return max([self.r, *(int(value) for _, value in self.ranks.entries)])

    def module(self, name: str) -> tuple[int, float]:
        """The rank a module's tensors must have and what its B is multiplied by (lora_alpha / r, or over
        sqrt(r) with rsLoRA), by its name in the base model ("model.layers.0.self_attn.q_proj")."""
        key = name.encode()  # RE2 matches bytes without a decoding pass
        r = int(self.ranks.get(key, self.r))
        return r, self.alphas.get(key, self.lora_alpha) / (math.sqrt(r) if self.use_rslora else r)


def parse_config(data: bytes, max_rank: int) -> AdapterConfig:
    """adapter_config.json's bytes as an AdapterConfig; ValueError naming the field that is wrong."""
    try:
        raw = from_json(data)  # a bounded nesting depth, unlike json.loads (RecursionError)
    except ValueError as exc:
        raise ValueError(f"adapter_config.json is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"adapter_config.json must hold a JSON object, not {type(raw).__name__}")  # noqa: TRY004 - a 400
    for field, what in UNSUPPORTED.items():
        if raw.get(field) not in (None, False, [], {}):
            raise ValueError(f"adapter_config.json: {field}: {what} is not supported (plain LoRA only)")
    try:
        schema = _Schema.model_validate(raw)
    except ValidationError as exc:
        err = exc.errors(include_url=False, include_input=False)[0]
        where = ".".join(str(part)[:64] for part in err["loc"])
        raise ValueError(f"adapter_config.json: {where}: {err['msg']}") from None
    if schema.bias != "none":
        raise ValueError(f"adapter_config.json: bias: trained biases ({schema.bias!r}) are not supported")
    for field, rank in [("r", schema.r), *(("rank_pattern", v) for v in (schema.rank_pattern or {}).values())]:
        if rank > max_rank:
            raise ValueError(f"adapter_config.json: {field}: rank {rank} is over --max-lora-rank {max_rank}")
    return AdapterConfig(schema.r, schema.lora_alpha, schema.use_rslora,
                         Patterns.compile("rank_pattern", schema.rank_pattern),
                         Patterns.compile("alpha_pattern", schema.alpha_pattern))
