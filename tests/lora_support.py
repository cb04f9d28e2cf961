"""LoRA adapters made with peft for the tests (random weights, fixed seeds, never downloaded), adapter folders
written by hand (hostile ones included), and run-time loads signed as a cluster peer's."""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

from pagedserve import LoRARequest
from pagedserve.server.peer_auth import SECRET_ENV, PeerKey

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name: (rank, lora_alpha, target modules, rsLoRA, alpha_pattern)
ADAPTERS = {
    "attn8": (8, 16, ["q_proj", "v_proj"], False, {}),
    "all16": (16, 8, ALL, True, {}),
    "mlp4": (4, 32, ["gate_proj", "up_proj", "down_proj"], False, {"down_proj": 8}),
}
LOAD, UNLOAD = "/v1/load_lora_adapter", "/v1/unload_lora_adapter"


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


def write_adapter(folder: Path, config: dict | bytes, tensors: dict[str, torch.Tensor]) -> Path:
    """A PEFT folder as given: config as a dict (JSON) or as the file's very bytes."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_bytes(config if isinstance(config, bytes) else json.dumps(config).encode())
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def session_key() -> PeerKey:
    """The test session's cluster secret: conftest.py puts it in the environment every server inherits."""
    return PeerKey.from_hex(os.environ[SECRET_ENV])


def signed_post(url: str, path: str, payload: dict, key: PeerKey | None = None, timeout: float = 120) -> httpx.Response:
    """POST payload to url + path signed as a peer's (key: default the session's; another key signs wrong)."""
    body = json.dumps(payload).encode()
    headers = {"content-type": "application/json", **(key or session_key()).sign("POST", path, body)}
    return httpx.post(url + path, content=body, headers=headers, timeout=timeout)


def load_adapter(url: str, name: str, path: str | Path, key: PeerKey | None = None) -> httpx.Response:
    """A run-time load, as the router makes one."""
    return signed_post(url, LOAD, {"lora_name": name, "lora_path": str(path)}, key)


def unload_adapter(url: str, name: str) -> httpx.Response:
    return signed_post(url, UNLOAD, {"lora_name": name})
