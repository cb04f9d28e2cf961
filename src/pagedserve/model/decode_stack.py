"""All decoder layers of a pure decode step in one C++ call (csrc/decode_stack.cpp), where the model allows.

A decode step of one sequence spends ~1.7 ms of its 7.4 in Python and module dispatch between ~300 kernel
calls. The stack runs the same kernels in the same order with the same arguments, so its output equals the
Python layers' bit for bit (tests/test_decode_stack.py), every KV format included (int4 with the step's key
plan); the layers stay the path for everything else: prefill rows, LoRA, float linears or biases, head sizes
the kernels lack, and batches that the Python layers would send to a dequantized GEMM.
"""
from __future__ import annotations

from typing import Any

import torch

from pagedserve.model.attention import KERNEL_HEAD_DIMS, AttentionMetadata
from pagedserve.model.kv_cache_dtype import LayerKVCache
from pagedserve.model.quant_linear import (
    AMX_MAX_ROWS,
    DEQUANT_MIN_ROWS,
    PATHS,
    QuantLinear,
    few_rows_limit,
    gemm_path,
    kernel_path,
)
from pagedserve.model.sliding_window import HybridMetadata, WindowMetadata


def build_decode_stack(model: Any, stack_cls: str = "DecodeStack") -> Any | None:
    """The C++ stack over model's layers, or None when a layer needs the Python path. stack_cls: DecodeStack
    (Llama's layer) or GemmaDecodeStack (Gemma 3's: its layers give their norms, see models/gemma3.py)."""
    kernels, config = model.kernels, model.config
    if kernels is None or kernel_path() not in PATHS or config.head_dim not in KERNEL_HEAD_DIMS:
        return None
    o_proj = model.layers[0].self_attn.o_proj
    parallel = getattr(o_proj, "sums_partials", False)  # a tensor-parallel rank: the all-reduces run between halves
    if parallel and not hasattr(getattr(kernels, stack_cls), "set_all_reduce"):
        return None  # a stack without the collectives (Gemma's): the Python layers reduce
    linears = [(layer.self_attn.qkv_proj, unreduced(layer.self_attn.o_proj), layer.mlp.gate_up_proj,
                unreduced(layer.mlp.down_proj)) for layer in model.layers]
    if not all(isinstance(m, QuantLinear) and m.bias is None and not m.qweight.per_token_int8
               and m.qweight.input_perm is None  # W8A8 quantizes its tokens, GPTQ's act order gathers them, in Python
               for group in linears for m in group):
        return None
    amx_min_rows = few_rows_limit(torch.bfloat16) if gemm_path() == "amx" else 1 << 30
    attn = model.layers[0].self_attn
    stack = getattr(kernels, stack_cls)(attn.num_heads, attn.num_kv_heads, attn.head_dim, model.norm.eps, attn.scale,
                                        PATHS[kernel_path()], amx_min_rows)
    for layer, group in zip(model.layers, linears, strict=True):
        weights = [m.qweight for m in group]
        stack.add_layer(*layer.stack_norms(), [w.qweight for w in weights], [w.scales for w in weights],
                        [w.mins for w in weights], [w.bits for w in weights], [w.group for w in weights],
                        [w.hadamard for w in weights])
    if parallel:
        stack.set_all_reduce(o_proj.comm.all_reduce)
    return stack


def unreduced(proj: Any) -> Any:
    """A row-parallel projection's own linear (the stack makes its all-reduce), else proj."""
    return proj.inner if getattr(proj, "sums_partials", False) else proj


def stack_takes(rows: int, meta: AttentionMetadata, kv_caches: list[LayerKVCache]) -> bool:
    """Whether this step runs on the stack: decode rows only, the C++ attention, and a batch the Python
    layers would also give to the integer kernel or the tiles."""
    limit = AMX_MAX_ROWS if gemm_path() == "amx" else DEQUANT_MIN_ROWS - 1
    return (meta.num_decodes == rows and rows <= limit and meta.use_kernel
            and (meta.key_plan is not None or not kv_caches[0].fmt.int4))


def run_decode_stack(stack: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttentionMetadata,
                     block_size: int, kv_caches: list[LayerKVCache]) -> torch.Tensor:
    plan = meta.key_plan if kv_caches[0].fmt.int4 else None
    return stack.forward(x, cos, sin, meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens,
                         block_size, [kv.k for kv in kv_caches], [kv.v for kv in kv_caches],
                         [kv.k_scale for kv in kv_caches], [kv.v_scale for kv in kv_caches],
                         None if plan is None else plan.rows, None if plan is None else plan.completions,
                         [kv.k_tail for kv in kv_caches], [kv.k_offset for kv in kv_caches],
                         None if plan is None else kv_caches[0].tail_of_block)


def layer_metas(meta: AttentionMetadata | HybridMetadata, num_layers: int) -> list[AttentionMetadata | WindowMetadata]:
    """Each layer's metadata: its KV cache group's in a hybrid step (sliding_window.HybridMetadata)."""
    return [meta.layer(i) for i in range(num_layers)] if isinstance(meta, HybridMetadata) else [meta] * num_layers


def gemma_stack_takes(rows: int, metas: list[AttentionMetadata | WindowMetadata], kv_caches: list[LayerKVCache]) -> bool:
    """stack_takes for GemmaDecodeStack: every group's rows are decodes, full-attention groups on the C++ kernel,
    and no int4 KV (whose key tails follow one table per sequence)."""
    limit = AMX_MAX_ROWS if gemm_path() == "amx" else DEQUANT_MIN_ROWS - 1
    return (rows <= limit and not kv_caches[0].fmt.int4
            and all(m.num_decodes == rows and (isinstance(m, WindowMetadata) or m.use_kernel) for m in metas))


def run_gemma_decode_stack(stack: Any, x: torch.Tensor, global_rope: tuple[torch.Tensor, torch.Tensor],
                           local_rope: tuple[torch.Tensor, torch.Tensor], metas: list[AttentionMetadata | WindowMetadata],
                           block_size: int,
                           kv_caches: list[LayerKVCache]) -> torch.Tensor:
    tables = [m.decode_tables if isinstance(m, WindowMetadata) else m.decode_block_tables for m in metas]
    return stack.forward(x, *global_rope, *local_rope, [m.slot_mapping for m in metas], tables,
                         [m.decode_context_lens for m in metas], block_size, [kv.k for kv in kv_caches],
                         [kv.v for kv in kv_caches], [kv.k_scale for kv in kv_caches], [kv.v_scale for kv in kv_caches])
