"""What the gateway reads from a request body. Unknown fields pass through to the provider, which
validates them; the gateway's own extensions (route, sources, cache) are removed before forwarding, and
fields internal to a pagedserve cluster (INTERNAL_FIELDS) are refused: no client may set them. Text that
JSON can carry but Unicode cannot (a lone UTF-16 surrogate) is refused in any field, known or not.

The gateway also bounds what a request can cost before it is sent (prompt_bound, completion_bound): budgets
and token limits reserve that worst case, so it must be a bound the provider's real usage cannot pass.
"""
from __future__ import annotations

import json
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from pagedserve.gateway.errors import APIError

EXTENSION_FIELDS = ("route", "sources", "cache")
# Set by a pagedserve router on its workers' requests (disaggregated prefill/decode: a lease on KV blocks and
# the peer to pull them from); a client that could send one would point a decode worker at any URL.
INTERNAL_FIELDS = frozenset({"kv_transfer_params"})
MAX_DEPTH = 64  # JSON nesting: tool schemas nest a dozen levels; 100,000 would overflow the parser's stack
MAX_TOKENS = 1 << 24  # above any model's context: larger values are mistakes, and would overflow int64 nanodollars
PROMPT_OVERHEAD = 64  # tokens a chat template may add beyond the body (role markers, a default system prompt)
SourceName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[\w.:/-]+$")]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    arguments: str = Field(description="a JSON object, as a string")


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    id: str
    type: str = "function"
    function: FunctionCall


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant turn's calls")
    tool_call_id: str | None = Field(None, description="a tool turn: the call it answers")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(str(part.get("text", "")) for part in self.content)
        return self.content or ""

    @property
    def text_only(self) -> bool:
        """False when a content part is not text (an image, audio): the cache cannot tell two of them apart."""
        return not isinstance(self.content, list) or all(p.get("type", "text") == "text" for p in self.content)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool | None = None


class GatewayRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # "10" is not a max_tokens: the schema says integer
    limit_field: ClassVar[str] = "max_tokens"  # where admission writes the bound when the body sets none
    model: str = Field(min_length=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=64)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    route: Literal["small", "large"] | None = Field(None, description="pin the difficulty tier")
    sources: list[SourceName] = Field(default_factory=list, max_length=32,
                                      description="knowledge sources the answer depends on")
    cache: bool = Field(True, description="false: neither read nor write the semantic cache")

    @property
    def deterministic(self) -> bool:
        return self.temperature == 0 and self.n == 1

    @property
    def offers_tools(self) -> bool:
        """Whether the answer may call a tool (never cached, never handed to another request)."""
        return False

    def completion_limit(self, default: int) -> int:
        """Tokens one choice may produce: what the request says, else `default` (which is then forwarded)."""
        return self.max_completion_tokens or self.max_tokens or default

    @property
    def unbounded(self) -> bool:
        """Whether the body sets no bound on the tokens of an answer."""
        return self.max_tokens is None and self.max_completion_tokens is None

    def completion_bound(self, default: int) -> int:
        """Completion tokens the whole request may produce: every choice of every prompt."""
        return self.completion_limit(default) * self.n


class ChatRequest(GatewayRequest):
    messages: list[Message] = Field(min_length=1)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None

    def query(self) -> tuple[str | None, list]:
        """The last user message (what the semantic cache matches) and the rest of the conversation around
        it, trailing turns included: two requests may share an answer only if all of that is equal."""
        for i in range(len(self.messages) - 1, -1, -1):
            if self.messages[i].role == "user":
                dumped = [m.model_dump(exclude_none=True) for m in self.messages]
                dumped[i].pop("content", None)  # the query's own text is matched by similarity
                return self.messages[i].text(), dumped
        return None, []

    @property
    def text_only(self) -> bool:
        return all(m.text_only for m in self.messages)

    @property
    def offers_tools(self) -> bool:
        return bool(self.tools or (self.model_extra or {}).get("functions"))

    def prompt_bound(self) -> int:
        """Prompt tokens cannot exceed the UTF-8 bytes of what reaches the template (a token is at least one
        byte) plus the template's own overhead; tools and functions are part of the prompt too."""
        tools = [t.model_dump(exclude_none=True, by_alias=True) for t in self.tools or []]
        parts = [m.model_dump(exclude_none=True) for m in self.messages] + [tools, (self.model_extra or {}).get("functions")]
        return _utf8_bytes(parts) + PROMPT_OVERHEAD


