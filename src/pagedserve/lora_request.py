"""Which LoRA adapter a request runs under (vLLM's LoRARequest)."""
from __future__ import annotations

import re
from dataclasses import dataclass

# An adapter's name is what clients send as `model` and what logs, metrics and the router's config show: a
# plain token, never a path piece ("..") nor a line break that could forge a log line.
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def check_lora_name(name: object) -> str:
    """name, when it is a valid adapter name; ValueError saying what one is otherwise."""
    if not isinstance(name, str) or not NAME.fullmatch(name) or ".." in name:
        raise ValueError("an adapter's name is 1 to 64 ASCII letters, digits, '.', '_' or '-', starting with a "
                         "letter or digit, without '..'")
    return name


@dataclass(frozen=True, slots=True)
class LoRARequest:
    lora_name: str  # what clients call it (the `model` of an API request)
    lora_int_id: int  # a positive id, unique per adapter
    lora_path: str  # a PEFT folder: adapter_config.json + adapter_model.safetensors

    def __post_init__(self) -> None:
        check_lora_name(self.lora_name)
        if not isinstance(self.lora_int_id, int) or isinstance(self.lora_int_id, bool) or self.lora_int_id < 1:
            raise ValueError("lora_int_id must be a positive integer")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must name the adapter's folder")
