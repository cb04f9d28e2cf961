"""LoRA adapters against transformers + peft (fp32, greedy, token for token): adapters of different ranks,
targets and scalings made here with peft, served together with the base model in one batch."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagedserve import LLM, LoRARequest
from pagedserve.sampling_params import SamplingParams
from tests.conftest import hf_greedy
from tests.lora_support import ADAPTERS, lora, make_adapters, write_adapter

NUM_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NUM_TOKENS, min_tokens=NUM_TOKENS)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, hf_model) -> dict[str, tuple[Path, object]]:
    return make_adapters(hf_model, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def prompts(reference_prompts) -> list[list[int]]:
    return reference_prompts[:3]


@pytest.fixture(scope="module")
def expected(adapters, hf_model, prompts) -> dict[str | None, list[list[int]]]:
    out = {None: [hf_greedy(hf_model, p, NUM_TOKENS) for p in prompts]}
    for name, (_, model) in adapters.items():
        out[name] = [hf_greedy(model, p, NUM_TOKENS) for p in prompts]
    return out


def run(llm: LLM, prompts, loras) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, lora_request=loras)
    return [o.outputs[0].token_ids for o in outs]


def test_adapters_change_the_output(expected):
    """Otherwise the token-identity tests below would prove nothing."""
    for name in ADAPTERS:
        assert expected[name] != expected[None], name


def test_three_adapters_and_the_base_model_in_one_batch_match_peft(adapters, expected, prompts):
    llm = LLM(dtype="float32", kv_cache_memory="32MiB", enable_lora=True)
    names = [None, *ADAPTERS]
    jobs = [(p, n) for n in names for p in range(len(prompts))]
    got = run(llm, [prompts[p] for p, _ in jobs], [lora(adapters, n) if n else None for _, n in jobs])
    for (p, n), tokens in zip(jobs, got, strict=True):
        assert tokens == expected[n][p], (n, p)
    # Again, now largely from the prefix cache: each adapter hits only its own blocks.
    before = llm.engine.stats().prefix_cache_hit_tokens
    again = run(llm, [prompts[p] for p, _ in jobs], [lora(adapters, n) if n else None for _, n in jobs])
    assert again == got
    assert llm.engine.stats().prefix_cache_hit_tokens > before


def test_reload_under_the_same_name_never_reuses_the_old_kv(adapters, expected, prompts):
    llm = LLM(dtype="float32", kv_cache_memory="32MiB", enable_lora=True)
    assert run(llm, prompts, lora(adapters, "attn8")) == expected["attn8"]
    assert llm.engine.loras.unload("attn8")
    # Another adapter's weights under the old name (a new version of a fine-tune): its own outputs, no stale KV.
    assert run(llm, prompts, lora(adapters, "mlp4", int_id=7, as_name="attn8")) == expected["mlp4"]
    assert run(llm, prompts, lora(adapters, "attn8", int_id=8)) == expected["attn8"]


def test_max_loras_one_still_serves_every_adapter(adapters, expected, prompts):
    llm = LLM(dtype="float32", kv_cache_memory="32MiB", enable_lora=True, max_loras=1)
    names = list(ADAPTERS) * 2
    got = run(llm, [prompts[0]] * len(names), [lora(adapters, n) for n in names])
    assert got == [expected[n][0] for n in names]


def test_bf16_path_stays_close(adapters, prompts):
    """bf16 with the fused kernels: the adapter's effect is there (agreement with fp32 for the first tokens)."""
    fp32 = LLM(dtype="float32", kv_cache_memory="32MiB", enable_lora=True)
    bf16 = LLM(dtype="bfloat16", kv_cache_memory="32MiB", enable_lora=True)
    request = lora(adapters, "all16")
    a, b = run(fp32, prompts, request), run(bf16, prompts, request)
    assert sum(x[:4] == y[:4] for x, y in zip(a, b)) >= 2


