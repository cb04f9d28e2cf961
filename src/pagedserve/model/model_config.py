"""Architecture hyper-parameters of a Llama-family model, read from GGUF metadata or config.json."""
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

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf(cls, cfg: dict, name: str) -> ModelConfig:
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        arch = cfg.get("model_type", "llama")
        # transformers 5 writes RoPE's base and scaling into one `rope_parameters` dict; older configs
        # have top-level `rope_theta` and `rope_scaling`.
        rope = cfg.get("rope_parameters") or {}
        scaled = rope.get("rope_type", rope.get("type", "default")) != "default"
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
        )
