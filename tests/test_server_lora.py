"""LoRA adapters over HTTP (a real `pagedserve serve --enable-lora`, the official openai client): adapters given
at start-up and loaded at run time (by a signed peer), chosen by `model`, served together, listed in /v1/models,
unloaded; bad adapters are 4xx errors and the server keeps serving. tests/test_lora_hardening.py has the hostile
ones."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.conftest import hf_greedy
from tests.lora_support import LOAD, load_adapter, make_adapters, signed_post, unload_adapter
from tests.server_support import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
NUM_TOKENS = 12


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, hf_model):
    return make_adapters(hf_model, tmp_path_factory.mktemp("adapters"))


@pytest.fixture(scope="module")
def prompt(reference_prompts) -> list[int]:
    return reference_prompts[0]


@pytest.fixture(scope="module")
def expected(adapters, hf_model, prompt) -> dict[str, list[int]]:
    out = {MODEL: hf_greedy(hf_model, prompt, NUM_TOKENS)}
    out |= {name: hf_greedy(model, prompt, NUM_TOKENS) for name, (_, model) in adapters.items()}
    return out


@pytest.fixture(scope="module")
def server(adapters) -> str:
    srv = ServerProcess(["--dtype", "float32", "--kv-cache-memory", "32MiB", "--max-model-len", "1024",
                         "--enable-lora", "--max-loras", "2", "--lora-modules", f"attn8={adapters['attn8'][0]}",
                         f'{{"name": "mlp4", "path": "{adapters["mlp4"][0]}", "base_model_name": "{MODEL}"}}'])
    yield srv.url
    srv.stop()


def tokens_of(server: str, text: str) -> list[int]:
    return httpx.post(f"{server}/tokenize", json={"prompt": text}).json()["tokens"]


async def concurrent(server: str, prompt: list[int], models: list[str]) -> list[str]:
    client = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=300)
    replies = await asyncio.gather(*(client.completions.create(
        model=m, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0, extra_body={"min_tokens": NUM_TOKENS})
        for m in models))
    return [r.choices[0].text for r in replies]


def test_adapters_by_model_name_match_peft_and_run_together(server, adapters, expected, prompt):
    cards = {c["id"]: c for c in httpx.get(f"{server}/v1/models").json()["data"]}
    assert cards["attn8"]["parent"] == MODEL and cards["mlp4"]["root"] == str(adapters["mlp4"][0])
    assert cards[MODEL]["parent"] is None
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=300)
    texts = {}
    for model in (MODEL, "attn8", "mlp4"):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=NUM_TOKENS, temperature=0,
                                      extra_body={"min_tokens": NUM_TOKENS})
        assert r.model == model
        texts[model] = r.choices[0].text
        assert tokens_of(server, texts[model])[:4] == expected[model][:4]  # text round trips may re-split later
    decoded = {m: httpx.post(f"{server}/detokenize", json={"tokens": expected[m]}).json()["prompt"] for m in texts}
    assert texts == decoded  # each adapter's text is exactly peft's greedy continuation
    # Base and both adapters at once (over --max-loras 2 with the base, so some wait): the same texts.
    models = [MODEL, "attn8", "mlp4"] * 2
    assert asyncio.run(concurrent(server, prompt, models)) == [texts[m] for m in models]


def test_load_and_unload_at_run_time(server, adapters, expected, prompt):
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=300)
    r = load_adapter(server, "all16", adapters["all16"][0])
    assert r.status_code == 200, r.text
    assert "all16" in {c["id"] for c in httpx.get(f"{server}/v1/models").json()["data"]}
    r = client.completions.create(model="all16", prompt=prompt, max_tokens=NUM_TOKENS, temperature=0,
                                  extra_body={"min_tokens": NUM_TOKENS})
    assert r.choices[0].text == httpx.post(f"{server}/detokenize", json={"tokens": expected["all16"]}).json()["prompt"]
    assert load_adapter(server, "all16", adapters["all16"][0]).status_code == 400  # already served
    r = unload_adapter(server, "all16")
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="all16", prompt="hi", max_tokens=2)
    assert unload_adapter(server, "all16").status_code == 404


@pytest.mark.parametrize(("body", "status", "message"), [
    ({"lora_name": "wide", "lora_path": "/nonexistent/adapter"}, 400, "cannot read"),
    ({"lora_name": MODEL, "lora_path": "/x"}, 400, "already served"),
    ({"lora_name": "", "lora_path": "/x"}, 400, None),
    ({"lora_name": "x"}, 400, None),
])
def test_bad_loads_are_errors_and_the_server_keeps_serving(server, body, status, message):
    r = signed_post(server, LOAD, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and (message is None or message in error["message"])
    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)
    assert client.completions.create(model="attn8", prompt="Hello", max_tokens=2).choices[0].text is not None
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-adapter", prompt="Hello", max_tokens=2)