def test_bad_adapters_are_refused_with_the_reason(tmp_path, adapters):
    llm = LLM(dtype="float32", kv_cache_memory="16MiB", enable_lora=True, max_lora_rank=8)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_{}.weight"
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8}
    cases = {
        "rank 16, over --max-lora-rank 8": (str(adapters["all16"][0]), "over --max-lora-rank"),
        "another base model": (str(write_adapter(tmp_path / "wide", cfg, {key.format("A"): torch.zeros(4, 1024),
                                                                         key.format("B"): torch.zeros(576, 4)})),
                               "another base model"),
        "corrupt file": (str(tmp_path / "corrupt"), "cannot read adapter_model.safetensors"),
        "no folder": (str(tmp_path / "missing"), "cannot read"),
        "lora_B missing": (str(write_adapter(tmp_path / "half", cfg, {key.format("A"): torch.zeros(4, 576)})), "lacks"),
    }
    (tmp_path / "corrupt").mkdir()
    (tmp_path / "corrupt" / "adapter_config.json").write_text(json.dumps(cfg))
    (tmp_path / "corrupt" / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    for i, (what, (path, message)) in enumerate(cases.items()):
        with pytest.raises(ValueError, match=message):
            llm.generate("Hello", GREEDY, lora_request=LoRARequest(f"bad{i}", i + 1, path))
        assert "bad" not in "".join(llm.engine.loras.adapters), what
    assert llm.generate("Hello", GREEDY)[0].outputs[0].token_ids  # the engine still serves
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(dtype="float32", kv_cache_memory="16MiB").generate("Hi", GREEDY, lora_request=lora(adapters, "attn8"))


@pytest.mark.parametrize("path", ["kernel", "torch"])
def test_slots_apply_each_adapter_to_its_rows_only(path, monkeypatch):
    """The batched kernel (and its PyTorch fallback) against one matmul pair per adapter: ranks padded to the largest slotted one,
    projections an adapter lacks left alone, slots refilled least recently used first, a reload with other
    weights under the same name written afresh rather than read from the old slot."""
    from types import SimpleNamespace

    from pagedserve.model.lora import LoRAAdapter, LoRASlots, LoRAWeights, fused_shapes

    if path == "torch":
        monkeypatch.setattr("pagedserve.model.lora.cpu_kernels", lambda: None)
    torch.manual_seed(0)
    config = SimpleNamespace(hidden_size=32, intermediate_size=48, q_size=32, kv_size=16, num_hidden_layers=2)
    shapes = fused_shapes(config)

    def adapter(name: str, rank: int, modules: tuple[str, ...]) -> LoRAAdapter:
        layers = [{m: LoRAWeights(torch.randn(rank, shapes[m][0]), torch.randn(shapes[m][1], rank)) for m in modules}
                  for _ in range(2)]
        return LoRAAdapter(name, 1, "", rank, layers)

    slots = LoRASlots(config, num_slots=2, dtype=torch.float32)
    steps = [[adapter("a", 4, ("qkv_proj", "down_proj")), adapter("b", 12, ("qkv_proj",))],
             [adapter("c", 2, ("o_proj", "qkv_proj"))]]
    steps[1].append(steps[0][0])  # "a" again beside a newcomer: "b" is the one evicted
    steps.append([adapter("a", 4, ("qkv_proj",)), steps[0][0]])  # a reload of "a" (other weights) and the old load
    for step in steps:
        rows = [[range(518), range(527, 528)], [range(518, 523)]][:len(step)]  # a GEMM-sized segment, short ones
        batch = slots.batch(list(zip(step, rows)))
        for module, (fan_in, fan_out) in shapes.items():
            x, y = torch.randn(530, fan_in), torch.randn(530, fan_out)
            expected = y.clone()
            for ad, ranges in zip(step, rows):
                w = ad.layers[1].get(module)
                for r in ranges:
                    if w is not None:
                        expected[r.start:r.stop] += x[r.start:r.stop] @ w.a.T @ w.b.T
            batch.add(y, x, 1, module)
            torch.testing.assert_close(y, expected)
    assert slots.a["qkv_proj"].shape[2] == 12 and len(slots.slot_of) == 2
