"""Qwen3 (dense, QK-norm) and the mixture-of-experts families (Qwen3-MoE, Mixtral): tiny random-weight models that
transformers writes from a config (several seeds, odd sizes), greedy output token-identical to transformers in
fp32 across chunked prefill, prefix hits, preemption and mixed batches; expert load in the engine's stats and
/metrics; every other feature checked or refused by name."""
from __future__ import annotations

import copy
import statistics

import pytest
import torch

from pagedserve import LLM
from pagedserve.sampling_params import GuidedDecodingParams, SamplingParams
from tests.conftest import hf_greedy
from tests.test_hf_folder import EOS, byte_tokenizer

NUM_TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)
PROMPTS = ["Hello, world!", "The quick brown fox jumps over the lazy dog. " * 4, "1, 2, 3,", "Once upon a time"]

# (kind, seed, config): odd hidden and expert sizes (unaligned for _grouped_mm: padded at load), head_dim 16
# (the PyTorch attention path) or 64 (the C++ kernels), both routing normalizations, dense layers among sparse ones.
MODELS = {
    "qwen3": ("qwen3", 0, {"hidden_size": 72, "intermediate_size": 100, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "head_dim": 16}),
    "qwen3-hd64": ("qwen3", 1, {"hidden_size": 96, "intermediate_size": 64, "num_attention_heads": 2,
                                "num_key_value_heads": 1, "head_dim": 64}),
    "qwen3_moe": ("qwen3_moe", 2, {"hidden_size": 60, "intermediate_size": 88, "moe_intermediate_size": 36,
                                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                   "num_experts": 7, "num_experts_per_tok": 2, "norm_topk_prob": True}),
    "qwen3_moe-unnormalized": ("qwen3_moe", 3, {"hidden_size": 48, "intermediate_size": 40,
                                                "moe_intermediate_size": 20, "num_attention_heads": 2,
                                                "num_key_value_heads": 1, "head_dim": 24, "num_experts": 5,
                                                "num_experts_per_tok": 3, "norm_topk_prob": False,
                                                "mlp_only_layers": [0], "num_hidden_layers": 3}),
    "mixtral": ("mixtral", 4, {"hidden_size": 68, "intermediate_size": 52, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "head_dim": 18, "num_local_experts": 6,
                               "num_experts_per_tok": 2}),
}


def tiny_model(kind: str, seed: int, shape: dict):
    """Random weights far from transformers' init (as tests/test_hf_folder.py), so a misplaced weight, a wrong
    norm or routing changes the argmax."""
    import transformers

    cls = {"qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral"}[kind]
    base = {"vocab_size": EOS + 1, "num_hidden_layers": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
            "bos_token_id": None, "eos_token_id": EOS, "tie_word_embeddings": False, "rope_theta": 1000000.0}
    config = getattr(transformers, f"{cls}Config")(**{**base, **shape})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{cls}ForCausalLM")(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight") else 0.3 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module", params=list(MODELS))
def family_model(request, tmp_path_factory):
    kind, seed, shape = MODELS[request.param]
    folder = tmp_path_factory.mktemp(request.param)
    llm, prompts, expected = served(kind, seed, shape, folder)
    assert len({tuple(e) for e in expected}) == len(prompts)  # the weights say something
    return kind, folder, llm, prompts, expected


