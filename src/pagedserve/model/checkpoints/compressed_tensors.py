"""llm-compressor's checkpoints (compressed-tensors format), repacked once at load into the planar layout of
model/quant.py so that the existing int4 / int8 kernels run them, without loss.

- `pack-quantized` (W4A16, W8A16): the integers packed 32 / bits to an int32, element i at bit bits * i, stored
  plus 2^(bits-1). 4 bits become GGML-ordered nibbles (unsigned: q + 8) with mins = -(8 + zero point) * scale,
  which our kernels dequantize with one fused multiply-add: scale * (q + 8) + min, the exact product scale * q
  for symmetric weights (the only rounding is the fma's own). 8 bits stay int8 with their scales.
- `int-quantized` / `naive-quantized` (W8A8): int8 as stored; with dynamic per-token int8 activations
  (quant_linear.py quantizes each token as compressed-tensors does: scale = amax / 127.5, round, clamp).
- `float-quantized` (FP8 W8A8): e4m3 values as stored, outputs scaled (model/fp8_linear.py).

Groups that do not divide K (compressed-tensors allows a short last group) or are not a multiple of 32 are
split into the largest common divisor with K that is one (scales repeated), e.g. 128 over K = 576 -> 64.
An activation order (`weight_g_idx`, actorder "group") is reordered once: the columns sorted by group, and the
kernels read the input's columns in that order (QuantizedWeight.input_perm).
Anything else (other bit widths, sparsity, transforms, KV schemes) is an error that names it; asymmetric 8 bits
are dequantized at load (logged).
"""
from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass, replace

import torch

from pagedserve.model.fp8_linear import FP8Weight
from pagedserve.model.quant import GGUF_BLOCK, QuantizedWeight

logger = logging.getLogger(__name__)

FORMATS = ("pack-quantized", "int-quantized", "naive-quantized", "float-quantized")
WEIGHT_PARTS = ("weight", "weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx",
                "input_scale", "input_zero_point")


@dataclass(frozen=True, slots=True)
class Scheme:
    """One config group: what its targets' weights (and activations) are."""
    targets: tuple[str, ...]
    format: str
    bits: int
    type: str  # int | float
    strategy: str  # tensor | channel | group
    group_size: int | None
    symmetric: bool
    activations: str | None  # None (weights only), int8-token, fp8-token or fp8-tensor

    @property
    def name(self) -> str:
        a = {None: "16", "int8-token": "8 (int8 per token)", "fp8-token": "8 (fp8 per token)",
             "fp8-tensor": "8 (fp8 per tensor)"}[self.activations]
        w = f"{self.type}{self.bits} per {self.strategy}" + (f" {self.group_size}" if self.group_size else "")
        return f"compressed-tensors {self.format}: W{self.bits}A{a}, weights {w}{'' if self.symmetric else ' asym'}"

    def matches(self, module: str) -> bool:
        return any(t == "Linear" or t == module or (t.startswith("re:") and re.match(t[3:], module))
                   for t in self.targets)


def read_schemes(config: dict) -> list[Scheme]:
    """The config groups of a quantization_config, refusing by name what we cannot run."""
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if config.get(key):
            raise ValueError(f"compressed-tensors {key} is not supported yet (this checkpoint has {config[key]!r})")
    schemes = []
    for name, group in config.get("config_groups", {}).items():
        fmt = group.get("format") or config.get("format")
        if fmt not in FORMATS:
            raise ValueError(f"compressed-tensors format {fmt!r} (group {name}) is not supported; supported: "
                             f"{', '.join(FORMATS)}")
        w = group.get("weights") or {}
        kind = f"{w.get('type')}{w.get('num_bits')} weights per {w.get('strategy')}"
        if (w.get("type"), w.get("num_bits")) not in (("int", 4), ("int", 8), ("float", 8)):
            raise ValueError(f"compressed-tensors {kind} (group {name}) are not supported; supported: int4, int8, fp8")
        if w.get("strategy") not in ("tensor", "channel", "group"):
            raise ValueError(f"compressed-tensors {kind} (group {name}) are not supported; supported strategies: "
                             "tensor, channel, group")
        if group.get("output_activations"):
            raise ValueError(f"compressed-tensors output activation quantization (group {name}) is not supported")
        schemes.append(Scheme(tuple(group.get("targets", ())), fmt, w["num_bits"], w["type"], w["strategy"],
                              w.get("group_size"), w.get("symmetric", True),
                              activations(group.get("input_activations"), name)))
    if not schemes:
        raise ValueError("compressed-tensors quantization_config has no config_groups")
    return schemes


