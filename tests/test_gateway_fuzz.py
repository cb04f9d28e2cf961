"""Schemathesis against a real gateway's OpenAPI schema (/openapi.json): valid and invalid inputs for every
operation, with a fixed seed and a bounded number of examples. No input may give a 5xx, and every answer
must match the schema (status declared, OpenAI error shape, content type). The provider is the stand-in
of gateway_stub_provider.py: what is fuzzed is the gateway's handling of input, and thousands of answers
from a real model would not fit in a few minutes.

Every body field the gateway reads is declared in that schema, so it is fuzzed: tools, tool_choice,
response_format and the messages' tool fields on chat, and the index admin bodies (documents, search); a test
checks they stay declared. The printed totals are the reliability table's (docs/reliability.md): requests
tried, 5xx seen, and requests per operation.
"""
from __future__ import annotations

import contextlib
import json
from collections import Counter

import httpx
import pytest
import schemathesis
from gateway_support import cli, gateway, start_all, stub_provider
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

pytestmark = pytest.mark.slow

ADMIN = "admin-secret"
EXAMPLES = 60  # per operation and generation mode: ~1,300 requests, two minutes or so on 2 cores
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    stub, stub_url = stub_provider("fuzz-stub", tmp)
    config = {"max_body_bytes": 65536, "key_defaults": {"rpm": 10**6},
              "providers": {"stub": {"base_url": stub_url + "/v1", "models": {"small": {"name": "stub"}}}},
              "routes": {"chat": {"small": ["stub/small"], "sources": ["wiki"]}}}
    process, url = gateway("fuzz-gw", config, tmp, ADMIN)
    with contextlib.ExitStack() as stack:
        start_all(stack, stub, process)
        key = json.loads(cli("gateway", "keys", "create", "--config", str(tmp / "fuzz-gw.yaml"), "--user", "fz"))
        yield url, key["key"]


def fuzz(operation, mode, url: str, auth: dict, tally: dict) -> None:
    """EXAMPLES generated cases of one operation in one mode, each sent and checked; failures are collected."""
    @seed(13)
    @settings(max_examples=EXAMPLES, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        response = case.call(base_url=url, headers=auth, timeout=30)
        tally["requests"] += 1
        tally["operations"][f"{case.method} {case.path}"] += 1
        tally["5xx"] += response.status_code >= 500
        try:
            case.validate_response(response, checks=CHECKS, headers=auth)
        except AssertionError as e:  # collect every kind of failure, not only the first
            tally["failures"].append(f"{case.method} {case.path} ({mode.value}): {str(e)[:300]}")
    try:
        run()
    except Unsatisfiable:  # nothing to make invalid (GET /health has no input): no negative cases
        assert mode is schemathesis.GenerationMode.NEGATIVE


def test_fuzzed_input_never_gets_a_5xx_or_an_answer_off_the_schema(target):
    url, token = target
    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    tally = {"requests": 0, "5xx": 0, "failures": [], "operations": Counter()}
    for operation in (result.ok() for result in schema.get_all_operations()):
        # The admin key for admin operations, an API key for the rest: both must hold against bad input.
        auth = {"authorization": f"Bearer {ADMIN if operation.path.startswith('/admin') else token}"}
        for mode in schemathesis.GenerationMode:
            fuzz(operation, mode, url, auth, tally)
    failures = tally["failures"]
    print(json.dumps({"requests": tally["requests"], "5xx": tally["5xx"], "failures": len(failures),
                      "operations": tally["operations"]}))
    assert tally["requests"] >= 10 * EXAMPLES
    for operation in ("POST /v1/chat/completions", "POST /v1/completions", "POST /admin/index/{source}/documents",
                      "POST /admin/index/{source}/search", "DELETE /admin/index/{source}/documents/{name}"):
        assert tally["operations"][operation] >= EXAMPLES, tally["operations"]
    assert tally["5xx"] == 0 and failures == [], "\n".join(failures[:20])
    assert httpx.get(url + "/health", timeout=5).status_code == 200


def test_the_schema_declares_the_fields_the_gateway_reads(target):
    """What is not declared is not fuzzed: the tool and format fields, and every index admin operation."""
    url, _ = target
    doc = httpx.get(url + "/openapi.json", timeout=10).json()
    schemas = doc["components"]["schemas"]
    assert {"messages", "tools", "tool_choice", "parallel_tool_calls", "response_format", "max_tokens",
            "route", "sources", "cache"} <= schemas["ChatRequest"]["properties"].keys()
    assert {"role", "content", "name", "tool_calls", "tool_call_id"} <= schemas["Message"]["properties"].keys()
    assert {"name", "description", "parameters"} <= schemas["FunctionDefinition"]["properties"].keys()
    assert {"type", "json_schema"} <= schemas["ResponseFormat"]["properties"].keys()
    operations = {f"{method.upper()} {path}" for path, ops in doc["paths"].items() for method in ops}
    assert {"GET /admin/index", "GET /admin/index/{source}", "POST /admin/index/{source}/documents",
            "DELETE /admin/index/{source}", "DELETE /admin/index/{source}/documents/{name}",
            "POST /admin/index/{source}/search"} <= operations
    for path in ("/admin/index/{source}/documents", "/admin/index/{source}/search"):
        assert doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
