"""Architecture hyper-parameters of a model of any family (model/models/), read from GGUF metadata or config.json."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    attention_bias: bool = False  # Qwen2 has q/k/v bias
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = "model"
    family: str = "llama"  # model/models/ registry key
    hidden_act: str = "silu"  # of the gated MLP: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    layer_types: list[str] | None = None  # per layer: full_attention or sliding_attention; None: all full
    sliding_window: int | None = None  # tokens a sliding layer's query sees, itself included
    rope_local_theta: float | None = None  # RoPE base of the sliding layers (Gemma 3)
    query_pre_attn_scalar: float | None = None  # attention scale = this ** -0.5 (Gemma); None: head_dim
    num_experts: int = 0  # mixture of experts: routed experts per sparse layer (0: dense)
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalize the top-k routing weights to sum to 1
    decoder_sparse_step: int = 1  # every this-many-th layer is sparse (Qwen3-MoE)
    mlp_only_layers: list[int] = field(default_factory=list)  # dense layers among them

    @property
    def layer_windows(self) -> list[int | None]:
        """Per layer, its sliding window, or None for full attention."""
        types = self.layer_types or ["full_attention"] * self.num_hidden_layers
        return [self.sliding_window if t == "sliding_attention" else None for t in types]

    def is_sparse_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict, name: str, family: str = "llama") -> ModelConfig:
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        arch = cfg.get("model_type", "llama")
        # transformers 5 writes RoPE's base and scaling into one `rope_parameters` dict (per layer type where
        # they differ: Gemma 3); older configs have top-level `rope_theta` and `rope_scaling`.
        rope = cfg.get("rope_parameters") or {}
        local = rope.get("sliding_attention") or {}
        rope = rope.get("full_attention", rope)
        scaled = rope.get("rope_type", rope.get("type", "default")) != "default"
        sliding = cfg.get("sliding_window") if cfg.get("layer_types") else None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-5),
            rope_theta=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=cfg.get("rope_scaling") or (rope if scaled else None),
            attention_bias=cfg.get("attention_bias", arch == "qwen2"),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[] if eos is None else ([eos] if isinstance(eos, int) else list(eos)),
            name=name,
            family=family,
            hidden_act=cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu",
            layer_types=cfg.get("layer_types") if sliding else None,
            sliding_window=sliding,
            rope_local_theta=local.get("rope_theta", cfg.get("rope_local_base_freq")),
            query_pre_attn_scalar=cfg.get("query_pre_attn_scalar"),
            num_experts=cfg.get("num_experts") or cfg.get("num_local_experts") or 0,
            num_experts_per_tok=cfg.get("num_experts_per_tok") or 0,
            moe_intermediate_size=cfg.get("moe_intermediate_size") or cfg.get("intermediate_size", 0),
            norm_topk_prob=cfg.get("norm_topk_prob", True),
            decoder_sparse_step=cfg.get("decoder_sparse_step") or 1,
            mlp_only_layers=list(cfg.get("mlp_only_layers") or []),
        )
