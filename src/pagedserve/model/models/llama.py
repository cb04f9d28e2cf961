"""Our own Llama-family model (Llama 2/3, SmolLM, Mistral, Qwen2) over a paged KV cache; the base the other
families' modules (models/qwen3.py, models/moe.py) extend where they differ."""
from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.model.attention import AttentionMetadata, paged_attention
from pagedserve.model.decode_stack import build_decode_stack, run_decode_stack, stack_takes
from pagedserve.model.fp8_linear import FP8Linear, FP8Weight
from pagedserve.model.kernels import cpu_kernels
from pagedserve.model.kv_cache_dtype import LayerKVCache, hadamard
from pagedserve.model.layers import RMSNorm, RotaryEmbedding, StepContext, fuse, rotate
from pagedserve.model.linear import Linear, can_pack, pack_linears
from pagedserve.model.lora import LoRABatch
from pagedserve.model.model_config import ModelConfig
from pagedserve.model.quant import QuantizedWeight, quantize
from pagedserve.model.quant_linear import QuantEmbedding, QuantLinear


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int = 0) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        self.scale = self.head_dim ** -0.5

    def project(self, x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """q, k and v side by side [T, q_size + 2 kv_size], before RoPE."""
        qkv = self.qkv_proj(x)
        if ctx.lora is not None:
            ctx.lora.add(qkv, x, self.layer_index, "qkv_proj")
        return qkv

    def forward(self, x: torch.Tensor, residual: torch.Tensor, kv: LayerKVCache, ctx: StepContext) -> torch.Tensor:
        """Returns residual + attention(x)."""
        qkv = self.project(x, ctx)
        if ctx.kernels is not None and kv.fmt.int4:
            plan = ctx.meta.key_plan
            ctx.kernels.rope_and_cache_int4(qkv, ctx.cos, ctx.sin, kv.k, kv.v, kv.k_scale, kv.v_scale, kv.k_tail,
                                            kv.k_offset, ctx.meta.slot_mapping, plan.rows, plan.completions, ctx.block_size,
                                            self.num_heads, self.num_kv_heads)
        elif ctx.kernels is not None:  # rotates q and k inside qkv and writes k, v to the cache in one pass
            ctx.kernels.rope_and_cache(qkv, ctx.cos, ctx.sin, kv.k, kv.v, kv.k_scale, kv.v_scale,
                                       ctx.meta.slot_mapping, self.num_heads, self.num_kv_heads)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if ctx.kernels is None:
            q, k = rotate(q, ctx.cos, ctx.sin), rotate(k, ctx.cos, ctx.sin)
            if kv.fmt.rotates_keys(self.head_dim):  # the C++ write turns them inside rope_and_cache
                q, k = hadamard(q), hadamard(k)
            kv.write(k, v, ctx.meta.slot_mapping, ctx.meta.key_plan)
        o = paged_attention(q, k, v, kv, ctx.meta, ctx.block_size, self.scale, ctx.kernels).flatten(1)
        return project_out(self.o_proj, o, residual, ctx, self.layer_index, "o_proj")


def project_out(proj: nn.Module, x: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext, layer: int,
                module: str) -> torch.Tensor:
    """residual + proj(x) + the step's LoRA delta of module. A row-parallel proj (tensor parallelism) holds this
    rank's input columns, as its adapters' A do: their partial delta must join its partial product before the
    all-reduce, else each rank would add only its own part."""
    if ctx.lora is None:
        return proj(x, residual)
    if getattr(proj, "sums_partials", False):
        return proj(x, residual, lambda y: ctx.lora.add(y, x, layer, module))
    out = proj(x, residual)
    ctx.lora.add(out, x, layer, module)
    return out


ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class MLP(nn.Module):
    """Gated MLP: act(gate) * up, then down; SwiGLU (silu) or GeGLU (tanh GELU: Gemma)."""

    def __init__(self, config: ModelConfig, layer_index: int = 0, intermediate_size: int | None = None) -> None:
        super().__init__()
        if config.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported MLP activation {config.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")
        self.layer_index = layer_index
        self.act = config.hidden_act
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * size, bias=False)
        self.down_proj = Linear(size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext) -> torch.Tensor:
        """Returns residual + mlp(x) (mlp(x) when residual is None)."""
        gate_up = self.gate_up_proj(x)
        if ctx.lora is not None:
            ctx.lora.add(gate_up, x, self.layer_index, "gate_up_proj")
        if ctx.kernels is not None:
            h = ctx.kernels.silu_and_mul(gate_up) if self.act == "silu" else ctx.kernels.gelu_tanh_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            h = ACTIVATIONS[self.act](gate) * up
        return project_out(self.down_proj, h, residual, ctx, self.layer_index, "down_proj")


class DecoderLayer(nn.Module):
    attention_cls: type[Attention] = Attention

    def __init__(self, config: ModelConfig, layer_index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self.attention_cls(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = self.make_mlp(config, layer_index)

    def make_mlp(self, config: ModelConfig, layer_index: int) -> nn.Module:
        return MLP(config, layer_index)

    def stack_norms(self) -> tuple[torch.Tensor, ...]:
        """What csrc/decode_stack.cpp's add_layer takes before the linears."""
        return self.input_layernorm.weight, self.post_attention_layernorm.weight

    def forward(self, x: torch.Tensor, kv: LayerKVCache, ctx: StepContext) -> torch.Tensor:
        x = self.self_attn(self.input_layernorm(x, ctx.kernels), x, kv, ctx)
        return self.mlp(self.post_attention_layernorm(x, ctx.kernels), x, ctx)


# GGUF tensor name (per layer part) -> HF name.
GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


class LlamaForCausalLM(nn.Module):
    layer_cls: type[DecoderLayer] = DecoderLayer
    runs_decode_stack = True  # csrc/decode_stack.cpp computes exactly these layers (no QK-norm, no experts)
    gguf_layer_names: ClassVar[dict[str, str]] = GGUF_LAYER_NAMES

    @classmethod
    def configure_from_gguf(cls, config: ModelConfig, meta: dict) -> None:
        """What this family's config needs beyond the metadata every GGUF has (model/loader.py's gguf_config)."""

    @classmethod
    def from_gguf_tensor(cls, name: str, w: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantizedWeight:
        """A GGUF tensor (in HF naming) in this family's convention."""
        return w

    @classmethod
    def check_hf_config(cls, cfg: dict) -> None:
        """Raises ValueError naming what a config.json asks that this family's code does not compute."""

    def __init__(self, config: ModelConfig, freq_factors: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(self.layer_cls(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rope = RotaryEmbedding(config, freq_factors)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.kernels: Any | None = None
        self.decode_stack: Any | None = None  # model/decode_stack.py, set by use_fast_path where it applies

    def use_fast_path(self, use_kernels: bool) -> None:
        """After loading, in the final dtype: bf16 on CPU prepacks the linears and runs the fused C++ ops."""
        weight = self.norm.weight  # always float, in the model's dtype
        if can_pack(weight.dtype, weight.device):
            pack_linears(self)
        if use_kernels and weight.dtype == torch.bfloat16 and weight.device.type == "cpu":
            self.kernels = cpu_kernels()
            self.decode_stack = build_decode_stack(self) if self.runs_decode_stack else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[LayerKVCache],
                meta: AttentionMetadata, block_size: int, lora: LoRABatch | None = None) -> torch.Tensor:
        """Returns the final hidden states [T, hidden]; logits are computed only where a token is sampled."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope.tables(positions, torch.float32 if self.kernels is not None else x.dtype)
        if self.decode_stack is not None and lora is None and stack_takes(x.shape[0], meta, kv_caches):
            x = run_decode_stack(self.decode_stack, x, cos, sin, meta, block_size, kv_caches)
            return self.norm(x, self.kernels)
        ctx = StepContext(meta, block_size, cos, sin, self.kernels, lora)
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(x, kv, ctx)
        return self.norm(x, self.kernels)

    def compute_logits(self, hidden: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """[rows, vocab] logits in fp32 for sampling, or in the model's dtype (upcast=False) for an argmax."""
        logits = self.lm_head(hidden)
        return logits.float() if upcast else logits

    def load_weights(self, weights: dict[str, torch.Tensor | QuantizedWeight]) -> None:
        """Weights in HF naming; q/k/v and gate/up are fused into one matmul each. A QuantizedWeight
        replaces its Linear (or the embedding, and the head tied to it) by the quantized layer."""
        params = dict(self.named_parameters())
        for i in range(self.config.num_hidden_layers):
            self.fuse_layer(weights, f"model.layers.{i}.")
        with torch.no_grad():
            for name, w in weights.items():
                key = name.removeprefix("model.")
                if key == "rope_freqs" or (key == "lm_head.weight" and self.config.tie_word_embeddings):
                    continue
                if isinstance(w, QuantizedWeight | FP8Weight):
                    self._set_quantized(key, w)
                    continue
                if key not in params:
                    raise ValueError(f"unexpected weight {name!r} for {self.config.architecture}")
                if params[key].shape != w.shape:
                    raise ValueError(f"weight {name!r} has shape {tuple(w.shape)}, expected {tuple(params[key].shape)}")
                params[key].copy_(w)

    def fuse_layer(self, weights: dict[str, torch.Tensor | QuantizedWeight], p: str, mlp: bool = True) -> None:
        """One layer's q/k/v and (mlp) gate/up weights (prefix p) into the fused projections' names."""
        fuse(weights, p + "self_attn.qkv_proj.weight", [p + f"self_attn.{n}_proj.weight" for n in "qkv"])
        if self.config.attention_bias:
            fuse(weights, p + "self_attn.qkv_proj.bias", [p + f"self_attn.{n}_proj.bias" for n in "qkv"])
        if mlp:
            fuse(weights, p + "mlp.gate_up_proj.weight", [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"])

    def _set_quantized(self, key: str, w: QuantizedWeight | FP8Weight) -> None:
        path = key.removesuffix(".weight")
        module = self.get_submodule(path)
        if tuple(w.shape) != (module.weight.shape[0], module.weight.shape[1]):
            raise ValueError(f"weight {key!r} has shape {w.shape}, expected {tuple(module.weight.shape)}")
        if path == "embed_tokens":
            self.embed_tokens = QuantEmbedding(w, module.weight.dtype)
            if self.config.tie_word_embeddings:
                self.lm_head = QuantLinear(w)
            return
        parent, _, name = path.rpartition(".")
        layer = FP8Linear(w, module.bias) if isinstance(w, FP8Weight) else QuantLinear(w, module.bias)
        setattr(self.get_submodule(parent) if parent else self, name, layer)

    def quantize_linears(self, mode: str, group: int = 32, hadamard: int = 0) -> None:
        """int8 / int4 from the loaded float weights: every projection, and the LM head. A head tied to the
        embedding is quantized to int8 whatever the mode (as llama.cpp keeps its output tensor at 6-8 bits:
        it is the most sensitive matrix) and serves the embedding lookups too. hadamard: int8's basis for W8A8
        (quant_linear.w8a8_basis), for every weight whose K it divides; an int4 mode's tied head keeps none."""
        def basis(w: torch.Tensor, weight_mode: str) -> int:
            return hadamard if mode == weight_mode == "int8" and hadamard and w.shape[1] % hadamard == 0 else 0

        if self.config.tie_word_embeddings:
            w = self.embed_tokens.weight
            tied = quantize(w, "int8", hadamard=basis(w, "int8"))
            self.embed_tokens = QuantEmbedding(tied, w.dtype)
            self.lm_head = QuantLinear(tied)
        for path, module in list(self.named_modules()):
            if isinstance(module, Linear):
                parent, _, name = path.rpartition(".")
                w = module.weight
                quantized = QuantLinear(quantize(w, mode, group, hadamard=basis(w, mode)), module.bias)
                setattr(self.get_submodule(parent) if parent else self, name, quantized)

