"""Loading a Hugging Face safetensors folder (config.json, *.safetensors, tokenizer.json) for architectures
other than the default SmolLM GGUF: tiny randomly initialised Llama and Qwen2 models saved with transformers'
own save_pretrained, whose greedy output must be token-identical to transformers' in fp32."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from pagedserve import LLM
from pagedserve.model.loader import load_model
from pagedserve.sampling_params import SamplingParams
from tests.conftest import hf_greedy

NUM_TOKENS = 16
EOS = 256  # after the 256 byte tokens
PROMPTS = ["Hello, world!", "The quick brown fox jumps over the lazy dog. " * 3, "1, 2, 3,"]


def byte_tokenizer(folder: Path) -> None:
    """A byte-level tokenizer (one token per byte, no merges) and an end-of-sequence token: vocab 257."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(["<eos>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>", "add_bos_token": False}))


def tiny_model(kind: str):
    """Random weights far from transformers' init (std 0.02, zero biases, unit norms), so that a weight
    loaded into the wrong place, a missing bias or a wrong RoPE base changes the argmax."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    shape = {"vocab_size": EOS + 1, "intermediate_size": 128, "num_hidden_layers": 2, "max_position_embeddings": 256,
             "rms_norm_eps": 1e-6, "bos_token_id": None, "eos_token_id": EOS}
    if kind == "llama":  # Llama 3 style: a large RoPE base, tied embeddings; head_dim 64 (the C++ kernels)
        model = LlamaForCausalLM(LlamaConfig(**shape, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                                             rope_theta=500000.0, tie_word_embeddings=True))
    else:  # Qwen2: q/k/v biases, its own RoPE base, a separate lm_head; head_dim 16 (the PyTorch path)
        model = Qwen2ForCausalLM(Qwen2Config(**shape, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                             rope_theta=1000000.0, tie_word_embeddings=False))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.3 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def folder_and_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    model = tiny_model(request.param)
    model.save_pretrained(folder)
    byte_tokenizer(folder)
    return request.param, folder, model


def test_hf_folder_is_read_as_transformers_saved_it(folder_and_model):
    kind, folder, model = folder_and_model
    assert list(folder.glob("*.safetensors")) and not list(folder.glob("*.gguf"))
    loaded = load_model(str(folder))
    hf = model.config
    assert loaded.config.architecture == kind
    assert loaded.config.rope_theta == hf.rope_parameters["rope_theta"]  # transformers 5 nests it there
    assert loaded.config.attention_bias == (kind == "qwen2")
    assert loaded.config.tie_word_embeddings == (kind == "llama")
    assert loaded.config.eos_token_ids == [EOS]
    assert len(loaded.tokenizer.encode("Hi!")) == 3  # one token per byte
    assert loaded.tokenizer.decode(loaded.tokenizer.encode("naïve café")) == "naïve café"


def test_greedy_matches_transformers_token_for_token(folder_and_model):
    _, folder, model = folder_and_model
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="4MiB")
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    expected = [hf_greedy(model, p, NUM_TOKENS) for p in prompts]
    assert len({tuple(e) for e in expected}) == len(prompts)  # the weights say something: not one token repeated
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS))
    assert [o.outputs[0].token_ids for o in outs] == expected
    # A text prompt goes through the folder's tokenizer to the same tokens.
    text = llm.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS))[0]
    assert text.prompt_token_ids == prompts[0] and text.outputs[0].token_ids == expected[0]


def test_rope_keys_of_older_and_newer_configs_mean_the_same():
    from pagedserve.model.layers import RotaryEmbedding
    from pagedserve.model.model_config import ModelConfig

    base = {"vocab_size": 10, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
            "num_attention_heads": 1, "max_position_embeddings": 64}
    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 16}
    older = ModelConfig.from_hf({**base, "rope_theta": 500000.0, "rope_scaling": llama3}, "m")
    newer = ModelConfig.from_hf({**base, "rope_parameters": {"rope_theta": 500000.0, **llama3}}, "m")
    plain = ModelConfig.from_hf({**base, "rope_parameters": {"rope_theta": 500000.0, "rope_type": "default"}}, "m")
    assert older.rope_theta == newer.rope_theta == plain.rope_theta == 500000.0 and plain.rope_scaling is None
    torch.testing.assert_close(RotaryEmbedding(older).cos, RotaryEmbedding(newer).cos, rtol=0, atol=0)
    assert not torch.equal(RotaryEmbedding(newer).cos, RotaryEmbedding(plain).cos)  # the scaling was applied
