"""The output folder in compressed-tensors' format, as llm-compressor writes it and vLLM, transformers and our
loader (model/checkpoints/compressed_tensors.py) read it: per quantized linear `weight_packed` (int32, element i
at bit bits * i, stored plus 2^(bits - 1)), `weight_scale` [N, groups], `weight_shape`, and for asymmetric
weights `weight_zero_point` packed down the rows; W8A8 (`int-quantized`) stores int8 `weight` and
`weight_scale` [N, 1]. Everything else (embeddings, norms, a tied LM head) stays fp32 and unquantized."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from pagedserve.model.loader import LoadedModel
from pagedserve.quantize.rtn import Grid, Quantized

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt", "generation_config.json")


def pack_int32(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 values [N, K] -> int32 [N, ceil(K * bits / 32)], as compressed-tensors' pack_to_int32 (4 or 8 bits)."""
    per_word = 32 // bits
    n, k = q.shape
    padded = torch.zeros(n, math.ceil(k / per_word) * per_word, dtype=torch.int64)
    padded[:, :k] = q.to(torch.int64) + (1 << (bits - 1))
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    words = (padded.view(n, -1, per_word) << shifts).sum(dim=-1)
    return (words - (words >= 1 << 31).long() * (1 << 32)).to(torch.int32)  # two's complement of the top bit


def module_tensors(name: str, qz: Quantized, w8a8: bool) -> dict[str, torch.Tensor]:
    if w8a8:
        return {f"{name}.weight": qz.q.contiguous(), f"{name}.weight_scale": qz.scale.reshape(-1, 1).contiguous()}
    out = {f"{name}.weight_packed": pack_int32(qz.q, qz.grid.bits), f"{name}.weight_scale": qz.scale.contiguous(),
           f"{name}.weight_shape": torch.tensor(list(qz.q.shape), dtype=torch.int64)}
    if qz.zero is not None:
        out[f"{name}.weight_zero_point"] = pack_int32(qz.zero.T, qz.grid.bits).T.contiguous()
    return out


def quantization_config(grid: Grid, w8a8: bool) -> dict:
    weights = {"num_bits": grid.bits, "type": "int", "symmetric": grid.symmetric, "dynamic": False,
               "strategy": "channel" if grid.group is None else "group", "group_size": grid.group,
               "actorder": None, "block_structure": None, "observer": "minmax", "observer_kwargs": {}}
    activations = None
    if w8a8:
        activations = {"num_bits": 8, "type": "int", "symmetric": True, "dynamic": True, "strategy": "token",
                       "group_size": None, "actorder": None, "block_structure": None, "observer": None,
                       "observer_kwargs": {}}
    fmt = "int-quantized" if w8a8 else "pack-quantized"
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": activations,
                                          "output_activations": None, "format": fmt}},
            "ignore": ["lm_head"], "kv_cache_scheme": None, "sparsity_config": {}, "transform_config": {},
            "global_compression_ratio": None}


HF_ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen3": ("Qwen3ForCausalLM", "qwen3")}


def hf_config(loaded: LoadedModel, source: Path | None) -> dict:
    """The source folder's config.json, or one written from a GGUF's config (Llama family or Qwen3)."""
    if source is not None and source.is_dir():
        return json.loads((source / "config.json").read_text())
    c = loaded.config
    arch, model_type = HF_ARCHITECTURES[c.family]
    cfg = {"architectures": [arch], "model_type": model_type, "vocab_size": c.vocab_size,
           "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
           "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
           "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
           "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
           "rope_theta": c.rope_theta, "rope_parameters": {"rope_theta": c.rope_theta, "rope_type": "default"},
           "attention_bias": c.attention_bias, "mlp_bias": False, "hidden_act": c.hidden_act,
           "tie_word_embeddings": c.tie_word_embeddings, "bos_token_id": c.bos_token_id,
           "eos_token_id": c.eos_token_ids[0] if len(c.eos_token_ids) == 1 else c.eos_token_ids, "dtype": "float32"}
    if c.rope_scaling:
        cfg["rope_scaling"] = cfg["rope_parameters"] = {**c.rope_scaling, "rope_theta": c.rope_theta}
    return cfg


def write_tokenizer(loaded: LoadedModel, source: Path | None, out: Path) -> None:
    """The source folder's tokenizer files, or a GGUF's tokenizer as tokenizer.json + tokenizer_config.json."""
    if source is not None and source.is_dir():
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, out / name)
        return
    tok = loaded.tokenizer
    tok.backend.save(str(out / "tokenizer.json"))
    name = tok.backend.id_to_token
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": tok.add_bos, "model_max_length":
           loaded.config.max_position_embeddings}
    if tok.bos_token_id is not None:
        cfg["bos_token"] = name(tok.bos_token_id)
    if tok.eos_token_ids:
        cfg["eos_token"] = name(tok.eos_token_ids[0])
    if tok.chat_template:
        cfg["chat_template"] = tok.chat_template
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    gen = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_ids[0] if tok.eos_token_ids else None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2))


def write_folder(out: Path, loaded: LoadedModel, source: Path | None, weights: dict[str, torch.Tensor],
                 quantized: dict[str, Quantized], grid: Grid, w8a8: bool) -> None:
    """weights: every float tensor in HF naming (the quantized linears' float copies are left out)."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in weights.items()
               if k.removesuffix(".weight") not in quantized and k != "rope_freqs"}
    if loaded.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    for name, qz in quantized.items():
        tensors |= module_tensors(name, qz, w8a8)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = hf_config(loaded, source) | {"quantization_config": quantization_config(grid, w8a8)}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tokenizer(loaded, source, out)
