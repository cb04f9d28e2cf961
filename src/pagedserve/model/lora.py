"""LoRA adapters in PEFT format, applied beside the base model's projections and batched over the adapters
of a step (one C++ call per projection over all of them, SGMV-style, never a loop per request or adapter).

At load an adapter is regrouped onto our fused projections: for qkv_proj (q, k, v) and gate_up_proj (gate,
up) the parts' A matrices stack along the rank and B places each part's rows in its slice of the fused
output (zero elsewhere), so x @ A^T @ B^T is the whole fused delta. The scaling (lora_alpha / r, or
lora_alpha / sqrt(r) with rsLoRA; per-module alpha_pattern honoured) is folded into B.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from pagedserve.model.kernels import cpu_kernels
from pagedserve.model.model_config import ModelConfig

# PEFT module name -> (our fused module, which part of its output)
TARGETS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
KEY = re.compile(r"layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass(slots=True)
class LoRAWeights:
    """One fused projection of one layer."""
    a: torch.Tensor  # [rank, in]: the parts' A matrices stacked
    b: torch.Tensor  # [out, rank]: scaled, each part's rows in its output slice


@dataclass(slots=True)
class LoRAAdapter:
    name: str
    int_id: int
    path: str
    rank: int  # the largest rank of any of its modules
    layers: list[dict[str, LoRAWeights]]  # per layer: fused module name -> weights
    nbytes: int = field(init=False)
    cache_key: str = field(init=False)  # what the prefix cache keys blocks by: the weights' content

    def __post_init__(self) -> None:
        self.nbytes = sum(w.a.nbytes + w.b.nbytes for layer in self.layers for w in layer.values())
        self.cache_key = f"lora:{weights_digest(self.layers)}"


def weights_digest(layers: list[dict[str, LoRAWeights]]) -> str:
    """The same in every process that loaded the same weights in the same dtype (Python's hash() is not), so
    KV computed under an adapter keeps its identity when it moves between workers, and a reload with other
    weights under the same name is another identity."""
    h = hashlib.sha256()  # SHA-NI: ~1.2 GB/s here, faster than blake2b
    for i, layer in enumerate(layers):
        for module in sorted(layer):
            w = layer[module]
            h.update(f"{i}.{module}:{w.a.dtype}:{tuple(w.a.shape)}:{tuple(w.b.shape)};".encode())
            for t in (w.a, w.b):
                h.update(t.contiguous().view(torch.uint8).numpy())
    return h.hexdigest()[:32]


def part_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of every PEFT target module."""
    h, i = config.hidden_size, config.intermediate_size
    return {"q_proj": (config.q_size, h), "k_proj": (config.kv_size, h), "v_proj": (config.kv_size, h),
            "o_proj": (h, config.q_size), "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}


def load_adapter(path: str | Path, config: ModelConfig, name: str, int_id: int, max_rank: int,
                 dtype: torch.dtype) -> LoRAAdapter:
    """Reads a PEFT adapter folder; ValueError with the reason when it cannot serve this base model."""
    folder = Path(path)
    try:
        cfg = json.loads((folder / "adapter_config.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"adapter '{name}': cannot read {folder / 'adapter_config.json'}: {exc}") from None
    if cfg.get("peft_type", "LORA") != "LORA" or cfg.get("use_dora"):
        raise ValueError(f"adapter '{name}': only plain LoRA adapters are supported (got {cfg.get('peft_type')}"
                         f"{', DoRA' if cfg.get('use_dora') else ''})")
    try:
        tensors = load_file(str(folder / "adapter_model.safetensors"))
    except (OSError, SafetensorError) as exc:
        raise ValueError(f"adapter '{name}': cannot read adapter_model.safetensors: {exc}") from None
    parts = _collect(tensors, name, config.num_hidden_layers)
    shapes = part_shapes(config)
    layers: list[dict[str, LoRAWeights]] = [{} for _ in range(config.num_hidden_layers)]
    ranks = [0]
    for layer, modules in enumerate(parts):
        fused: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        for module, (a, b) in modules.items():
            r = _check(name, layer, module, a, b, shapes[module], max_rank)
            ranks.append(r)
            scale = _alpha(cfg, f"model.layers.{layer}.{module}", r) / (math.sqrt(r) if cfg.get("use_rslora") else r)
            fused_name, part = TARGETS[module]
            fused.setdefault(fused_name, []).append((part, a, b * scale))
        for fused_name, pieces in fused.items():
            layers[layer][fused_name] = _fuse(pieces, fused_name, shapes, dtype)
    return LoRAAdapter(name, int_id, str(folder), max(ranks), layers)


def _collect(tensors: dict[str, torch.Tensor], name: str, num_layers: int) -> list[dict]:
    """Per layer: PEFT module -> (A, B)."""
    found: list[dict[str, dict[str, torch.Tensor]]] = [{} for _ in range(num_layers)]
    for key, t in tensors.items():
        m = KEY.search(key)
        if m is None:
            raise ValueError(f"adapter '{name}': unsupported tensor {key!r} (only lora_A / lora_B of "
                             f"{', '.join(TARGETS)} are)")
        layer, module, which = int(m.group(1)), m.group(3), m.group(4)
        if module not in TARGETS or layer >= num_layers:
            raise ValueError(f"adapter '{name}': {key!r} targets a module this base model does not have")
        found[layer].setdefault(module, {})[which] = t.float()
    out = []
    for layer, modules in enumerate(found):
        for module, ab in modules.items():
            if set(ab) != {"A", "B"}:
                raise ValueError(f"adapter '{name}': layer {layer} {module} lacks its lora_{({'A', 'B'} - set(ab)).pop()}")
        out.append({module: (ab["A"], ab["B"]) for module, ab in modules.items()})
    return out


def _check(name: str, layer: int, module: str, a: torch.Tensor, b: torch.Tensor, shape: tuple[int, int],
           max_rank: int) -> int:
    out_features, in_features = shape
    r = a.shape[0]
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != in_features or b.shape != (out_features, r):
        raise ValueError(f"adapter '{name}' was made for another base model: layer {layer} {module} has A "
                         f"{tuple(a.shape)} and B {tuple(b.shape)}, expected ({r}, {in_features}) and "
                         f"({out_features}, {r})")
    if r > max_rank:
        raise ValueError(f"adapter '{name}' has rank {r} (layer {layer} {module}), over --max-lora-rank {max_rank}")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise ValueError(f"adapter '{name}': layer {layer} {module} holds non-finite weights")
    return r


def _alpha(cfg: dict, module_path: str, r: int) -> float:
    """lora_alpha, or the alpha_pattern entry whose key names this module (PEFT matches key suffixes)."""
    for key, alpha in (cfg.get("alpha_pattern") or {}).items():
        if re.fullmatch(rf"(.*\.)?{key}", module_path):
            return float(alpha)
    return float(cfg.get("lora_alpha", r))


def _fuse(pieces: list[tuple[int, torch.Tensor, torch.Tensor]], fused_name: str, shapes: dict[str, tuple[int, int]],
          dtype: torch.dtype) -> LoRAWeights:
    """Stacks the parts' A along the rank; places each part's B in its output slice."""
    names = [n for n, (f, _) in TARGETS.items() if f == fused_name]
    offsets = [0]
    for n in names:
        offsets.append(offsets[-1] + shapes[n][0])
    rank = sum(a.shape[0] for _, a, _ in pieces)
    b = torch.zeros(offsets[-1], rank)
    col = 0
    for part, a, scaled_b in sorted(pieces, key=lambda p: p[0]):
        b[offsets[part]:offsets[part + 1], col:col + a.shape[0]] = scaled_b
        col += a.shape[0]
    a = torch.cat([a for _, a, _ in sorted(pieces, key=lambda p: p[0])])
    return LoRAWeights(a.to(dtype).contiguous(), b.to(dtype).contiguous())


def fused_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) of every fused projection an adapter can touch."""
    h, i = config.hidden_size, config.intermediate_size
    return {"qkv_proj": (h, config.q_size + 2 * config.kv_size), "o_proj": (config.q_size, h),
            "gate_up_proj": (h, 2 * i), "down_proj": (i, h)}


class LoRASlots:
    """The running batch's adapters stacked per layer and projection, A as [slots, rank, in] and B^T as
    [slots, rank, out] (ranks zero-padded to the largest slotted one), so that a step applies every adapter of a
    projection in one call (our C++ lora_sgmv over rows sorted by slot: Punica's SGMV) instead of a pair of
    matmuls per adapter. --max-loras slots, refilled least recently used first; an adapter is keyed by its
    weights (cache_key), so a reload with other weights never reads the old ones."""

    def __init__(self, config: ModelConfig, num_slots: int, dtype: torch.dtype) -> None:
        self.shapes = fused_shapes(config)
        self.num_layers, self.num_slots, self.dtype = config.num_hidden_layers, num_slots, dtype
        self.a = {m: torch.zeros(self.num_layers, num_slots, 0, i, dtype=dtype) for m, (i, _) in self.shapes.items()}
        self.b = {m: torch.zeros(self.num_layers, num_slots, 0, o, dtype=dtype) for m, (_, o) in self.shapes.items()}
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # least recently used first

    def batch(self, groups: list[tuple[LoRAAdapter, list[range]]]) -> LoRABatch | None:
        """The step's adapter rows (each adapter's ranges of the flat batch), in segments by slot."""
        if not groups:
            return None
        slots = self._activate([adapter for adapter, _ in groups])
        order: list[int] = []
        starts, seg_slots = [0], []
        for slot, (_, ranges) in sorted(zip(slots, groups), key=lambda g: g[0]):
            for r in ranges:
                order += r
            starts.append(len(order))
            seg_slots.append(slot)
        return LoRABatch(self, torch.tensor(order, dtype=torch.long), torch.tensor(starts, dtype=torch.long),
                         torch.tensor(seg_slots, dtype=torch.long))

    def _activate(self, adapters: list[LoRAAdapter]) -> list[int]:
        in_use = {a.cache_key for a in adapters}
        if len(in_use) > self.num_slots:
            raise RuntimeError(f"{len(in_use)} adapters in one step, over --max-loras {self.num_slots}")
        out = []
        for adapter in adapters:
            key = adapter.cache_key
            if key in self.slot_of:
                self.slot_of.move_to_end(key)
            else:
                taken = set(self.slot_of.values())
                free = [s for s in range(self.num_slots) if s not in taken]
                if free:
                    slot = free[0]
                else:
                    victim = next(k for k in self.slot_of if k not in in_use)
                    slot = self.slot_of.pop(victim)
                self._write(adapter, slot)
                self.slot_of[key] = slot
            out.append(self.slot_of[key])
        return out

    def _write(self, adapter: LoRAAdapter, slot: int) -> None:
        for module in self.shapes:
            rank = max((layer[module].a.shape[0] for layer in adapter.layers if module in layer), default=0)
            if rank > self.a[module].shape[2]:  # grow every slot's padding to this rank
                a, b = self.a[module], self.b[module]
                self.a[module] = torch.cat([a, a.new_zeros(*a.shape[:2], rank - a.shape[2], a.shape[3])], dim=2)
                self.b[module] = torch.cat([b, b.new_zeros(*b.shape[:2], rank - b.shape[2], b.shape[3])], dim=2)
            self.a[module][:, slot].zero_()
            self.b[module][:, slot].zero_()
            for i, layer in enumerate(adapter.layers):
                w = layer.get(module)
                if w is not None:
                    r = w.a.shape[0]
                    self.a[module][i, slot, :r] = w.a
                    self.b[module][i, slot, :r] = w.b.T


@dataclass(slots=True)
class LoRABatch:
    """The adapters of one step: the rows (tokens) they serve sorted by slot, in one segment per slot; rows
    without an adapter are left out."""
    slots: LoRASlots
    index: torch.Tensor  # int64 [n]: rows of the flat batch, by slot
    seg_starts: torch.Tensor  # int64 [segments + 1]: each segment's first position in index
    seg_slots: torch.Tensor  # int64 [segments]: its slot

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, module: str) -> None:
        """y += every adapter's delta of module for its rows of x, in one kernel call."""
        a, b = self.slots.a[module][layer], self.slots.b[module][layer]
        if a.shape[1] == 0:  # no slotted adapter touches this projection
            return
        kernels = cpu_kernels() if x.device.type == "cpu" else None
        if kernels is not None:
            kernels.lora_sgmv(y, x.contiguous(), self.index, self.seg_starts, self.seg_slots, a, b)
            return
        starts = self.seg_starts.tolist()
        for slot, first, end in zip(self.seg_slots.tolist(), starts, starts[1:]):
            rows = self.index[first:end]
            y.index_add_(0, rows, (x.index_select(0, rows) @ a[slot].T) @ b[slot])
