"""The model registry: one module per family, chosen from config.json's `architectures` / `model_type` or a
GGUF's `general.architecture`. What each family cannot do yet is said here, so that the engine refuses it by name.
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
    lora: bool = True  # PEFT adapters on its projections

    def model_class(self) -> type[nn.Module]:
        return getattr(importlib.import_module(f"pagedserve.model.models.{self.module}"), self.class_name)


FAMILIES = (
    ModelFamily("llama", "llama", "LlamaForCausalLM",
                ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"), ("llama", "mistral", "qwen2"),
                ("llama", "mistral", "qwen2")),
    ModelFamily("gemma3", "gemma3", "Gemma3ForCausalLM", ("Gemma3ForCausalLM",), ("gemma3_text",), ("gemma3",)),
    ModelFamily("qwen3", "qwen3", "Qwen3ForCausalLM", ("Qwen3ForCausalLM",), ("qwen3",)),
    # Adapters would need one per expert.
    ModelFamily("qwen3_moe", "moe", "Qwen3MoeForCausalLM", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), lora=False),
    ModelFamily("mixtral", "moe", "MixtralForCausalLM", ("MixtralForCausalLM",), ("mixtral",), lora=False),
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


def gguf_family(arch: str | None) -> ModelFamily:
    for f in FAMILIES:
        if arch in f.gguf_architectures:
            return f
    supported = ", ".join(a for f in FAMILIES for a in f.gguf_architectures)
    raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {supported} (Qwen3 and mixture-of-experts "
                     "models load from Hugging Face folders)")
