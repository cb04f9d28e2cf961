"""OpenAI's request fields as its own SDK and common clients send them: every field of the SDK's Chat Completions
and Completions request types is accepted (the list is read from the SDK, so a field a new SDK adds fails here
until it is handled), `null` means the default, the SDK's returned messages go back as they are, a typo is a
400 naming it; `logit_bias` steers greedy decoding; `stream_options.continuous_usage_stats` puts the usage in
every chunk, in the request shape guidellm sends."""
from __future__ import annotations

import asyncio
import dataclasses
import typing

import httpx
import openai
import pytest
import torch
from guidellm.backends.openai.request_handlers import (
    ChatCompletionsRequestHandler,
    TextCompletionsRequestHandler,
)
from guidellm.schemas import GenerationRequest
from guidellm.schemas.base.request import UsageMetrics
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params

from pagedserve import LLM
from pagedserve.engine.request import Request
from pagedserve.engine.sampler import SamplingBatch, sample
from pagedserve.sampling_params import SamplingParams
from pagedserve.server.protocol import ChatCompletionRequest, ignored_fields
from tests.server_support import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
USER = {"role": "user", "content": "Name a fruit."}
PROMPT = "The capital of France is"
WEATHER = {"name": "get_weather", "description": "the weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
TOOLS = [{"type": "function", "function": WEATHER}]

# Each field of the SDK's request types with a plausible value (plus the fields it needs beside it).
CHAT_FIELDS: dict[str, dict] = {
    "messages": {}, "model": {},
    "audio": {"audio": {"format": "wav", "voice": "alloy"}},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "function_call": {"functions": [WEATHER], "function_call": {"name": "get_weather"}},
    "functions": {"functions": [WEATHER]},
    "logit_bias": {"logit_bias": {"198": -5}},
    "logprobs": {"logprobs": True},
    "max_completion_tokens": {"max_completion_tokens": 1},
    "max_tokens": {"max_tokens": 1},
    "metadata": {"metadata": {"run": "fields-test"}},
    "modalities": {"modalities": ["text"]},
    "moderation": {"moderation": {"model": "omni-moderation-latest", "policy": {"input": {"mode": "score"}}}},
    "n": {"n": 2},
    "parallel_tool_calls": {"tools": TOOLS, "parallel_tool_calls": False},
    "prediction": {"prediction": {"type": "content", "content": "Apple"}},
    "presence_penalty": {"presence_penalty": 0.5},
    "prompt_cache_key": {"prompt_cache_key": "user-42"},
    "prompt_cache_options": {"prompt_cache_options": {"mode": "implicit", "ttl": "30m"}},
    "prompt_cache_retention": {"prompt_cache_retention": "24h"},
    "reasoning_effort": {"reasoning_effort": "low"},
    "response_format": {"response_format": {"type": "text"}},
    "safety_identifier": {"safety_identifier": "5f2b"},
    "seed": {"seed": 7},
    "service_tier": {"service_tier": "auto"},
    "stop": {"stop": ["\n\n"]},
    "store": {"store": False},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}},
    "temperature": {"temperature": 0.5},
    "tool_choice": {"tools": TOOLS, "tool_choice": "auto"},
    "tools": {"tools": TOOLS},
    "top_logprobs": {"logprobs": True, "top_logprobs": 2},
    "top_p": {"top_p": 0.9},
    "user": {"user": "user-42"},
    "verbosity": {"verbosity": "low"},
    "web_search_options": {"web_search_options": {"search_context_size": "low"}},
}
COMPLETION_FIELDS: dict[str, dict] = {
    "model": {}, "prompt": {},
    "best_of": {"best_of": 2},
    "echo": {"echo": True},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "logit_bias": {"logit_bias": {"198": -5}},
    "logprobs": {"logprobs": 2},
    "max_tokens": {"max_tokens": 1},
    "n": {"n": 2},
    "presence_penalty": {"presence_penalty": 0.5},
    "seed": {"seed": 7},
    "stop": {"stop": "\n"},
    "stream": {"stream": True},
    "stream_options": {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": True}},
    "suffix": {"suffix": ""},  # fill-in-the-middle: refused unless empty (test_suffix_is_refused_by_name)
    "temperature": {"temperature": 0.5},
    "top_p": {"top_p": 0.9},
    "user": {"user": "user-42"},
}


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess(["--dtype", "float32", "--kv-cache-memory", "32MiB", "--max-model-len", "1024",
                         "--embedding-model", "none"])
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def sdk_fields(params: type) -> set[str]:
    return set(params.__required_keys__ | params.__optional_keys__)


def nullable_fields(params: type) -> list[str]:
    """The fields the SDK types as Optional: OpenAI takes null for them."""
    hints = typing.get_type_hints(params)
    return sorted(name for name, hint in hints.items() if name not in params.__required_keys__
                  and type(None) in typing.get_args(hint))


def create(call, body: dict):
    """One SDK call; a stream is read to its end (its errors surface there)."""
    result = call(**body)
    return list(result) if isinstance(result, openai.Stream) else result


# ---- every documented field ----

@pytest.mark.parametrize(("params", "table"), [(chat_create_params.CompletionCreateParamsStreaming, CHAT_FIELDS),
                                               (completion_create_params.CompletionCreateParamsStreaming,
                                                COMPLETION_FIELDS)], ids=["chat", "completions"])
def test_the_table_covers_every_field_of_the_sdk(params, table):
    missing = sdk_fields(params) - set(table)
    assert not missing, f"the SDK documents fields this test (and the server) has not decided on: {missing}"


def test_every_documented_chat_field_is_accepted(client):
    for field, extra in CHAT_FIELDS.items():
        body = {"model": MODEL, "messages": [USER], "max_completion_tokens": 1, **extra}
        try:
            create(client.chat.completions.create, body)
        except openai.APIStatusError as exc:
            pytest.fail(f"{field}: {exc.status_code} {exc.body}")


def test_every_documented_completion_field_is_accepted(client):
    for field, extra in COMPLETION_FIELDS.items():
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, **extra}
        try:
            create(client.completions.create, body)
        except openai.APIStatusError as exc:
            pytest.fail(f"{field}: {exc.status_code} {exc.body}")


