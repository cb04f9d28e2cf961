"""Request and response bodies of the OpenAI-compatible API (pydantic), as served and as documented."""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUseDefault, core_schema


def _valid_unicode(text: str) -> str:
    """JSON can escape a lone UTF-16 surrogate ("\\ud800"); no tokenizer or UTF-8 encoder can take one."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text must be valid Unicode: a lone UTF-16 surrogate at character {exc.start}") from None
    return text


Text = Annotated[str, AfterValidator(_valid_unicode)]
Prompt = Annotated[str, Field(min_length=1), AfterValidator(_valid_unicode)]
TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]  # the engine keeps seeds in int64
Stop = Text | Annotated[list[Text], Field(max_length=16)] | None
# OpenAI's limits: at most 300 tokens, biases in [-100, 100]; a key is a token id written without leading zeros.
LogitBias = Annotated[dict[Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,8})$")],
                           Annotated[float, Field(ge=-100, le=100)]],
                      Field(max_length=300, json_schema_extra={"additionalProperties": False})]


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class NullIsDefault:
    """`null` for an optional field means its default, as in OpenAI's API (SDKs and clients send nulls for
    fields they leave unset): the value validates as the default, and the schema says null is accepted."""

    @staticmethod
    def _default_if_null(value: Any) -> Any:
        if value is None:
            raise PydanticUseDefault()
        return value

    def __get_pydantic_core_schema__(self, source: Any, handler: Any) -> core_schema.CoreSchema:
        return core_schema.no_info_before_validator_function(self._default_if_null, handler(source))

    def __get_pydantic_json_schema__(self, schema: core_schema.CoreSchema, handler: Any) -> dict:
        return {"anyOf": [handler(schema), {"type": "null"}]}


OrDefault = NullIsDefault()
IGNORED = "x-pagedserve-ignored"  # marks a field that is accepted and not acted upon


def ignored(what: str) -> Any:
    """An OpenAI field this server accepts (typed, so a malformed value is still a 400) but does not act on:
    marked IGNORED, so that serving.py logs each one a request sets at debug level, and left out of model_dump
    so that nothing downstream sees it."""
    return Field(None, description=f"accepted and ignored: {what}", exclude=True, json_schema_extra={IGNORED: True})


def ignored_fields(model: BaseModel, path: str = "") -> set[str]:
    """The ignored fields a request sets, as paths without indices ('store', 'messages.audio')."""
    found: set[str] = set()
    for name in model.model_fields_set:
        value, info = getattr(model, name), type(model).model_fields[name]
        if value is not None and _is_ignored(info):
            found.add(path + name)
        for child in value if isinstance(value, list) else [value]:
            if isinstance(child, BaseModel):
                found |= ignored_fields(child, f"{path}{name}.")
    return found


def _is_ignored(info: FieldInfo) -> bool:
    return isinstance(info.json_schema_extra, dict) and info.json_schema_extra.get(IGNORED) is True


class StrictModel(BaseModel):
    """Requests reject fields they don't know (OpenAI does too), so nothing is silently ignored, and take
    each value only in the JSON type the schema gives it (no true as 1, no "16" as 16)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _integral_floats_as_ints(cls, data: Any) -> Any:
        """JSON Schema's integer includes 1.0 and 1e3, which strict mode would refuse: they become ints
        (float fields take ints). Iterative, since the body may nest as deep as the JSON parser allows."""
        stack = [data]
        while stack:
            node = stack.pop()
            entries = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
            for key, value in list(entries):
                if isinstance(value, float) and value.is_integer():
                    node[key] = int(value)
                elif isinstance(value, dict | list):
                    stack.append(value)
        return data


# ---- errors ----

class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


# ---- shared request parts ----

class StreamOptions(StrictModel):
    include_usage: bool | None = Field(None, description="a last chunk with the usage (choices empty); default "
                                       "false, true when continuous_usage_stats is")
    continuous_usage_stats: Annotated[bool, OrDefault] = Field(
        False, description="vLLM extra: every chunk carries the usage so far (with include_usage, its default)")
    include_obfuscation: bool | None = ignored("no obfuscation field is ever sent")

    @property
    def final_usage(self) -> bool:
        return self.continuous_usage_stats if self.include_usage is None else self.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.continuous_usage_stats and self.final_usage


