"""The Responses API (POST /v1/responses, GET/DELETE /v1/responses/{id}) against a real `pagedserve serve`, driven by
the official openai SDK: inputs, instructions, stored conversations, function tools, structured text, streaming
and its events, truncation, hostile bodies; then through a router (a stored response's turn goes back to the
replica that holds it) and through a gateway (keys, usage and traces)."""
import asyncio
import contextlib
import hashlib
import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from pagedserve.cluster.launcher import free_port
from pagedserve.server.response_store import ResponseStore
from pagedserve.server.responses import _Events, _Finisher
from pagedserve.server.responses_protocol import ResponseObject, ResponsesRequest, TextConfig
from tests.gateway_support import cli, gateway
from tests.polling import wait_for
from tests.router_support import RouterProcess
from tests.server_support import ServerProcess

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                          "properties": {"city": {"type": "string", "maxLength": 30},
                                         "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}},
           "strict": True}
ASK = "What is the weather like in Paris right now?"
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0}}}


class Person(BaseModel):
    name: str = Field(max_length=24)
    age: int = Field(ge=0, le=120)


@pytest.fixture(scope="module")
def server() -> str:
    srv = ServerProcess(["--dtype", "float32", "--kv-cache-memory", "32MiB", "--max-model-len", "1024",
                         "--embedding-model", "none"])
    yield srv.url
    srv.stop()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="none", max_retries=0, timeout=120)


