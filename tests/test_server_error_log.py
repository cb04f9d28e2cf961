"""A client's error is one log line that says why (type, parameter, request id, message), not only a status: the
reason used to be in the body alone. Text from the client cannot break the line."""
from __future__ import annotations

import httpx

from tests.server_support import ServerProcess


def test_a_client_error_logs_one_line_with_its_reason(tmp_path):
    log = tmp_path / "server.log"
    server = ServerProcess(["--dtype", "float32", "--kv-cache-memory", "16MiB", "--embedding-model", "none"],
                           log_path=log)
    try:
        named = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "temperature": 7},
                           headers={"x-request-id": "abc-123"})
        assert named.status_code == 400 and named.headers["x-request-id"] == "abc-123"
        hostile = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "bogus\nfield\x1b[2J": 1},
                             headers={"x-request-id": "not a plain\tid"})
        assert hostile.status_code == 400
        generated = hostile.headers["x-request-id"]
        assert len(generated) == 16 and generated.isalnum()
        assert httpx.get(server.url + "/v1/models/nope").status_code == 404
    finally:
        server.stop()
    lines = [line for line in log.read_text().splitlines() if "pagedserve.server.errors" in line]
    assert len(lines) == 3, lines
    assert "-> 400 invalid_request_error param='temperature'" in lines[0] and "request=abc-123" in lines[0]
    assert "less than or equal to 2" in lines[0]
    assert f"request={generated}" in lines[1] and "\\n" in lines[1] and "\x1b" not in lines[1]
    assert "-> 404 not_found_error param='model'" in lines[2]
