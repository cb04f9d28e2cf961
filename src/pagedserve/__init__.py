"""pagedserve: an LLM serving stack with a paged KV cache engine.

`from pagedserve import LLM, SamplingParams` as with vLLM. Both are imported on first use, so that
`import pagedserve` stays cheap for the router and gateway processes, which never load torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.llm import LLM
    from pagedserve.lora_request import LoRARequest
    from pagedserve.sampling_params import SamplingParams

_LAZY = {"LLM": "pagedserve.llm", "SamplingParams": "pagedserve.sampling_params",
         "LoRARequest": "pagedserve.lora_request"}
__all__ = ["LLM", "LoRARequest", "SamplingParams"]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'pagedserve' has no attribute {name!r}")
