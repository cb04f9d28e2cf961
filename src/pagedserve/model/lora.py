"""LoRA adapters in PEFT format, applied beside the base model's projections and batched over the adapters
of a step (one C++ call per projection over all of them, SGMV-style, never a loop per request or adapter).

At load an adapter is regrouped onto our fused projections: for qkv_proj (q, k, v) and gate_up_proj (gate,
up) the parts' A matrices stack along the rank and B places each part's rows in its slice of the fused
output (zero elsewhere), so x @ A^T @ B^T is the whole fused delta. The scaling (lora_alpha / r, or
lora_alpha / sqrt(r) with rsLoRA; per-module alpha_pattern and rank_pattern honoured) is folded into B.

An adapter's files are read as hostile input: only regular files within the size its declared rank allows,
its config validated field by field (model/lora_config.py), every tensor a finite float matrix of the base
layer's sizes and the config's rank. Whatever is wrong is a ValueError saying what.
"""
from __future__ import annotations

import errno
import hashlib
import os
import re
import stat
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import safetensors.torch
import torch

from pagedserve.model.kernels import cpu_kernels
from pagedserve.model.lora_config import MAX_CONFIG_BYTES, AdapterConfig, parse_config
from pagedserve.model.model_config import ModelConfig

# PEFT module name -> (our fused module, which part of its output)
TARGETS = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "o_proj": ("o_proj", 0),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", 0)}
BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
         "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # where each sits in a decoder layer
