"""The model registry: one module per family, chosen from config.json's `architectures` / `model_type` or a
GGUF's `general.architecture`.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True, slots=True)
class ModelFamily:
    name: str
    module: str  # pagedserve.model.models.<module>
    class_name: str
    hf_architectures: tuple[str, ...]
    model_types: tuple[str, ...]  # config.json's model_type
    gguf_architectures: tuple[str, ...] = ()
    moe: bool = False  # routed experts: a GGUF of a shared architecture name (llama) with experts is this family

    def model_class(self) -> type[nn.Module]:
        return getattr(importlib.import_module(f"pagedserve.model.models.{self.module}"), self.class_name)


FAMILIES = (
    ModelFamily("llama", "llama", "LlamaForCausalLM",
                ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"), ("llama", "mistral", "qwen2"),
                ("llama", "mistral", "qwen2")),
    ModelFamily("gemma3", "gemma3", "Gemma3ForCausalLM", ("Gemma3ForCausalLM",), ("gemma3_text",), ("gemma3",)),
    ModelFamily("qwen3", "qwen3", "Qwen3ForCausalLM", ("Qwen3ForCausalLM",), ("qwen3",), ("qwen3",)),
    # llama.cpp writes Mixtral as `llama` with an expert count.
    ModelFamily("qwen3_moe", "moe", "Qwen3MoeForCausalLM", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), ("qwen3moe",),
                moe=True),
    ModelFamily("mixtral", "moe", "MixtralForCausalLM", ("MixtralForCausalLM",), ("mixtral",), ("llama",), moe=True),
)
BY_NAME = {f.name: f for f in FAMILIES}


def family(name: str) -> ModelFamily:
    return BY_NAME[name]


def hf_family(cfg: dict) -> ModelFamily:
    """The family of a config.json: its first `architectures` entry, else its `model_type`."""
    archs = cfg.get("architectures") or []
    for f in FAMILIES:
        if archs and archs[0] in f.hf_architectures or not archs and cfg.get("model_type") in f.model_types:
            return f
    named = archs[0] if archs else cfg.get("model_type")
    supported = ", ".join(a for f in FAMILIES for a in f.hf_architectures)
    raise ValueError(f"unsupported model architecture {named!r}; supported: {supported}")


def gguf_family(arch: str | None, experts: int = 0) -> ModelFamily:
    """The family of a GGUF's `general.architecture`, with `<arch>.expert_count` telling Mixtral from Llama."""
    for f in FAMILIES:
        if arch in f.gguf_architectures and f.moe == (experts > 0):
            return f
    supported = ", ".join(dict.fromkeys(a for f in FAMILIES for a in f.gguf_architectures))
    kind = f" with {experts} experts" if experts and any(arch in f.gguf_architectures for f in FAMILIES) else ""
    raise ValueError(f"unsupported GGUF architecture {arch!r}{kind}; supported: {supported} (qwen3moe and llama "
                     "with experts, as llama.cpp writes Mixtral, are mixtures of experts)")
