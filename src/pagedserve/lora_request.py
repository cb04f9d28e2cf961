"""Which LoRA adapter a request runs under (vLLM's LoRARequest)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    lora_name: str  # what clients call it (the `model` of an API request)
    lora_int_id: int  # a positive id, unique per adapter
    lora_path: str  # a PEFT folder: adapter_config.json + adapter_model.safetensors

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("a LoRA adapter needs a name")
        if self.lora_int_id < 1:
            raise ValueError("lora_int_id must be a positive integer")
