"""Mixture-of-experts families: Qwen3-MoE (Qwen3's attention, QK-norm) and Mixtral (Llama's attention).

Each token goes to its top-k experts by the router's softmax, the k weights renormalized to sum to 1 (always in
Mixtral, when norm_topk_prob in Qwen3-MoE). The batch's (token, expert) pairs are sorted by expert and every
expert's rows run in one grouped GEMM per projection (torch._grouped_mm, as model/lora.py's SGMV groups adapters):
an expert no token chose is an empty group and costs nothing, and no Python loop runs per expert. _grouped_mm
wants 16-byte aligned rows, so the experts' weights are zero-padded once at load to multiples of 8 columns.
With --quantization int8 / int4 the experts are quantized like the dense projections (the router stays float: a
flipped routing decision costs more than any rounding) and each expert that got rows runs its two quantized GEMMs
over them (the integer kernel for a decode step's few rows reads each chosen expert's weights once); experts no
token chose are skipped. A GGUF's experts (llama.cpp's `ffn_*_exps` stacks, split per expert at load) run the
same way as stored under --quantization gguf, in the types the kernels take, and dequantized otherwise.
Each sparse layer counts the tokens routed to each expert (for /metrics: load balance).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.model.layers import StepContext
from pagedserve.model.linear import Linear
from pagedserve.model.model_config import ModelConfig
from pagedserve.model.models.llama import (
    ACTIVATIONS,
    GGUF_LAYER_NAMES,
    MLP,
    Attention,
    DecoderLayer,
    LlamaForCausalLM,
)
from pagedserve.model.models.qwen3 import GGUF_QWEN3_LAYER_NAMES, Qwen3Attention
from pagedserve.model.quant import QuantizedWeight, quantize
from pagedserve.model.quant_linear import kernel_path, quant_matmul

ALIGN = 8  # columns: 16 bytes of bf16, 32 of fp32


def padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int = 0) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_experts, self.top_k = config.num_experts, config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.act = ACTIVATIONS[config.hidden_act]
        h, i = config.hidden_size, config.moe_intermediate_size
        self.hidden, self.inter = h, i
        self.gate = Linear(h, self.num_experts, bias=False)  # the router
        # Transposed for x @ W: gate in columns [0, i), up in [padded(i), padded(i) + i).
        self.w13 = nn.Parameter(torch.zeros(self.num_experts, padded(h), 2 * padded(i)), requires_grad=False)
        self.w2 = nn.Parameter(torch.zeros(self.num_experts, padded(i), padded(h)), requires_grad=False)
        self.register_buffer("tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.long), persistent=False)
        self.quantized: list[tuple[QuantizedWeight, QuantizedWeight]] = []  # per expert (gate_up, down), once quantized
        self.comm: Any = None  # a tensor-parallel rank's collectives: its experts' columns give a partial sum

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, ctx: StepContext) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)  # [T, k]
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)
        rows = order // self.top_k  # the token of each (token, expert) pair, by expert
        counts = torch.bincount(flat, minlength=self.num_experts)
        self.tokens_per_expert += counts
        y = self._experts(x[rows], counts) if self.quantized else self._grouped(x[rows], counts)
        y = y * weights.flatten()[order].unsqueeze(1).to(y.dtype)
        out = torch.zeros_like(x).index_add_(0, rows, y)
        if self.comm is not None:
            out = self.comm.all_reduce(out)
        return out if residual is None else residual + out

    def _grouped(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offs = torch.cumsum(counts, 0).to(torch.int32)
        gate, up = torch._grouped_mm(F.pad(xs, (0, padded(self.hidden) - self.hidden)), self.w13, offs=offs).chunk(2, -1)
        return torch._grouped_mm(self.act(gate) * up, self.w2, offs=offs)[:, :self.hidden]

    def _experts(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Quantized experts: each chosen expert's rows (contiguous, sorted by expert) through its own GEMMs."""
        y, start, path = torch.empty_like(xs), 0, kernel_path()
        for (gate_up, down), n in zip(self.quantized, counts.tolist(), strict=True):
            if n:
                gate, up = quant_matmul(xs[start:start + n], gate_up, path).chunk(2, dim=-1)
                y[start:start + n] = quant_matmul(self.act(gate) * up, down, path)
                start += n
        return y

    def quantize_experts(self, mode: str, group: int) -> None:
        """int8 / int4 from the loaded float experts, in the dense projections' layout; the float copies freed."""
        h, i, pi = self.hidden, self.inter, padded(self.inter)
        self.quantized = [(quantize(torch.cat([self.w13[e, :h, :i].T, self.w13[e, :h, pi:pi + i].T]), mode, group),
                           quantize(self.w2[e, :i, :h].T, mode, group)) for e in range(self.num_experts)]
        self._drop_float_experts()

    def _drop_float_experts(self) -> None:
        """Once the experts run quantized, their float copies are freed."""
        self.w13 = nn.Parameter(torch.empty(0), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(0), requires_grad=False)

    def load_experts(self, gate: list, up: list, down: list) -> None:
        """Per expert, HF layouts: gate and up [inter, hidden], down [hidden, inter]; float tensors, or
        QuantizedWeights of one format (a GGUF's experts as stored), which run as quantized experts."""
        h, i, pi = self.hidden, self.inter, padded(self.inter)
        if all(isinstance(w, QuantizedWeight) for w in (*gate, *up, *down)):
            self._check_shapes(gate, up, down)
            self.quantized = [(QuantizedWeight.cat([g, u]), d) for g, u, d in zip(gate, up, down, strict=True)]
            self._drop_float_experts()
            return
        gate, up, down = ([w.dequantize() if isinstance(w, QuantizedWeight) else w for w in ws] for ws in (gate, up, down))
        self._check_shapes(gate, up, down)
        with torch.no_grad():
            self.w13.zero_()
            self.w2.zero_()
            for e, (g, u, d) in enumerate(zip(gate, up, down, strict=True)):
                self.w13[e, :h, :i] = g.T
                self.w13[e, :h, pi:pi + i] = u.T
                self.w2[e, :i, :h] = d.T


    def _check_shapes(self, gate: list, up: list, down: list) -> None:
        h, i = self.hidden, self.inter
        for e, (g, u, d) in enumerate(zip(gate, up, down, strict=True)):
            for name, w, shape in (("gate", g, (i, h)), ("up", u, (i, h)), ("down", d, (h, i))):
                if tuple(w.shape) != shape:
                    raise ValueError(f"layer {self.layer_index} expert {e} {name} has shape {tuple(w.shape)}, "
                                     f"expected {shape}")


