"""Gemma 3 (text): what differs from Llama is all here.

- RMSNorm scales by (1 + w) and computes in fp32 (GGUF files store 1 + w: the loader subtracts the 1, as
  transformers does, so both compute the same bits); norms before *and* after attention and the MLP;
- QK-norm over each head before RoPE, and a scale of query_pre_attn_scalar ** -0.5;
- sliding-window layers (five of every six in the released models) with their own RoPE base; their KV cache
  groups keep only the blocks the window sees (engine/kv_cache.py) and their attention is model/sliding_window.py;
- GeGLU (tanh GELU), embeddings scaled by sqrt(hidden), a tied head.

On the bf16 fast path the layers run Gemma's own fused C++ ops (the (1 + w) norms with the residual add, QK-norm,
GeGLU) beside Llama's RoPE + KV write and the attention kernels (windowed for sliding layers), and a pure decode step
over quantized linears runs all layers in one C++ call (csrc/decode_stack.cpp's GemmaDecodeStack, op for op the same).
"""
from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import nn

from pagedserve.model.attention import paged_attention
from pagedserve.model.decode_stack import (
    build_decode_stack,
    gemma_stack_takes,
    layer_metas,
    run_gemma_decode_stack,
)
from pagedserve.model.kernels import cpu_kernels
from pagedserve.model.kv_cache_dtype import LayerKVCache, hadamard
from pagedserve.model.layers import RotaryEmbedding, StepContext, rotate
from pagedserve.model.linear import can_pack, pack_linears
from pagedserve.model.lora import LoRABatch
from pagedserve.model.model_config import ModelConfig
from pagedserve.model.models.llama import GGUF_LAYER_NAMES, MLP, Attention, LlamaForCausalLM, project_out
from pagedserve.model.quant import QuantizedWeight
from pagedserve.model.sliding_window import HybridMetadata, WindowMetadata, window_attention


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), in fp32 whatever the model dtype (as transformers computes it)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps
        self.scale: torch.Tensor | None = None  # 1 + w in fp32 for the C++ ops, set by Gemma3ForCausalLM.use_fast_path

    def forward(self, x: torch.Tensor, kernels: Any | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The norm, plus residual when given (the norm rounded to x's dtype first, as in transformers)."""
        if kernels is not None:
            return kernels.gemma_rms_norm(x, self.scale, self.eps, residual)
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = (xf * (1.0 + self.weight.float())).type_as(x)
        return out if residual is None else residual + out


class Gemma3Attention(Attention):
    def __init__(self, config: ModelConfig, layer_index: int = 0) -> None:
        super().__init__(config, layer_index)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.window = config.layer_windows[layer_index]

    def forward(self, x: torch.Tensor, kv: LayerKVCache, ctx: StepContext,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """attention(x), before the post-attention norm; rope: this layer's (cos, sin)."""
        qkv = self.project(x, ctx)
        if ctx.kernels is not None:  # QK-norm, then RoPE and the KV write (fp8's Hadamard turn too), in place
            ctx.kernels.gemma_qk_norm(qkv, self.q_norm.scale, self.k_norm.scale, self.num_heads, self.num_kv_heads,
                                      self.q_norm.eps)
            ctx.kernels.rope_and_cache(qkv, *rope, kv.k, kv.v, kv.k_scale, kv.v_scale, ctx.meta.slot_mapping,
                                       self.num_heads, self.num_kv_heads)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if ctx.kernels is None:
            q, k = rotate(self.q_norm(q), *rope), rotate(self.k_norm(k), *rope)
            if kv.fmt.rotates_keys(self.head_dim):
                q, k = hadamard(q), hadamard(k)
            kv.write(k, v, ctx.meta.slot_mapping)
        if isinstance(ctx.meta, WindowMetadata):
            o = window_attention(q, kv, ctx.meta, ctx.block_size, self.scale, ctx.kernels).flatten(1)
        else:
            o = paged_attention(q, k, v, kv, ctx.meta, ctx.block_size, self.scale, ctx.kernels).flatten(1)
        return project_out(self.o_proj, o, None, ctx, self.layer_index, "o_proj")


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int = 0) -> None:
        super().__init__()
        size, eps = config.hidden_size, config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = Gemma3Attention(config, layer_index)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.mlp = MLP(config, layer_index)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, x: torch.Tensor, kv: LayerKVCache, ctx: StepContext,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        k = ctx.kernels
        x = self.post_attention_layernorm(self.self_attn(self.input_layernorm(x, k), kv, ctx, rope), k, x)
        return self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x, k), None, ctx), k, x)

    def stack_norms(self) -> tuple[list[torch.Tensor], int]:
        """What GemmaDecodeStack's add_layer takes before the linears: the six norms' 1 + w, and the window."""
        norms = [self.input_layernorm, self.post_attention_layernorm, self.pre_feedforward_layernorm,
                 self.post_feedforward_layernorm, self.self_attn.q_norm, self.self_attn.k_norm]
        return [n.scale for n in norms], self.self_attn.window or 0