def activations(args: dict | None, group: str) -> str | None:
    if not args:
        return None
    kind = (args.get("type"), args.get("num_bits"), args.get("strategy"), bool(args.get("dynamic")),
            args.get("symmetric", True))
    if kind == ("int", 8, "token", True, True):
        return "int8-token"
    if kind[:2] == ("float", 8) and kind[2] in ("token", "tensor"):
        return f"fp8-{kind[2]}"
    raise ValueError(f"compressed-tensors input activations {args.get('type')}{args.get('num_bits')} per "
                     f"{args.get('strategy')} (dynamic {args.get('dynamic')}, group {group}) are not supported; "
                     "supported: int8 per token (dynamic), fp8")


def load_compressed_tensors(tensors: dict[str, torch.Tensor], config: dict
                            ) -> tuple[dict[str, torch.Tensor | QuantizedWeight | FP8Weight], str]:
    """The folder's tensors with each quantized module's parts replaced by its weight as our kernels read it."""
    schemes = read_schemes(config)
    modules = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_scale")})
    quantized_parts = {f"{m}.{p}" for m in modules for p in WEIGHT_PARTS}
    out = {k: v.float() for k, v in tensors.items() if k not in quantized_parts}
    used = set()
    for module in modules:
        scheme = next((s for s in schemes if s.matches(module)), None)
        if scheme is None:
            raise ValueError(f"{module} has quantized weights but no compressed-tensors config group targets it")
        parts = {p: tensors[f"{module}.{p}"] for p in WEIGHT_PARTS if f"{module}.{p}" in tensors}
        out[f"{module}.weight"] = convert(parts, scheme, module)
        used.add(scheme)
    names = sorted({s.name for s in used})
    for s in used:
        if s.activations and s.activations.startswith("fp8"):
            logger.info("%s: FP8 weights run as their exact e4m3 values in a float GEMM with per-channel output "
                        "scales (no FP8 arithmetic on CPUs); activations stay unquantized, which adds no error",
                        s.name)
    return out, "; ".join(names)


