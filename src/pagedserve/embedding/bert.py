"""A small BERT encoder (the architecture of all-MiniLM-L6-v2) in plain PyTorch."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(slots=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float

    @classmethod
    def from_dict(cls, d: dict) -> BertConfig:
        if d.get("hidden_act", "gelu") != "gelu" or d.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError("only BERT with gelu and absolute position embeddings is supported")
        return cls(**{k: d[k] for k in cls.__slots__})


class BertEmbeddings(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        # Single-segment input: token type 0 everywhere.
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


class BertLayer(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        h = c.hidden_size
        self.num_heads = c.num_attention_heads
        self.query, self.key, self.value = nn.Linear(h, h), nn.Linear(h, h), nn.Linear(h, h)
        self.attn_out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)
        self.intermediate = nn.Linear(h, c.intermediate_size)
        self.output = nn.Linear(c.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=c.layer_norm_eps)

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        return x.view(b, t, self.num_heads, h // self.num_heads).transpose(1, 2)

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor) -> torch.Tensor:
        q, k, v = (self.split_heads(proj(x)) for proj in (self.query, self.key, self.value))
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        attn = attn.transpose(1, 2).reshape(x.shape)
        x = self.attn_norm(x + self.attn_out(attn))
        return self.out_norm(x + self.output(F.gelu(self.intermediate(x))))


class BertModel(nn.Module):
    def __init__(self, c: BertConfig):
        super().__init__()
        self.embeddings = BertEmbeddings(c)
        self.layers = nn.ModuleList(BertLayer(c) for _ in range(c.num_hidden_layers))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Last hidden states [batch, tokens, hidden]; attention_mask is True on real tokens."""
        key_mask = attention_mask[:, None, None, :]  # broadcast over heads and query positions
        x = self.embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, key_mask)
        return x


# Hugging Face checkpoint names -> ours, per layer.
_LAYER_RENAMES = {
    "attention.self.query": "query",
    "attention.self.key": "key",
    "attention.self.value": "value",
    "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "intermediate",
    "output.dense": "output",
    "output.LayerNorm": "out_norm",
}


def convert_hf_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Maps a BertModel checkpoint (with or without the 'bert.' prefix) onto BertModel above."""
    out = {}
    for name, tensor in state.items():
        name = name.removeprefix("bert.")
        if name.startswith("embeddings."):
            if name != "embeddings.position_ids":
                out[name] = tensor
        elif name.startswith("encoder.layer."):
            index, rest = name.removeprefix("encoder.layer.").split(".", 1)
            module, param = rest.rsplit(".", 1)
            out[f"layers.{index}.{_LAYER_RENAMES[module]}.{param}"] = tensor
    return out
