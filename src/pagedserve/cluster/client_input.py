"""What the router takes from a client: the body (bounded while it is read, chunked or not) and the
headers it routes on, read strictly. A header sent several times, or with an empty or malformed value,
is never read as absent: residency tags add up (a client can add constraints, never drop one), and
what cannot be read as one value is refused with a 400."""
from __future__ import annotations

import json
from collections.abc import Callable

from starlette.datastructures import Headers
from starlette.requests import Request

from pagedserve.cluster.regions import OPTIONAL_WHITESPACE, parse_name, parse_residency


class Refusal(Exception):
    """The client's request cannot be routed; answered in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, refused with 413 as soon as it passes `limit` (declared or as it arrives)."""
    declared = request.headers.getlist("content-length")
    if any(v.isascii() and v.isdigit() and int(v) > limit for v in declared):
        raise Refusal(413, f"request body is larger than {limit} bytes", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise Refusal(413, f"request body is larger than {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def json_object(body: bytes) -> dict:
    try:
        payload = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise Refusal(400, f"request body is not valid JSON: {exc}") from None
    if not isinstance(payload, dict):
        raise Refusal(400, "request body must be a JSON object")
    return payload


def residency(headers: Headers, name: str) -> frozenset[str]:
    """Every tag of every `name` header: all required. Present but naming no tag, or naming something
    that is not a tag: refused, since the sender meant a constraint."""
    values = headers.getlist(name)
    try:
        tags = frozenset().union(*(parse_residency(v) for v in values))
    except ValueError as exc:
        raise Refusal(400, f"header {name}: {exc}", param=name, code="invalid_header") from None
    if values and not tags:
        raise Refusal(400, f"header {name} names no residency tag; send the tags a replica must carry "
                           "(e.g. 'eu'), or no such header", param=name, code="invalid_header")
    return tags


def client_region(headers: Headers, name: str) -> str | None:
    try:
        return single(headers, name, parse_name)
    except ValueError as exc:
        raise Refusal(400, f"header {name}: {exc}", param=name, code="invalid_header") from None


def single(headers: Headers, name: str, normalize: Callable[[str], str] = str) -> str | None:
    """The one non-empty value of `name` (repeats of the same normalized value are one), or None when
    absent or empty; different values are refused rather than one picked."""
    values = {normalize(v.strip(OPTIONAL_WHITESPACE)) for v in headers.getlist(name)
              if v.strip(OPTIONAL_WHITESPACE)}
    if len(values) > 1:
        raise Refusal(400, f"header {name} has several values {sorted(values)}; send one",
                      param=name, code="invalid_header")
    return values.pop() if values else None