def activation_order(g_idx: torch.Tensor | None, k: int, size: int, module: str) -> torch.Tensor | None:
    """The input channels in stored order (each group's channels together, groups in turn) for a g_idx [K] that
    is not k // size (GPTQ's desc_act / actorder); None when the order is the input's own. Every group must hold
    `size` channels, as GPTQ makes them."""
    if g_idx is None or torch.equal(g_idx.long(), torch.arange(k) // size):
        return None
    perm = torch.argsort(g_idx.long(), stable=True)
    if not torch.equal(g_idx.long()[perm], torch.arange(k) // size):
        raise ValueError(f"{module}: an activation order whose groups are not all {size} channels is not supported")
    return perm


def in_order(weight: QuantizedWeight | torch.Tensor, perm: torch.Tensor | None) -> QuantizedWeight | torch.Tensor:
    """A weight built from columns in perm's order, told so (or, dequantized, put back in the input's order)."""
    if perm is None:
        return weight
    if isinstance(weight, QuantizedWeight):
        return replace(weight, input_perm=perm)
    return torch.empty_like(weight).index_copy_(1, perm, weight)


def convert(parts: dict[str, torch.Tensor], scheme: Scheme, module: str) -> QuantizedWeight | FP8Weight | torch.Tensor:
    scale = parts["weight_scale"].float()
    if scheme.type == "float":
        weight = parts["weight"]
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{module}: float-quantized weights of dtype {weight.dtype} are not supported (e4m3 only)")
        return FP8Weight(weight, scale.reshape(-1).expand(weight.shape[0]).contiguous(), scheme.name)
    q = unpack(parts, scheme) if scheme.format == "pack-quantized" else parts["weight"].to(torch.int8)
    k = q.shape[1]
    perm = activation_order(parts.get("weight_g_idx"), k, scheme.group_size or k, module)
    if perm is not None:
        if scheme.activations:
            raise ValueError(f"{module}: quantized activations with an activation order (weight_g_idx) are not "
                             "supported")
        q = q[:, perm]
    return in_order(_integer_weight(q, parts, scale, scheme, module), perm)


def _integer_weight(q: torch.Tensor, parts: dict[str, torch.Tensor], scale: torch.Tensor, scheme: Scheme,
                    module: str) -> QuantizedWeight | torch.Tensor:
    """int4 / int8 levels q [N, K] (columns as they will be stored) in our planar layout."""
    n, k = q.shape
    zero = parts.get("weight_zero_point")
    if zero is not None and scheme.format == "pack-quantized":
        zero = unpack_int32(zero.t(), scheme.bits, n).t()  # zero points are packed down the rows
    scale = scale.reshape(n, -1) if scale.numel() > 1 else scale.reshape(1, 1).expand(n, 1)
    group, scale, zero = planar_groups(scale, zero, k, scheme, module)
    if scheme.bits == 8:
        if zero is not None and bool(zero.any()):
            logger.warning("%s: asymmetric int8 weights have no kernel (it reads no 8-bit mins): dequantized to "
                           "float at load", module)
            return dequantize_reference(q, scale, zero, group)
        return QuantizedWeight(q.contiguous(), scale.contiguous(), None, 8, group, "compressed-tensors int8", 0,
                               per_token_int8=scheme.activations == "int8-token")
    if scheme.activations:
        raise ValueError(f"{module}: int4 weights with {scheme.activations} activations are not supported")
    mins = -(8.0 + (0.0 if zero is None else zero.float())) * scale
    return QuantizedWeight(pack_nibbles((q.to(torch.int16) + 8).to(torch.uint8)), scale.contiguous(),
                           mins.contiguous(), 4, group, "compressed-tensors int4")


def unpack_int32(packed: torch.Tensor, bits: int, width: int) -> torch.Tensor:
    """compressed-tensors' pack_to_int32 undone along the last dim: element i at bit bits * i of the row's words,
    stored plus 2^(bits - 1); width: the unpacked length (the packing pads to 32 elements)."""
    if 32 % bits:
        raise ValueError(f"packed int{bits} weights are not supported (4 or 8 bits)")
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32) * bits
    values = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    values = values.reshape(*packed.shape[:-1], packed.shape[-1] * per_word)[..., :width]
    return (values - (1 << (bits - 1))).to(torch.int8)


def unpack(parts: dict[str, torch.Tensor], scheme: Scheme) -> torch.Tensor:
    n, k = (int(d) for d in parts["weight_shape"].tolist())
    return unpack_int32(parts["weight_packed"], scheme.bits, k).reshape(n, k)


def planar_groups(scale: torch.Tensor, zero: torch.Tensor | None, k: int, scheme: Scheme, module: str
                  ) -> tuple[int, torch.Tensor, torch.Tensor | None]:
    """Our group size and the scales (and zero points) per group of it: per tensor or channel, one group of K;
    a checkpoint group the kernels cannot take is split into gcd(group, K) columns with its values repeated."""
    if scheme.strategy != "group":
        return k, scale, zero
    size = scheme.group_size
    group = math.gcd(size, k)
    if k % GGUF_BLOCK or (group % GGUF_BLOCK and not (group == 16 and scheme.bits == 8)):
        raise ValueError(f"{module}: compressed-tensors groups of {size} over K={k} cannot run on our kernels "
                         f"(they need K and the group as multiples of {GGUF_BLOCK})")
    if group == size:
        return group, scale, zero
    index = torch.arange(k // group) * group // size  # the checkpoint group of each of ours
    return group, scale[:, index], None if zero is None else zero[:, index]


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """uint8 values 0..15 [N, K] in GGML's order per 32: byte j holds k = j (low nibble) and k = j + 16."""
    n, k = u.shape
    g = u.view(n, k // GGUF_BLOCK, 2, GGUF_BLOCK // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def dequantize_reference(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, group: int) -> torch.Tensor:
    """(q - zero) * scale in fp32, per group: compressed-tensors' own dequantization."""
    n, k = q.shape
    shifted = q.float().view(n, k // group, group)
    if zero is not None:
        shifted = shifted - zero.float().unsqueeze(-1)
    return (shifted * scale.unsqueeze(-1)).reshape(n, k)
