"""Qwen3, Qwen3-MoE and Mixtral from GGUF files that llama.cpp's own converter (convert_hf_to_gguf.py, from the
llama-cpp-python sdist: `make llama-cpp`) writes from tiny random-weight transformers models: the family chosen
from `general.architecture` and the expert count, the experts split from llama.cpp's stacks, greedy output
token-identical to transformers in fp32, and Q8_0 experts run as stored."""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve import LLM
from pagedserve.sampling_params import SamplingParams
from tests.conftest import hf_greedy
from tests.test_model_qwen3_moe import ALIGNED, MODELS, tiny_model

# Converting runs llama.cpp's script in a subprocess per model (seconds each): behind make test-all.
pytestmark = pytest.mark.slow

LLAMA_CPP = Path(__file__).resolve().parents[1] / "build" / "peers" / "llama.cpp"
NUM_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
PROMPTS = ["Hello, world!", "The quick brown fox jumps over the lazy dog. " * 4, "1, 2, 3,", "Once upon a time"]
@pytest.fixture(scope="module")
def tokenizer_files() -> dict[str, str]:
    """SmolLM2's tokenizer, as our GGUF loader builds it: the converter checks a BPE's pre-tokenizer against the
    ones llama.cpp knows (this one is `smollm`), so a made-up byte tokenizer would not convert."""
    from pagedserve.model.loader import load_model

    tokenizer = load_model(None).tokenizer
    eos = tokenizer.backend.id_to_token(tokenizer.eos_token_ids[0])
    return {"tokenizer.json": tokenizer.backend.to_str(),
            "tokenizer_config.json": json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos})}


def convert(kind: str, seed: int, shape: dict, folder: Path, tokenizer_files: dict[str, str], outtype: str = "f32"):
    """The tiny model saved to folder, and the GGUF llama.cpp's converter makes of it."""
    if not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"no llama.cpp sources at {LLAMA_CPP} (make llama-cpp fetches them)")
    vocab = json.loads(tokenizer_files["tokenizer.json"])["model"]["vocab"]
    model = tiny_model(kind, seed, {**shape, "vocab_size": len(vocab), "eos_token_id": 2})
    model.save_pretrained(folder)
    for name, text in tokenizer_files.items():
        (folder / name).write_text(text)
    out = folder / f"model-{outtype}.gguf"
    env = {**os.environ, "PYTHONPATH": str(LLAMA_CPP / "gguf-py")}  # the converter's own gguf-py
    result = subprocess.run([sys.executable, str(LLAMA_CPP / "convert_hf_to_gguf.py"), str(folder), "--outtype",
                             outtype, "--outfile", str(out)], env=env, capture_output=True, text=True, timeout=600,
                            check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    return model, out


def greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]


# Not qwen3_moe-unnormalized: llama.cpp's converter refuses its dense layer, and its qwen3moe always renormalizes.
CASES = {name: MODELS[name] for name in ("qwen3", "qwen3-hd64", "qwen3_moe", "mixtral")}


@pytest.mark.parametrize("name", list(CASES))
def test_gguf_matches_transformers(name, tmp_path, tokenizer_files):
    kind, seed, shape = CASES[name]
    model, path = convert(kind, seed, shape, tmp_path, tokenizer_files)
    llm = LLM(str(path), dtype="float32", kv_cache_memory="8MiB")
    config = llm.engine.model_config
    assert config.family == kind
    assert config.num_experts == shape.get("num_experts", shape.get("num_local_experts", 0))
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    expected = [hf_greedy(model, p, NUM_TOKENS) for p in prompts]
    assert len({tuple(e) for e in expected}) == len(prompts)  # the weights say something
    assert greedy(llm, prompts) == expected


@pytest.mark.parametrize("name", list(ALIGNED))  # Q8_0 needs rows of whole 32-value blocks
def test_q8_0_experts_run_as_stored(name, tmp_path, tokenizer_files, quant_kernel):
    """--quantization gguf keeps each expert's Q8_0 blocks and runs the chosen experts' integer GEMMs: the tokens
    equal those of the same blocks dequantized in PyTorch and of the file loaded dequantized, and the prompts'
    logprobs stay close to transformers' on the float model the file was made from (Q8_0 rounding)."""
    from pagedserve.model.models.moe import SparseMoE

    kind, seed, shape = ALIGNED[name]
    model, path = convert(kind, seed, shape, tmp_path, tokenizer_files, "q8_0")
    stored = LLM(str(path), dtype="float32", kv_cache_memory="8MiB", quantization="gguf")
    moes = [m for m in stored.engine.runner.model.modules() if isinstance(m, SparseMoE)]
    assert moes and all(len(m.quantized) == m.num_experts and m.w13.numel() == 0 for m in moes)
    assert {w.source for m in moes for pair in m.quantized for w in pair} == {"Q8_0"}
    prompts = [stored.tokenizer.encode(p) for p in PROMPTS]
    got = greedy(stored, prompts)
    quant_kernel("torch")
    assert greedy(stored, prompts) == got
    quant_kernel(None)
    assert greedy(LLM(str(path), dtype="float32", kv_cache_memory="8MiB"), prompts) == got
    # Teacher-forced on the prompts, close to the float model (a misplaced expert is not).
    outs = stored.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    ours = [next(iter(lp.values())).logprob for o in outs for lp in o.prompt_logprobs[1:]]
    with torch.inference_mode():
        ref = [torch.log_softmax(model(torch.tensor([p])).logits[0, :-1].float(), -1)[range(len(p) - 1), p[1:]]
               for p in prompts]
    ref = torch.cat(ref).tolist()
    error = statistics.mean(abs(a - b) for a, b in zip(ours, ref, strict=True))
    assert error < 0.15 * statistics.pstdev(ref), (error, statistics.pstdev(ref))


def test_unsupported_gguf_architectures_are_named():
    from pagedserve.model.models import gguf_family

    assert gguf_family("llama").name == "llama" and gguf_family("llama", 8).name == "mixtral"
    assert gguf_family("qwen3moe", 128).name == "qwen3_moe"
    with pytest.raises(ValueError, match="'phi3'.*qwen3moe"):
        gguf_family("phi3")
    with pytest.raises(ValueError, match="'qwen3' with 4 experts"):
        gguf_family("qwen3", 4)


def test_a_tensor_of_the_wrong_rank_is_named(tmp_path, tokenizer_files):
    """A 3-D tensor where a matrix belongs (or an expert stack of 2 dimensions) is refused, naming it."""
    import gguf
    import numpy as np

    from pagedserve.model.loader import load_model

    _, path = convert(*MODELS["qwen3"], tmp_path, tokenizer_files)
    reader = gguf.GGUFReader(str(path))
    writer = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "qwen3")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        writer.add_key_value(field.name, field.contents(), field.types[0],
                             field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        data = np.asarray(t.data)
        if t.name == "blk.0.attn_q.weight":
            data = np.stack([data, data])
        writer.add_tensor(t.name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="blk.0.attn_q.weight.*at most 2 dimensions"):
        load_model(str(tmp_path / "bad.gguf"))