class JSONSchemaFormat(StrictModel):
    model_config = ConfigDict(populate_by_name=True)

    name: Text = Field(min_length=1, max_length=64)
    description: Text | None = None
    schema_: dict | None = Field(None, alias="schema", description="the JSON schema; absent: any JSON object")
    strict: bool | None = Field(None, description="accepted; the schema is always enforced")


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_for_json_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type 'json_schema', and only there")
        return self


class KVTransferParams(StrictModel):
    """Internal to a pagedserve cluster: which half of a disaggregated request this is. Accepted only on the
    peer routes (server/peer_routes.py), which its router signs; a client's request never carries it."""
    do_remote_decode: bool = Field(False, description="prefill here, decode elsewhere: answer with a lease")
    do_remote_prefill: bool = Field(False, description="the prompt was computed elsewhere: pull its KV first")
    remote_url: Text | None = Field(None, max_length=512, description="the prefill worker's base URL (an origin)")
    lease_id: str | None = Field(None, pattern=r"^[0-9a-f]{32}$")
    num_blocks: int | None = Field(None, ge=0, le=1 << 20)
    block_size: int | None = Field(None, ge=1, le=1 << 16)
    kv_format: str | None = Field(None, pattern=r"^[a-z0-9_]{1,32}$")
    tokens_sha: str | None = Field(None, pattern=r"^[0-9a-f]{32}$")
    expires_in_s: float | None = None
    expires_at: float | None = Field(None, description="when the sealed handle stops being valid (Unix time)")
    signature: str | None = Field(None, pattern=r"^[0-9a-f]{64}$", description="the prefill worker's seal")
    first_token_id: int | None = Field(None, ge=0, description="the first output token, sampled by the prefill "
                                       "worker: the decode worker streams it at once and goes on from it")

    @model_validator(mode="after")
    def _one_side(self):
        if self.do_remote_decode == self.do_remote_prefill:
            raise ValueError("kv_transfer_params: set exactly one of do_remote_decode and do_remote_prefill")
        if self.do_remote_prefill and None in (self.remote_url, self.lease_id, self.num_blocks, self.block_size,
                                               self.kv_format, self.tokens_sha, self.expires_at, self.signature):
            raise ValueError("kv_transfer_params with do_remote_prefill needs remote_url and the prefill worker's "
                             "sealed handle (lease_id, num_blocks, block_size, kv_format, tokens_sha, expires_at, "
                             "signature)")
        if self.remote_url is not None:
            _check_origin(self.remote_url)
        return self

    def handle(self) -> dict:
        """The fields the prefill worker sealed (server/peer_auth.py): all but the routing ones."""
        return self.model_dump(exclude={"do_remote_decode", "do_remote_prefill", "remote_url"}, exclude_none=True)


