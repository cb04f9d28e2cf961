"""Issue #37: the real clients against a real `pagedserve serve`, a router in front of it and a gateway with it as
its provider. One fp32 server for the module; each test's id names the client and the tier.

- lm-evaluation-harness (`local-completions`, `local-chat-completions`): accuracy on 32 multiple-choice questions
  and perplexity on four paragraphs (tests/data/lm_eval/), checked against transformers on the same weights; greedy
  generate_until on both endpoints checked against transformers' greedy answers.
- guidellm: a short streaming benchmark; its JSON report counts the requests.
- instructor: TOOLS-mode partial objects while the call streams, and JSON_SCHEMA mode.
- langchain-openai: invoke, stream, bind_tools, with_structured_output (function calling and JSON schema), and the
  error a structured call cut by max_tokens must raise.
- openai-python: messages' model_dump() sent back as the next turn, streaming usage, the Responses API.
- the Node `openai` SDK (when node and npm are here): chat, streaming, tools.
"""
from __future__ import annotations

import json
import os
import string
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from tests.client_support import (
    LM_EVAL_TASKS,
    MODEL,
    NODE_OPENAI,
    SERVER_ARGS,
    Tier,
    gateway_tier,
    greedy_text,
    install_node_openai,
    read_jsonl,
    reference_scores,
    router_tier,
    run_node,
    save_tokenizer,
)
from tests.server_support import ServerProcess

# Third-party clients end to end against a server, a router and a gateway: minutes, so behind make test-all.
pytestmark = pytest.mark.slow

MC, PPL, GEN = "pagedserve_compat_mc", "pagedserve_compat_ppl", "pagedserve_compat_gen"
TIERS = ["server", "router", "gateway"]
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


class City(BaseModel):
    name: str
    country: str
    population: int = Field(description="number of inhabitants")
    is_capital: bool


CITY_PROMPT = [{"role": "user", "content": "Describe Paris as a City: its name, country, population and whether it "
                                          "is a capital."}]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # A generous start-up: on shared cores the first start may be compiling the C++ kernels.
    srv = ServerProcess(SERVER_ARGS, startup_timeout=600, log_path=tmp_path_factory.mktemp("compat") / "server.log")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def router(server, tmp_path_factory):
    with router_tier(server.url, tmp_path_factory.mktemp("router")) as tier:
        yield tier


@pytest.fixture(scope="module")
def gateway(server, tmp_path_factory):
    with gateway_tier(server.url, tmp_path_factory.mktemp("gateway")) as tier:
        yield tier


@pytest.fixture(params=TIERS)
def tier(request, server) -> Tier:
    return Tier("server", server.url) if request.param == "server" else request.getfixturevalue(request.param)


@pytest.fixture(scope="session")
def tokenizer_folder(tmp_path_factory) -> Path:
    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def hf_tokenizer(tokenizer_folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_folder)


@pytest.fixture(scope="module")
def reference(hf_model, hf_tokenizer):
    scores = reference_scores(hf_model, hf_tokenizer)
    # A question whose best two choices are nearly tied in the reference would make "the same accuracy" a matter of
    # rounding: the data set must not contain one.
    margins = [max(lps) - sorted(lps)[-2] for lps in scores.choice_logprobs]
    assert min(margins) > 0.05, f"question {margins.index(min(margins))} is a near tie: {min(margins):.4f}"
    return scores


@pytest.fixture(scope="module")
def task_manager():
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (test extras)")
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=str(LM_EVAL_TASKS))


def lm_eval_args(tier: Tier, endpoint: str, tokenizer_folder: Path) -> dict:
    """local-completions / local-chat-completions at the tier: the server's tokenizer over HTTP (/tokenize,
    /detokenize, /tokenizer_info) where the tier serves it, else (the gateway) the tokenizer folder."""
    args = {"model": MODEL, "base_url": f"{tier.v1}/{endpoint}", "max_retries": 1, "timeout": 300,
            "header": {"Authorization": f"Bearer {tier.api_key}"}}
    if endpoint == "completions":
        args |= {"batch_size": 4, "tokenizer_backend": "remote"} if tier.name != "gateway" else \
            {"batch_size": 4, "tokenizer_backend": "huggingface", "tokenizer": str(tokenizer_folder)}
    return args


# ---------------------------------------------------------------------------------------------- lm-eval


