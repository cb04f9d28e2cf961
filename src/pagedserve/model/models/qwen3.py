"""Qwen3 (dense): Llama's layer with QK-norm (an RMSNorm over each head of q and k before RoPE) and no q/k/v bias.

The norms run on q and k in place inside the fused qkv output, so RoPE and the KV write that follow (the fused
bf16 C++ pass included) are Llama's; the C++ decode stack has no QK-norm, so this family's decodes run the layers.
"""
from __future__ import annotations

import torch

from pagedserve.model.layers import RMSNorm, StepContext
from pagedserve.model.model_config import ModelConfig
from pagedserve.model.models.llama import GGUF_LAYER_NAMES, Attention, DecoderLayer, LlamaForCausalLM

GGUF_QWEN3_LAYER_NAMES = {**GGUF_LAYER_NAMES, "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


class Qwen3Attention(Attention):
    def __init__(self, config: ModelConfig, layer_index: int = 0) -> None:
        super().__init__(config, layer_index)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def project(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        qkv = super().project(x, ctx)
        q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        for part, heads, norm in ((q, self.num_heads, self.q_norm), (k, self.num_kv_heads, self.k_norm)):
            view = part.view(-1, heads, self.head_dim)
            view.copy_(norm(view))
        return qkv


class Qwen3DecoderLayer(DecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
    gguf_layer_names = GGUF_QWEN3_LAYER_NAMES
    runs_decode_stack = False
