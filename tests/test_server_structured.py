"""Structured outputs and tool calling over HTTP: a real `pagedserve serve` driven by the official openai client
(`chat.completions.parse` with a pydantic model, tools round trips streamed and not) and raw httpx for the errors."""
import json
import re

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from pagedserve.server.protocol import ChatTool
from pagedserve.server.tool_parsers import Llama3JsonParser, choose_parser
from pagedserve.server.tools import ToolCallStream, ToolPlan
from tests.server_support import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string", "maxLength": 30},
                                  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a time zone",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["timezone"],
                   "properties": {"timezone": {"type": "string", "maxLength": 40}}}}}
TOOLS = [WEATHER, CLOCK]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
ITEM = {"type": "object", "additionalProperties": False, "required": ["product", "quantity"],
        "properties": {"product": {"type": "string", "maxLength": 20},
                       "quantity": {"type": "integer", "minimum": 1, "maximum": 99}}}


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)
    city: str = Field(max_length=24)


@pytest.fixture(scope="module")
def server() -> str:
    srv = ServerProcess(["--dtype", "float32", "--kv-cache-memory", "64MiB", "--max-model-len", "1024",
                         "--shed-after", ""])
    yield srv.url
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=300)


def check_calls(calls) -> None:
    """Every call names a known tool and its arguments follow that tool's schema."""
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_parse_returns_a_pydantic_object(client):
    completion = client.chat.completions.parse(
        model=MODEL, response_format=Person, max_tokens=80, temperature=0,
        messages=[{"role": "user", "content": "Invent a person and describe them."}])
    choice = completion.choices[0]
    assert choice.finish_reason == "stop"
    assert isinstance(choice.message.parsed, Person)
    assert Person.model_validate_json(choice.message.content) == choice.message.parsed


def test_json_modes_on_completions_with_n_and_seeds(client):
    prompt = "A grocery order as JSON:"
    free = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=1.0, seed=3, n=3,
                                     extra_body={"guided_json": ITEM})
    strict = client.completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=1.0, seed=3, n=3,
                                       extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                           "name": "item", "schema": ITEM}}})
    for c in free.choices + strict.choices:
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.text), ITEM)
    # guided_json and response_format compile to the same grammar: same seeds, same texts.
    assert [c.text for c in free.choices] == [c.text for c in strict.choices]
    assert len({c.text for c in free.choices}) > 1  # n samples, not one repeated
    obj = client.completions.create(model=MODEL, prompt="A JSON object describing a cat:", max_tokens=60,
                                    temperature=0, extra_body={"response_format": {"type": "json_object"}})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].text), dict)
    else:  # an open object may run out of tokens, and says so; what came is a prefix of one
        assert obj.choices[0].finish_reason == "length" and obj.choices[0].text.startswith("{")


def test_streamed_json_schema_matches_the_unstreamed_answer(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "item", "schema": ITEM, "strict": True}}
    messages = [{"role": "user", "content": "Order some apples."}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt, max_tokens=60,
                                           temperature=0)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, response_format=fmt,
                                                 max_tokens=60, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    jsonschema.validate(json.loads(text), ITEM)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"


def test_guided_regex_choice_and_grammar(client):
    def chat(**extra) -> str:
        r = client.chat.completions.create(model=MODEL, max_tokens=20, temperature=0.7, seed=1,
                                           messages=[{"role": "user", "content": "Is the sky blue?"}],
                                           extra_body=extra)
        assert r.choices[0].finish_reason == "stop"
        return r.choices[0].message.content

    assert chat(guided_choice=["yes", "no", "maybe"]) in ("yes", "no", "maybe")
    phone = chat(guided_regex=r"\(\d{3}\) \d{3}-\d{4}")
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone), phone
    assert chat(guided_grammar='root ::= "It is " ("blue" | "grey") "."') in ("It is blue.", "It is grey.")
    lark = chat(guided_grammar='start: "answer: " WORD\nWORD: /[a-z]{2,8}/')
    assert lark.startswith("answer: ") and lark[8:].isalpha() and lark[8:].islower()


