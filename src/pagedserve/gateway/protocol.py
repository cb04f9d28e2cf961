"""What the gateway reads from a request body. Unknown fields pass through to the provider, which
validates them; the gateway's own extensions (route, sources, cache) are removed before forwarding.
"""
from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pagedserve.gateway.errors import APIError

EXTENSION_FIELDS = ("route", "sources", "cache")


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(str(part.get("text", "")) for part in self.content)
        return self.content or ""


class GatewayRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str = Field(min_length=1)
    stream: bool = False
    n: int = Field(1, ge=1, le=64)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    route: Literal["small", "large"] | None = Field(None, description="pin the difficulty tier")
    sources: list[str] = Field(default_factory=list, description="knowledge sources the answer depends on")
    cache: bool = Field(True, description="false: neither read nor write the semantic cache")

    @property
    def deterministic(self) -> bool:
        return self.temperature == 0 and self.n == 1

    def completion_limit(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default


class ChatRequest(GatewayRequest):
    messages: list[Message] = Field(min_length=1)

    def query(self) -> tuple[str | None, list]:
        """The last user message (what the semantic cache matches) and everything before it."""
        for i in range(len(self.messages) - 1, -1, -1):
            if self.messages[i].role == "user":
                context = [m.model_dump(exclude_none=True) for m in self.messages[:i]]
                return self.messages[i].text(), context
        return None, []

    def prompt_chars(self) -> int:
        return sum(len(m.text()) + 16 for m in self.messages)


class CompletionRequest(GatewayRequest):
    prompt: str | list[str] | list[int] | list[list[int]]

    def completion_limit(self, default: int) -> int:
        return self.max_tokens or 16  # OpenAI's default for completions

    def query(self) -> tuple[str | None, list]:
        return (self.prompt, []) if isinstance(self.prompt, str) else (None, [])

    def prompt_chars(self) -> int:
        return len(self.prompt) if isinstance(self.prompt, str) else len(json.dumps(self.prompt))


def parse_request(raw: bytes, kind: str) -> tuple[GatewayRequest, dict]:
    """The validated request and the body to forward; APIError(400) says what is wrong."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise APIError(400, "request body is not valid JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    model = ChatRequest if kind == "chat" else CompletionRequest
    try:
        request = model.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        param = ".".join(str(p) for p in err.get("loc", ())) or None
        message = err.get("msg", "invalid request").removeprefix("Value error, ")
        if err.get("type") == "missing":
            message = f"'{param}' is a required property"
        raise APIError(400, f"{message} (parameter '{param}')" if param else message, param=param,
                       code="invalid_value") from None
    forward = {k: v for k, v in body.items() if k not in EXTENSION_FIELDS}
    return request, forward