def test_lm_eval_loglikelihood_accuracy_and_perplexity(tier, task_manager, tokenizer_folder, reference):
    from lm_eval import simple_evaluate

    out = simple_evaluate(model="local-completions", model_args=lm_eval_args(tier, "completions", tokenizer_folder),
                          tasks=[MC, PPL], task_manager=task_manager, log_samples=True)
    samples = sorted(out["samples"][MC], key=lambda s: s["doc_id"])
    assert len(samples) == len(reference.answers) == 32
    for sample, expected, greedy in zip(samples, reference.choice_logprobs, reference.choice_greedy, strict=True):
        got = [ll for ll, _ in sample["filtered_resps"]]
        assert got == pytest.approx(expected, abs=0.02), f"question {sample['doc_id']}: {got} vs {expected}"
        # is_greedy: lm-eval compares each token's logprob with the best of its top_logprobs (echo, logprobs=1)
        assert [g for _, g in sample["filtered_resps"]] == greedy, f"question {sample['doc_id']}"
    predictions = [float(p == a) for p, a in zip(reference.predictions, reference.answers, strict=True)]
    assert [s["acc"] for s in samples] == predictions
    assert out["results"][MC]["acc,none"] == reference.acc
    perplexity = out["results"][PPL]
    assert perplexity["word_perplexity,none"] == pytest.approx(reference.word_perplexity, rel=0.005)
    assert perplexity["byte_perplexity,none"] == pytest.approx(reference.byte_perplexity, rel=0.005)
    assert perplexity["bits_per_byte,none"] == pytest.approx(reference.bits_per_byte, rel=0.005)


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"], ids=["completions", "chat"])
def test_lm_eval_generate_until(tier, endpoint, task_manager, tokenizer_folder, hf_model, hf_tokenizer):
    from lm_eval import simple_evaluate

    chat = endpoint == "chat/completions"
    out = simple_evaluate(model="local-chat-completions" if chat else "local-completions",
                          model_args=lm_eval_args(tier, endpoint, tokenizer_folder), tasks=[GEN],
                          task_manager=task_manager, log_samples=True, apply_chat_template=chat)
    samples = sorted(out["samples"][GEN], key=lambda s: s["doc_id"])
    docs = read_jsonl("compat_gen.jsonl")
    assert len(samples) == len(docs)
    matches = []
    for sample, doc in zip(samples, docs, strict=True):
        context = sample["arguments"][0][0]
        if chat:  # what lm-eval sent: its messages, rendered here by the tokenizer's own chat template
            messages = json.loads(context[0] if isinstance(context, tuple) else context)  # JsonChatStr(prompt)
            assert messages == [{"role": "user", "content": doc["prompt"]}]
            text = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        else:
            assert context == doc["prompt"]
            text = context
        ids = hf_tokenizer(text, add_special_tokens=False).input_ids
        expected = greedy_text(hf_model, hf_tokenizer, ids, 16, "\n")
        assert sample["resps"][0][0] == expected, f"{doc['prompt']!r}"
        normalised = expected.strip().lower().translate(str.maketrans("", "", string.punctuation))
        matches.append(normalised == doc["answer"].lower())
    assert out["results"][GEN]["exact_match,none"] == pytest.approx(sum(matches) / len(matches))


# ---------------------------------------------------------------------------------------------- guidellm


def test_guidellm_streaming_benchmark(tier, tokenizer_folder, tmp_path):
    pytest.importorskip("guidellm", reason="guidellm is not installed (test extras)")
    report = tmp_path / "benchmarks.json"
    backend = f"kind=openai_http,target={tier.url},model={MODEL},api_key={tier.api_key}"
    command = [str(Path(sys.executable).parent / "guidellm"), "run", "--backend", backend,
               "--profile", "kind=synchronous", "--constraint", "kind=max_requests,count=4",
               "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
               "--tokenizer", f"kind=huggingface_auto,model={tokenizer_folder}",
               "--output", f"kind=json,path={report}", "--disable-console-interactive"]
    done = subprocess.run(command, check=False, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    totals, state = benchmark["metrics"]["request_totals"], benchmark["scheduler_state"]
    assert totals["errored"] == totals["incomplete"] == state["errored_requests"] == 0, (totals, state)
    # Four were sent; on loaded cores guidellm 0.8.1 has reported a run's totals one short (3 of 4, none failed).
    assert 0 < totals["successful"] == totals["total"] <= 4, (totals, state)
    assert len(benchmark["requests"]["successful"]) == totals["successful"]
    for request in benchmark["requests"]["successful"]:
        body = json.loads(request["request_args"])["body"]
        assert body["stream"] is True and request["output"]  # guidellm's default: streamed chat completions
        assert request["output_metrics"]["text_tokens"] == 16  # ignore_eos held, counted from the stream's usage
        assert request["input_metrics"]["text_tokens"] > 32  # the synthetic prompt in the chat template
        assert request["info"]["timings"]["token_iterations"] >= 2  # the answer came as a stream, not at once


# ---------------------------------------------------------------------------------------------- instructor


def test_instructor_tools_partial_objects_grow(tier):
    instructor = pytest.importorskip("instructor", reason="instructor is not installed (test extras)")
    client = instructor.from_openai(tier.openai(), mode=instructor.Mode.TOOLS)
    partials = [p.model_dump() for p in client.chat.completions.create_partial(
        model=MODEL, response_model=City, messages=CITY_PROMPT, max_tokens=200, temperature=0)]
    assert partials, "no partial object"
    city = City.model_validate(partials[-1])  # the last one is complete
    filled = [sum(v is not None for v in p.values()) for p in partials]
    assert filled == sorted(filled), f"fields disappeared over the stream: {filled}"
    assert len(set(filled)) >= 3, (f"partial objects did not grow ({len(partials)} of them, fields filled: {filled}): "
                                   f"the call's arguments were not streamed piece by piece")
    assert city.name


def test_instructor_json_schema_mode(tier):
    instructor = pytest.importorskip("instructor", reason="instructor is not installed (test extras)")
    client = instructor.from_openai(tier.openai(), mode=instructor.Mode.JSON_SCHEMA)
    city, completion = client.chat.completions.create_with_completion(
        model=MODEL, response_model=City, messages=CITY_PROMPT, max_tokens=200, temperature=0)
    assert isinstance(city, City) and city.name
    assert completion.choices[0].finish_reason == "stop"
    assert City.model_validate_json(completion.choices[0].message.content).model_dump() == city.model_dump()


# ---------------------------------------------------------------------------------------------- langchain


def chat_model(tier: Tier, **kwargs):
    pytest.importorskip("langchain_openai", reason="langchain-openai is not installed (test extras)")
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=tier.v1, api_key=tier.api_key, temperature=0, max_retries=0,
                      timeout=300, **{"max_tokens": 24, **kwargs})