def test_tool_round_trip_required_then_answer(client, server):
    first = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=80, temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    check_calls(choice.message.tool_calls)
    call = choice.message.tool_calls[0]
    result = json.dumps({"temperature": 18, "unit": "celsius", "sky": "cloudy"})
    turns = ASK_WEATHER + [choice.message.model_dump(exclude_none=True),
                           {"role": "tool", "tool_call_id": call.id, "content": result}]
    # The model continues from the result: the rendered prompt carries the call and the result.
    tokens = httpx.post(f"{server}/tokenize", json={"messages": turns, "tools": TOOLS}).json()["tokens"]
    prompt = httpx.post(f"{server}/detokenize", json={"tokens": tokens}).json()["prompt"]
    assert f"<tool_response>\n{result}\n</tool_response>" in prompt
    assert '"name": "get_weather"' in prompt and "<tools>" in prompt
    second = client.chat.completions.create(model=MODEL, messages=turns, tools=TOOLS, max_tokens=40, temperature=0)
    answer = second.choices[0]
    assert answer.message.content and answer.finish_reason in ("stop", "length")
    # The same turns streamed give the same answer.
    streamed = list(client.chat.completions.create(model=MODEL, messages=turns, tools=TOOLS, max_tokens=40,
                                                   temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == answer.message.content


def test_streamed_named_tool_call_matches_the_unstreamed_one(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    messages = [{"role": "user", "content": "What time is it in Tokyo?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=named,
                                           max_tokens=60, temperature=0)
    assert whole.choices[0].finish_reason == "stop"  # OpenAI's: a forced call ends with stop
    check_calls(whole.choices[0].message.tool_calls)
    assert [c.function.name for c in whole.choices[0].message.tool_calls] == ["get_time"]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice=named,
                                                max_tokens=60, temperature=0, stream=True):
        if not chunk.choices:
            continue
        finish = chunk.choices[0].finish_reason or finish
        for d in chunk.choices[0].delta.tool_calls or []:
            call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
            call["id"] = d.id or call["id"]
            call["name"] += d.function.name or ""
            call["arguments"] += d.function.arguments or ""
    assert finish == "stop" and len(calls) == 1
    expected = whole.choices[0].message.tool_calls[0].function
    assert calls[0]["name"] == expected.name and json.loads(calls[0]["arguments"]) == json.loads(expected.arguments)
    assert calls[0]["id"].startswith("call_")


def test_tool_call_arguments_stream_as_the_model_writes_them(client):
    """OpenAI's shape: the call's first delta has its id, type and name with empty arguments; its arguments
    follow in fragments, one entry per chunk (instructor's create_partial reads them as they come)."""
    entries, finish = [], None
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS,
                                                tool_choice="required", parallel_tool_calls=False, max_tokens=80,
                                                temperature=0, stream=True):
        if chunk.choices:
            finish = chunk.choices[0].finish_reason or finish
            deltas = chunk.choices[0].delta.tool_calls or []
            assert len({d.index for d in deltas}) == len(deltas)  # never two entries of one index in a chunk
            entries += deltas
    first, fragments = entries[0], entries[1:]
    assert first.id.startswith("call_") and first.type == "function" and first.function.name == "get_weather"
    assert first.function.arguments == ""
    assert len(fragments) >= 3 and all(d.id is None and d.function.name is None for d in fragments)
    arguments = json.loads("".join(d.function.arguments for d in fragments))
    assert set(arguments) == {"city", "unit"} and finish == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_cut_by_max_tokens_is_still_a_call(client, stream):
    """Cut mid-arguments: a tool_calls entry with what was written, finish_reason length (not raw text)."""
    kwargs = {"model": MODEL, "messages": ASK_WEATHER, "tools": TOOLS, "tool_choice": "required",
                  "parallel_tool_calls": False, "max_tokens": 20, "temperature": 0}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "length" and choice.message.content is None
        call = choice.message.tool_calls[0]
        name, arguments = call.function.name, call.function.arguments
    else:
        name, arguments, content, finish = None, "", "", None
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            if chunk.choices:
                delta = chunk.choices[0].delta
                content += delta.content or ""
                finish = chunk.choices[0].finish_reason or finish
                for d in delta.tool_calls or []:
                    name, arguments = name or d.function.name, arguments + (d.function.arguments or "")
        assert finish == "length" and content == ""
    assert name == "get_weather" and arguments.startswith("{") and "<tool_call>" not in arguments
    with pytest.raises(json.JSONDecodeError):
        json.loads(arguments)  # cut: what was written so far


def test_legacy_functions_are_offered_as_tools_and_answered_in_their_shape(client, server):
    functions = [t["function"] for t in TOOLS]
    body = {"model": MODEL, "messages": ASK_WEATHER, "functions": functions, "max_tokens": 80, "temperature": 0,
            "function_call": {"name": "get_weather"}}
    answer = httpx.post(server + "/v1/chat/completions", json=body, timeout=300).json()["choices"][0]
    call = answer["message"]["function_call"]
    assert call["name"] == "get_weather" and set(json.loads(call["arguments"])) == {"city", "unit"}
    assert answer["message"].get("tool_calls") is None and answer["finish_reason"] == "stop"
    with httpx.stream("POST", server + "/v1/chat/completions", json={**body, "stream": True}, timeout=300) as r:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                  if line.startswith("data: {") and json.loads(line[6:])["choices"]]
    streamed = [d["function_call"] for d in deltas if d.get("function_call")]
    assert streamed[0]["name"] == "get_weather" and json.loads(
        "".join(d.get("arguments") or "" for d in streamed)) == json.loads(call["arguments"])
    both = httpx.post(server + "/v1/chat/completions", json={**body, "tools": TOOLS}, timeout=60)
    assert both.status_code == 400 and both.json()["error"]["param"] == "functions"


class Address(BaseModel):
    city: str = Field(max_length=20)
    country: str = Field(max_length=20)


class Shipment(BaseModel):
    item: str = Field(max_length=20)
    ship_to: Address
    bill_to: Address


def test_pydantic_tool_with_shared_definitions(client):
    """openai.pydantic_function_tool puts nested models in `$defs`: the forced call still follows them."""
    tool = openai.pydantic_function_tool(Shipment)
    r = client.chat.completions.create(model=MODEL, tools=[tool], tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=120, temperature=0,
                                       messages=[{"role": "user", "content": "Ship a lamp from Oslo to Lima."}])
    assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "Shipment"
    Shipment.model_validate_json(call.function.arguments)


def test_parallel_required_calls_all_parse(client):
    r = client.chat.completions.create(
        model=MODEL, tools=TOOLS, tool_choice="required", max_tokens=150, temperature=0.8, seed=5, n=2,
        messages=[{"role": "user", "content": "Weather in Oslo and the time in Lima, please."}])
    for c in r.choices:
        if c.finish_reason == "tool_calls":
            check_calls(c.message.tool_calls)
        else:  # ran out of tokens inside a further call: the finished calls still parse
            assert c.finish_reason == "length"


PLAN = ToolPlan([ChatTool.model_validate(t) for t in TOOLS], "auto", True, set(SCHEMAS))
OUTPUT = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n'
          '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"timezone": "America/Lima"}}\n</tool_call>'
          '<tool_call>{"name": "unknown_fn", "arguments": {}}</tool_call> <tool_call>{"nam')