class MoEDecoderLayer(DecoderLayer):
    def make_mlp(self, config: ModelConfig, layer_index: int) -> nn.Module:
        return SparseMoE(config, layer_index) if config.is_sparse_layer(layer_index) else MLP(config, layer_index)


class Qwen3MoeDecoderLayer(MoEDecoderLayer):
    attention_cls = Qwen3Attention


class MixtralDecoderLayer(MoEDecoderLayer):
    attention_cls = Attention


class MoEForCausalLM(LlamaForCausalLM):
    runs_decode_stack = False
    expert_names = ("gate_proj", "up_proj", "down_proj")  # HF names of each expert's gate, up and down
    block = "mlp"  # where the experts sit in a layer, in HF naming

    def fuse_layer(self, weights: dict[str, torch.Tensor | QuantizedWeight], p: str) -> None:
        layer = self.layers[int(p.split(".")[2])]
        if not isinstance(layer.mlp, SparseMoE):
            super().fuse_layer(weights, p)
            return
        super().fuse_layer(weights, p, mlp=False)
        moe, names = layer.mlp, self.expert_names
        parts = [[_pop(weights, f"{p}{self.block}.experts.{e}.{n}.weight") for e in range(moe.num_experts)]
                 for n in names]
        moe.load_experts(*parts)
        router = _pop(weights, f"{p}{self.block}.gate.weight")  # stays float: see quantize_linears
        weights[f"{p}mlp.gate.weight"] = router.dequantize() if isinstance(router, QuantizedWeight) else router

    def quantize_linears(self, mode: str, group: int = 32, hadamard: int = 0) -> None:
        """The dense projections and the head as LlamaForCausalLM quantizes them, the experts in their layout, and
        each router left float."""
        routers = {id(layer.mlp): layer.mlp.gate for layer in self.layers if isinstance(layer.mlp, SparseMoE)}
        super().quantize_linears(mode, group, hadamard)
        for layer in self.layers:
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp.gate = routers[id(layer.mlp)]
                layer.mlp.quantize_experts(mode, group)

    def expert_tokens(self) -> torch.Tensor:
        """Tokens routed to each expert so far: [sparse layers, experts]."""
        return torch.stack([layer.mlp.tokens_per_expert for layer in self.layers if isinstance(layer.mlp, SparseMoE)])


def _pop(weights: dict[str, torch.Tensor | QuantizedWeight], name: str) -> torch.Tensor | QuantizedWeight:
    if name not in weights:
        raise ValueError(f"model file lacks {name!r}")
    return weights.pop(name)


def gguf_expert_names(layer_names: dict[str, str], block: str, names: tuple[str, str, str]) -> dict[str, str]:
    """llama.cpp's names of a sparse layer's router and expert stacks -> HF names ({e}: the expert)."""
    return {**layer_names, "ffn_gate_inp": f"{block}.gate",
            **{f"ffn_{part}_exps": f"{block}.experts.{{e}}.{n}" for part, n in zip(("gate", "up", "down"), names)}}


class Qwen3MoeForCausalLM(MoEForCausalLM):
    layer_cls = Qwen3MoeDecoderLayer
    gguf_layer_names = gguf_expert_names(GGUF_QWEN3_LAYER_NAMES, MoEForCausalLM.block, MoEForCausalLM.expert_names)


class MixtralForCausalLM(MoEForCausalLM):
    layer_cls = MixtralDecoderLayer
    expert_names = ("w1", "w3", "w2")
    block = "block_sparse_moe"
    gguf_layer_names = gguf_expert_names(GGUF_LAYER_NAMES, block, expert_names)
