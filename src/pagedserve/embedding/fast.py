"""Fast CPU inference for the BERT encoder of bert.py, for short queries embedded one at a time.

For a 10-30 token query the fp32 encoder spends nearly all its time in 36 small GEMMs (M = tokens) whose
cost is moving the 21M weights, not arithmetic. This model keeps the architecture and the weights but:

- stores each linear's weight in fp16, prepacked for fbgemm's fp16-weight / fp32-activation GEMM (half the
  bytes, a kernel built for small M; activations and accumulation stay fp32, so the embedding stays within
  cosine 0.99999 of the fp32 one: tests/test_gateway_embedding.py);
- fuses query, key and value into one GEMM;
- runs attention without a mask when the batch has no padding (one query).

int8 (fbgemm's dynamic-quantized linear, with per-token and SmoothQuant-style per-channel scales) was tried
too: no faster inside the model on this hardware and only cosine 0.996 on very short texts, so not used.
fast_kernels_available() says whether this PyTorch has the kernels (x86 builds with fbgemm).
"""
from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.embedding.bert import BertEmbeddings, BertLayer, BertModel


def fast_kernels_available() -> bool:
    if not (hasattr(torch, "fbgemm_pack_gemm_matrix_fp16") and hasattr(torch, "fbgemm_linear_fp16_weight_fp32_activation")):
        return False
    if "fbgemm" not in torch.backends.quantized.supported_engines:
        return False
    try:
        Fp16WeightLinear(torch.ones(2, 2), torch.zeros(2))(torch.ones(1, 2))
    except RuntimeError:  # e.g. a CPU without the instructions fbgemm needs
        return False
    return True


class Fp16WeightLinear(nn.Module):
    """y = x @ weight.T + bias with the weight packed in fp16 for fbgemm; x, y and accumulation in fp32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        super().__init__()
        # fbgemm's standalone linear ops are marked deprecated (in favour of torchao), not removed; the
        # check above falls back to fp32 if they ever go.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.packed = torch.fbgemm_pack_gemm_matrix_fp16(weight.detach().float().contiguous())
        self.register_buffer("bias", bias.detach().float().clone())

    @classmethod
    def fuse(cls, linears: list[nn.Linear]) -> Fp16WeightLinear:
        """One GEMM for several linears over the same input; outputs concatenated in order."""
        return cls(torch.cat([lin.weight for lin in linears]), torch.cat([lin.bias for lin in linears]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.fbgemm_linear_fp16_weight_fp32_activation(x, self.packed, self.bias)


class FastBertLayer(nn.Module):
    def __init__(self, layer: BertLayer):
        super().__init__()
        self.num_heads = layer.num_heads
        self.qkv = Fp16WeightLinear.fuse([layer.query, layer.key, layer.value])
        self.attn_out = Fp16WeightLinear.fuse([layer.attn_out])
        self.attn_norm = layer.attn_norm
        self.intermediate = Fp16WeightLinear.fuse([layer.intermediate])
        self.output = Fp16WeightLinear.fuse([layer.output])
        self.out_norm = layer.out_norm

    def forward(self, x: torch.Tensor, key_mask: torch.Tensor | None) -> torch.Tensor:
        b, t, h = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, h // self.num_heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)
        attn = attn.transpose(1, 2).reshape(x.shape)
        x = self.attn_norm(x + self.attn_out(attn))
        return self.out_norm(x + self.output(F.gelu(self.intermediate(x))))


class FastBertModel(nn.Module):
    """BertModel's forward (same inputs and outputs) on the fast linears."""

    def __init__(self, model: BertModel):
        super().__init__()
        self.embeddings: BertEmbeddings = model.embeddings
        self.layers = nn.ModuleList(FastBertLayer(layer) for layer in model.layers)
        self.eval()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        # Without padding (one query) every key is real: no mask, and attention without one is faster.
        key_mask = None if bool(attention_mask.all()) else attention_mask[:, None, None, :]
        x = self.embeddings(input_ids)
        for layer in self.layers:
            x = layer(x, key_mask)
        return x