EXPERTS = re.compile(r"\.experts\.")  # peft's names for adapters on experts (per expert, or the fused stacks)
KEY = re.compile(r"layers\.(\d{1,6})\.(self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
MAX_KEY_CHARS = 256
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
HEADER_BYTES = 1 << 20  # allowance for the safetensors header (~150 bytes a tensor)
# Only regular files are read: O_NOFOLLOW keeps a planted symlink from leading out of the folder, O_NONBLOCK
# keeps a FIFO from blocking the loader thread (and every load queued behind it), and the file's type and size
# are checked on the descriptor itself, so nothing can be swapped in between the check and the read.
OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


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
    try:
        cfg = parse_config(read_regular(path, "adapter_config.json", MAX_CONFIG_BYTES, "an adapter_config.json"),
                           max_rank)
        shapes = part_shapes(config)
        # float64 A and B of every module at the largest rank the config declares, and a header
        limit = HEADER_BYTES + 8 * cfg.max_rank * config.num_hidden_layers * sum(o + i for o, i in shapes.values())
        data = read_regular(path, "adapter_model.safetensors", limit,
                            f"the weights of a rank-{cfg.max_rank} adapter of this base model")
        try:
            tensors = safetensors.torch.load(data)
        except Exception as exc:  # noqa: BLE001 - hostile bytes raise SafetensorError, TypeError, ...: all a 400
            raise ValueError(f"cannot read adapter_model.safetensors: not a safetensors file ({exc})") from None
        parts = _collect(tensors, config.num_hidden_layers)
        _refuse_experts(parts, config)
        layers = _layers(parts, cfg, shapes, dtype)
    except ValueError as exc:
        raise ValueError(f"adapter '{name}': {exc}") from None
    rank = max((a.shape[0] for modules in parts for a, _ in modules.values()), default=0)
    return LoRAAdapter(name, int_id, str(path), rank, layers)


def read_regular(folder: str | Path, name: str, limit: int, what: str) -> bytes:
    """folder/name when it is a regular file of at most limit bytes (in the folder, or a symlink to a file in
    it); ValueError otherwise."""
    real = os.path.realpath(folder)
    target = os.path.join(real, name)
    try:
        try:
            fd = os.open(target, OPEN_FLAGS)
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            resolved = os.path.realpath(target)
            if os.path.commonpath([real, resolved]) != real:
                raise ValueError(f"{target} is a symbolic link to outside the adapter's folder") from None
            fd = os.open(resolved, OPEN_FLAGS)
    except OSError as exc:
        raise ValueError(f"cannot read {target}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{target} is not a regular file")
        if st.st_size > limit:
            raise ValueError(f"{target} has {st.st_size} bytes, over the {limit} allowed for {what}")
        with open(fd, "rb", closefd=False) as f:
            data = f.read(st.st_size + 1)
    finally:
        os.close(fd)
    if len(data) != st.st_size:  # a file that grew while read, or one whose size the kernel makes up (/proc)
        raise ValueError(f"{target} changed while it was read")
    return data


def _collect(tensors: dict[str, torch.Tensor], num_layers: int) -> list[dict[str, tuple[torch.Tensor, ...]]]:
    """Per layer: PEFT module -> (A, B)."""
    found: list[dict[str, dict[str, torch.Tensor]]] = [{} for _ in range(num_layers)]
    for key, t in tensors.items():
        m = KEY.search(key) if len(key) <= MAX_KEY_CHARS else None
        if m is None and EXPERTS.search(key[:MAX_KEY_CHARS]):
            raise ValueError(f"{key[:MAX_KEY_CHARS]!r} adapts a mixture of experts' experts: not supported yet (adapters "
                             f"on the attention projections, and on dense layers' MLPs, are)")
        if m is None:
            raise ValueError(f"unsupported tensor {key[:MAX_KEY_CHARS]!r} (only lora_A / lora_B of "
                             f"{', '.join(TARGETS)} are)")
        layer, block, module, which = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        if BLOCK.get(module) != block or layer >= num_layers:
            raise ValueError(f"{key!r} targets a module this base model does not have")
        if which in found[layer].setdefault(module, {}):
            raise ValueError(f"layer {layer} {module} has two lora_{which} tensors")
        found[layer][module][which] = t
    out = []
    for layer, modules in enumerate(found):
        for module, ab in modules.items():
            if set(ab) != {"A", "B"}:
                raise ValueError(f"layer {layer} {module} lacks its lora_{({'A', 'B'} - set(ab)).pop()}")
        out.append({module: (ab["A"], ab["B"]) for module, ab in modules.items()})
    return out


def _refuse_experts(parts: list[dict[str, tuple[torch.Tensor, ...]]], config: ModelConfig) -> None:
    """A sparse layer has no gate/up/down projection of its own: an adapter naming one there was made for
    another model, and our experts take no adapter (it would be silently left out)."""
    for layer, modules in enumerate(parts):
        mlp = sorted(m for m in modules if BLOCK[m] == "mlp")
        if mlp and config.is_sparse_layer(layer):
            raise ValueError(f"layer {layer} is a mixture of experts, with no {', '.join(mlp)} of its own to adapt "
                             f"(adapters on its experts are not supported yet)")


def _layers(parts: list[dict[str, tuple[torch.Tensor, ...]]], cfg: AdapterConfig, shapes: dict[str, tuple[int, int]],
            dtype: torch.dtype) -> list[dict[str, LoRAWeights]]:
    """Each layer's modules checked, scaled and fused."""
    layers: list[dict[str, LoRAWeights]] = [{} for _ in parts]
    for layer, modules in enumerate(parts):
        fused: dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        for module, (a, b) in modules.items():
            rank, scale = cfg.module(f"model.layers.{layer}.{BLOCK[module]}.{module}")  # as PEFT names it
            _check(f"layer {layer} {module}", a, b, shapes[module], rank)
            fused_name, part = TARGETS[module]
            fused.setdefault(fused_name, []).append((part, a.float(), b.float() * scale))
        for fused_name, pieces in fused.items():
            w = layers[layer][fused_name] = _fuse(pieces, fused_name, shapes, dtype)
            if not (torch.isfinite(w.a).all() and torch.isfinite(w.b).all()):
                raise ValueError(f"layer {layer} {fused_name}: weights overflow {dtype} once scaled by lora_alpha")
    return layers


def _check(where: str, a: torch.Tensor, b: torch.Tensor, shape: tuple[int, int], rank: int) -> None:
    """A and B of one module: float matrices of the base layer's sizes and the config's rank, finite."""
    for which, t in (("lora_A", a), ("lora_B", b)):
        if t.dtype not in FLOAT_DTYPES:
            raise ValueError(f"{where} {which} is {t.dtype}, not float16, bfloat16, float32 or float64")
        if t.dim() != 2:
            raise ValueError(f"{where} {which} has {t.dim()} dimensions, not 2")
    out_features, in_features = shape
    if a.shape[1] != in_features or b.shape[0] != out_features:
        raise ValueError(f"made for another base model: {where} has A {tuple(a.shape)} and B {tuple(b.shape)}, "
                         f"expected (r, {in_features}) and ({out_features}, r)")
    if a.shape[0] != rank or b.shape[1] != rank:
        raise ValueError(f"{where} has A {tuple(a.shape)} and B {tuple(b.shape)}, but adapter_config.json gives "
                         f"it rank {rank} (r or rank_pattern)")
    if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
        raise ValueError(f"{where} holds non-finite weights")


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

    def hold(self, adapter: LoRAAdapter, slot: int) -> None:
        """Puts adapter in slot unless it is there already: a tensor-parallel worker mirrors the slots rank 0's
        _activate chose, so that rank 0's LoRABatch indexes every rank's slots alike."""
        key = adapter.cache_key
        if self.slot_of.get(key) == slot:
            return
        for k in [k for k, s in self.slot_of.items() if s == slot or k == key]:
            del self.slot_of[k]
        self._write(adapter, slot)
        self.slot_of[key] = slot

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
