"""Prompt logprobs over HTTP, as lm-eval's loglikelihood tasks and vLLM's clients ask for them: `echo` with
`logprobs` on /v1/completions (the prompt's tokens in the legacy layout, the first null; `max_tokens: 0` for the
prompt alone), vLLM's `prompt_logprobs` on both endpoints, and the tokenizer endpoints a remote tokenizer uses
(/tokenize with add_special_tokens and return_token_strs, /detokenize, /tokenizer_info). Logprobs are checked
against transformers on the same weights (fp32)."""
from __future__ import annotations

import httpx
import pytest
import torch

from tests.server_support import ServerProcess

TEXT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(["--dtype", "float32", "--kv-cache-memory", "32MiB", "--embedding-model", "none"])
    yield srv
    srv.stop()


def reference_logprobs(hf_model, ids: list[int]) -> list[float]:
    """log p(token i | tokens before it) for i >= 1, from transformers."""
    with torch.inference_mode():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    return [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(server, hf_model):
    ids = httpx.post(server.url + "/tokenize", json={"prompt": TEXT, "add_special_tokens": False}).json()["tokens"]
    body = {"prompt": [ids, ids[:5]], "max_tokens": 1, "logprobs": 2, "echo": True, "temperature": 0}
    answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    full, short = sorted(answer["choices"], key=lambda c: c["index"])
    logprobs = full["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) + 1  # the prompt's tokens, then the sampled one
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    expected = reference_logprobs(hf_model, ids)
    got = logprobs["token_logprobs"][1:len(ids)]
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < 1e-3
    for chosen, top in zip(got, logprobs["top_logprobs"][1:len(ids)], strict=True):
        assert len(top) == 2 and max(top.values()) >= chosen - 1e-6  # lm-eval's is_greedy reads exactly this
    assert full["text"].startswith(TEXT) and logprobs["text_offset"][:2] == [0, len(logprobs["tokens"][0])]
    assert short["logprobs"]["token_logprobs"][1:5] == pytest.approx(got[:4], abs=1e-4)


def test_max_tokens_zero_gives_the_prompt_alone(server):
    body = {"prompt": TEXT, "max_tokens": 0, "logprobs": 0, "echo": True}
    answer = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    choice = answer["choices"][0]
    assert choice["text"] == TEXT and answer["usage"]["completion_tokens"] == 0
    assert len(choice["logprobs"]["tokens"]) == answer["usage"]["prompt_tokens"]
    refused = httpx.post(server.url + "/v1/completions", json={"prompt": TEXT, "max_tokens": 0}, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "max_tokens"


def test_prompt_logprobs_on_both_endpoints(server, hf_model):
    completion = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "prompt": TEXT, "max_tokens": 1, "prompt_logprobs": 1}).json()["choices"][0]["prompt_logprobs"]
    ids = httpx.post(server.url + "/tokenize", json={"prompt": TEXT}).json()["tokens"]
    assert completion[0] is None and len(completion) == len(ids)
    for token_id, entry, expected in zip(ids[1:], completion[1:], reference_logprobs(hf_model, ids), strict=True):
        assert entry[str(token_id)]["logprob"] == pytest.approx(expected, abs=1e-3)
        assert 1 <= len(entry) <= 2 and min(e["rank"] for e in entry.values()) == 1
    chat = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "prompt_logprobs": 0}).json()
    rendered = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == rendered["count"]


def test_tokenizer_endpoints_answer_as_vllm_does(server):
    plain = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world", "add_special_tokens": False,
                                                       "return_token_strs": True}).json()
    assert plain["count"] == len(plain["tokens"]) == len(plain["token_strs"]) == 2
    assert httpx.post(server.url + "/detokenize", json={"tokens": plain["tokens"]}).json()["prompt"] == "Hello world"
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and "im_start" in info["chat_template"]
    assert info["model_max_length"] == plain["max_model_len"] and info["vocab_size"] > 49000