def served(kind: str, seed: int, shape: dict, folder) -> tuple[LLM, list[list[int]], list[list[int]]]:
    """The tiny model written to folder, our fp32 LLM on it, the prompts' ids and transformers' greedy tokens."""
    model = tiny_model(kind, seed, shape)
    model.save_pretrained(folder)
    byte_tokenizer(folder)
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="4MiB")
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    return llm, prompts, [hf_greedy(model, p, NUM_TOKENS) for p in prompts]


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_family_is_chosen_from_config(family_model):
    kind, _, llm, _, _ = family_model
    assert llm.engine.family.name == kind
    assert type(llm.engine.runner.model).__name__ == {"qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                                                      "mixtral": "MixtralForCausalLM"}[kind]


def test_greedy_matches_transformers_in_every_regime(family_model):
    _, folder, llm, prompts, expected = family_model
    assert run(llm, prompts) == expected  # a mixed batch: prefills of several lengths, then decodes together
    before = llm.engine.stats().prefix_cache_hit_tokens
    assert run(llm, prompts) == expected  # again, from the prefix cache
    assert llm.engine.stats().prefix_cache_hit_tokens > before
    chunked = LLM(str(folder), dtype="float32", kv_cache_memory="4MiB", max_num_batched_tokens=24)
    assert run(chunked, prompts) == expected
    torch_attention = LLM(str(folder), dtype="float32", kv_cache_memory="4MiB", attention_backend="torch",
                          enable_prefix_caching=False)
    assert run(torch_attention, prompts) == expected


def test_preemption_keeps_output_identical(family_model):
    _, folder, llm, prompts, expected = family_model
    per_block = llm.engine.runner.bytes_per_block(llm.engine.model_config, llm.engine.kv_format, 16)
    longest = -(-(max(len(p) for p in prompts) + NUM_TOKENS) // 16)
    small = LLM(str(folder), dtype="float32", kv_cache_memory=str((longest + 3) * per_block))
    assert run(small, prompts) == expected
    assert small.engine.stats().num_preemptions > 0


def test_kv_cache_dtypes_and_structured_output_run(family_model):
    _, folder, _, prompts, _ = family_model
    for dtype in ("int8", "fp8", "int4"):
        llm = LLM(str(folder), dtype="float32", kv_cache_memory="4MiB", kv_cache_dtype=dtype)
        outs = run(llm, prompts[:2])
        assert all(len(o) == NUM_TOKENS for o in outs)
    choice = SamplingParams(temperature=0, max_tokens=8, guided_decoding=GuidedDecodingParams(choice=["yes", "no"]))
    out = llm.generate(PROMPTS[0], choice)[0].outputs[0].text
    assert out in ("yes", "no")


def test_bfloat16_runs_the_fused_ops(family_model):
    """bf16 on CPU: prepacked linears and the fused C++ norms, RoPE and KV writes (QK-norm applied in place
    before them); the experts' grouped GEMM in bf16."""
    _, folder, _, prompts, expected = family_model
    llm = LLM(str(folder), dtype="bfloat16", kv_cache_memory="4MiB")
    assert sum(o[:2] == e[:2] for o, e in zip(run(llm, prompts), expected)) >= 3


def test_forks_share_blocks(family_model):
    _, _, llm, prompts, expected = family_model
    out = llm.generate({"prompt_token_ids": prompts[1]}, SamplingParams(temperature=0, n=3, max_tokens=NUM_TOKENS,
                                                                        min_tokens=NUM_TOKENS))[0]
    assert [o.token_ids for o in out.outputs] == [expected[1]] * 3


def test_expert_load_is_counted_and_exported(family_model):
    kind, _, llm, prompts, _ = family_model
    stats = llm.engine.stats()
    if kind == "qwen3":
        assert stats.expert_tokens == []
        return
    from pagedserve.server.metrics import EngineStatsCollector

    config = llm.engine.model_config
    assert len(stats.expert_tokens) == config.num_experts
    sparse = sum(config.is_sparse_layer(i) for i in range(config.num_hidden_layers))
    before = sum(stats.expert_tokens)
    run(llm, prompts[:1])
    routed = sum(llm.engine.stats().expert_tokens) - before
    assert routed == sparse * config.num_experts_per_tok * (len(prompts[0]) + NUM_TOKENS - 1)
    text = "\n".join(str(m) for m in EngineStatsCollector(llm.engine.stats, "m").collect())
    assert "pagedserve_moe_expert_tokens" in text and "pagedserve_moe_expert_load_imbalance" in text


def test_moe_refuses_what_it_cannot_do(family_model):
    kind, folder, _, _, _ = family_model
    if kind == "qwen3":
        pytest.skip("dense: int8 weights are checked in tests/test_model_gemma3.py")
    with pytest.raises(ValueError, match="needs K divisible by 32"):  # these odd sizes: int8 refused by name
        LLM(str(folder), dtype="float32", kv_cache_memory="4MiB", quantization="int8")


def test_lora_on_attention_and_dense_layers_matches_peft(family_model, tmp_path):
    """peft adapters on every family (the MLP too on dense Qwen3): greedy tokens equal peft's own in fp32, two
    adapters in one batch. An adapter on the experts (peft's target_parameters on the fused expert stacks) is
    refused, saying so."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from pagedserve import LoRARequest
    from tests.lora_support import write_adapter

    kind, folder, _, prompts, _ = family_model
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    # peft turns gate/up/down targets on a mixture of experts into adapters on its experts (refused below), even
    # on its dense layers: the MoE families' adapters here are on the attention projections.
    mlp = "|mlp\\.(gate|up|down)_proj" if kind == "qwen3" else ""
    targets = {"attn": (8, r".*self_attn\.(q|k|v|o)_proj"), "mixed": (4, rf".*(self_attn\.(q|v)_proj{mlp})")}
    requests, reference = [], []
    for i, (name, (rank, target)) in enumerate(targets.items()):
        torch.manual_seed(50 + i)
        peft = get_peft_model(copy.deepcopy(base), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=target,
                                                               init_lora_weights=False)).eval()
        with torch.no_grad():  # a fine-tune's size of delta, not nn.Linear's init
            for n, p in peft.named_parameters():
                if "lora_B" in n:
                    p.mul_(0.25)
        peft.save_pretrained(tmp_path / name)
        requests.append(LoRARequest(name, i + 1, str(tmp_path / name)))
        reference.append([hf_greedy(peft, p, NUM_TOKENS) for p in prompts])
    llm = LLM(str(folder), dtype="float32", kv_cache_memory="4MiB", enable_lora=True, max_loras=2)
    mixed = [requests[i % 2] for i in range(len(prompts))]  # both adapters in one batch
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=mixed)
    assert [o.outputs[0].token_ids for o in outs] == [reference[i % 2][i] for i in range(len(prompts))]
    assert reference[0] != reference[1]  # the adapters change the output
    if kind == "qwen3":
        return
    torch.manual_seed(60)
    experts = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, target_modules=[], init_lora_weights=False,
                                                             target_parameters=["gate_up_proj", "down_proj"]))
    experts.save_pretrained(tmp_path / "experts")
    with pytest.raises(ValueError, match="experts"):
        llm.generate(PROMPTS[0], GREEDY, lora_request=LoRARequest("experts", 3, str(tmp_path / "experts")))
    # Hand-written: per-expert modules (older peft's names), and a gate_proj on a layer that has only experts.
    cfg, sparse = llm.engine.model_config, 1
    h, i, r = cfg.hidden_size, cfg.moe_intermediate_size, 4
    per_expert = {f"base_model.model.model.layers.{sparse}.mlp.experts.0.gate_proj.lora_{x}.weight": t
                  for x, t in (("A", torch.zeros(r, h)), ("B", torch.zeros(i, r)))}
    on_sparse = {f"base_model.model.model.layers.{sparse}.mlp.gate_proj.lora_{x}.weight": t
                 for x, t in (("A", torch.zeros(r, h)), ("B", torch.zeros(cfg.intermediate_size, r)))}
    config = {"peft_type": "LORA", "r": r, "lora_alpha": 8, "target_modules": ["gate_proj"]}
    for n, (tensors, message) in enumerate(((per_expert, "adapts a mixture of experts' experts"),
                                            (on_sparse, f"layer {sparse} is a mixture of experts"))):
        folder = write_adapter(tmp_path / f"hand{n}", config, tensors)
        with pytest.raises(ValueError, match=message):
            llm.generate(PROMPTS[0], GREEDY, lora_request=LoRARequest(f"hand{n}", 4 + n, str(folder)))


# Sizes the int8 / int4 kernels take (K a multiple of 32 in every projection, the experts' too).
ALIGNED = {
    "qwen3_moe": ("qwen3_moe", 5, {"hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
                                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                   "num_experts": 6, "num_experts_per_tok": 2, "norm_topk_prob": True}),
    "mixtral": ("mixtral", 6, {"hidden_size": 96, "intermediate_size": 64, "num_attention_heads": 4,
                               "num_key_value_heads": 2, "head_dim": 24, "num_local_experts": 5,
                               "num_experts_per_tok": 2}),
}


@pytest.mark.parametrize("name", list(ALIGNED))
def test_quantized_experts_run_their_own_gemms(name, tmp_path, quant_kernel):
    """--quantization int8 / int4 on a mixture of experts: the experts are quantized like the dense projections (the
    routers stay float) and each chosen expert runs its quantized GEMMs. The kernels' tokens equal the same
    quantized weights run dequantized in PyTorch (fp32), int8 stays close to the float model, and the resident
    weights shrink."""
    from pagedserve.model.linear import Linear
    from pagedserve.model.models.moe import SparseMoE

    float_llm, prompts, expected = served(*ALIGNED[name], tmp_path)
    assert run(float_llm, prompts) == expected
    for mode in ("int8", "int4"):
        llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory="4MiB", quantization=mode)
        moes = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]
        assert moes and all(len(m.quantized) == m.num_experts and m.w13.numel() == 0 for m in moes)
        assert all(type(m.gate) is Linear for m in moes)  # the router stays float
        assert llm.engine.weight_bytes < float_llm.engine.weight_bytes / (2.5 if mode == "int8" else 3)
        got = run(llm, prompts)
        quant_kernel("torch")
        assert run(llm, prompts) == got  # the same quantized weights, dequantized in PyTorch
        quant_kernel(None)
        if mode == "int8":  # teacher-forced on the prompts: close to the float model (a misplaced expert is not)
            ours, ref = prompt_logprobs(llm), prompt_logprobs(float_llm)
            error = statistics.mean(abs(a - b) for a, b in zip(ours, ref, strict=True))
            assert error < 0.15 * statistics.pstdev(ref), (error, statistics.pstdev(ref))


def prompt_logprobs(llm: LLM) -> list[float]:
    """Each prompt token's logprob under the model, all prompts in turn."""
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    return [next(iter(lp.values())).logprob for o in outs for lp in o.prompt_logprobs[1:]]


def test_dense_qwen3_quantizes_at_load(family_model):
    kind, folder, llm, prompts, _ = family_model
    if kind != "qwen3" or llm.engine.model_config.hidden_size % 32:
        pytest.skip("int8 and int4 need K divisible by 32")
    for mode in ("int8", "int4"):
        quantized = LLM(str(folder), dtype="float32", kv_cache_memory="4MiB", quantization=mode)
        assert all(len(o) == NUM_TOKENS for o in run(quantized, prompts[:2]))


def test_unsupported_architecture_is_named(tmp_path):
    import json

    from pagedserve.model.loader import load_model

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["FalconForCausalLM"], "model_type": "falcon"}))
    with pytest.raises(ValueError, match="unsupported model architecture 'FalconForCausalLM'; supported: .*"
                                         "Gemma3ForCausalLM.*Qwen3MoeForCausalLM.*MixtralForCausalLM"):
        load_model(str(tmp_path))