def test_null_means_the_default_wherever_openai_takes_it(server):
    chat = dict.fromkeys(nullable_fields(chat_create_params.CompletionCreateParamsStreaming))
    assert {"n", "stop", "temperature", "top_p", "seed", "stream_options", "logit_bias", "store"} <= set(chat)
    answer = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                        json={**chat, "model": MODEL, "messages": [USER], "max_completion_tokens": 2})
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"]) == 1 and answer.json()["usage"]["completion_tokens"] == 2
    # max_tokens: null asks for the rest of the context (vLLM's meaning), a long wait here: it is given.
    legacy = dict.fromkeys(nullable_fields(completion_create_params.CompletionCreateParamsStreaming))
    legacy |= {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    answer = httpx.post(f"{server.url}/v1/completions", json=legacy, timeout=60)
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["choices"]) == 1 and answer.json()["choices"][0]["logprobs"] is None
    vllm = {"top_k": None, "min_p": None, "repetition_penalty": None, "ignore_eos": None, "min_tokens": None}
    answer = httpx.post(f"{server.url}/v1/completions", json={**vllm, "prompt": PROMPT, "max_tokens": 2}, timeout=60)
    assert answer.status_code == 200, answer.text


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [USER], "temprature": 0.5}, "temprature"),
    ("/v1/chat/completions", {"messages": [USER], "stream": True,
                              "stream_options": {"continuous_usage_stat": True}}, "stream_options.continuous_usage_stat"),
    ("/v1/chat/completions", {"messages": [{**USER, "refusel": "no"}]}, "messages.0.refusel"),
    ("/v1/completions", {"prompt": PROMPT, "store": True}, "store"),  # a chat field, not a completions one
], ids=["top-level", "stream_options", "message", "other-endpoint"])
def test_an_unknown_field_is_a_400_naming_it(server, path, body, param):
    answer = httpx.post(f"{server.url}{path}", json=body, timeout=60)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text


def test_suffix_is_refused_by_name(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model=MODEL, prompt="def add(a, b):", suffix="    return c", max_tokens=4)
    assert refused.value.body["param"] == "suffix"


