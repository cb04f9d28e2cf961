"""LoRA adapters made with peft for the tests (random weights, fixed seeds, never downloaded)."""
from __future__ import annotations

import copy
from pathlib import Path

import torch

from pagedserve import LoRARequest

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name: (rank, lora_alpha, target modules, rsLoRA, alpha_pattern)
ADAPTERS = {
    "attn8": (8, 16, ["q_proj", "v_proj"], False, {}),
    "all16": (16, 8, ALL, True, {}),
    "mlp4": (4, 32, ["gate_proj", "up_proj", "down_proj"], False, {"down_proj": 8}),
}


def make_adapters(hf_model, root: Path) -> dict[str, tuple[Path, object]]:
    """name -> (PEFT folder, the peft model that serves as its reference)."""
    from peft import LoraConfig, get_peft_model

    made = {}
    for i, (name, (rank, alpha, targets, rslora, pattern)) in enumerate(ADAPTERS.items()):
        torch.manual_seed(1000 + i)
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                            alpha_pattern=pattern, lora_dropout=0.0, init_lora_weights=False)
        model = get_peft_model(copy.deepcopy(hf_model), config).eval()
        with torch.no_grad():  # nn.Linear's init makes deltas that swamp the model: shrink B to a fine-tune's size
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.mul_(0.25)
        folder = root / name
        model.save_pretrained(folder)
        made[name] = (folder, model)
    return made


def lora(adapters, name: str, int_id: int | None = None, as_name: str | None = None) -> LoRARequest:
    ids = {n: i + 1 for i, n in enumerate(ADAPTERS)}
    return LoRARequest(as_name or name, int_id or ids[name], str(adapters[name][0]))