def streamed(plan: ToolPlan, text: str, split: int) -> tuple[str, list[str]]:
    """The content and called names a stream produces when text arrives in two pieces."""
    stream = ToolCallStream(plan)
    text_a, deltas_a = stream.feed(text[:split])
    text_b, deltas_b = stream.feed(text[split:])
    rest, deltas_c = stream.finish()
    return text_a + text_b + rest, [d.function.name for d in deltas_a + deltas_b + deltas_c if d.function.name]


def test_hermes_parser_and_stream_agree_at_every_split():
    content, calls = PLAN.parse(OUTPUT)
    assert [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[1].function.arguments) == {"timezone": "America/Lima"}
    assert content.startswith("Let me check.") and "unknown_fn" in content and content.endswith('{"nam')
    for split in range(1, len(OUTPUT)):
        text, names = streamed(PLAN, OUTPUT, split)
        assert names == ["get_weather", "get_time"], split
        assert text.replace("\n", "") == content.replace("\n", ""), split
    single = ToolPlan(PLAN.tools, "auto", False, PLAN.names)
    assert [c.function.name for c in single.parse(OUTPUT)[1]] == ["get_weather"]
    plain = "No tools needed: <tool_call is not a tag"
    assert PLAN.parse(plain) == (plain, [])


def test_llama3_json_parser_and_stream():
    plan = ToolPlan(PLAN.tools, "auto", True, PLAN.names, Llama3JsonParser())
    calls_text = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}; '
                  '{"name": "get_time", "parameters": {"timezone": "UTC"}}')
    content, calls = plan.parse(calls_text)
    assert content is None and [c.function.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].function.arguments) == {"city": "Oslo", "unit": "celsius"}
    for text, expected in [(calls_text, ["get_weather", "get_time"]), ("It is sunny in Oslo {today}.", []),
                           ('{"name": "launch_rocket", "parameters": {}}', []), ('{"name": "get_time", "par', [])]:
        for split in range(1, len(text)):
            out, names = streamed(plan, text, split)
            assert names == expected, (text, split)
            assert out == ("" if expected else text), (text, split)
    assert choose_parser("auto", "{% if message.role == 'ipython' %}<|python_tag|>{% endif %}").name == "llama3_json"
    assert choose_parser("auto", "<|im_start|>{{ message.role }}").name == "hermes"
    with pytest.raises(ValueError, match="unknown tool call parser"):
        choose_parser("mistral", None)