def _check_origin(url: str) -> None:
    """A peer's base URL is scheme://host[:port] and nothing else: no credentials, path, query or fragment
    that could steer a pull elsewhere."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if (parts.scheme not in ("http", "https") or not parts.hostname or parts.username is not None
            or parts.password is not None or parts.path not in ("", "/") or parts.query or parts.fragment
            or port == -1):
        raise ValueError("kv_transfer_params.remote_url must be a peer's origin, http(s)://host[:port]")


class SamplingFields(StrictModel):
    """Sampling fields common to completions and chat, including vLLM's extras."""

    model: Text | None = Field(None, description="served model name; defaults to the one model served")
    n: Annotated[int, OrDefault] = Field(1, ge=1, le=64)
    temperature: Annotated[float, OrDefault] = Field(1.0, ge=0.0, le=2.0)
    top_p: Annotated[float, OrDefault] = Field(1.0, gt=0.0, le=1.0)
    top_k: Annotated[int, OrDefault] = Field(-1, ge=-1, description="vLLM extra: -1 or 0 disables")
    min_p: Annotated[float, OrDefault] = Field(0.0, ge=0.0, le=1.0, description="vLLM extra")
    repetition_penalty: Annotated[float, OrDefault] = Field(1.0, gt=0.0, description="vLLM extra")
    presence_penalty: Annotated[float, OrDefault] = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: Annotated[float, OrDefault] = Field(0.0, ge=-2.0, le=2.0)
    seed: Seed | None = None
    stop: Stop = None
    stop_token_ids: list[TokenId] | None = Field(None, description="vLLM extra")
    ignore_eos: Annotated[bool, OrDefault] = Field(False, description="vLLM extra")
    min_tokens: Annotated[int, OrDefault] = Field(0, ge=0, description="vLLM extra")
    skip_special_tokens: Annotated[bool, OrDefault] = Field(True, description="vLLM extra")
    include_stop_str_in_output: Annotated[bool, OrDefault] = Field(False, description="vLLM extra")
    prompt_logprobs: int | None = Field(None, ge=0, le=20, description="vLLM extra: each prompt token's logprob "
                                        "and this many alternatives (the first token's is null)")
    response_format: ResponseFormat | None = Field(None, description="text, json_object or json_schema: "
                                                                     "enforced while decoding")
    guided_json: dict | Text | None = Field(None, description="vLLM extra: a JSON schema the output follows")
    guided_regex: Text | None = Field(None, description="vLLM extra: a regex the output matches")
    guided_choice: Annotated[list[Text], Field(min_length=1)] | None = Field(
        None, description="vLLM extra: the output is one of these strings")
    guided_grammar: Text | None = Field(None, description="vLLM extra: a Lark or GBNF (EBNF) grammar")
    logit_bias: LogitBias | None = Field(None, description="token id (a string) -> bias added to its logit before "
                                         "sampling: -100 bans it, 100 all but forces it; logprobs stay the model's own")
    stream: Annotated[bool, OrDefault] = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    priority: int | Literal["critical", "standard", "sheddable"] | None = Field(
        None, description="pagedserve/vLLM extra: a class or an integer (lower is more important); "
                          "default standard (0); also the x-priority header")
    timeout: float | None = Field(None, gt=0, description="pagedserve extra: seconds to the last token; past "
                                                          "it a 504, and a request that cannot make it is "
                                                          "refused at once; also the x-request-timeout header")

    @model_validator(mode="before")
    @classmethod
    def _no_internal_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and "kv_transfer_params" in data and "kv_transfer_params" not in cls.model_fields:
            raise ValueError("kv_transfer_params is internal to a pagedserve cluster: its router sets it on the "
                             "workers' peer routes, never a client")
        return data

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self


# ---- completions ----

class CompletionRequest(SamplingFields):
    prompt: Prompt | Annotated[list[Prompt], Field(min_length=1)] | TokenIds | Annotated[
        list[TokenIds], Field(min_length=1)] = Field(
        description="a string, a list of strings, a list of token ids, or a list of token-id lists (none empty)")
    max_tokens: int | None = Field(16, ge=0, description="0 only with echo: the prompt (and its logprobs) alone")
    echo: Annotated[bool, OrDefault] = Field(False, description="the prompt before the completion; with logprobs, "
                                             "the prompt's tokens' logprobs too (the first is null)")
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=64, description="samples this many per prompt and returns the n "
                                "with the highest mean token logprob; at least n; not with stream")
    suffix: Text | None = Field(None, description="fill-in-the-middle: refused unless empty (no such format here)")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, suffix: str | None) -> str | None:
        if suffix:
            raise ValueError("suffix is not supported: this server has no fill-in-the-middle format")
        return suffix


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's layout: per prompt token, its id (as a string key) and the alternatives' -> logprob; null for the first.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = Field(None, description="vLLM extra, when asked for")


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    degraded: list[str] | None = Field(None, description="pagedserve extra: what was cut under load, e.g. "
                                                       "max_tokens=64 or n=1")
    kv_transfer_params: dict | None = Field(None, description="the prefill half's lease on the prompt's KV blocks")