def test_langchain_invoke_and_stream(tier):
    llm = chat_model(tier, stream_usage=True)
    answer = llm.invoke(QUESTION[0]["content"])
    raw = tier.openai().chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    assert answer.content and answer.content == raw.choices[0].message.content
    assert answer.response_metadata["finish_reason"] == raw.choices[0].finish_reason
    assert answer.usage_metadata["output_tokens"] == raw.usage.completion_tokens
    assert answer.usage_metadata["input_tokens"] == raw.usage.prompt_tokens
    chunks = list(llm.stream(QUESTION[0]["content"]))
    assert len([c for c in chunks if c.content]) >= 2
    streamed = sum(chunks[1:], chunks[0])
    assert streamed.content == answer.content
    assert streamed.usage_metadata["output_tokens"] == raw.usage.completion_tokens  # the stream's usage chunk
    assert streamed.response_metadata["finish_reason"] == raw.choices[0].finish_reason


def test_langchain_bind_tools(tier):
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"Sunny in {city}"

    llm = chat_model(tier, max_tokens=64).bind_tools([get_weather], tool_choice="get_weather")
    message = llm.invoke("What is the weather in Paris?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str) and call["id"]
    assert not message.invalid_tool_calls
    streamed = None
    for chunk in llm.stream("What is the weather in Paris?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [(call["name"], call["args"])]
    assert get_weather.invoke(call["args"]).startswith("Sunny in")


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_langchain_structured_output(tier, method):
    structured = chat_model(tier, max_tokens=200).with_structured_output(City, method=method)
    city = structured.invoke(CITY_PROMPT[0]["content"])
    assert isinstance(city, City) and city.name and city.country


def test_langchain_structured_output_cut_by_max_tokens_json_schema_raises(tier):
    """A structured answer cut by max_tokens is an error, never a silent None: with json_schema, the SDK's
    LengthFinishReasonError (the server ends the cut answer with finish_reason length)."""
    import openai

    structured = chat_model(tier, max_tokens=24).with_structured_output(City, method="json_schema")
    with pytest.raises(openai.LengthFinishReasonError):
        result = structured.invoke(CITY_PROMPT[0]["content"])
        pytest.fail(f"a cut structured answer came back as {result!r} instead of an error")


def test_langchain_structured_output_cut_by_max_tokens_function_calling(tier):
    """A forced call cut by max_tokens comes back as OpenAI's does: finish_reason length and the call with the
    arguments written so far, which LangChain files under invalid_tool_calls. (langchain-openai 1.8 has no length
    error for function calling: with_structured_output then gives None, as it would from api.openai.com; the raw
    message is where a caller sees the cut, so that is what must be right.)"""
    structured = chat_model(tier, max_tokens=24).with_structured_output(City, method="function_calling",
                                                                        include_raw=True)
    out = structured.invoke(CITY_PROMPT[0]["content"])
    raw = out["raw"]
    assert raw.response_metadata["finish_reason"] == "length"
    assert not raw.tool_calls
    (cut,) = raw.invalid_tool_calls
    assert cut["name"] == "City" and cut["id"] and cut["args"].startswith("{")
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut["args"])
    assert out["parsed"] is None or out["parsing_error"] is not None  # never an object made up from a cut call


# ---------------------------------------------------------------------------------------------- openai-python


def test_openai_model_dump_round_trip(tier):
    client = tier.openai()
    messages = list(QUESTION)
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    messages += [first.choices[0].message.model_dump(), {"role": "user", "content": "And of Italy?"}]
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
    assert second.choices[0].message.content
    # The dumped turn is the same conversation as the plain assistant turn: the prompt is rendered identically.
    plain = list(QUESTION) + [{"role": "assistant", "content": first.choices[0].message.content},
                              {"role": "user", "content": "And of Italy?"}]
    again = client.chat.completions.create(model=MODEL, messages=plain, max_tokens=16, temperature=0)
    assert second.usage.prompt_tokens == again.usage.prompt_tokens
    assert second.choices[0].message.content == again.choices[0].message.content


def test_openai_model_dump_round_trip_with_tool_calls(tier):
    client = tier.openai()
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL],
                                           tool_choice=NAMED_WEATHER, max_tokens=40, temperature=0)
    message = first.choices[0].message
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    messages += [message.model_dump(), {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21}'}]
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=24,
                                            temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    # The tool result reached the prompt: the server renders the same turns for the dumped message and for one
    # written by hand.
    by_hand = messages[:1] + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        messages[2]]
    again = client.chat.completions.create(model=MODEL, messages=by_hand, tools=[WEATHER_TOOL], max_tokens=24,
                                           temperature=0)
    assert second.usage.prompt_tokens == again.usage.prompt_tokens