def test_llama3_json_format_on_a_server():
    """The same model told to write Llama 3 style calls: forced calls parse, streamed and not."""
    srv = ServerProcess(["--dtype", "float32", "--kv-cache-memory", "32MiB", "--max-model-len", "1024",
                         "--tool-call-parser", "llama3_json"])
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=300)
        r = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, max_tokens=80, temperature=0)
        assert r.choices[0].finish_reason == "tool_calls"
        check_calls(r.choices[0].message.tool_calls)
        deltas = [d for c in client.chat.completions.create(
            model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            max_tokens=80, temperature=0, stream=True) if c.choices for d in c.choices[0].delta.tool_calls or []]
        assert [d.function.name for d in deltas if d.function.name] == [
            c.function.name for c in r.choices[0].message.tool_calls]
        turns = ASK_WEATHER + [r.choices[0].message.model_dump(exclude_none=True),
                               {"role": "tool", "tool_call_id": r.choices[0].message.tool_calls[0].id,
                                "content": "18 degrees"}]
        tokens = httpx.post(f"{srv.url}/tokenize", json={"messages": turns, "tools": TOOLS}).json()["tokens"]
        prompt = httpx.post(f"{srv.url}/detokenize", json={"tokens": tokens}).json()["prompt"]
        assert "ipython\n18 degrees" in prompt and '"parameters": {' in prompt
    finally:
        srv.stop()


BAD = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_grammar": "start: missing_rule"}, "guided_grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": '{"type": "array", "items": ' * 3000 + "{}" + "}" * 3000}, "guided_json"),
    ({"guided_json": {"$ref": "#/nowhere"}}, "guided_json"),
    ({"guided_grammar": "%%%% ::= ::= ((("}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": []}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}],
      "tool_choice": "required"}, "tools"),
    ({"guided_choice": [str(i) for i in range(1001)]}, "guided_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$defs": "x"}}}],
      "tool_choice": "required"}, "tools.0.function.parameters.$defs"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages.0"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages.0"),
]


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[p + str(i) for i, (_, p) in enumerate(BAD)])
def test_bad_constraints_are_400s_naming_the_field(server, extra, param):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra}
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["type"] == "invalid_request_error"


def test_server_healthy_after_bad_constraints(client, server):
    for body in (b.copy() for b, _ in BAD[:3]):
        httpx.post(f"{server}/v1/completions", json={"prompt": "x", "max_tokens": 2, **body}, timeout=60)
    assert httpx.get(f"{server}/health").status_code == 200
    r = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=4, temperature=0,
                                  extra_body={"guided_regex": r" \d(, \d)*"})
    assert r.choices[0].text.startswith(" 4")
