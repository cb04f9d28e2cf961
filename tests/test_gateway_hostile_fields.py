"""Issue #36, finding 6 and the internal fields, against a real gateway process: a lone UTF-16 surrogate (which
JSON can carry and no UTF-8 encoder takes) in any text field of any request body is a 400 naming the field,
never a 500, on every endpoint; fields internal to a pagedserve cluster (kv_transfer_params) are refused
from clients and never reach a provider; hostile index admin input (names, paths, sizes) gets a 4xx.

The text fields are not listed by hand: every string the gateway's own OpenAPI schema declares in a request
body is tried, so a field added to a schema is covered without touching this test."""
from __future__ import annotations

import contextlib
import itertools
import json

import httpx
import pytest
from gateway_support import gateway, start_all, stub_provider, stub_state

from pagedserve.gateway.protocol import INTERNAL_FIELDS
from pagedserve.gateway.retrieval.indexer import MAX_DOCUMENT_BYTES

pytestmark = pytest.mark.slow

ADMIN = "admin-secret"
LONE = "a\ud800b"  # sent as the JSON escape "a\ud800b" (json.dumps escapes it: ensure_ascii)
MINIMAL = {  # a valid body per operation, which the test then spoils one field at a time
    "/v1/chat/completions": {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"model": "chat", "prompt": "hi", "max_tokens": 2},
    "/v1/responses": {"model": "chat", "input": "hi", "max_output_tokens": 2},
    "/admin/keys": {"user": "x"},
    "/admin/sources/{name}/bump": {},
    "/admin/index/{source}/documents": {"documents": [{"name": "a.md", "content": "# A\n\ntext"}]},
    "/admin/index/{source}/search": {"query": "text"},
}
PATHS = {"{name}": "wiki", "{source}": "wiki"}