# ---- chat ----

class TextPart(StrictModel):
    type: Literal["text"]
    text: Text
    prompt_cache_breakpoint: dict | None = ignored("the prefix cache is automatic")


class RefusalPart(StrictModel):
    """An assistant's refusal as returned by OpenAI, sent back: rendered as the turn's text."""
    type: Literal["refusal"]
    refusal: Text


class FunctionCall(StrictModel):
    name: Text
    arguments: Text  # a JSON object, as a string (OpenAI's shape)


class ToolCall(StrictModel):
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


def legacy_call_id(name: str) -> str:
    """The id that ties a legacy function_call to the `function` message answering it (they have none)."""
    return f"call_{name}"


class ChatMessage(StrictModel):
    """OpenAI's messages, as sent and as the SDK returns them; a `function` result becomes a tool result, an
    assistant's function_call its one tool call, and refusals its text, so that only those shapes go on."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Text | list[TextPart | RefusalPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant turn's calls")
    tool_call_id: Text | None = Field(None, description="a tool turn: the call it answers")
    function_call: FunctionCall | None = Field(None, exclude=True, description="deprecated by OpenAI: an assistant "
                                               "turn's one call, taken as its tool call")
    refusal: Text | None = Field(None, exclude=True, description="an assistant's refusal: the turn's text")
    annotations: list[dict] | None = ignored("an assistant turn's citations")
    audio: dict | None = ignored("an assistant turn's audio")

    @model_validator(mode="after")
    def _tool_fields(self):
        self._normalize()
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs tool_call_id, and only a tool message has one")
        return self

    def _normalize(self) -> None:
        refusing = self.refusal is not None or any(isinstance(p, RefusalPart) for p in self.content or ())
        if (refusing or self.function_call is not None) and self.role != "assistant":
            raise ValueError("only assistant messages carry refusal or function_call")
        if self.role == "function":
            if self.name is None:
                raise ValueError("a function message needs the name of the function it answers")
            self.role, self.tool_call_id = "tool", legacy_call_id(self.name)
        if self.function_call is not None:
            if self.tool_calls:
                raise ValueError("an assistant message carries function_call or tool_calls, not both")
            self.tool_calls = [ToolCall(id=legacy_call_id(self.function_call.name), function=self.function_call)]
            self.function_call = None
        if isinstance(self.content, list):
            self.content = [TextPart(type="text", text=p.refusal) if isinstance(p, RefusalPart) else p
                            for p in self.content]
        if self.refusal is not None:
            self.content, self.refusal = self.text() + self.refusal, None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)  # refusal parts are text parts by now
        return self.content or ""


class FunctionDefinition(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: Text | None = None
    parameters: dict | None = Field(None, description="a JSON schema of the arguments object")
    strict: bool | None = None


class ChatTool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: Text


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


# top_logprobs asks for alternatives of logprobs, so it needs logprobs: true (OpenAI's rule), said in the schema too.
TOP_LOGPROBS_NEED_LOGPROBS = {
    "if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
    "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]},
}


class ChatCompletionRequest(SamplingFields):
    model_config = ConfigDict(json_schema_extra=TOP_LOGPROBS_NEED_LOGPROBS)

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="deprecated by OpenAI; max_completion_tokens wins")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: Annotated[bool, OrDefault] = False
    top_logprobs: int | None = Field(None, ge=0, le=20, description="needs logprobs: true")
    tools: list[ChatTool] | None = Field(None, min_length=1, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="default auto when tools are given")
    parallel_tool_calls: Annotated[bool, OrDefault] = True
    # OpenAI's legacy function calling: offered as tools (server/tools.py), answered in its own shape
    functions: Annotated[list[FunctionDefinition], Field(min_length=1, max_length=128)] | None = Field(
        None, description="deprecated by OpenAI for tools: offered to the model as tools; the answer's call comes "
                          "back as message.function_call")
    function_call: Literal["none", "auto"] | NamedFunction | None = Field(
        None, description="deprecated by OpenAI for tool_choice: none, auto or {name}")
    add_generation_prompt: Annotated[bool, OrDefault] = Field(True, description="vLLM extra")
    # OpenAI's fields that do not apply to this server; accepted so that clients written for OpenAI work
    audio: dict | None = ignored("audio output (text only here)")
    metadata: Annotated[dict[Annotated[Text, Field(max_length=64)], Annotated[Text, Field(max_length=512)]],
                        Field(max_length=16)] | None = ignored("nothing is stored")
    modalities: list[Text] | None = ignored("the output is text")
    moderation: dict | None = ignored("no moderation runs here")
    prediction: dict | None = ignored("no predicted outputs")
    prompt_cache_key: Text | None = ignored("the prefix cache is automatic")
    prompt_cache_options: dict | None = ignored("the prefix cache is automatic")
    prompt_cache_retention: Text | None = ignored("the prefix cache is automatic")
    reasoning_effort: Text | None = ignored("no reasoning model")
    safety_identifier: Text | None = ignored("no abuse monitoring")
    service_tier: Text | None = ignored("one tier; use priority")
    store: bool | None = ignored("nothing is stored")
    verbosity: Text | None = ignored("no such control")
    web_search_options: dict | None = ignored("no web search")

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        return self


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    function_call: FunctionCall | None = Field(None, description="the call, for a request with legacy functions")


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    degraded: list[str] | None = Field(None, description="pagedserve extra: what was cut under load, e.g. "
                                                       "max_tokens=64 or n=1")
    kv_transfer_params: dict | None = Field(None, description="the prefill half's lease on the prompt's KV blocks")
    prompt_logprobs: PromptLogprobs | None = Field(None, description="vLLM extra, when asked for")


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None
    function_call: DeltaFunctionCall | None = Field(None, description="for a request with legacy functions")


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    degraded: list[str] | None = Field(None, description="pagedserve extra: what was cut under load, e.g. "
                                                       "max_tokens=64 or n=1")
    kv_transfer_params: dict | None = Field(None, description="the prefill half's lease on the prompt's KV blocks")


# ---- models, tokenizer, health ----

class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedserve"
    max_model_len: int | None = None
    dtype: str | None = None  # the LLM's compute dtype
    quantization: str | None = None  # the LLM's weights: none | gguf | int8 | int4 | compressed-tensors (...) | gptq ...
    quant_kernel: str | None = None  # the kernel path its quantized weights run on (none when unquantized)
    kv_cache_dtype: str | None = None  # the LLM's KV cache storage: bfloat16 | float32 | fp8_e4m3 | fp8_e5m2 | int8 | int4
    root: str | None = None  # a LoRA adapter: where it was loaded from
    parent: str | None = None  # a LoRA adapter: the base model it runs on


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(StrictModel):
    """Exactly one of prompt and messages (neither is nullable, so the schema's oneOf says it exactly)."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [{"required": ["prompt"]}, {"required": ["messages"]}]})

    model: Text | None = None
    prompt: Text = Field(None, description="text to tokenize as is; or give messages")  # type: ignore[assignment]
    messages: list[ChatMessage] = Field(None, description="a chat to render with the model's template")  # type: ignore[assignment]
    tools: list[ChatTool] | None = Field(None, min_length=1, max_length=128, description="rendered with messages")
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = Field(None, description="vLLM's: whether the tokenizer adds its special "
                                            "tokens (BOS); default as generation does")
    return_token_strs: bool | None = Field(False, description="vLLM's: each token's string too")

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        if self.tools is not None and self.messages is None:
            raise ValueError("tools go with messages")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class TokenizerInfoResponse(BaseModel):
    """What a client needs to tokenize as the server does (vLLM's /tokenizer_info; lm-eval's remote tokenizer)."""
    tokenizer_class: str
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    chat_template: str | None = None
    model_max_length: int
    vocab_size: int
    add_bos_token: bool


class DetokenizeRequest(StrictModel):
    model: Text | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: Literal["ok", "unhealthy", "draining"]