def chat(client: openai.OpenAI, messages: list[dict], **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


def test_string_input_with_instructions_is_the_chat_of_a_system_and_a_user_turn(client):
    r = client.responses.create(model=MODEL, input="Name a fruit.", instructions="Answer in one word.",
                                max_output_tokens=16, temperature=0, metadata={"team": "qa"}, user="u1")
    same = chat(client, [{"role": "system", "content": "Answer in one word."},
                         {"role": "user", "content": "Name a fruit."}], max_tokens=16)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "completed" and r.incomplete_details is None and r.completed_at
    assert r.output_text == same.choices[0].message.content and r.output_text
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    usage = r.usage
    assert (usage.input_tokens, usage.output_tokens) == (same.usage.prompt_tokens, same.usage.completion_tokens)
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0 and usage.input_tokens_details.cached_tokens >= 0
    assert (r.instructions, r.max_output_tokens, r.temperature, r.metadata, r.user, r.store) == (
        "Answer in one word.", 16, 0.0, {"team": "qa"}, "u1", True)
    assert r.tools == [] and r.tool_choice == "auto" and r.parallel_tool_calls and r.text.format.type == "text"


def test_item_input_renders_roles_and_content_parts_as_chat_does(client):
    items = [{"role": "developer", "content": "You are terse."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Say "},
                                                             {"type": "input_text", "text": "hello."}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Hello.", "annotations": []}]},
             {"role": "user", "content": "Again, in French."}]
    r = client.responses.create(model=MODEL, input=items, max_output_tokens=12, temperature=0)
    same = chat(client, [{"role": "developer", "content": "You are terse."}, {"role": "user", "content": "Say hello."},
                         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Again, in French."}],
                max_tokens=12)
    assert r.output_text == same.choices[0].message.content
    assert r.usage.input_tokens == same.usage.prompt_tokens


def test_previous_response_id_continues_the_stored_conversation(client):
    first = client.responses.create(model=MODEL, input="My name is Ada. Say OK.", instructions="Be brief.",
                                    max_output_tokens=8, temperature=0)
    second = client.responses.create(model=MODEL, input="What is my name?", previous_response_id=first.id,
                                     max_output_tokens=12, temperature=0)
    # The earlier input and output come first; instructions are not carried over (OpenAI's rule).
    same = chat(client, [{"role": "user", "content": "My name is Ada. Say OK."},
                         {"role": "assistant", "content": first.output_text},
                         {"role": "user", "content": "What is my name?"}], max_tokens=12)
    assert second.previous_response_id == first.id and second.instructions is None
    assert second.output_text == same.choices[0].message.content
    assert second.usage.input_tokens == same.usage.prompt_tokens > first.usage.total_tokens - 8
    by_hand = client.responses.create(model=MODEL, max_output_tokens=12, temperature=0, input=[
        {"role": "user", "content": "My name is Ada. Say OK."}, *first.output, {"role": "user", "content": "What is my name?"}])
    assert by_hand.output_text == second.output_text  # the SDK's output items sent back as input
    assert client.responses.retrieve(second.id).output_text == second.output_text
    client.responses.delete(second.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(second.id)
    with pytest.raises(openai.NotFoundError) as gone:
        client.responses.create(model=MODEL, input="And?", previous_response_id=second.id, max_output_tokens=4)
    assert gone.value.body["param"] == "previous_response_id"
    assert gone.value.body["code"] == "previous_response_not_found"


def test_store_false_is_not_kept(client):
    r = client.responses.create(model=MODEL, input="Hi", store=False, max_output_tokens=4, temperature=0)
    assert r.store is False
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=MODEL, input="Hi again", previous_response_id=r.id, max_output_tokens=4)
    assert missing.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_forced_function_call_and_its_output_round_trip(client):
    forced = client.responses.create(model=MODEL, input=ASK, tools=[WEATHER], max_output_tokens=60, temperature=0,
                                     tool_choice={"type": "function", "name": "get_weather"})
    assert forced.status == "completed"
    [call] = forced.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 degrees"}
    answer = client.responses.create(model=MODEL, input=[{"role": "user", "content": ASK}, call, result],
                                     tools=[WEATHER], tool_choice="none", max_output_tokens=20, temperature=0)
    same = chat(client, [{"role": "user", "content": ASK},
                         {"role": "assistant", "tool_calls": [{"id": call.call_id, "type": "function", "function": {
                             "name": call.name, "arguments": call.arguments}}]},
                         {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 degrees"}],
                tools=[{"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}],
                tool_choice="none", max_tokens=20)
    assert answer.output_text == same.choices[0].message.content
    assert answer.usage.input_tokens == same.usage.prompt_tokens
    # The same turn on top of the stored call: only the output is sent.
    continued = client.responses.create(model=MODEL, input=[result], previous_response_id=forced.id,
                                        tools=[WEATHER], tool_choice="none", max_output_tokens=20, temperature=0)
    assert continued.output_text == answer.output_text


def test_json_schema_text_format_is_enforced(client):
    parsed = client.responses.parse(model=MODEL, input="Invent a person.", text_format=Person, max_output_tokens=60,
                                    temperature=0)
    assert parsed.status == "completed" and isinstance(parsed.output_parsed, Person)
    r = client.responses.create(model=MODEL, input="A person as JSON.", max_output_tokens=60, temperature=0,
                                text={"format": {"type": "json_schema", "name": "person", "strict": True,
                                                 "schema": PERSON}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), PERSON)
    assert r.text.format.type == "json_schema" and r.text.format.name == "person"


def test_stream_events_in_order_and_deltas_make_the_final_text(client):
    with client.responses.stream(model=MODEL, input="Say hi.", max_output_tokens=200, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and set(kinds[4:-4]) == {"response.output_text.delta"}
    assert "".join(deltas) == final.output_text == events[-4].text
    assert final.id == events[0].response.id and final.status == "completed"
    whole = client.responses.create(model=MODEL, input="Say hi.", max_output_tokens=200, temperature=0)
    assert whole.output_text == final.output_text
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_streamed_function_call(client):
    with client.responses.stream(model=MODEL, input=ASK, tools=[WEATHER], max_output_tokens=60, temperature=0,
                                 tool_choice={"type": "function", "name": "get_weather"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    [call] = final.output
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert call.type == "function_call" and events[-3].arguments == call.arguments == deltas
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])


def test_max_output_tokens_makes_an_incomplete_response(client, server):
    r = client.responses.create(model=MODEL, input="Write a long story about a dragon.", max_output_tokens=4,
                                temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 4 and r.output[0].status == "incomplete" and r.completed_at is None
    with httpx.stream("POST", f"{server}/v1/responses", timeout=60, json={
            "input": "Write a long story about a dragon.", "max_output_tokens": 4, "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line.startswith("event: ")]
    assert lines[-1] == "event: response.incomplete"


def test_an_error_mid_stream_is_an_error_event():
    """The chat path's error chunk (a deadline passed after the first token) ends the events with `error`, named in
    the Responses API's terms, and the response is not stored (the converter on its own: no server can be made to
    fail mid-stream on cue)."""
    req, store = ResponsesRequest(input="hi"), ResponseStore()
    base = ResponseObject(id="resp_x", status="in_progress", model=MODEL, text=TextConfig())

    async def chunks():
        yield 'data: {"choices": [{"index": 0, "delta": {"content": "Hel"}}]}\n\n'
        yield ('data: {"error": {"message": "the request\'s deadline passed", "type": "timeout_error", '
               '"param": "messages", "code": "deadline_exceeded"}}\n\n')
        yield "data: [DONE]\n\n"

    async def collect() -> list[str]:
        return [e async for e in _Events(base, _Finisher(store, req, (), None)).stream(chunks(), None)]

    sent = [json.loads(e.split("data: ", 1)[1]) for e in asyncio.run(collect())]
    assert [e["type"] for e in sent] == ["response.created", "response.in_progress", "response.output_item.added",
                                         "response.content_part.added", "response.output_text.delta", "error"]
    assert sent[-1]["code"] == "deadline_exceeded" and sent[-1]["param"] == "input" and sent[-1]["sequence_number"] == 5
    assert len(store) == 0


def test_the_store_keeps_its_bounds():
    """Count, bytes and age, least recently used out first (the store on its own: an hour is too long to wait)."""
    store = ResponseStore(max_age_s=3600, max_responses=2, max_bytes=100)
    for name in ("a", "b"):
        assert store.put(name, {}, (), 10)
    assert store.get("a") is not None  # now b is the least recently used
    store.put("c", {}, (), 10)
    assert store.get("b") is None and len(store) == 2
    assert store.get("a") is not None and store.get("c") is not None  # a is the least recently used again
    store.put("d", {}, (), 85)  # over 100 bytes with a and c: the least recently used goes until it fits
    assert store.get("a") is None and store.get("c") is not None and store.get("d") is not None
    assert not store.put("huge", {}, (), 101) and store.get("huge") is None
    old = ResponseStore(max_age_s=0.0)
    old.put("x", {}, (), 1)
    assert old.get("x") is None and len(old) == 0


LONE = "@lone@"  # sent as a JSON escape of a lone surrogate, which no encoder takes
F = {"type": "function", "name": "f"}
HOSTILE = [
    ({"input": "hi", "bogus": 1}, "bogus"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"model": "x"}, "input"),
    ({"input": LONE}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": LONE}]}]}, "input"),
    ({"input": "hi", "instructions": LONE}, "instructions"),
    ({"input": "hi", "metadata": {"k": LONE}}, "metadata.k"),
    ({"input": "hi", "tools": [{**F, "parameters": {"description": LONE}}]}, "tools.0.parameters"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {LONE: {}}}}},
     "text.format.json_schema.schema"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]}, "input"),
    ({"input": [{"type": "reasoning", "id": "r", "summary": []}]}, "input"),
    ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": "hi", "tools": [F], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice"),
    ({"input": "hi", "tools": [F], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [
        {"type": "function", "name": "g"}]}}, "tool_choice.tools.0.name"),
    ({"input": "hi", "tool_choice": "required"}, "tool_choice"),
    ({"input": "hi", "background": True}, "background"),
    ({"input": "hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "hi", "stream_options": {"include_obfuscation": False}}, "stream_options"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "hi", "max_output_tokens": "5"}, "max_output_tokens"),
    ({"input": "hi", "temperature": 3}, "temperature"),
    ({"input": "hi", "previous_response_id": "nope"}, "previous_response_id"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}},
     "text.format"),
    ({"input": "hi", "tools": [F], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "text.format"),
    ({"input": "hi", "tools": [{**F, "parameters": json.loads('{"a": ' * 100 + "1" + "}" * 100)}]},
     "tools.0.parameters"),
    ({"input": "word " * 3000}, "input"),
]


@pytest.mark.parametrize(("body", "param"), HOSTILE, ids=[p for _, p in HOSTILE])
def test_hostile_bodies_are_400s_naming_the_field(server, body, param):
    raw = json.dumps(body).replace(f'"{LONE}"', '"a\\ud800b"')
    response = httpx.post(f"{server}/v1/responses", content=raw.encode(), timeout=60,
                          headers={"content-type": "application/json"})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"]


def test_documented_fields_are_accepted_and_nulls_are_defaults(client):
    r = client.responses.create(
        model=MODEL, input="Hi", max_output_tokens=4, temperature=None, top_p=None, tools=None, store=None,
        include=["message.output_text.logprobs"], max_tool_calls=2, prompt_cache_key="k", prompt_cache_retention="24h",
        reasoning={"effort": "low"}, safety_identifier="s", service_tier="auto", top_logprobs=2, truncation="auto",
        background=False, text={"format": {"type": "text"}, "verbosity": "low"},
        extra_body={"top_k": None, "seed": 7, "priority": "critical"})
    assert r.status == "incomplete" and r.temperature == 1.0 and r.top_p == 1.0 and r.store is True
    assert r.truncation == "auto" and r.background is False


def test_oversized_and_malformed_bodies(server):
    url = f"{server}/v1/responses"
    assert httpx.post(url, content=b'{"input": "' + b"x" * (9 << 20) + b'"}', timeout=60).status_code == 413
    for raw in (b"[1]", b"{", b'{"input": ' + b"[" * 5000 + b"]" * 5000 + b"}"):
        assert httpx.post(url, content=raw, timeout=60).status_code == 400
    assert httpx.get(f"{server}/v1/responses/resp_unknown", timeout=10).status_code == 404
    bad_tag = httpx.post(url, json={"input": "hi"}, headers={"x-pagedserve-replica-tag": "zz"}, timeout=10)
    assert bad_tag.status_code == 400 and bad_tag.json()["error"]["param"] == "x-pagedserve-replica-tag"


def tag(name: str) -> str:
    return hashlib.sha256(name.encode()).hexdigest()[:8]


@pytest.mark.slow  # a router process
def test_router_sends_a_continuation_to_the_replica_that_holds_it(server, tmp_path):
    """Two replica entries over the one server (so either could answer) and round robin: the turn that names a
    stored response still goes to the entry whose tag its id carries. A replica that is down, or unknown, is a 404."""
    dead = f"http://127.0.0.1:{free_port()}"
    replicas = [{"url": server, "name": "left"}, {"url": server, "name": "right"}, {"url": dead, "name": "gone"}]
    with RouterProcess(tmp_path, replicas=replicas, policy="round_robin", health_interval_s=0.5) as router:
        router.wait_healthy(["left", "right"])
        routed = openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0, timeout=120)
        first = routed.responses.with_raw_response.create(model=MODEL, input="Hi, I am Ada.", max_output_tokens=6,
                                                          temperature=0)
        holder = first.headers["x-pagedserve-replica"]
        first_id = first.parse().id
        assert first_id.startswith(f"resp_{tag(holder)}_")
        for _ in range(3):  # round robin would alternate; each continuation goes back to the holder
            turn = routed.responses.with_raw_response.create(model=MODEL, input="Who am I?", max_output_tokens=6,
                                                             previous_response_id=first_id, temperature=0)
            assert turn.headers["x-pagedserve-replica"] == holder and turn.parse().status in ("completed", "incomplete")
        with routed.responses.stream(model=MODEL, input="Who am I?", previous_response_id=first_id,
                                     max_output_tokens=40, temperature=0) as stream:
            assert stream.get_final_response().id.startswith(f"resp_{tag(holder)}_")
        for missing, why in ((f"resp_{tag('gone')}_{'0' * 32}", "unavailable"),
                             (f"resp_{tag('nowhere')}_{'0' * 32}", "no replica")):
            with pytest.raises(openai.NotFoundError) as exc:
                routed.responses.create(model=MODEL, input="Hi", previous_response_id=missing, max_output_tokens=4)
            assert exc.value.body["param"] == "previous_response_id" and why in exc.value.body["message"]
        # GET and DELETE of a stored response go to its holder too; an id that is not one of ours is a 404 there.
        kept = routed.responses.with_raw_response.retrieve(first_id)
        assert kept.headers["x-pagedserve-replica"] == holder and kept.parse().id == first_id
        assert routed.responses.delete(first_id) is None
        for gone in (first_id, f"resp_{'0' * 32}", f"resp_{tag('gone')}_{'0' * 32}", "resp_..%2f..%2fhealth"):
            with pytest.raises(openai.NotFoundError):
                routed.responses.retrieve(gone)


@pytest.mark.slow  # a gateway process
def test_gateway_forwards_responses_with_keys_usage_and_traces(server, tmp_path):
    admin = "admin-secret"
    config = {"cache": {"enabled": False}, "key_defaults": {"rpm": 600},
              "providers": {"local": {"base_url": f"{server}/v1", "timeout_s": 60, "models": {
                  "small": {"name": MODEL, "input": 100.0, "output": 400.0}}}},
              "routes": {"assistant": {"small": ["local/small"]}}}
    process, url = gateway("responses-gw", config, tmp_path, admin)
    with contextlib.ExitStack() as stack:
        stack.enter_context(process)
        key = json.loads(cli("gateway", "keys", "create", "--config", str(tmp_path / "responses-gw.yaml"),
                             "--user", "ada"))["key"]
        gw = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=120)
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).responses.create(
                model="assistant", input="Hi")
        raw = gw.responses.with_raw_response.create(model="assistant", input="Name a color.", max_output_tokens=8,
                                                    temperature=0)
        first = raw.parse()
        assert first.status in ("completed", "incomplete") and first.output_text

        def trace(trace_id: str) -> dict | None:
            traces = httpx.get(f"{url}/admin/traces?limit=50", headers={"authorization": f"Bearer {admin}"},
                               timeout=10).json()["data"]
            return next((t for t in traces if t["trace_id"] == trace_id), None)  # written once it is settled
        seen = wait_for(lambda: trace(raw.headers["x-gateway-trace-id"]), 30, "the trace")
        assert (seen["prompt_tokens"], seen["completion_tokens"]) == (first.usage.input_tokens,
                                                                     first.usage.output_tokens)
        assert seen["endpoint"] == "responses" and seen["status"] == 200 and seen["cost_usd"] > 0
        with gw.responses.with_streaming_response.create(model="assistant", input="And another?", stream=True,
                                                         previous_response_id=first.id, max_output_tokens=8,
                                                         temperature=0) as streamed:
            trace_id = streamed.headers["x-gateway-trace-id"]
            events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: ")]
        assert events[0]["type"] == "response.created" and events[-1]["type"] in ("response.completed",
                                                                                  "response.incomplete")
        usage = events[-1]["response"]["usage"]
        seen = wait_for(lambda: trace(trace_id), 30, "the streamed request's trace")
        assert (seen["prompt_tokens"], seen["completion_tokens"]) == (usage["input_tokens"], usage["output_tokens"])
        assert usage["input_tokens"] > first.usage.total_tokens - 8  # the stored turn was prepended