def test_ignored_fields_are_the_ones_logged():
    req = ChatCompletionRequest.model_validate({
        "messages": [USER, {"role": "assistant", "content": "Apple", "annotations": [], "audio": {"id": "a1"}}],
        "store": True, "metadata": None, "stream": True, "stream_options": {"include_obfuscation": True},
        "temperature": 0})
    assert ignored_fields(req) == {"store", "messages.annotations", "messages.audio",
                                   "stream_options.include_obfuscation"}


# ---- messages as the SDK returns them ----

def test_model_dump_round_trip_over_two_turns(client):
    messages = [USER]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    returned = first.choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call", "tool_calls"} <= set(returned)
    messages += [returned, {"role": "user", "content": "And another one?"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
    # the returned answer is part of the second prompt
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + first.usage.completion_tokens
    assert second.choices[0].message.content


def tokens(server, messages: list[dict]) -> list[int]:
    answer = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()["tokens"]


def test_returned_shapes_render_as_their_current_equivalents(server):
    refusal = "I can't help with that."
    assert tokens(server, [USER, {"role": "assistant", "content": None, "refusal": refusal}]) == \
        tokens(server, [USER, {"role": "assistant", "content": refusal}])
    assert tokens(server, [USER, {"role": "assistant", "content": [{"type": "refusal", "refusal": refusal}]}]) == \
        tokens(server, [USER, {"role": "assistant", "content": refusal}])
    call = {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    legacy = [USER, {"role": "assistant", "content": None, "function_call": call},
              {"role": "function", "name": "get_weather", "content": "sunny"}]
    current = [USER, {"role": "assistant", "content": None,
                      "tool_calls": [{"id": "call_get_weather", "type": "function", "function": call}]},
               {"role": "tool", "name": "get_weather", "tool_call_id": "call_get_weather", "content": "sunny"}]
    assert tokens(server, legacy) == tokens(server, current)
    for bad in ({"role": "user", "content": "x", "refusal": "no"}, {"role": "function", "content": "sunny"}):
        answer = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": [bad]}, timeout=60)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "messages.0", answer.text


# ---- logit_bias ----

def greedy(client, **extra) -> openai.types.Completion:
    return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=1, **extra)


def token_id(server, text: str) -> int:
    ids = httpx.post(f"{server.url}/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 1, ids
    return ids[0]


def test_logit_bias_forces_and_bans_tokens(server, client):
    base = greedy(client).choices[0]
    forced = token_id(server, " banana")
    answer = greedy(client, logit_bias={str(forced): 100}).choices[0]
    assert answer.text == " banana" * 4
    # logprobs are the model's own: the same alternatives as without the bias, and the forced token unlikely
    assert answer.logprobs.top_logprobs[0] == pytest.approx(base.logprobs.top_logprobs[0], abs=1e-4)
    assert answer.logprobs.token_logprobs[0] < -5
    first = token_id(server, base.logprobs.tokens[0])
    banned = greedy(client, logit_bias={str(first): -100}).choices[0]
    assert banned.logprobs.tokens[0] != base.logprobs.tokens[0]
    chat = client.chat.completions.create(model=MODEL, messages=[USER], max_tokens=3, temperature=0,
                                          logit_bias={str(forced): 100})
    assert chat.choices[0].message.content == " banana" * 3


def test_logit_bias_leaves_the_rest_of_the_batch_alone(server, client):
    """Greedy requests without a bias give the same tokens beside a biased one as alone."""
    bias = {str(token_id(server, " banana")): 100}

    async def together() -> list:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
            return await asyncio.gather(*(
                c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, **extra)
                for extra in ({}, {"logit_bias": bias}, {})))

    alone = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
    plain, biased, plain_again = asyncio.run(together())
    assert plain.choices[0].text == plain_again.choices[0].text == alone
    assert biased.choices[0].text == " banana" * 8


@pytest.mark.parametrize(("bias", "says"), [
    ({"49152": 1}, "outside the vocabulary"), ({"5": 100.5}, "less than or equal to 100"),
    ({"05": 1}, "pattern"), ({"x": 1}, "pattern"), ({str(i): 1 for i in range(301)}, "at most 300"),
], ids=["outside-vocab", "too-large", "leading-zero", "not-an-id", "too-many"])
def test_bad_logit_bias_is_a_400_naming_it(server, bias, says):
    answer = httpx.post(f"{server.url}/v1/chat/completions", timeout=60,
                        json={"messages": [USER], "max_tokens": 1, "logit_bias": bias})
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"].startswith("logit_bias") and says in error["message"], error


def test_sampler_adds_each_rows_bias_to_that_row_only():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]] * 3)
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0, logit_bias={"3": 100, 0: -100}),
              SamplingParams(temperature=0, logit_bias={2: 1.5})]
    reqs = [Request(f"r{i}", [0], p, 0.0, seed=1, eos_token_ids=[]) for i, p in enumerate(params)]
    assert sample(logits.clone(), SamplingBatch.build(reqs, 4)).token_ids.tolist() == [0, 3, 0]
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={1: 101})
    assert SamplingBatch.build(reqs[:1], 4).bias is None  # requests without it pay nothing