def test_openai_stream_include_usage(tier):
    client = tier.openai()
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage is not None
    assert all(c.usage is None for c in body)
    assert "".join(c.choices[0].delta.content or "" for c in body) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason] == [whole.choices[0].finish_reason]
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (whole.usage.prompt_tokens,
                                                                       whole.usage.completion_tokens)


def test_openai_responses_create_and_stream(tier):
    client = tier.openai()
    question = QUESTION[0]["content"]
    created = client.responses.create(model=MODEL, input=question, max_output_tokens=24, temperature=0)
    assert created.output_text and created.usage.output_tokens <= 24
    assert created.status in ("completed", "incomplete")
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    assert created.output_text == chat.choices[0].message.content  # one user turn, as chat renders it
    with client.responses.stream(model=MODEL, input=question, max_output_tokens=24, temperature=0) as stream:
        deltas = [event.delta for event in stream if event.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert len(deltas) >= 2 and "".join(deltas) == final.output_text == created.output_text
    assert final.usage.output_tokens == created.usage.output_tokens


# ---------------------------------------------------------------------------------------------- Node SDK

NODE_SCRIPT = """
import OpenAI from 'openai';
const client = new OpenAI({baseURL: process.env.BASE_URL, apiKey: process.env.API_KEY, maxRetries: 0});
const model = process.env.MODEL;
const messages = %(question)s;
const chat = await client.chat.completions.create({model, messages, max_tokens: 24, temperature: 0});
const stream = await client.chat.completions.create({model, messages, max_tokens: 24, temperature: 0, stream: true,
                                                     stream_options: {include_usage: true}});
let streamed = '', pieces = 0, usage = null;
for await (const chunk of stream) {
  if (chunk.choices.length && chunk.choices[0].delta.content) { streamed += chunk.choices[0].delta.content; pieces++; }
  if (chunk.usage) usage = chunk.usage;
}
const tools = [%(tool)s];
const called = await client.chat.completions.create({model, max_tokens: 40, temperature: 0, tools,
  tool_choice: %(named)s, messages: [{role: 'user', content: 'What is the weather in Paris?'}]});
const call = called.choices[0].message.tool_calls[0];
console.log(JSON.stringify({chat: chat.choices[0].message.content, usage: chat.usage, streamed, pieces,
                            streamUsage: usage, call: {name: call.function.name, arguments: call.function.arguments}}));
"""


@pytest.fixture(scope="session")
def node_sdk(tmp_path_factory) -> Path:
    folder = install_node_openai(tmp_path_factory.mktemp("node-openai"))
    if folder is None:
        pytest.skip(f"node and npm are not on this machine (the suite runs openai@{NODE_OPENAI} for Node)")
    return folder


def test_node_openai_sdk(tier, node_sdk):
    script = NODE_SCRIPT % {"question": json.dumps(QUESTION), "tool": json.dumps(WEATHER_TOOL),
                            "named": json.dumps(NAMED_WEATHER)}
    result = run_node(node_sdk, script, tier)
    python = tier.openai().chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=24, temperature=0)
    assert result["chat"] == python.choices[0].message.content == result["streamed"]
    assert result["pieces"] >= 2
    assert result["streamUsage"]["completion_tokens"] == result["usage"]["completion_tokens"]
    assert result["call"]["name"] == "get_weather"
    assert isinstance(json.loads(result["call"]["arguments"])["city"], str)