class Gemma3ForCausalLM(LlamaForCausalLM):
    layer_cls = Gemma3DecoderLayer
    runs_decode_stack = False
    gguf_layer_names: ClassVar[dict[str, str]] = {**GGUF_LAYER_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                                                  "post_attention_norm": "post_attention_layernorm",
                                                  "post_ffw_norm": "post_feedforward_layernorm",
                                                  "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}

    @classmethod
    def configure_from_gguf(cls, config: ModelConfig, meta: dict) -> None:
        """The GGUF gives the window but not which layers slide nor their RoPE base: every sixth layer attends to
        everything and sliding ones use base 10,000, as in every released Gemma 3 (and transformers' defaults).
        The attention scale is head_dim ** -0.5 (llama.cpp's rule; transformers' default 256 is the same here)."""
        config.sliding_window = meta["gemma3.attention.sliding_window"]
        config.layer_types = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                              for i in range(config.num_hidden_layers)]
        config.rope_local_theta = 10000.0
        config.query_pre_attn_scalar = config.head_dim
        config.hidden_act = "gelu_pytorch_tanh"
        tokens = meta["tokenizer.ggml.tokens"]
        if "<end_of_turn>" in tokens:  # a chat turn's end stops generation too (Gemma's generation_config)
            config.eos_token_ids = [*config.eos_token_ids, tokens.index("<end_of_turn>")]

    @classmethod
    def from_gguf_tensor(cls, name: str, w: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantizedWeight:
        """llama.cpp stores the norms' 1 + w; subtracted back as transformers does, for the same fp32 bits."""
        return w - 1.0 if name.endswith("norm.weight") else w

    @classmethod
    def check_hf_config(cls, cfg: dict) -> None:
        for key in ("final_logit_softcapping", "attn_logit_softcapping"):
            if cfg.get(key) is not None:
                raise ValueError(f"{key} is not supported (Gemma 3 has none; Gemma 2 does)")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("use_bidirectional_attention is not supported (a causal language model is)")

    def __init__(self, config: ModelConfig, freq_factors: torch.Tensor | None = None) -> None:
        super().__init__(config, freq_factors)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.local_rope = RotaryEmbedding(config, theta=config.rope_local_theta or config.rope_theta)
        self.embed_scale = config.hidden_size ** 0.5

    def use_fast_path(self, use_kernels: bool) -> None:
        """bf16 on CPU: prepacked float linears, Gemma's fused C++ ops, and the decode stack over quantized ones."""
        weight = self.norm.weight
        if can_pack(weight.dtype, weight.device):
            pack_linears(self)
        if use_kernels and weight.dtype == torch.bfloat16 and weight.device.type == "cpu":
            self.kernels = cpu_kernels()
        if self.kernels is None:
            return
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.scale = 1.0 + module.weight.detach().float()
        self.decode_stack = build_decode_stack(self, "GemmaDecodeStack")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKVCache],
                meta: HybridMetadata, block_size: int, lora: LoRABatch | None = None) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.embed_scale).to(x.dtype)  # rounded as transformers rounds it
        rope_dtype = torch.float32 if self.kernels is not None else x.dtype  # the C++ RoPE takes fp32 tables
        global_rope = self.rope.tables(positions, rope_dtype)
        local_rope = self.local_rope.tables(positions, rope_dtype)
        metas = layer_metas(meta, len(self.layers))
        if self.decode_stack is not None and lora is None and gemma_stack_takes(x.shape[0], metas, kv_caches):
            x = run_gemma_decode_stack(self.decode_stack, x, global_rope, local_rope, metas, block_size, kv_caches)
            return self.norm(x, self.kernels)
        for layer, kv, layer_meta in zip(self.layers, kv_caches, metas):
            ctx = StepContext(layer_meta, block_size, *global_rope, self.kernels, lora)
            x = layer(x, kv, ctx, local_rope if layer.self_attn.window else global_rope)
        return self.norm(x, self.kernels)