@pytest.fixture(scope="module")
def gw(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hostile-fields")
    stub, stub_url = stub_provider("fields-stub", tmp)
    config = {"key_defaults": {"rpm": 10**6}, "max_body_bytes": 65536,
              "providers": {"stub": {"base_url": stub_url + "/v1", "models": {"small": {"name": "stub"}}}},
              "routes": {"chat": {"small": ["stub/small"]}}}
    process, url = gateway("fields-gw", config, tmp, ADMIN)
    with contextlib.ExitStack() as stack:
        start_all(stack, stub, process)
        key = httpx.post(url + "/admin/keys", json={"user": "hal"}, headers={"authorization": f"Bearer {ADMIN}"},
                         timeout=10).json()["key"]
        yield {"url": url, "stub": stub_url, "key": key}


def send(gw: dict, path: str, body) -> httpx.Response:
    token = ADMIN if path.startswith("/admin") else gw["key"]
    url = gw["url"] + path.replace("{name}", PATHS["{name}"]).replace("{source}", PATHS["{source}"])
    return httpx.post(url, content=json.dumps(body).encode(), timeout=60,
                      headers={"authorization": f"Bearer {token}", "content-type": "application/json"})


def text_paths(schema: dict, components: dict, path: tuple = (), seen: frozenset = frozenset()) -> set[tuple]:
    """Every path to a string in the bodies a JSON schema allows (a list's items at index 0)."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        if name in seen:
            return set()
        schema, seen = components[name], seen | {name}
    found = set()
    for branch in schema.get("anyOf", []) + schema.get("oneOf", []) + schema.get("allOf", []):
        found |= text_paths(branch, components, path, seen)
    types = schema.get("type") if isinstance(schema.get("type"), list) else [schema.get("type")]
    if "string" in types or "enum" in schema or "const" in schema:
        found.add(path)
    for name, sub in schema.get("properties", {}).items():
        found |= text_paths(sub, components, (*path, name), seen)
    if isinstance(schema.get("items"), dict):
        found |= text_paths(schema["items"], components, (*path, 0), seen)
    return found


def spoiled(body: dict, path: tuple) -> dict:
    """A copy of body with LONE at path, building the objects and lists on the way."""
    body = json.loads(json.dumps(body))
    node = body
    for step, following in itertools.pairwise(path):
        empty = [] if isinstance(following, int) else {}
        if isinstance(step, int):
            node.extend(empty for _ in range(step + 1 - len(node)))
            if not isinstance(node[step], (dict, list)):
                node[step] = empty
        elif not isinstance(node.get(step), (dict, list)):
            node[step] = empty
        node = node[step]
    if isinstance(path[-1], int):
        node[:] = [LONE]
    else:
        node[path[-1]] = LONE
    return body


def test_a_lone_surrogate_in_any_text_field_of_any_body_is_a_400_naming_it(gw):
    doc = httpx.get(gw["url"] + "/openapi.json", timeout=10).json()
    components, tried = doc["components"]["schemas"], []
    for path, operations in doc["paths"].items():
        body_schema = operations.get("post", {}).get("requestBody", {}).get("content", {}).get("application/json")
        if body_schema is None:
            continue
        for field in sorted(text_paths(body_schema["schema"], components), key=str):
            param = ".".join(map(str, field))
            response = send(gw, path, spoiled(MINIMAL[path], field))
            assert response.status_code == 400, (path, param, response.text)
            error = response.json()["error"]
            assert error["param"] == param and "surrogate" in error["message"], (path, error)
            tried.append(f"{path} {param}")
        for where in ((), ("nested",)):  # in a field's name, at the top or deeper
            body = {**MINIMAL[path], "x": {LONE: 1}} if where else {**MINIMAL[path], LONE: 1}
            response = send(gw, path, body)
            assert response.status_code == 400 and response.json()["error"]["param"] == ("x" if where else None)
    print(json.dumps({"text_fields_tried": len(tried), "5xx": 0}))
    named = {"/v1/chat/completions messages.0.content", "/v1/chat/completions messages.0.name",
             "/v1/completions prompt", "/v1/chat/completions tools.0.function.description",
             "/v1/chat/completions messages.0.tool_call_id", "/v1/chat/completions messages.0.tool_calls.0.id",
             "/v1/chat/completions response_format.json_schema.name", "/admin/index/{source}/search query",
             "/admin/index/{source}/documents documents.0.name", "/admin/index/{source}/documents documents.0.content"}
    assert named <= set(tried) and len(tried) >= 30, sorted(set(tried))
    # Fields no schema declares (a content part's text, a vendor's extra) are refused all the same.
    for field, param in (({"messages": [{"role": "user", "content": [{"type": "text", "text": LONE}]}]},
                          "messages.0.content.0.text"), ({"vendor_extra": {"note": [LONE]}}, "vendor_extra.note.0")):
        response = send(gw, "/v1/chat/completions", {**MINIMAL["/v1/chat/completions"], **field})
        assert response.status_code == 400 and response.json()["error"]["param"] == param
    # A surrogate pair is one character, and fine.
    pair = {**MINIMAL["/v1/chat/completions"], "messages": [{"role": "user", "content": "I like \U0001f600"}]}
    assert send(gw, "/v1/chat/completions", pair).status_code == 200


def test_internal_fields_are_refused_on_every_endpoint_and_never_forwarded(gw):
    asked = stub_state(gw["stub"])["requests"]
    handle = {"do_remote_prefill": True, "remote_url": "http://169.254.169.254", "lease": "x"}
    for path, body in MINIMAL.items():
        for field in sorted(INTERNAL_FIELDS):
            response = send(gw, path, {**body, field: handle})
            assert response.status_code == 400, (path, response.text)
            assert response.json()["error"]["param"] in (field, None), response.text
    assert stub_state(gw["stub"])["requests"] == asked  # nothing reached the provider
    assert send(gw, "/v1/chat/completions", MINIMAL["/v1/chat/completions"]).status_code == 200
    assert not INTERNAL_FIELDS & stub_state(gw["stub"])["last_body"].keys()


def test_hostile_index_admin_input_gets_a_4xx(gw):
    admin = {"authorization": f"Bearer {ADMIN}"}
    url = gw["url"]
    documents = url + "/admin/index/wiki/documents"
    cases = [
        ({"documents": [{"name": "a\nb.md", "content": "x"}]}, 400, "documents.0.name"),
        ({"documents": [{"name": "x" * 600 + ".md", "content": "x"}]}, 400, "documents.0.name"),
        ({"documents": [{"name": "a.md", "content": "x", "path": "/etc/passwd"}]}, 400, "path"),  # no paths on its disk
        ({"documents": [{"name": "a.md", "content_base64": "!!"}]}, 400, "documents[0]"),
        ({"documents": [{"name": "a.md", "content": "# A\n\nx"}], "prune_prefix": "\u0000"}, 400, "prune_prefix"),
        ({"documents": [{"name": "big.md", "content": "x" * (MAX_DOCUMENT_BYTES + 1)}]}, 400, "larger than 16 MiB"),
        ({"documents": [{"name": "big.md", "content": "x" * (64 << 20)}]}, 413, "exceeds"),
    ]
    for body, status, words in cases:
        response = httpx.post(documents, json=body, headers=admin, timeout=120)
        assert response.status_code == status and words in response.json()["error"]["message"], (
            str(body)[:200], response.text[:300])
    for body in ({"query": "x", "k": 10**30}, {"query": "x", "mode": "everything"}, {"query": "x", "min_score": 7},
                 {"query": ""}, {"query": "x" * 200_000}):
        response = httpx.post(url + "/admin/index/wiki/search", json=body, headers=admin, timeout=30)
        assert response.status_code == 400, (body, response.text)
    nan = httpx.post(url + "/admin/index/wiki/search", content=b'{"query": "x", "min_score": NaN}', headers=admin)
    assert nan.status_code == 400
    for method, path in (("GET", "/admin/index/%ED%A0%80"), ("GET", "/admin/index/..%2F..%2Fetc"),
                         ("DELETE", "/admin/index/wiki/documents/..%2F..%2Fetc%2Fpasswd"),
                         ("POST", "/admin/index/" + "x" * 300 + "/search"), ("POST", "/admin/sources/%00/bump"),
                         ("GET", "/admin/traces?limit=-1&user=%ED%A0%80"), ("DELETE", "/admin/keys/%ED%A0%80")):
        response = httpx.request(method, url + path, headers=admin, json={"query": "x"} if method == "POST" else None,
                                 timeout=30)
        assert response.status_code < 500 and (response.status_code == 200 or response.json()["error"]["message"])