def test_offline_logit_bias_bans_forces_and_is_checked_against_the_vocabulary():
    llm = LLM(dtype="float32", kv_cache_memory="16MiB", max_model_len=128)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    first = llm.generate([PROMPT], greedy)[0].outputs[0].token_ids[0]
    comma = llm.tokenizer.encode(",", add_special_tokens=False)[0]
    biased = dataclasses.replace(greedy, logit_bias={first: -100, str(comma): 100})  # OpenAI's string ids too
    assert llm.generate([PROMPT], biased)[0].outputs[0].token_ids == [comma] * 4
    with pytest.raises(ValueError, match="logit_bias token ids must be in"):
        llm.generate([PROMPT], dataclasses.replace(greedy, logit_bias={llm.engine.model_config.vocab_size: 1}))


# ---- usage in every chunk ----

def test_continuous_usage_stats_puts_the_usage_in_every_chunk(client):
    options = {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = list(client.chat.completions.create(model=MODEL, messages=[USER], max_tokens=6, stream=True,
                                                 extra_body={"ignore_eos": True, **options}))
    assert all(chunk.usage is not None for chunk in chunks)
    counts = [chunk.usage.completion_tokens for chunk in chunks]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 6 == chunks[-1].usage.completion_tokens
    content = [chunk.usage.completion_tokens for chunk in chunks if chunk.choices and chunk.choices[0].delta.content]
    assert content == sorted(set(content)) and len(content) >= 3  # grows with the tokens
    assert len({chunk.usage.prompt_tokens for chunk in chunks}) == 1
    legacy = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, stream=True,
                                            extra_body={"ignore_eos": True, **options}))
    counts = [chunk.usage.completion_tokens for chunk in legacy]
    assert counts == sorted(counts) and counts[-1] == 6 and len(set(counts)) >= 3
    plain = list(client.chat.completions.create(model=MODEL, messages=[USER], max_tokens=3, stream=True,
                                                stream_options={"include_usage": True}))
    assert [chunk.usage is not None for chunk in plain] == [False] * (len(plain) - 1) + [True]


@pytest.mark.parametrize("handler", [ChatCompletionsRequestHandler, TextCompletionsRequestHandler],
                         ids=["chat", "completions"])
def test_guidellm_streaming_requests_are_answered(server, handler: type):
    """guidellm's own request handler builds the body (stream_options include_usage + continuous_usage_stats,
    stop null, ignore_eos) and reads the stream, as `guidellm benchmark` does by default."""
    request = GenerationRequest(request_id="r1", columns={"text_column": ["Tell me about the sea."]},
                                input_metrics=UsageMetrics(), output_metrics=UsageMetrics(text_tokens=6))
    reader = handler()
    arguments = reader.format(request, stream=True, model=MODEL)
    assert arguments.body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    path = "/v1/chat/completions" if "messages" in arguments.body else "/v1/completions"
    with httpx.stream("POST", server.url + path, json=arguments.body, timeout=60) as answer:
        assert answer.status_code == 200, answer.read()
        for line in answer.iter_lines():
            if reader.add_streaming_line(line) is None:
                break
    response = reader.compile_streaming(request, arguments)
    assert response.text and response.output_metrics.text_tokens == 6 and response.input_metrics.text_tokens > 0

