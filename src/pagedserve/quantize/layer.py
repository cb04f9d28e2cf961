"""One Llama-family (or Qwen3) decoder layer as a plain dense forward over its HF-named fp32 weights, for calibration: the
engine's forward needs a paged KV cache and step metadata, which a batch of fixed-length samples does not.
Uses the model code's own RMSNorm, RoPE tables and rotation, so the numbers are the engine's fp32 path's.

taps: the input of each group of linears that share one (what the methods calibrate on)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.model.model_config import ModelConfig
from pagedserve.model.models.llama import ACTIVATIONS
from pagedserve.model.token_quant import quantize_tokens

# Linears that read the same input, by the tap that holds it; the order is the layer's.
GROUPS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
          "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
LINEARS = tuple(name for names in GROUPS.values() for name in names)
# Llama, Mistral, Qwen2, and Qwen3 (its QK-norm: an RMSNorm over each head of q and k before RoPE). Gemma 3's
# (1 + w) norms around each block, sliding windows and per-layer RoPE bases, and the experts of a mixture, are not
# in this forward.
SUPPORTED_FAMILIES = ("llama", "qwen3")


def check_family(config: ModelConfig) -> None:
    if config.family not in SUPPORTED_FAMILIES:
        raise ValueError(f"pagedserve quantize supports the Llama family (llama, mistral, qwen2) and qwen3 for now; "
                         f"{config.architecture} ({config.family}) is not supported yet")


def layer_weights(weights: dict[str, torch.Tensor], i: int) -> dict[str, torch.Tensor]:
    """Layer i's tensors, named without the `model.layers.{i}.` prefix."""
    prefix = f"model.layers.{i}."
    return {k.removeprefix(prefix): v for k, v in weights.items() if k.startswith(prefix)}


def linear(x: torch.Tensor, w: dict[str, torch.Tensor], name: str, act_quant: bool) -> torch.Tensor:
    if act_quant:  # W8A8: the inputs as compressed-tensors' dynamic per-token int8 makes them
        x = quantize_tokens(x.reshape(-1, x.shape[-1])).reshape(x.shape)
    return F.linear(x, w[f"{name}.weight"], w.get(f"{name}.bias"))


def forward(w: dict[str, torch.Tensor], x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, config: ModelConfig,
            taps: dict[str, torch.Tensor] | None = None, act_quant: bool = False) -> torch.Tensor:
    """x [B, T, hidden] (B samples of T tokens, positions 0..T-1) -> the layer's output; cos, sin [T, d/2]."""
    from pagedserve.model.layers import rotate

    taps = {} if taps is None else taps
    b, t, _ = x.shape
    d, heads, kv_heads = config.head_dim, config.num_attention_heads, config.num_key_value_heads
    h = F.rms_norm(x, (x.shape[-1],), w["input_layernorm.weight"], config.rms_norm_eps)
    taps["qkv"] = h
    q, k, v = (linear(h, w, f"self_attn.{n}_proj", act_quant) for n in "qkv")
    q, k = q.view(b * t, heads, d), k.view(b * t, kv_heads, d)
    if "self_attn.q_norm.weight" in w:  # Qwen3
        q = F.rms_norm(q, (d,), w["self_attn.q_norm.weight"], config.rms_norm_eps)
        k = F.rms_norm(k, (d,), w["self_attn.k_norm.weight"], config.rms_norm_eps)
    q = rotate(q, cos.repeat(b, 1), sin.repeat(b, 1)).view(b, t, heads, d).transpose(1, 2)
    k = rotate(k, cos.repeat(b, 1), sin.repeat(b, 1)).view(b, t, kv_heads, d).transpose(1, 2)
    v = v.view(b, t, kv_heads, d).transpose(1, 2)
    if kv_heads != heads:
        k, v = k.repeat_interleave(heads // kv_heads, dim=1), v.repeat_interleave(heads // kv_heads, dim=1)
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, heads * d)
    taps["o"] = o
    x = x + linear(o, w, "self_attn.o_proj", act_quant)
    h = F.rms_norm(x, (x.shape[-1],), w["post_attention_layernorm.weight"], config.rms_norm_eps)
    taps["gate_up"] = h
    a = ACTIVATIONS[config.hidden_act](linear(h, w, "mlp.gate_proj", act_quant)) * linear(h, w, "mlp.up_proj", act_quant)
    taps["down"] = a
    return x + linear(a, w, "mlp.down_proj", act_quant)