class CompletionRequest(GatewayRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = Field(None, ge=1, le=64)

    def completion_limit(self, default: int) -> int:
        return self.max_tokens or 16  # OpenAI's default for completions

    def completion_bound(self, default: int) -> int:
        prompts = len(self.prompt) if isinstance(self.prompt, list) and self.prompt and not isinstance(
            self.prompt[0], int) else 1
        return self.completion_limit(default) * max(self.n, self.best_of or 1) * prompts

    def query(self) -> tuple[str | None, list]:
        return (self.prompt, []) if isinstance(self.prompt, str) else (None, [])

    @property
    def text_only(self) -> bool:
        return True

    def prompt_bound(self) -> int:
        """Token ids count as themselves, text as its UTF-8 bytes; `suffix` is prompt too."""
        prompts = [self.prompt] if isinstance(self.prompt, str) or not self.prompt or isinstance(
            self.prompt[0], int) else self.prompt
        total = sum(len(p) if isinstance(p, list) else len(p.encode()) for p in prompts)
        suffix = (self.model_extra or {}).get("suffix")
        return total + (_utf8_bytes(suffix) if suffix else 0) + PROMPT_OVERHEAD * len(prompts)


class ResponsesRequest(GatewayRequest):
    """OpenAI's Responses API, forwarded to providers that speak it. Its prompt bound covers the body only: the
    conversation a previous_response_id continues is stored at the provider, so its tokens are known only from
    the usage the answer reports (and charged from it)."""
    limit_field: ClassVar[str] = "max_output_tokens"
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    tools: list[dict] | None = Field(None, max_length=128)
    previous_response_id: str | None = None

    def completion_limit(self, default: int) -> int:
        return self.max_output_tokens or default

    @property
    def unbounded(self) -> bool:
        return self.max_output_tokens is None

    def prompt_bound(self) -> int:
        return _utf8_bytes([self.input, self.instructions, self.tools]) + PROMPT_OVERHEAD


def _utf8_bytes(value) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


def too_deep(value, limit: int = MAX_DEPTH) -> bool:
    """Whether JSON nests deeper than `limit` (iterative: a deep value must not exhaust the stack here)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
    return False


def lone_surrogate(value) -> tuple[str | None, bool] | None:
    """Where JSON carried text no UTF-8 encoder takes (a lone UTF-16 surrogate, "\\ud800"): the dotted path of
    the string, or of the object whose field name holds it (None at the top), and whether it is a name.
    None if there is none. Iterative, like too_deep."""
    stack = [(value, ())]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if not _encodable(item):
                return ".".join(map(str, path)), False
            continue
        if isinstance(item, dict):
            for k in item:
                if not _encodable(k):
                    return ".".join(map(str, path)) or None, True
            entries = item.items()
        else:
            entries = enumerate(item)
        stack.extend((v, (*path, k)) for k, v in entries if isinstance(v, (str, dict, list)))
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def load_json_object(raw: bytes) -> dict:
    """A request body as a JSON object; APIError(400) for anything else (bad UTF-8, too deep, not an object,
    a lone surrogate in any string: it would fail every encoder downstream, from SQLite to the tokenizer)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise APIError(400, "request body is not valid JSON (or nests too deeply)", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "request body must be a JSON object", code="invalid_json")
    if too_deep(body):
        raise APIError(400, f"request body nests deeper than {MAX_DEPTH} levels", code="invalid_json")
    found = lone_surrogate(body)
    if found is not None:
        param, in_name = found
        where = "a field name" + (f" in '{param}'" if param else "") if in_name else f"parameter '{param}'"
        raise APIError(400, f"text must be valid Unicode: a lone UTF-16 surrogate in {where}", param=param,
                       code="invalid_value")
    return body


def validation_error(e: ValidationError) -> APIError:
    """A pydantic error as OpenAI's 400, naming the first offending parameter."""
    err = e.errors()[0]
    param = ".".join(str(p) for p in err.get("loc", ())) or None
    message = err.get("msg", "invalid request").removeprefix("Value error, ")
    if err.get("type") == "missing":
        message = f"'{param}' is a required property"
    return APIError(400, f"{message} (parameter '{param}')" if param else message, param=param, code="invalid_value")


def parse_request(raw: bytes, kind: str) -> tuple[GatewayRequest, dict]:
    """The validated request and the body to forward; APIError(400) says what is wrong."""
    body = load_json_object(raw)
    model = {"chat": ChatRequest, "responses": ResponsesRequest}.get(kind, CompletionRequest)
    internal = sorted(INTERNAL_FIELDS & body.keys())
    if internal:
        raise APIError(400, f"{internal[0]} is internal to a pagedserve cluster (its router sets it between its "
                       "workers); a client cannot send it", param=internal[0], code="invalid_value")
    try:
        request = model.model_validate(body)
    except ValidationError as e:
        raise validation_error(e) from None
    forward = {k: v for k, v in body.items() if k not in EXTENSION_FIELDS}
    return request, forward
